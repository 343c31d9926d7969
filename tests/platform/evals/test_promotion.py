"""Promotion: the prefilled draft, both verifier checks, field-level errors, the leakage guard, bulk
promotion of a failure mode, and versions with their content hash."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flywheel.evals import promotion
from flywheel.evals.leakage import LeakageError
from flywheel.evals.models import StoredRow
from flywheel.evals.rows import export_jsonl
from flywheel.evals.services import item_remove, version_freeze

pytestmark = pytest.mark.django_db


def test_prefill_expects_what_the_agent_did_at_the_flagged_turn(trajectory):
    values = promotion.promotion_prefill(trajectory=trajectory, message_index=4)
    assert values["expect"] == "calls"
    assert values["expected_calls"] == [{"name": "refund", "arguments": {"order_id": "A-1001", "amount": 500.0}}]
    # The recorded observation of the same tool, for a replay row's corrected call.
    assert values["observations"] == {"refund": json.dumps({"ok": True, "refunded": 500.0})}
    # Without a choice: the last assistant turn that made calls.
    assert promotion.promotion_prefill(trajectory=trajectory)["message_index"] == 4
    final = promotion.promotion_prefill(trajectory=trajectory, message_index=6)
    assert final["expect"] == "answer" and final["expected_answer"] == "Done, refunded."


def test_both_checks_run_on_the_row_the_trainer_will_read(trajectory, suite, corrected):
    check = promotion.promotion_check(trajectory=trajectory, data=corrected, target=suite)
    assert not check.errors and not check.conflicts
    # The agent refunded 500: the verifier fails it, on the argument, and says which.
    assert check.original_score.passed is False
    assert check.original_score.failure == "wrong_arguments"
    assert "amount" in json.dumps(check.original_score.checks)
    # The reference is the agent's call corrected by the matchers: amount in range, order id kept.
    ref_args = json.loads(check.reference["tool_calls"][0]["function"]["arguments"])
    assert ref_args == {"order_id": "A-1001", "amount": 49.99}
    assert check.reference_score.passed is True
    assert check.row["messages"] == trajectory.messages[:4]
    assert check.row["tools"] == trajectory.tools
    assert check.savable()


def test_unchanged_expectation_warns_that_the_verifier_passes_the_bad_output(trajectory, suite):
    data = promotion.promotion_prefill(trajectory=trajectory, message_index=4)
    check = promotion.promotion_check(trajectory=trajectory, data=data, target=suite)
    assert check.original_passes and check.reference_passes
    assert check.warnings == [promotion.ORIGINAL_PASSES]
    assert not check.savable()
    with pytest.raises(promotion.PromotionRefused):
        promotion.trajectory_promote(trajectory=trajectory, data=data, target=suite)
    assert suite.cases.count() == 0
    # The reviewer may still save it, knowingly.
    case, _ = promotion.trajectory_promote(trajectory=trajectory, data=data, target=suite, accept_passing_original=True)
    assert case.suite == suite


@pytest.mark.parametrize(("change", "field", "words"), [
    ({"expected_calls": [{"name": "refund", "arguments": {"amount": {"regex": "(a)\\1"}}}]}, "expected_calls", "regex"),
    ({"expected_calls": [{"name": "refund", "arguments": {"amount": {"range": [60, 10]}}}]}, "expected_calls", "range"),
    ({"expected_calls": [{"name": "refund", "arguments": {"amount": {"one_of": []}}}]}, "expected_calls", "one_of"),
    ({"expected_calls": "[{\"name\": "}, "expected_calls", "not valid JSON"),
    ({"expected_calls": [{"arguments": {}}]}, "expected_calls", "tool name"),
    ({"expect": "answer", "answer_match": "regex", "expected_answer": "(?<=x)y"}, "expected_answer", "regex"),
    ({"expect": "answer", "answer_match": "json_schema", "expected_answer": {"type": "nope"}}, "expected_answer", "schema"),
    ({"expect": "answer", "answer_match": "regex", "expected_answer": "^Refunded"}, "reference_answer", "state the correct"),
    ({"message_index": 3}, "message_index", "not an assistant"),
    ({"message_index": "four"}, "message_index", "whole number"),
    ({"message_index": float("inf")}, "message_index", "whole number"),
    ({"max_turns": "9" * 5000, "env_type": "replay"}, "max_turns", "whole number"),
    ({"env_type": "teleport"}, "env_type", "choose one of"),
    ({"env_type": "workplace"}, "initial_state", "initial state"),
    ({"reference_calls": [{"name": "refund", "arguments": {"amount": {"any": True}}}]}, "reference_calls", "not a matcher"),
    ({"expected_calls": [{"name": "refund", "arguments": {"note": {"regex": "^ok"}}}]}, "reference_calls", "no single value"),
])
def test_a_wrong_field_is_an_error_on_that_field(trajectory, suite, corrected, change, field, words):
    check = promotion.promotion_check(trajectory=trajectory, data={**corrected, **change}, target=suite)
    assert field in check.errors, check.errors
    assert any(words in message for message in check.errors[field]), check.errors
    assert not check.savable()
    with pytest.raises(promotion.PromotionRefused) as refused:
        promotion.trajectory_promote(trajectory=trajectory, data={**corrected, **change}, target=suite)
    assert field in refused.value.check.errors


def test_answer_expectations(ingest, refund_record, suite):
    t = ingest(refund_record("r-answer", answer="I can't help with that."))
    exact = {"message_index": 6, "expect": "answer", "answer_match": "exact", "expected_answer": "Refunded 50.00."}
    check = promotion.promotion_check(trajectory=t, data=exact, target=suite)
    assert not check.original_passes and check.reference_passes  # the reference defaults to the expected answer
    regex = {**exact, "answer_match": "regex", "expected_answer": "(?i)refunded 50", "reference_answer": "Refunded 50.00 today."}
    check = promotion.promotion_check(trajectory=t, data=regex, target=suite)
    assert not check.original_passes and check.reference_passes
    schema = {"type": "object", "required": ["refunded"], "properties": {"refunded": {"type": "number"}}}
    as_json = {**exact, "answer_match": "json_schema", "expected_answer": json.dumps(schema),
               "reference_answer": '{"refunded": 50}'}
    check = promotion.promotion_check(trajectory=t, data=as_json, target=suite)
    assert check.original_score.failure == "invalid_format" and check.reference_passes


def test_a_reference_that_fails_is_refused_with_its_checks(trajectory, suite, corrected):
    data = {**corrected, "reference_calls": [{"name": "refund", "arguments": {"order_id": "A-1001", "amount": 80}}]}
    check = promotion.promotion_check(trajectory=trajectory, data=data, target=suite)
    assert not check.errors and not check.reference_passes
    assert check.reference_score.failure == "wrong_arguments"
    assert any("reference fails" in r for r in check.reasons())


def test_promotion_makes_versions_with_a_content_hash(trajectory, ingest, refund_record, suite, corrected, user):
    case, _ = promotion.trajectory_promote(trajectory=trajectory, data=corrected, target=suite, user=user)
    v1 = suite.versions.get()
    assert v1.number == 1 and v1.size == 1 and v1.rows[0]["id"] == case.row_id
    assert v1.content_hash == hashlib.sha256(export_jsonl(v1.rows)).hexdigest()
    row = v1.rows[0]
    assert set(row) == {"id", "messages", "tools", "verifier", "origin"}  # single_turn: no env block
    assert row["origin"] == {"trajectory_id": trajectory.pk, "failure_mode": None}

    other = ingest(refund_record("r-2", order="B-7", request="Refund 50.00 for order B-7 please"))
    data = {**corrected, "expected_calls": [{"name": "refund", "arguments": {"order_id": "B-7", "amount": 50}}]}
    promotion.trajectory_promote(trajectory=other, data=data, target=suite, user=user)
    v2 = suite.versions.get(number=2)
    assert v2.size == 2 and v2.content_hash != v1.content_hash
    # Each distinct row is stored once: v2 shares case-1's row with v1.
    assert v2.row_digests[0] == v1.row_digests[0] and StoredRow.objects.count() == 2
    v1.refresh_from_db()
    assert v1.size == 1 and len(v1.rows) == 1  # versions never change
    for change in ("row_digests", "rows"):
        setattr(v1, change, [])
        with pytest.raises(ValueError, match="immutable"):
            v1.save()

    v3 = item_remove(item=case, user=user)
    assert v3.number == 3 and [r["id"] for r in v3.rows] == [r["id"] for r in v2.rows[1:]]
    # Same rows, same hash: the hash is of the content, not of the version.
    assert v3.content_hash == hashlib.sha256(export_jsonl(v2.rows[1:])).hexdigest()

    # The same turn of the same trajectory is not added twice.
    check = promotion.promotion_check(trajectory=other, data=data, target=suite)
    assert "target" in check.errors


def test_leakage_guard_keeps_eval_trajectories_and_prompts_out_of_training(
        trajectory, ingest, refund_record, suite, task_set, corrected, user):
    promotion.trajectory_promote(trajectory=trajectory, data=corrected, target=suite, user=user)
    # The same trajectory cannot become a task...
    with pytest.raises(promotion.PromotionRefused) as refused:
        promotion.trajectory_promote(trajectory=trajectory, data=corrected, target=task_set, user=user)
    conflicts = refused.value.check.conflicts
    assert [c.rule for c in conflicts] == ["trajectory", "prompt"]
    assert "case-" in conflicts[0].other and "Refunds" in conflicts[0].other
    # ...nor another trajectory asking the same thing (case, spaces and punctuation aside)...
    twin = ingest(refund_record("r-twin", request="please REFUND 50.00 on order A-1001 -- the mug arrived broken"))
    with pytest.raises(promotion.PromotionRefused) as refused:
        promotion.trajectory_promote(trajectory=twin, data=corrected, target=task_set, user=user)
    assert [c.rule for c in refused.value.check.conflicts] == ["prompt"]
    # ...while a different request goes in.
    fresh = ingest(refund_record("r-fresh", order="C-3", request="Refund 50.00 on C-3, it never came."))
    data = {**corrected, "expected_calls": [{"name": "refund", "arguments": {"order_id": "C-3", "amount": 50}}]}
    task, _ = promotion.trajectory_promote(trajectory=fresh, data=data, target=task_set, user=user)
    # And the other way round: a training trajectory never becomes an eval case.
    with pytest.raises(promotion.PromotionRefused) as refused:
        promotion.trajectory_promote(trajectory=fresh, data=data, target=suite, user=user)
    assert refused.value.check.conflicts[0].rule == "trajectory" and task.row_id in refused.value.check.conflicts[0].other


def test_freezing_checks_leakage_again(trajectory, ingest, refund_record, suite, task_set, corrected, user):
    """A task added before the eval case that duplicates it: the suite's version cannot be frozen."""
    promotion.trajectory_promote(trajectory=trajectory, data=corrected, target=task_set, user=user)
    version = task_set.versions.get()
    # A case with the same request, made before the task existed, is simulated by removing the guard's
    # view of it: write the case straight to the suite (as an older row would be).
    twin = ingest(refund_record("r-twin", request="Please refund 50.00 on order A-1001, the mug arrived broken!"))
    from flywheel.evals.rows import last_user_request, prompt_digest
    messages = twin.messages[:4]
    suite.cases.create(trajectory=twin, message_index=4, messages=messages, tools=twin.tools,
                       verifier={"type": "exact", "expected": "x"}, prompt_digest=prompt_digest(messages),
                       prompt_text=last_user_request(messages))
    with pytest.raises(LeakageError) as refused:
        version_freeze(version=version, user=user)
    assert refused.value.conflicts[0].rule == "prompt"
    version.refresh_from_db()
    assert version.frozen_at is None
    suite.cases.all().delete()
    assert version_freeze(version=version, user=user).frozen_at is not None


