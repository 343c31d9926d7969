"""The review queue in real Chromium, driven by the keyboard alone (claim, move to a message, assign a mode
by its number, complete and go on, the key sheet), and bulk assignment from the list with a shift-click
range."""

from __future__ import annotations

import re

from django.urls import NoReverseMatch, reverse
from playwright.sync_api import expect

from flywheel.failures import services
from flywheel.failures.models import FailureModeAssignment
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.models import Trajectory, TriageSignal


def _record(external_id: str) -> dict:
    return {
        "external_id": external_id,
        "agent": "support-bot",
        "messages": [
            {"role": "user", "content": f"Refund order {external_id}"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "refund", "arguments": '{"id": 1}'}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "error: refund failed"},
            {"role": "assistant", "content": "Sorry, I could not do that."},
        ],
        "tools": [{"type": "function", "function": {"name": "refund", "parameters": {"type": "object"}}}],
        "outcome": "failure",
        "started_at": "2026-11-20T10:00:00Z",
    }


def test_queue_by_keyboard_alone_and_bulk_select_with_shift_click(open_page, live_server, project, user):
    assert not ingest_trajectories(project=project, records=[_record(f"t-{i}") for i in range(5)]).rejected
    rows = list(Trajectory.objects.filter(project=project).order_by("id"))
    # The oldest is flagged by triage at the highest severity: the queue offers it first.
    TriageSignal.objects.create(project=project, trajectory=rows[0], kind="tool_error", severity=3, message_index=2)
    Trajectory.objects.filter(pk=rows[0].pk).update(triage_severity=3)
    wrong_id = services.failure_mode_create(project=project, name="Refund with a wrong id", category_key="wrong_arguments", user=user)
    services.failure_mode_create(project=project, name="Gives up at once", category_key="bad_planning", user=user)

    page = open_page(user)
    page.goto(f"/p/{project.slug}/queue/")
    expect(page.locator("[data-progress]")).to_contain_text("0 done · 5 remaining")
    page.keyboard.press("Enter")  # claim
    expect(page.locator(f'[data-queue-item="{rows[0].pk}"]')).to_be_visible()
    page.wait_for_load_state("load")  # the keys' scripts run (deferred) before the next key
    page.keyboard.press("j")
    page.keyboard.press("j")  # message #1, the refund call
    expect(page.locator("article#m1")).to_have_class(re.compile(r"\bcurrent\b"))
    expect(page.locator("[data-at]")).to_have_text("message #1")
    try:  # e: the promotion form, at the message the cursor is on (where promotion is installed)
        reverse("promotion_form", args=[project.slug, rows[0].pk])
        expect(page.locator("[data-promote]")).to_have_attribute("href", re.compile(r"/promote\?message=1$"))
    except NoReverseMatch:
        expect(page.locator("button[disabled]", has_text="Promote")).to_be_visible()
    number = page.locator("button.keyed", has_text="Refund with a wrong id").locator("kbd").inner_text()
    page.keyboard.press(number)  # assign the mode shown beside that number
    expect(page.locator(".mode-list")).to_contain_text("Refund with a wrong id")
    page.wait_for_load_state("load")
    expect(page.locator("article#m1")).to_have_class(re.compile(r"\bcurrent\b"))  # the cursor stays
    assert FailureModeAssignment.objects.get(failure_mode=wrong_id, trajectory=rows[0]).message_index == 1
    page.keyboard.press("?")
    expect(page.locator("#keyhelp")).to_be_visible()
    expect(page.locator("#keyhelp")).to_contain_text("assign the failure mode shown beside the number")
    page.keyboard.press("Escape")
    expect(page.locator("#keyhelp")).to_be_hidden()
    page.keyboard.press("Enter")  # complete and next
    expect(page.locator("[data-progress]")).to_contain_text("1 done · 4 remaining")
    expect(page.locator(f'[data-queue-item="{rows[4].pk}"]')).to_be_visible()  # then the newest
    page.wait_for_load_state("load")
    assert Trajectory.objects.get(pk=rows[0].pk).reviewed_outcome == "failure"
    page.keyboard.press("u")  # undo the completion: the first item is back
    expect(page.locator(f'[data-queue-item="{rows[0].pk}"]')).to_be_visible()
    assert Trajectory.objects.get(pk=rows[0].pk).reviewed_outcome == ""

    # Bulk: tick the newest row, shift-click the third: three rows ticked; assign a mode to them.
    page.goto(f"/p/{project.slug}/")
    boxes = page.locator("#rows input[name=ids]")
    expect(boxes).to_have_count(5)
    boxes.nth(0).click()
    boxes.nth(2).click(modifiers=["Shift"])
    expect(page.locator("[data-bulk-count]")).to_have_text("3 selected")
    assert [boxes.nth(i).is_checked() for i in range(5)] == [True, True, True, False, False]
    assert page.url.endswith(f"/p/{project.slug}/")  # ticking never opened a row
    page.locator("#bulk select[name=mode]").select_option(label="Gives up at once")
    page.locator("[data-bulk-submit]").click()
    expect(page.locator(".flash")).to_contain_text("added to 3 trajectories selected")
    carried = set(Trajectory.objects.filter(failure_assignments__failure_mode__name="Gives up at once").values_list("pk", flat=True))
    assert carried == {rows[4].pk, rows[3].pk, rows[2].pk}
    assert not page.log.page_errors and not page.log.console_errors, (page.log.page_errors, page.log.console_errors)
