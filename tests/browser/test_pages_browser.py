"""What a new user trips on, in real Chromium: the review queue's number keys keep their modes for the whole
session, and pages keep their layout at 1280 and 1024 px (the project list's columns on one line, a page's
own links apart from the top bar with the project's name whole, triage badges and a mode's signals table
never cut off)."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from flywheel.failures import services
from flywheel.failures.models import FailureModeAssignment
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.models import Trajectory, TriageSignal

WIDTHS = (1280, 1024)


def _record(external_id: str, *, title: str = "") -> dict:
    return {
        "external_id": external_id,
        "agent": "support-bot",
        "messages": [
            {"role": "user", "content": title or f"Refund order {external_id}"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "refund", "arguments": '{"id": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "error: refund failed"},
            {"role": "assistant", "content": "Sorry, I could not do that."},
        ],
        "tools": [{"type": "function", "function": {"name": "refund", "parameters": {"type": "object"}}}],
        "outcome": "failure",
    }


def _keyed(page) -> list[str]:
    """The queue's keyed modes in order, as "digit name"."""
    buttons = page.locator("button.keyed")
    return [f"{b.locator('kbd').inner_text()} {b.get_attribute('data-mode-name')}" for b in buttons.all()]


def test_a_digit_means_the_same_mode_on_every_trajectory_of_the_queue(open_page, project, user):
    assert not ingest_trajectories(project=project, records=[_record(f"q-{i}") for i in range(3)]).rejected
    # Made first, named last: ordered by name or by use, "Zeta" would move once it is assigned.
    zeta = services.failure_mode_create(project=project, name="Zeta: refund with a wrong id",
                                        category_key="wrong_arguments", user=user)
    services.failure_mode_create(project=project, name="Alpha: gives up at once", category_key="bad_planning",
                                 user=user)
    services.failure_mode_create(project=project, name="Beta: answers without looking", category_key="other",
                                 user=user)
    page = open_page(user)
    page.goto(f"/p/{project.slug}/queue/")
    page.keyboard.press("Enter")  # claim
    expect(page.locator("button.keyed")).to_have_count(3)
    page.wait_for_load_state("load")
    order = _keyed(page)
    assert order == ["1 Zeta: refund with a wrong id", "2 Alpha: gives up at once", "3 Beta: answers without looking"]

    first = int(page.locator("[data-queue-item]").get_attribute("data-queue-item"))
    page.keyboard.press("1")
    expect(page.locator(".mode-list")).to_contain_text("Zeta")
    page.wait_for_load_state("load")
    assert _keyed(page) == order  # carried: marked, not moved
    expect(page.locator("button.keyed[data-key='1']")).to_have_class(re.compile(r"\bon\b"))
    page.keyboard.press("Enter")  # complete and next
    expect(page.locator(f"[data-queue-item]:not([data-queue-item='{first}'])")).to_be_visible()
    page.wait_for_load_state("load")
    second = int(page.locator("[data-queue-item]").get_attribute("data-queue-item"))
    assert _keyed(page) == order
    page.keyboard.press("1")  # the same key: the same mode
    expect(page.locator(".mode-list")).to_contain_text("Zeta")
    assert FailureModeAssignment.objects.filter(failure_mode=zeta, trajectory_id__in=[first, second]).count() == 2
    assert not page.log.page_errors and not page.log.console_errors, (page.log.page_errors, page.log.console_errors)


def _cut(page, selector: str) -> list[str]:
    """Elements matching `selector` whose content is wider than their box or that stick out of their
    closest table cell or panel: what a person sees cut off."""
    return page.locator(selector).evaluate_all("""(els) => els.filter((el) => {
        const box = el.getBoundingClientRect();
        const holder = el.closest("td, th, .panel");
        const outer = holder ? holder.getBoundingClientRect() : null;
        return el.scrollWidth > el.clientWidth + 1 || (outer && (box.right > outer.right + 1 || box.left < outer.left - 1));
    }).map((el) => el.textContent.trim())""")


def _lines(page, selector: str) -> list[int]:
    """How many lines each element's text takes."""
    return page.locator(selector).evaluate_all("""(els) => els.map((el) => {
        const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
        const tops = new Set();
        for (let node = walker.nextNode(); node; node = walker.nextNode()) {
            if (!node.textContent.trim()) continue;
            const range = document.createRange();
            range.selectNodeContents(node);
            for (const rect of range.getClientRects()) tops.add(Math.round(rect.top / 4));
        }
        return tops.size;
    })""")


