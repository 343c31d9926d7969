"""Promotion in real Chromium: from a failed trajectory's page, a reviewer corrects the expected call, runs
the checks, sees the verifier fail the agent's output and pass the reference (each with its checks), and
saves the case into a regression suite."""

from __future__ import annotations

import json

import pytest
from playwright.sync_api import expect

from flywheel.evals.services import suite_create
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.models import Trajectory

pytestmark = pytest.mark.django_db(transaction=True)

TOOLS = [{"type": "function", "function": {"name": "refund", "parameters": {
    "type": "object", "properties": {"order_id": {"type": "string"}, "amount": {"type": "number"}},
    "required": ["order_id", "amount"]}}}]


def test_promotion_shows_both_verifier_checks_then_saves(open_page, make_user, make_project, make_membership):
    owner, reviewer = make_user("owner"), make_user("rita")
    project = make_project("shop", owner=owner)
    make_membership(reviewer, project, "reviewer")
    suite = suite_create(project=project, name="Refund regressions", kind="regression", user=owner)
    record = {"external_id": "refund-1", "outcome": "failure", "tools": TOOLS, "messages": [
        {"role": "user", "content": "Refund 50.00 on order A-1001 <b>please</b>"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "refund", "arguments": json.dumps({"order_id": "A-1001", "amount": 500})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"ok": true}'},
        {"role": "assistant", "content": "Refunded."}]}
    assert ingest_trajectories(project=project, records=[record]).accepted == 1
    trajectory = Trajectory.objects.get(project=project)

    page = open_page(reviewer)
    page.goto(f"/p/shop/t/{trajectory.pk}/")
    page.click("#promote")
    expected = page.locator("#f-expected-calls")
    expect(expected).to_have_value(json.dumps([{"name": "refund", "arguments": {"order_id": "A-1001", "amount": 500}}],
                                              indent=2))
    page.select_option("#f-target", label="Refund regressions (regression)")
    expected.fill(json.dumps([{"name": "refund", "arguments": {"order_id": "A-1001", "amount": {"range": [49.5, 50.5]}}}]))
    page.click("#run-checks")

    original, reference = page.locator("#check-original"), page.locator("#check-reference")
    expect(original).to_have_attribute("data-passed", "false")
    expect(original).to_contain_text("fails")
    expect(original).to_contain_text("wrong_arguments")
    expect(original.locator('[data-check="call refund"]')).to_contain_text("amount")
    expect(reference).to_have_attribute("data-passed", "true")
    expect(reference).to_contain_text("passes")
    expect(page.locator("#warning")).to_have_count(0)
    assert suite.cases.count() == 0  # checking saves nothing

    page.click("#save")
    expect(page).to_have_url(f"/p/shop/evals/{suite.pk}/")
    case = suite.cases.get()
    expect(page.locator(f'[data-item="{case.row_id}"]')).to_contain_text("Refund 50.00 on order A-1001 <b>please</b>")
    expect(page.locator('[data-version="1"]')).to_be_visible()
    assert case.verifier["expected_calls"][0]["arguments"]["amount"] == {"range": [49.5, 50.5]}
    assert not page.log.page_errors and not page.log.console_errors and not page.log.dialogs


