"""Connecting an agent and registering a base model, in real Chromium: a maintainer creates a key in Settings,
goes on to "Connect your agent" with it and copies a snippet; a base model folder missing parts is refused
on the Models page with each part named, then a good one is registered. No console error on the way."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from playwright.sync_api import expect

from flywheel.registry.models import BaseModel


def _shot(page, name):
    folder = os.environ.get("FLYWHEEL_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / name), full_page=True)


def test_a_new_key_goes_on_to_connect_your_agent(open_page, user, project):
    page = open_page(user)
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.goto(f"/p/{project.slug}/settings/")
    page.fill("#key-name", "support agent")
    page.get_by_role("button", name="Create key").click()
    raw = page.locator("#issued-key").input_value()
    _shot(page, "settings-new-key.png")
    page.get_by_role("button", name="Connect your agent with this key").click()

    expect(page.get_by_role("heading", name="Connect your agent")).to_be_visible()
    expect(page.locator("#snippet-env")).to_contain_text(f"export FLYWHEEL_API_KEY={raw}")
    expect(page.locator("#snippet-curl")).to_contain_text(f"{page.url.split('/p/')[0]}/api/v1/trajectories")
    expect(page.get_by_role("link", name="Connect", exact=True)).to_have_attribute("aria-current", "page")
    _shot(page, "connect-with-key.png")

    page.locator('button[data-copy="snippet-python"]').click()
    expect(page.locator('button[data-copy="snippet-python"]')).to_have_text("Copied")
    copied = page.evaluate("navigator.clipboard.readText()")
    assert copied == page.locator("#snippet-python").text_content() and "import requests" in copied

    page.goto(page.url)  # a GET: the key is gone, a placeholder stands in for it
    expect(page.locator("#snippet-env")).to_contain_text("export FLYWHEEL_API_KEY='<a key with the ingest scope")
    assert raw not in page.content()

    for where, shot in ((f"/p/{project.slug}/upload/", "upload.png"), (f"/p/{project.slug}/dashboard/", "dashboard.png")):
        page.goto(where)
        page.get_by_role("main").get_by_role("link", name="Connect your agent").click()
        expect(page.get_by_role("heading", name="Connect your agent")).to_be_visible()
        page.go_back()
        _shot(page, shot)
    assert page.log.console_errors == [] and page.log.page_errors == []


def test_a_base_model_missing_parts_is_refused_with_each_part_named(open_page, user, project, tiny_model,
                                                                    celery_worker, settings):
    settings.FLYWHEEL_MODEL_CHECK_TIMEOUT_S = 3.0  # an idle worker answers in milliseconds; a loaded machine is slower
    models = Path(settings.FLYWHEEL_MODELS_DIR) / project.slug  # where the project's models may be registered from
    shutil.rmtree(models, ignore_errors=True)
    folder = models / "half-model"
    shutil.copytree(tiny_model, folder)
    tiny_model = shutil.copytree(tiny_model, models / "tiny")
    (folder / "model.safetensors").unlink()
    (folder / "chat_template.jinja").unlink()
    page = open_page(user)
    page.goto(f"/p/{project.slug}/models/#register")
    page.fill("#base-name", "half")
    page.fill("#base-path", str(folder))
    page.get_by_role("button", name="Check and register").click()
    errors = page.locator("#base-path-error li")
    expect(errors).to_have_count(2)
    expect(errors.nth(0)).to_contain_text("No weights")
    expect(errors.nth(1)).to_contain_text("No chat template")
    expect(page.locator("#base-path")).to_have_value(str(folder))
    page.locator("#register").scroll_into_view_if_needed()
    _shot(page, "models-register-refused.png")
    assert not BaseModel.objects.exists()

    page.fill("#base-path", str(tiny_model))
    # The first version goes to production, mirrored to MLflow in the same move: a fresh MLflow store takes a while.
    page.get_by_role("button", name="Check and register").click(timeout=60_000)
    expect(page.locator("p.acc-note")).to_contain_text("Base model registered", timeout=60_000)
    assert BaseModel.objects.get(project=project).path == str(tiny_model)
    assert page.log.console_errors == [] and page.log.page_errors == []


def test_a_copy_button_never_covers_the_code(open_page, user, project):
    """A Copy button laid over its snippet hides the end of the longest lines (the JSONL record runs far to the
    right): each button sits above its block, clear of the code, at 1024 px as at 1360."""
    page = open_page(user)
    for width in (1360, 1024):
        page.set_viewport_size({"width": width, "height": 900})
        page.goto(f"/p/{project.slug}/connect/")
        buttons = page.locator("button.connect-copy[data-copy]")
        expect(buttons.first).to_be_visible()
        overlaps = buttons.evaluate_all("""(buttons) => buttons.map((button) => {
            const pre = document.getElementById(button.getAttribute("data-copy"));
            const b = button.getBoundingClientRect(), p = pre.getBoundingClientRect();
            const apart = b.bottom <= p.top + 0.5 || b.top >= p.bottom - 0.5 || b.right <= p.left || b.left >= p.right;
            return apart ? null : button.getAttribute("data-copy");
        }).filter(Boolean)""")
        assert buttons.count() == 7 and overlaps == [], overlaps
        page.locator("#snippet-jsonl_file").scroll_into_view_if_needed()
        _shot(page, f"connect-jsonl-{width}.png")
    assert page.log.console_errors == [] and page.log.page_errors == []
