"""Live traffic per version in real Chromium: a member opens the Models page and sees each version's figures and
its two small series drawn by uPlot (served by the app), changes the window, follows a version to its own page
with every signal's rate and the larger series, and a hostile model_version string shows as text, never runs.
Screenshots go to FLYWHEEL_SCREENSHOTS when set."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

from django.utils import timezone
from playwright.sync_api import expect

from flywheel.registry import live, services
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.triage import triage_project

HOSTILE = '<img src=x onerror="alert(1)">'


def shot(page, name: str) -> None:
    folder = os.environ.get("FLYWHEEL_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / name), full_page=True)


def traffic(project, now) -> None:
    """Two days of traffic: v1 (production) fails about a fifth of the time, v2 a third; some unsafe calls; a
    string no version answers to, and a hostile one."""
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("lookup", "delete_account")]
    records = []
    for i in range(240):
        version = 1 if i % 3 else 2
        failed = (i // 3) % (3 if version == 2 else 5) == 0
        call = "delete_account" if i % 17 == 0 else "lookup"
        records.append({
            "external_id": f"t-{i}", "model_version": f"{project.slug}-v{version}" if i % 40 else "gpt-4o-mini",
            "outcome": "failure" if failed else "success",
            "started_at": (now - timedelta(minutes=12 * i)).isoformat(), "tools": tools,
            "latency_ms": 800 + (i % 9) * 120, "usage": {"prompt_tokens": 900 + i, "completion_tokens": 150},
            "messages": [{"role": "user", "content": "help"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c", "type": "function", "function": {"name": call, "arguments": "{}"}}]},
                         {"role": "tool", "tool_call_id": "c", "content": "ok"},
                         {"role": "assistant", "content": "done"}]})
    records.append({**records[1], "external_id": "hostile", "model_version": HOSTILE})
    assert not ingest_trajectories(project=project, records=records).rejected
    triage_project(project_id=project.pk)
    live.rollup_refresh()


def test_a_member_reads_live_traffic_per_version(open_page, project, user, tmp_path):
    base = tmp_path / "tiny"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "llama"}')
    v1 = services.base_model_register(project=project, name="tiny", path=str(base), user=user)
    services.model_version_create(project=project, base=v1.base, user=user)
    traffic(project, timezone.now())

    page = open_page(user, bypass_csp=True)  # escaping alone must keep the hostile string inert
    page.goto(f"/p/{project.slug}/models/?window=24h#live-traffic")
    panel = page.locator("#live-traffic")
    expect(panel.locator("#live-v1")).to_contain_text("production")
    expect(panel.locator("#live-v2")).to_be_visible()
    expect(panel.locator(".lt-chart canvas")).to_have_count(4)  # two small series per version
    expect(panel.locator(".lt-windows a[aria-current='true']")).to_have_text("24h")
    expect(panel.locator(".lt-names").first).to_contain_text(HOSTILE)  # shown as text
    expect(panel.locator(".lt-names").first).to_contain_text("gpt-4o-mini")
    shot(page, "live-models-24h.png")
    # Ten columns, two charts, a production badge and a missing price's note: the table scrolls inside its
    # panel on a 1280-pixel window, the page never sideways (it was 1,307 pixels wide).
    page.set_viewport_size({"width": 1280, "height": 900})
    page.reload()
    expect(panel.locator(".lt-chart canvas")).to_have_count(4)
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    shot(page, "live-models-1280.png")
    if os.environ.get("FLYWHEEL_SCREENSHOTS"):
        panel.screenshot(path=str(Path(os.environ["FLYWHEEL_SCREENSHOTS"]) / "live-panel-24h.png"))

    panel.locator(".lt-windows a", has_text="7d").click()
    expect(page).to_have_url(f"{page.url.split('?')[0]}?window=7d#live-traffic")
    expect(page.locator("#live-traffic .lt-windows a[aria-current='true']")).to_have_text("7d")

    page.locator("#live-v2 a").first.click()
    expect(page.locator("h1")).to_contain_text("v2")
    expect(page.locator("#live-signals")).to_contain_text("Unsafe action")
    expect(page.locator(".lt-chart.lt-big canvas")).to_have_count(2)
    assert int(page.locator("#live-trajectories").inner_text()) > 0
    shot(page, "live-version-v2.png")
    assert not page.log.dialogs and not page.log.page_errors and not page.log.console_errors
