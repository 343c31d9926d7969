"""The review pages in real Chromium: hostile agent content never runs and reads as text; a reviewer sets an
outcome, comments and tags through htmx; j/k and ? work from the keyboard; filters swap the rows."""

from __future__ import annotations

import json
import re

import pytest
from playwright.sync_api import expect

from flywheel.failures import review
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.models import Trajectory

# Each payload flips window.__pwned or opens a dialog if it ever runs.
SCRIPT = "<script>window.__pwned='script'</script>"
IMG = "<img src=x onerror=\"window.__pwned='img';alert('img')\">"
SVG = "<svg onload=alert('svg')></svg>"
LINK = "<a href=\"javascript:window.__pwned='link'\">click me</a>"
QUOTES = "\"'><img src=x onerror=alert('attr')>"
PAYLOAD = f"{SCRIPT} {IMG} {SVG} {LINK} {QUOTES}"


def record(external_id: str, **overrides):
    rec = {
        "external_id": external_id,
        "agent": "support-bot",
        "model_version": "v3",
        "messages": [
            {"role": "system", "content": "You are a support agent."},
            {"role": "user", "content": f"Where is order {external_id}?"},
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_order", "arguments": '{"order_id": "1"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Error: order service timed out"},
            {"role": "assistant", "content": "Sorry, I could not look it up."},
        ],
        "tools": [{"type": "function", "function": {"name": "get_order", "parameters": {"type": "object"}}}],
        "outcome": "failure",
        "latency_ms": 1830,
        "usage": {"prompt_tokens": 120, "completion_tokens": 30},
        "started_at": "2026-12-01T10:00:00Z",
    }
    rec.update(overrides)
    return rec


def hostile_record(external_id: str):
    rec = record(
        external_id + QUOTES,
        agent=("agent " + QUOTES)[:200],
        model_version=IMG[:200],
        metadata={PAYLOAD: PAYLOAD, "link": "javascript:alert('meta')"},
        feedback={"comment": PAYLOAD},
        human_intervention={"note": PAYLOAD},
    )
    rec["messages"][0]["content"] = SCRIPT
    rec["messages"][1]["content"] = "Hostile " + PAYLOAD
    rec["messages"][2]["content"] = LINK
    rec["messages"][2]["tool_calls"][0]["id"] = 'call"><script>alert(1)</script>'
    rec["messages"][2]["tool_calls"][0]["function"] = {"name": SVG, "arguments": json.dumps({"html": PAYLOAD})}
    rec["messages"][3]["tool_call_id"] = 'call"><script>alert(1)</script>'
    rec["messages"][3]["content"] = PAYLOAD
    rec["messages"][3]["name"] = QUOTES
    rec["tools"][0]["function"]["name"] = SVG
    return rec


def ingest(project, *records):
    result = ingest_trajectories(project=project, records=list(records))
    assert not result.rejected, result.rejected


def assert_nothing_ran(page):
    assert page.evaluate("window.__pwned") is None
    assert page.log.dialogs == [] and page.log.page_errors == []
    # No element the agent wrote exists: every script is ours, no handler attributes, no javascript: links.
    scripts = page.eval_on_selector_all("script", "els => els.map(e => e.getAttribute('src'))")
    assert all(src and src.startswith("/static/") for src in scripts), scripts
    assert page.locator("[onerror], [onload], svg").count() == 0
    assert page.locator("a[href^='javascript']").count() == 0


