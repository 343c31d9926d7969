"""The project settings page in real Chromium: htmx swaps each section in place under the strict CSP; a new
API key shows once; a refused change shows its reason."""

from __future__ import annotations

from playwright.sync_api import expect

from flywheel.accounts.models import ApiKey


def test_a_maintainer_creates_a_key_that_shows_once(open_page, user, project):
    page = open_page(user)
    page.goto(f"/p/{project.slug}/settings/")
    page.evaluate("window.__same_page = true")  # survives an htmx swap, not a page load
    page.fill("#key-name", "production agent")
    page.get_by_label("read").check()
    page.get_by_role("button", name="Create key").click()

    issued = page.locator("#issued-key")
    expect(issued).to_be_visible()
    raw = issued.input_value()
    key = ApiKey.objects.get(project=project)
    assert raw.startswith(f"fw_{key.prefix}_") and key.scopes == ["ingest", "read"]
    assert page.evaluate("window.__same_page") is True
    expect(page.locator(f'tr[data-key="{key.prefix}"]')).to_contain_text("production agent")

    page.reload()
    expect(page.locator(f'tr[data-key="{key.prefix}"]')).to_be_visible()
    assert raw not in page.content()
    assert page.log.console_errors == [] and page.log.page_errors == []


def test_a_refused_change_shows_why(open_page, user, project):
    page = open_page(user)
    page.goto(f"/p/{project.slug}/settings/")
    page.fill("#member-username", "nobody-here")
    page.get_by_role("button", name="Add", exact=True).click()
    expect(page.locator("#members .acc-error")).to_contain_text("there is no user named 'nobody-here'")
    assert page.log.console_errors == [] and page.log.page_errors == []
