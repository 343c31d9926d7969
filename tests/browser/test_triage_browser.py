"""Triage in real Chromium: a reviewer filters the list by a signal and sees each signal's badge on its message,
hostile tool names reading as text; a maintainer edits the policy and follows a re-run's progress to its end."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from playwright.sync_api import expect

from flywheel.trajectories import triage
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.models import Trajectory


@pytest.fixture(autouse=True)
def _triage_on(settings):
    """Automatic triage is what these tests are about (tests/conftest.py turns it off elsewhere)."""
    settings.FLYWHEEL_TRIAGE = True


HOSTILE = "<img src=x onerror=\"window.__pwned='img';alert('img')\">"
TOOLS = [
    {"type": "function", "function": {"name": "get_order", "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "refund_order", "parameters": {"type": "object"}}},
]


def call(name, args, call_id):
    return {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


def conversation(external_id, *middle, **extra):
    return {
        "external_id": external_id,
        "agent": "support-bot",
        "messages": [{"role": "user", "content": f"Help with {external_id}"}, *middle, {"role": "assistant", "content": "Done."}],
        "tools": TOOLS,
        "outcome": "failure",
        **extra,
    }


@pytest.fixture
def triaged(project):
    ingest_trajectories(
        project=project,
        records=[
            conversation("refund-big", call("refund_order", {"amount": 900}, "c1"), {"role": "tool", "tool_call_id": "c1", "content": "{}"}),
            conversation(
                "invented",
                call(HOSTILE, {"order_id": "1"}, "c1"),
                {"role": "tool", "tool_call_id": "c1", "content": "Error: unknown tool"},
                call("get_order", {"order_id": 1}, "c2"),
                {"role": "tool", "tool_call_id": "c2", "content": "{}"},
                feedback={"thumbs": "down"},
            ),
            conversation("fine", call("get_order", {"order_id": "1"}, "c1"), {"role": "tool", "tool_call_id": "c1", "content": "{}"}),
        ],
    )
    triage.triage_project(project_id=project.pk)
    return project


def _shot(page, name):
    folder = os.environ.get("FLYWHEEL_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / name), full_page=True)


def test_a_reviewer_filters_by_signal_and_sees_the_badges_on_the_messages(open_page, make_user, make_membership, triaged, bypass_csp):
    reviewer = make_user()
    make_membership(reviewer, triaged, "reviewer")
    page = open_page(reviewer, bypass_csp=bypass_csp)
    page.goto(f"/p/{triaged.slug}/")
    page.select_option("select[name=signal]", "unsafe_action")
    expect(page.locator("#rows tr")).to_have_count(1)
    expect(page.locator("#rows")).to_contain_text("refund-big")
    expect(page.locator("#rows .b-category")).to_have_text("Unsafe action")
    assert "signal=unsafe_action" in page.url
    _shot(page, "triage-list-signal-filter.png")

    invented = Trajectory.objects.get(external_id="invented")
    page.goto(f"/p/{triaged.slug}/t/{invented.pk}/")
    on_call = page.locator("#m1 .signal")
    expect(on_call).to_have_count(1)
    expect(on_call).to_contain_text("Undeclared tool")
    expect(on_call).to_contain_text(f"not declared: {HOSTILE}")  # the name reads as text
    expect(page.locator("#m2 .signal")).to_contain_text("Tool error")
    expect(page.locator("#m3 .signal")).to_contain_text("Breaks the tool schema")
    expect(page.locator("#triage")).to_contain_text("Negative feedback")
    expect(page.locator("#triage")).to_contain_text("Hallucinated API")
    _shot(page, "triage-detail-badges.png")
    assert page.evaluate("window.__pwned") is None
    assert not page.log.dialogs and not page.log.page_errors and not page.log.console_errors


def test_a_maintainer_reruns_triage_and_the_page_follows_its_progress(open_page, user, triaged):
    from flywheel.trajectories.models import TriageRun

    page = open_page(user)  # `user` maintains the project
    page.goto(f"/p/{triaged.slug}/triage/")
    page.fill("#policy-unsafe", '[{"name": "get_*"}]')
    page.click("text=Save policy")
    expect(page.locator("#state")).to_contain_text("3 triaged under an older policy")
    page.click("#rerun")
    # Queued, unless this test process's Celery worker (started by an earlier test) already took it.
    expect(page.locator("#run .run-status")).to_have_text(re.compile("^(Queued|Running|Done)$"))
    run = TriageRun.objects.get(project=triaged)
    triage.triage_run_process(run_id=run.pk)  # what a worker does (a no-op if one did); the page polls
    expect(page.locator("#run .run-status")).to_have_text("Done")
    expect(page.locator("#run")).to_contain_text("3 of 3 trajectories (100%)")
    _shot(page, "triage-page-rerun.png")
    assert not page.log.page_errors and not page.log.console_errors


def test_a_reviewer_reads_each_detectors_precision_and_recall(open_page, user, triaged):
    from flywheel.failures.review import trajectory_outcome_set

    for external_id, outcome in (("refund-big", "failure"), ("invented", "failure"), ("fine", "success")):
        trajectory_outcome_set(trajectory=Trajectory.objects.get(external_id=external_id), outcome=outcome, user=user)
    page = open_page(user)
    page.goto(f"/p/{triaged.slug}/triage/")
    page.click("#kinds >> text=Calibration")
    expect(page.locator("#detectors")).to_contain_text("3 labeled trajectories (2 failures, 1 success)")
    unsafe = page.locator('#detectors tr[data-detector="unsafe_action"]')
    expect(unsafe.locator('[data-cell="precision"]')).to_have_text("1.000")
    expect(unsafe.locator('[data-cell="recall"]')).to_have_text("0.500")
    # One of one flagged is a failure: 1.000, and an interval that says how little one shows.
    expect(unsafe.locator('[data-cell="precision-ci"]')).to_have_text("[0.21, 1.00]")
    expect(unsafe.locator('[data-cell="recall-ci"]')).to_have_text("[0.09, 0.91]")
    flagged = page.locator('#detectors tr[data-detector="any"]')
    expect(flagged.locator('[data-cell="on-failures"]')).to_have_text("2")
    expect(flagged.locator('[data-cell="on-successes"]')).to_have_text("0")
    page.select_option("#detector-labels select[name=labels]", "outcome")
    page.click("#detector-labels button")
    expect(page.locator("#detector-labels select[name=labels]")).to_have_value("outcome")
    expect(page.locator("#detectors-too-few")).to_be_visible()
    expect(page.locator("#detectors-meaning")).to_contain_text("holds by construction")
    _shot(page, "triage-detector-calibration.png")
    assert not page.log.page_errors and not page.log.console_errors


@pytest.fixture(params=[False, True], ids=["csp", "no-csp"])
def bypass_csp(request):
    """With the Content-Security-Policy, and without it: escaping alone must keep the tool name inert."""
    return request.param