@pytest.mark.parametrize("bypass_csp", [False, True], ids=["with-csp", "escaping-alone"])
def test_hostile_content_never_runs_and_reads_as_text(open_page, make_membership, make_user, project, bypass_csp):
    ingest(project, hostile_record("evil"))
    trajectory = Trajectory.objects.get(project=project)
    review.trajectory_tag_add(trajectory=trajectory, name="<img src=x onerror=alert('tag')>")
    reviewer = make_user()
    make_membership(reviewer, project, "reviewer")
    review.trajectory_comment_add(trajectory=trajectory, author=reviewer, body=PAYLOAD, message_index=1)
    page = open_page(reviewer, bypass_csp=bypass_csp)

    page.goto(f"/p/{project.slug}/")
    row = page.locator(f"#row-{trajectory.id}")
    expect(row).to_contain_text("Hostile <script>window.__pwned='script'</script>")
    expect(row).to_contain_text("<img src=x onerror=alert('tag')>")
    assert_nothing_ran(page)

    page.goto(f"/p/{project.slug}/?q=" + "onerror")  # the payload comes back through text search too
    expect(page.locator(f"#row-{trajectory.id}")).to_be_visible()
    assert_nothing_ran(page)

    page.goto(f"/p/{project.slug}/t/{trajectory.id}/")
    expect(page.locator("#m0 .content")).to_have_text(SCRIPT)
    expect(page.locator("#m1 .content")).to_have_text("Hostile " + PAYLOAD)
    expect(page.locator("#m2 .content")).to_have_text(LINK)
    expect(page.locator("#m2 .toolcall .fn")).to_have_text(SVG)
    expect(page.locator("#m2 .toolcall pre.json")).to_contain_text('"html": "' + PAYLOAD.replace('"', '\\"'))
    expect(page.locator("#m3 .content")).to_have_text(PAYLOAD)
    expect(page.locator("#m3 .link-call")).to_contain_text(SVG)  # the result still links to its call
    expect(page.locator("#comments-1 .comment .body")).to_have_text(PAYLOAD)
    expect(page.locator("#tags")).to_contain_text("<img src=x onerror=alert('tag')>")
    expect(page.locator(".side")).to_contain_text("javascript:alert('meta')")
    expect(page.locator(".subhead")).to_contain_text(IMG)
    assert_nothing_ran(page)


def test_reviewer_sets_outcome_comments_and_tags(open_page, make_user, make_membership, project):
    ingest(project, record("t-1"))
    trajectory = Trajectory.objects.get()
    reviewer = make_user("rita")
    make_membership(reviewer, project, "reviewer")
    page = open_page(reviewer)
    page.goto(f"/p/{project.slug}/t/{trajectory.id}/")
    page.evaluate("window.__sameDocument = true")  # gone if anything below reloads the page

    expect(page.locator("#head-outcome")).to_have_text("failure")
    page.get_by_role("button", name=re.compile("^Success")).click()
    expect(page.locator("#outcome")).to_contain_text("set by rita")
    expect(page.locator("#head-outcome")).to_have_text("success")
    # A person's next key comes after htmx has settled the new form; a key pressed within the swap would click
    # a button htmx has not taken over yet, and the form would post the ordinary way. A function, not an
    # expression: Playwright polls an expression with eval(), which the page's CSP (no unsafe-eval) refuses
    # whenever the first look finds htmx still busy.
    page.wait_for_function("() => !document.querySelector('.htmx-request, .htmx-swapping, .htmx-settling')")
    page.keyboard.press("f")  # the same through the keyboard
    expect(page.locator("#head-outcome")).to_have_text("failure")

    message = page.locator("#m3")
    message.get_by_text("Comment on #3").click()
    message.get_by_role("textbox", name="Comment").fill("Timeout, and the agent never retried.")
    message.get_by_role("button", name="Add comment").click()
    expect(message.locator(".comment")).to_contain_text("rita")
    expect(message.locator(".comment .body")).to_have_text("Timeout, and the agent never retried.")

    page.get_by_role("combobox", name="Tag name").fill("no-retry")
    page.get_by_role("button", name="Tag", exact=True).click()
    expect(page.locator("#tags .tag")).to_have_text(re.compile("no-retry"))
    page.get_by_role("button", name="Remove tag no-retry").click()
    expect(page.locator("#tags")).to_contain_text("No tags.")

    assert page.evaluate("window.__sameDocument") is True
    assert page.log.console_errors == [] and page.log.page_errors == [] and page.log.failed_requests == []
    page.reload()
    expect(page.locator("#head-outcome")).to_have_text("failure")
    expect(page.locator("#m3 .comment .body")).to_have_text("Timeout, and the agent never retried.")
    trajectory.refresh_from_db()
    assert trajectory.reviewed_outcome == "failure" and trajectory.reviewed_by == reviewer