def test_bulk_promotion_saves_the_drafts_that_pass_and_lists_the_others(ingest, refund_record, suite, user, project):
    from flywheel.failures.services import failure_mode_assign, failure_mode_create

    bad = [ingest(refund_record(f"bulk-{i}", order=f"O-{i}", request=f"Refund 50.00 on order O-{i}")) for i in range(3)]
    right = ingest(refund_record("bulk-right", order="O-9", amount=50.0, request="Refund 50.00 on order O-9"))
    mode = failure_mode_create(project=project, name="Refunds the wrong amount", category_key="wrong_arguments", user=user)
    failure_mode_assign(failure_mode=mode, trajectories=[*bad, right], user=user, message_index=4)
    # One expectation for the whole mode: refund 50 on whatever order the agent looked up.
    data = {"expect": "calls", "expected_calls": [{"name": "refund", "arguments": {
        "order_id": {"regex": "^O-\\d+$"}, "amount": 50}}]}
    result = promotion.failure_mode_promote(failure_mode=mode, data=data, target=suite, user=user)
    assert sorted(c.trajectory_id for c in result.saved) == sorted(t.pk for t in bad)
    assert [t.pk for t, _ in result.skipped] == [right.pk]
    assert "passes the agent's original output" in result.skipped[0][1][0]
    # Each saved draft kept its own order id in the reference, and records the failure mode.
    for case in result.saved:
        args = json.loads(case.reference["tool_calls"][0]["function"]["arguments"])
        assert args == {"order_id": case.trajectory.external_id.replace("bulk-", "O-"), "amount": 50}
        assert case.failure_mode_id == mode.pk and case.row()["origin"]["failure_mode"] == mode.pk
    assert result.version.number == 1 and result.version.size == 3  # one version for the batch


