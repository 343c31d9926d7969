"""Verifier calibration in real Chromium: a viewer writes a verifier and clicks Calibrate; the page answers at
once and follows the worker's calibration (htmx, under the Content-Security-Policy) until its figures show."""

from __future__ import annotations

import json
import re

import pytest
from playwright.sync_api import expect

from flywheel.evals.calibration import calibration_run_process
from flywheel.evals.calibration_models import VerifierCalibration
from flywheel.failures.review import trajectory_outcome_set
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.models import Trajectory

pytestmark = pytest.mark.django_db(transaction=True)

TOOLS = [{"type": "function", "function": {"name": "refund", "parameters": {
    "type": "object", "properties": {"order_id": {"type": "string"}, "amount": {"type": "number"}}}}}]


def refund(external_id, amount):
    return {"external_id": external_id, "tools": TOOLS, "messages": [
        {"role": "user", "content": "Refund 50.00 on order A-1001"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "refund", "arguments": json.dumps({"order_id": "A-1001", "amount": amount})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"ok": true}'},
        {"role": "assistant", "content": "Refunded."}]}


def test_a_viewer_follows_a_calibration_to_its_figures(open_page, make_user, make_project, make_membership):
    owner, viewer = make_user("owner"), make_user("vera")
    project = make_project("shop", owner=owner)
    make_membership(viewer, project, "viewer")
    assert ingest_trajectories(project=project, records=[refund("good", 50), refund("bad", 500)]).accepted == 2
    for t in Trajectory.objects.filter(project=project):
        trajectory_outcome_set(trajectory=t, outcome="success" if t.external_id == "good" else "failure", user=owner)

    page = open_page(viewer)
    page.goto("/p/shop/evals/calibration/")
    spec = {"type": "tool_call", "expected_calls": [{"name": "refund", "arguments": {"order_id": "A-1001",
                                                                                        "amount": 50}}]}
    page.fill("#c-verifier", json.dumps(spec))
    page.click("#calibrate button[type=submit]")
    # Queued, unless this test process's Celery worker (started by an earlier test) already took it.
    expect(page.locator("#calibration-run .run-status")).to_have_text(re.compile("^(Queued|Running|Done)$"))
    calibration_run_process(run_id=VerifierCalibration.objects.get(project=project).pk)  # the worker's part
    expect(page.locator("#calibration-run .run-status")).to_have_text("Done")
    expect(page.locator('#calibration-run [data-cell="success-pass"]')).to_have_text("1")
    expect(page.locator('#calibration-run [data-cell="failure-fail"]')).to_have_text("1")
    expect(page.locator("#precision")).to_have_text("1.000")
    assert not page.log.page_errors and not page.log.console_errors