def test_the_reviewer_confirms_with_a_reason_where_the_leakage_guard_is_unsure(
        open_page, make_user, make_project, make_membership, tmp_path):
    from flywheel.environments.services import task_set_create
    from flywheel.evals import promotion

    owner, reviewer = make_user("owner"), make_user("rita")
    project = make_project("library", owner=owner)
    make_membership(reviewer, project, "reviewer")
    holdout = suite_create(project=project, name="Held out", kind="holdout", user=owner)
    task_set = task_set_create(project=project, name="Loans", user=owner)

    def record(external_id: str, request: str) -> dict:
        return {"external_id": external_id, "outcome": "failure", "tools": TOOLS, "messages": [
            {"role": "user", "content": request},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "refund", "arguments": json.dumps({"order_id": "A-1001", "amount": 500})}}]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"ok": true}'}]}

    # Their sentence vectors are close, not close enough for the guard to be sure.
    assert ingest_trajectories(project=project, records=[record("r-1", "Renew my library books."),
                                                         record("r-2", "Can you extend the loan on my library books?")]).accepted == 2
    corrected = [{"name": "refund", "arguments": {"order_id": "A-1001", "amount": 50}}]
    promotion.trajectory_promote(trajectory=Trajectory.objects.get(external_id="r-1"), target=holdout, user=owner,
                                 data={"message_index": 1, "expect": "calls", "expected_calls": corrected})
    trajectory = Trajectory.objects.get(external_id="r-2")
    # The live server runs in this process: the sentence model is loaded here, once, as in a warm worker.
    from flywheel.failures.clustering.embedding import shared_model

    shared_model()

    page = open_page(reviewer)
    page.goto(f"/p/library/t/{trajectory.pk}/promote?message=1")
    page.select_option("#f-target", label="Loans")
    page.locator("#f-expected-calls").fill(json.dumps(corrected))
    page.click("#run-checks")
    confirm = page.locator("#leakage-confirm")
    expect(confirm).to_contain_text("The leakage guard is unsure")
    expect(confirm).to_contain_text("Renew my library books.")
    expect(confirm).to_contain_text("Held out")
    page.screenshot(path=str(tmp_path / "promote-unsure.png"), full_page=True)

    page.click("#save")  # no reason: not saved, and said why
    expect(page.locator("#not-saved")).to_contain_text("leakage_reason")
    assert task_set.tasks.count() == 0
    page.locator("#f-leakage-reason").fill("Renewing is one request, asking to extend the loan period another")
    page.click("#save")
    expect(page).to_have_url(f"/p/library/tasks/{task_set.pk}/")
    expect(page.locator('[data-confirmed="leakage"]')).to_contain_text("Renewing is one request")
    expect(page.locator('[data-confirmed="leakage"]')).to_contain_text("rita")
    assert not page.log.page_errors and not page.log.console_errors and not page.log.dialogs


def test_a_slow_check_says_it_is_running(open_page, make_user, make_project, tmp_path):
    """The first Run checks of a process could take many seconds (the sentence model): the button says the
    checks are running, and a second click sends nothing more, until the answer comes. The page's own
    listener (after the app's) records each submission and holds it, as a slow server would."""
    owner = make_user("owner")
    project = make_project("shop", owner=owner)
    suite_create(project=project, name="Refund regressions", kind="regression", user=owner)
    record = {"external_id": "refund-1", "outcome": "failure", "tools": TOOLS, "messages": [
        {"role": "user", "content": "Refund 50.00 on order A-1001"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "refund", "arguments": json.dumps({"order_id": "A-1001", "amount": 500})}}]}]}
    assert ingest_trajectories(project=project, records=[record]).accepted == 1
    trajectory = Trajectory.objects.get(project=project)

    page = open_page(owner)
    page.goto(f"/p/shop/t/{trajectory.pk}/promote?message=1")
    page.select_option("#f-target", label="Refund regressions (regression)")
    page.evaluate("""window.sent = []; window.addEventListener("submit", e => {
        window.sent.push({sent: !e.defaultPrevented, action: new FormData(e.target, e.submitter).get("action")});
        e.preventDefault(); })""")
    page.click("#run-checks")
    button = page.locator("#run-checks")
    expect(button).to_have_text("Running checks…")
    expect(button).to_have_class("btn busy")
    expect(page.locator("form#promotion[aria-busy=true]")).to_have_count(1)
    page.click("#run-checks")
    page.screenshot(path=str(tmp_path / "promote-running-checks.png"), full_page=True)
    # The first click was sent with its button's name and value; the second was held back.
    assert page.evaluate("window.sent") == [{"sent": True, "action": "check"}, {"sent": False, "action": "check"}]
    assert not page.log.page_errors and not page.log.console_errors