def test_replay_row_states_the_observation_of_the_corrected_call(trajectory, task_set, corrected):
    from trainer.envs import replay

    data = {**corrected, "env_type": "replay", "max_turns": 3,
            "observations": {"refund": '{"ok": true, "refunded": 50.0}'}}
    check = promotion.promotion_check(trajectory=trajectory, data=data, target=task_set)
    assert not check.errors, check.errors
    env = check.row["env"]
    assert env["type"] == "replay" and env["max_turns"] == 3
    # The recorded call (refund 500) keeps its recorded result; the corrected one gets the stated observation.
    assert env["recorded"] == [
        {"name": "refund", "arguments": {"order_id": "A-1001", "amount": 500.0},
         "observation": json.dumps({"ok": True, "refunded": 500.0})},
        {"name": "refund", "arguments": {"order_id": "A-1001", "amount": 49.99},
         "observation": '{"ok": true, "refunded": 50.0}'},
    ]
    assert check.original_score.passed is False and check.reference_score.passed is True
    # In the trainer's replay environment the corrected call is answered, so the episode goes on past it.
    transcript, score = replay(check.row, [check.reference, {"role": "assistant", "content": "Refunded 50.00."}])
    assert transcript[-2] == {"role": "tool", "tool_call_id": "call_ref_0", "name": "refund",
                              "content": '{"ok": true, "refunded": 50.0}'}
    assert score.passed


