"""Registering an environment server in real Chromium: a URL the operator does not list is refused with the
reason under the form, a listed server that answers /reset is registered and listed, and a task set is made
on it. No console error on the way."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.standin import StandIn, serving

pytestmark = pytest.mark.django_db(transaction=True)


class _Reset(StandIn):
    def do_POST(self):  # noqa: N802 (http.server's name)
        self.body()
        self.answer(200, {"session_id": "s-1"})


@pytest.fixture
def reset_server():
    with serving(_Reset) as server:
        yield server.url


def test_a_maintainer_registers_a_server_and_makes_a_task_set_on_it(open_page, make_user, make_project, settings,
                                                                   reset_server, tmp_path):
    settings.FLYWHEEL_ENV_URL_ALLOWLIST = [reset_server]
    settings.FLYWHEEL_OUTBOUND_ALLOWLIST = ["127.0.0.1"]
    owner = make_user("mia")
    make_project("gym", owner=owner)
    page = open_page(owner)
    page.goto("/p/gym/environments/")
    expect(page.locator("#servers")).to_contain_text("No environment server yet")

    page.fill("#id_name", "Team gym")
    page.fill("#id_url", "http://169.254.169.254/")
    page.click("#register button[type=submit]")
    error = page.locator('#register .field-error[data-field="url"]')
    expect(error).to_contain_text("is not in FLYWHEEL_ENV_URL_ALLOWLIST")
    expect(page.locator("#id_url")).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#id_name")).to_have_value("Team gym")  # what was typed stays
    page.screenshot(path=str(tmp_path / "environments-refused.png"), full_page=True)

    page.fill("#id_url", reset_server)
    page.click("#register button[type=submit]")
    expect(page.locator(".flash")).to_contain_text("Environment server Team gym registered")
    row = page.locator("#servers tbody tr").first
    expect(row).to_contain_text("Team gym")
    expect(row).to_contain_text(reset_server)
    page.screenshot(path=str(tmp_path / "environments-registered.png"), full_page=True)

    row.locator("input[name=name]").fill("Gym tasks")
    row.locator("form.ev-inline-form button").click()
    expect(page.locator("h1")).to_contain_text("Gym tasks")
    page.go_back()
    page.reload()
    expect(page.locator("#servers tbody tr").first).to_contain_text("Gym tasks")
    assert page.log.console_errors == [] and page.log.page_errors == []
