"""Verifier calibration: one turn of each labeled trajectory is scored (the case's turn, or promotion's
default turn for a written verifier), through the environment the row trains in, never "any turn passes"."""

from __future__ import annotations

import json

import pytest

from flywheel.evals import promotion
from flywheel.evals.calibration import verifier_calibrate

pytestmark = pytest.mark.django_db

REFUND_50 = {"type": "tool_call", "expected_calls": [{"name": "refund", "arguments": {
    "order_id": {"any": True}, "amount": {"range": [49.99, 50.01]}}}]}


@pytest.fixture
def label(user):
    from flywheel.trajectories.review import trajectory_outcome_set

    def run(trajectory, outcome: str):
        return trajectory_outcome_set(trajectory=trajectory, outcome=outcome, user=user)

    return run


def _refund_again(record: dict, amount: float) -> dict:
    """The agent refunds a second time, `amount`, before its final answer."""
    final = record["messages"].pop()
    record["messages"] += [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c3", "type": "function", "function": {
            "name": "refund", "arguments": json.dumps({"order_id": "A-1001", "amount": amount})}}]},
        {"role": "tool", "tool_call_id": "c3", "content": json.dumps({"ok": True, "refunded": amount})},
        final,
    ]
    return record


def test_a_case_is_scored_at_its_own_turn_not_at_any_turn(ingest, refund_record, suite, label, project, user):
    bad = ingest(refund_record("bad", amount=500.0))
    case, _ = promotion.trajectory_promote(trajectory=bad, target=suite, user=user, data={
        "message_index": 4, "expect": "calls", "expected_calls": REFUND_50["expected_calls"]})
    label(bad, "failure")
    label(ingest(refund_record("good", amount=50.0)), "success")
    # Refunded 500 at the case's turn, then 50 more: a failure, though a later turn passes on its own.
    twice = ingest(_refund_again(refund_record("twice", amount=500.0), 50.0))
    label(twice, "failure")
    result = verifier_calibrate(project=project, verifier=case.verifier, source=f"case:{case.pk}")
    assert result.matrix == {"success": {"pass": 1, "fail": 0}, "failure": {"pass": 0, "fail": 2}}
    assert result.disagreements == [] and result.kappa == 1.0


def test_a_written_verifier_is_scored_at_the_turn_promotion_would_start_from(ingest, refund_record, label, project):
    # Refunded 50 first, then 500 on top: the last turn that made calls is the wrong refund.
    over = ingest(_refund_again(refund_record("over", amount=50.0), 500.0))
    label(over, "failure")
    label(ingest(refund_record("good", amount=50.0)), "success")
    result = verifier_calibrate(project=project, verifier=REFUND_50)
    assert result.matrix == {"success": {"pass": 1, "fail": 0}, "failure": {"pass": 0, "fail": 1}}
    assert result.disagreements == []


def test_a_replay_case_scores_each_trajectory_through_its_own_replay(ingest, refund_record, suite, label, project, user):
    """The case expects the lookup and then the refund: an episode of two turns, which no single turn holds."""
    bad = ingest(refund_record("bad", amount=500.0))
    expected = [{"name": "lookup_order", "arguments": {"order_id": "A-1001"}},
                {"name": "refund", "arguments": {"order_id": "A-1001", "amount": 50}}]
    case, _ = promotion.trajectory_promote(trajectory=bad, target=suite, user=user, data={
        "message_index": 2, "expect": "calls", "expected_calls": expected, "env_type": "replay",
        "observations": {"refund": json.dumps({"ok": True, "refunded": 50.0})}})
    label(bad, "failure")
    good = ingest(refund_record("good", amount=50.0))
    label(good, "success")
    result = verifier_calibrate(project=project, verifier=case.verifier, source=f"case:{case.pk}")
    assert result.matrix == {"success": {"pass": 1, "fail": 0}, "failure": {"pass": 0, "fail": 1}}
    # A different, written verifier with the case chosen is scored as written: single-turn, at the refund.
    written = verifier_calibrate(project=project, verifier=REFUND_50, source=f"case:{case.pk}")
    assert written.matrix == {"success": {"pass": 1, "fail": 0}, "failure": {"pass": 0, "fail": 1}}


def test_a_workplace_case_is_scored_by_the_final_state_of_its_episode(ingest, suite, label, project, user):
    from trainer.envs.workplace import generate_tasks

    task = generate_tasks(1, seed=0, split="train", difficulty="single")[0]  # "Assign T4 ... to Peggy."
    right = task["solution"][0]
    wrong = json.loads(json.dumps(right))
    wrong["tool_calls"][0]["function"]["arguments"] = json.dumps({"task_id": "T4", "assignee": "Kevin"})

    def record(external_id: str, turn: dict) -> dict:
        return {"external_id": external_id, "outcome": "unknown", "tools": task["tools"],
                "messages": [*task["messages"], turn, {"role": "assistant", "content": "Done."}]}

    bad, good = ingest(record("wp-bad", wrong)), ingest(record("wp-good", right))
    index = len(task["messages"])
    case, _ = promotion.trajectory_promote(trajectory=bad, target=suite, user=user, data={
        "message_index": index, "expect": "state", "expected_state": task["verifier"]["expected"],
        "env_type": "workplace", "initial_state": task["env"]["initial_state"],
        "reference_calls": [{"name": "update_task", "arguments": {"task_id": "T4", "assignee": "Peggy"}}]})
    label(bad, "failure")
    label(good, "success")
    # Written, without the case's world, a state verifier has no state to judge: said, not a crash.
    written = verifier_calibrate(project=project, verifier=case.verifier)
    assert written.n == 0 and "final state" in written.spec_errors[0]
    result = verifier_calibrate(project=project, verifier=case.verifier, source=f"case:{case.pk}")
    assert result.matrix == {"success": {"pass": 1, "fail": 0}, "failure": {"pass": 0, "fail": 1}}
    assert result.disagreements == []