@pytest.fixture
def demo_like(project, user):
    """Trajectories with long titles and several triage signals each, a mode carrying them, a suite."""
    project.name = "Demo support agent"
    # A long description takes the table's width: the other columns must still not wrap.
    project.description = "A customer-support agent with order, refund and knowledge-base tools (demo data). " * 3
    project.save(update_fields=["name", "description"])
    long = "NW-80777: I just don't like the colour of the jacket, can I send it back and get my money? " * 2
    assert not ingest_trajectories(project=project, records=[_record(f"b-{i}", title=long) for i in range(3)]).rejected
    mode = services.failure_mode_create(project=project, name="Refund with a wrong id", category_key="wrong_arguments",
                                        user=user)
    trajectories = Trajectory.objects.filter(project=project)
    for trajectory in trajectories:
        for kind in ("tool_error", "schema_violation", "negative_feedback", "human_intervention"):
            TriageSignal.objects.create(project=project, trajectory=trajectory, kind=kind, severity=2, message_index=2)
    trajectories.update(triage_severity=2, suggested_category="wrong_arguments")
    services.failure_mode_assign(failure_mode=mode, trajectories=trajectories, user=user)
    return mode


@pytest.mark.parametrize("width", WIDTHS)
def test_pages_keep_their_layout(open_page, project, user, demo_like, width):
    page = open_page(user)
    page.set_viewport_size({"width": width, "height": 900})

    page.goto("/")
    cells = "#projects td:nth-child(n+2)"
    expect(page.locator(cells)).to_have_count(3)
    assert _lines(page, cells) == [1, 1, 1], "the project list's slug, role and Settings wrap"

    trajectory = Trajectory.objects.filter(project=project).first()
    for url in (f"/p/{project.slug}/t/{trajectory.pk}/promote", f"/p/{project.slug}/evals/"):
        page.goto(url)
        assert page.locator("header.topbar a", has_text="Eval suites").count() == 0, "the page's links are in the top bar"
        expect(page.locator("nav.subnav a", has_text="Eval suites")).to_be_visible()
        name = page.locator("header.topbar .crumb + a")
        expect(name).to_have_text("Demo support agent")
        assert name.evaluate("(el) => el.scrollWidth <= el.clientWidth"), "the project's name is cut"
        subnav, topbar = page.locator("nav.subnav").bounding_box(), page.locator("header.topbar").bounding_box()
        assert subnav["y"] >= topbar["y"] + topbar["height"] - 1  # under the top bar, not in it

    page.goto(f"/p/{project.slug}/")
    expect(page.locator("#rows .b-signal").first).to_be_visible()
    assert page.locator("#rows .t-badges .badge").count() == 3 * 6  # tool error, category, four signals
    assert _cut(page, "#rows .t-badges .badge") == []

    page.goto(f"/p/{project.slug}/failures/{demo_like.pk}/")
    expect(page.locator(".kv-table tr[data-signal]")).to_have_count(4)
    assert _cut(page, ".kv-table th, .kv-table td, .kv-table .badge") == []
    assert not page.log.page_errors and not page.log.console_errors, (page.log.page_errors, page.log.console_errors)


def _shot(page, name):
    import os
    from pathlib import Path

    folder = os.environ.get("FLYWHEEL_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / name))


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", ["Demo support agent", "Customer support agent for the EMEA returns desk (staging copy)"])
def test_the_top_bar_keeps_to_one_line_with_a_project_open(open_page, make_user, make_project, width, name):
    """The project's name and its dozen links fit on one line at 1024 px: a bar on two lines pushes every page
    down and splits the loop's links in two. A long name gives way (cut with an ellipsis, whole in its title);
    a short one stays whole; the links keep a readable size at 1280."""
    user = make_user("maintainer-jo")
    project = make_project("demo", name=name, owner=user)
    page = open_page(user)
    page.set_viewport_size({"width": width, "height": 700})
    page.goto("/")
    one_line = page.locator("header.topbar").bounding_box()["height"]

    page.goto(f"/p/{project.slug}/dashboard/")
    links = page.locator("header.topbar nav.topnav > a")
    expect(links).to_have_count(11)  # Trajectories … Dashboard, Connect, Settings
    _shot(page, f"topbar-{width}-{len(name)}.png")
    bar = page.locator("header.topbar").bounding_box()
    assert bar["height"] <= one_line + 1, f"the top bar takes {bar['height']}px, one line is {one_line}px"
    tops = page.locator("header.topbar a, header.topbar .user, header.topbar button").evaluate_all(
        "(els) => els.map((el) => Math.round(el.getBoundingClientRect().top))")
    assert max(tops) - min(tops) <= 2, tops
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), "the bar widens the page"
    shown = page.locator("header.topbar .crumb + a")
    expect(shown).to_have_attribute("title", name)
    cut = shown.evaluate("(el) => el.scrollWidth > el.clientWidth")
    assert cut == (len(name) > 40), "only a long name is cut"
    size = float(links.first.evaluate("(el) => parseFloat(getComputedStyle(el).fontSize)"))
    assert size >= (14 if width >= 1280 else 12), size