def test_workplace_row_expects_a_final_state(ingest, suite):
    """A workplace episode: the agent assigned the task to the wrong person; the expected final state says who."""
    from trainer.envs.workplace import generate_tasks

    task = generate_tasks(1, seed=0, split="train", difficulty="single")[0]  # "Assign T4 ... to Peggy."
    right = task["solution"][0]
    wrong = json.loads(json.dumps(right))
    wrong["tool_calls"][0]["function"]["arguments"] = json.dumps({"task_id": "T4", "assignee": "Kevin"})
    t = ingest({"external_id": "wp-1", "outcome": "failure", "tools": task["tools"],
                "messages": [*task["messages"], wrong, {"role": "assistant", "content": "Done."}]})
    index = len(task["messages"])
    data = {"message_index": index, "expect": "state", "expected_state": task["verifier"]["expected"],
            "env_type": "workplace", "initial_state": task["env"]["initial_state"],
            "reference_calls": [{"name": "update_task", "arguments": {"task_id": "T4", "assignee": "Peggy"}}]}
    check = promotion.promotion_check(trajectory=t, data=data, target=suite)
    assert not check.errors, check.errors
    assert check.row["env"]["type"] == "workplace"
    assert check.original_score.failure == "wrong_state" and check.reference_score.passed


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**6) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["name", "arguments", "regex", "range", "one_of", "any", "optional", "equals", "x"]),
        inner, max_size=3),
    max_leaves=12,
)
_fields = st.fixed_dictionaries({}, optional={
    "expect": st.sampled_from(["calls", "answer", "state", "nope"]) | _json,
    "expected_calls": _json | st.text(max_size=30), "reference_calls": _json,
    "answer_match": st.sampled_from(["exact", "regex", "json_schema"]) | _json,
    "expected_answer": _json, "reference_answer": _json, "expected_state": _json,
    "env_type": st.sampled_from(["single_turn", "replay", "workplace"]) | _json,
    "observations": _json, "observation_error_expected": _json, "initial_state": _json, "max_turns": _json,
    "message_index": _json,
})


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(fields=_fields)
def test_any_input_is_a_field_error_or_a_check_never_an_exception(trajectory, suite, fields):
    check = promotion.promotion_check(trajectory=trajectory, data=fields, target=suite)
    if check.errors:
        assert all(isinstance(m, str) and m for ms in check.errors.values() for m in ms)
        assert not check.savable()
    else:
        assert check.row is not None and check.original_score is not None