def test_viewer_sees_the_page_but_no_controls(open_page, make_user, make_membership, project):
    ingest(project, record("t-1"))
    trajectory = Trajectory.objects.get()
    viewer = make_user()
    make_membership(viewer, project, "viewer")
    page = open_page(viewer)
    page.goto(f"/p/{project.slug}/t/{trajectory.id}/")
    expect(page.locator("#m1 .content")).to_have_text("Where is order t-1?")
    expect(page.get_by_role("button", name=re.compile("^Success"))).to_have_count(0)
    expect(page.get_by_role("button", name="Add comment")).to_have_count(0)
    page.keyboard.press("s")  # no reviewer control answers
    expect(page.locator("#head-outcome")).to_have_text("failure")


def test_j_k_walk_the_filtered_list_and_question_mark_shows_the_keys(open_page, user, project):
    for rec in (record("f-old"), record("s-mid", outcome="success"), record("f-new")):
        ingest(project, rec)  # one at a time: a batch is written in external_id order
    ids = dict(Trajectory.objects.values_list("external_id", "id"))
    page = open_page(user)
    page.goto(f"/p/{project.slug}/?outcome=failure")
    rows = page.locator("#rows tr.row")
    expect(rows).to_have_count(2)

    page.keyboard.press("j")
    expect(rows.nth(0)).to_have_class(re.compile("selected"))
    page.keyboard.press("j")
    expect(rows.nth(1)).to_have_class(re.compile("selected"))
    page.keyboard.press("k")
    expect(rows.nth(0)).to_have_class(re.compile("selected"))
    page.keyboard.press("Enter")
    expect(page).to_have_url(re.compile(rf"/t/{ids['f-new']}/\?outcome=failure$"))
    expect(page.locator("h1")).to_contain_text("Where is order f-new?")

    page.keyboard.press("j")  # older within the filter: skips the success in between
    expect(page).to_have_url(re.compile(rf"/t/{ids['f-old']}/\?outcome=failure$"))
    expect(page.locator("h1")).to_contain_text("Where is order f-old?")
    page.keyboard.press("j")  # the oldest: nothing older, stays
    page.keyboard.press("k")
    expect(page).to_have_url(re.compile(rf"/t/{ids['f-new']}/"))

    help_dialog = page.locator("#keyhelp")
    expect(help_dialog).to_be_hidden()
    page.keyboard.press("?")
    expect(help_dialog).to_be_visible()
    expect(help_dialog).to_contain_text("next (older) / previous (newer) trajectory")
    page.keyboard.press("Escape")
    expect(help_dialog).to_be_hidden()

    page.keyboard.press("u")  # back to the list, filter kept
    expect(page).to_have_url(re.compile(r"/\?outcome=failure$"))


def test_filters_swap_the_rows_in_place(open_page, user, project):
    ingest(
        project,
        record("a", messages=[{"role": "user", "content": "Refund my double charge"}]),
        record("b", agent="billing-bot", outcome="success"),
        record("c"),
    )
    page = open_page(user)
    page.goto(f"/p/{project.slug}/")
    page.evaluate("window.__sameDocument = true")
    rows = page.locator("#rows tr.row")
    expect(rows).to_have_count(3)
    expect(page.locator(".tab.active")).to_contain_text("All 3")

    page.keyboard.press("/")
    page.keyboard.type("DOUBLE charge")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("Refund my double charge")
    expect(page).to_have_url(re.compile(r"q=DOUBLE\+charge"))

    page.get_by_role("searchbox").fill("")
    page.get_by_label("Agent").select_option("billing-bot")
    expect(rows).to_have_count(1)
    expect(page.locator(".tab.o-success")).to_contain_text("Success 1")

    page.get_by_label("Agent").select_option("")
    page.locator(".tab.o-failure").click()
    expect(rows).to_have_count(2)
    expect(page.locator(".tab.active")).to_contain_text("Failure 2")
    assert page.locator("#f-outcome").input_value() == "failure"  # the form keeps the tab's filter
    assert page.evaluate("window.__sameDocument") is True