def test_version_rows_checked_against_each_other_and_a_new_rule_plugs_in(
        trajectory, ingest, refund_record, suite, task_set, corrected, user, monkeypatch):
    from flywheel.evals import leakage

    promotion.trajectory_promote(trajectory=trajectory, data=corrected, target=suite, user=user)
    other = ingest(refund_record("r-2", order="B-7", request="I was charged twice for B-7, refund 50.00"))
    data = {**corrected, "expected_calls": [{"name": "refund", "arguments": {"order_id": "B-7", "amount": 50}}]}
    promotion.trajectory_promote(trajectory=other, data=data, target=task_set, user=user)
    suite_rows, task_rows = suite.versions.get().rows, task_set.versions.get().rows
    assert leakage.rows_conflicts(rows=task_rows, other_rows=suite_rows) == []
    assert [c.rule for c in leakage.rows_conflicts(rows=suite_rows, other_rows=suite_rows, other_label="v1")] == [
        "trajectory", "prompt"]

    # The embedding rule is a function of the same shape; here, any two refund requests are "near".
    def both_refunds(candidates, others):
        return [leakage.Conflict("embedding", c.label, o.label, "cosine 0.97") for c in candidates for o in others
                if "refund" in c.prompt_text.lower() and "refund" in o.prompt_text.lower()]

    monkeypatch.setattr(leakage, "NEAR_DUPLICATE_FINDERS", [*leakage.NEAR_DUPLICATE_FINDERS, both_refunds])
    assert [c.rule for c in leakage.rows_conflicts(rows=task_rows, other_rows=suite_rows)] == ["embedding"]
    with pytest.raises(LeakageError):
        version_freeze(version=task_set.versions.get(), user=user)


def test_a_trajectory_already_in_the_target_without_a_message_is_not_added_again(trajectory, suite, corrected, user):
    from flywheel.evals import rows as row_shape

    # As the demo's seeding makes a task: from the trajectory, with no message recorded.
    made = suite.items.create(trajectory=trajectory, messages=trajectory.messages[:1], tools=trajectory.tools or [],
                              verifier={"type": "exact", "expected": "x"},
                              prompt_digest=row_shape.prompt_digest(trajectory.messages[:1]), created_by=user)
    check = promotion.promotion_check(trajectory=trajectory, data=corrected, target=suite)
    assert check.errors["target"] == [f"this trajectory is already {made.row_id} of {suite.LABEL} '{suite.name}'"]
    with pytest.raises(promotion.PromotionRefused):
        promotion.trajectory_promote(trajectory=trajectory, data=corrected, target=suite, user=user)
    assert suite.items.count() == 1
