"""The leakage guard at its doors (promotion, freezing, two versions side by side): a reworded request of a
row on the other side is refused, and the other side includes what frozen versions and model lineages held
even after the row was removed."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import pytest

from flywheel.evals import leakage, promotion
from flywheel.evals.services import item_remove, suite_create, version_create, version_freeze

pytestmark = pytest.mark.django_db

TOOLS = [{"type": "function", "function": {"name": "lookup_customer", "parameters": {
    "type": "object", "properties": {"customer_id": {"type": "string"}}, "required": ["customer_id"]}}}]


def lookup(external_id: str, request: str, looked_up: str = "C-1") -> dict[str, Any]:
    """A user asks for a customer; the agent looks up `looked_up` (C-1: the wrong one)."""
    return {"external_id": external_id, "outcome": "failure", "tools": TOOLS, "messages": [
        {"role": "user", "content": request},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "lookup_customer", "arguments": json.dumps({"customer_id": looked_up})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{}"},
        {"role": "assistant", "content": "Here it is."}]}


@pytest.fixture
def ingest(project) -> Callable[..., Any]:
    from flywheel.trajectories.ingest import ingest_trajectories
    from flywheel.trajectories.models import Trajectory

    def run(external_id: str, request: str) -> Any:
        assert ingest_trajectories(project=project, records=[lookup(external_id, request)]).accepted == 1
        return Trajectory.objects.get(project=project, external_id=external_id)

    return run


@pytest.fixture
def holdout(project, user):
    return suite_create(project=project, name="Held out", kind="holdout", user=user)


@pytest.fixture
def task_set(project, user):
    from flywheel.environments.services import task_set_create

    return task_set_create(project=project, name="Lookups", user=user)


def promote(trajectory: Any, target: Any, user: Any, customer: str, reason: str | None = None) -> Any:
    data = {"message_index": 1, "expect": "calls",
            "expected_calls": [{"name": "lookup_customer", "arguments": {"customer_id": customer}}]}
    if reason is not None:
        data["leakage_reason"] = reason
    return promotion.trajectory_promote(trajectory=trajectory, data=data, target=target, user=user)[0]


def refused_by(trajectory: Any, target: Any, user: Any, customer: str, reason: str | None = None) -> promotion.PromotionCheck:
    with pytest.raises(promotion.PromotionRefused) as refused:
        promote(trajectory, target, user, customer, reason)
    return refused.value.check


# --- a request reworded ---------------------------------------------------------------------------------


def test_a_reworded_request_of_an_eval_case_never_becomes_a_task(ingest, holdout, task_set, user):
    promote(ingest("l-1", "Look up customer C-17"), holdout, user, "C-17")
    conflicts = refused_by(ingest("l-2", "Please look up customer C-17 for me"), task_set, user, "C-17").conflicts
    assert [c.rule for c in conflicts] == ["similar"]
    assert "Held out" in conflicts[0].other and "Look up customer C-17" in conflicts[0].detail
    # Another customer is another request, however alike the words.
    task = promote(ingest("l-3", "Look up customer C-71"), task_set, user, "C-71")
    # And the other way round: a task's request reworded never becomes an eval case.
    conflicts = refused_by(ingest("l-4", "Could you look up customer C-71?"), holdout, user, "C-71").conflicts
    assert [c.rule for c in conflicts] == ["similar"] and task.row_id in conflicts[0].other


def test_two_versions_with_a_reworded_request_conflict(ingest, holdout, task_set, user):
    """What a job's start compares (`rows_conflicts` on its frozen versions) and what freezing compares."""
    promote(ingest("l-1", "Look up customer C-17"), holdout, user, "C-17")
    reworded = ingest("l-2", "Please look up customer C-17 for me")
    # Written straight to the task set, as a row older than the case would be.
    task_set.tasks.create(trajectory=reworded, message_index=1, messages=reworded.messages[:1], tools=TOOLS,
                          verifier={"type": "exact", "expected": "x"}, prompt_text=reworded.messages[0]["content"])
    version = version_create(collection=task_set, user=user)
    conflicts = leakage.rows_conflicts(rows=version.rows, other_rows=holdout.versions.get().rows, other_label="v1")
    assert [c.rule for c in conflicts] == ["similar"]
    with pytest.raises(leakage.LeakageError):
        version_freeze(version=version, user=user)


# --- what the other side ever held --------------------------------------------------------------------------


def test_a_task_of_a_frozen_version_never_becomes_an_eval_case_once_removed(ingest, holdout, task_set, user):
    trajectory = ingest("l-1", "Look up customer C-17")
    task = promote(trajectory, task_set, user, "C-17")
    row_id = task.row_id
    version_freeze(version=task_set.versions.get(), user=user)  # a job may have trained on it
    item_remove(item=task, user=user)
    conflicts = refused_by(trajectory, holdout, user, "C-17").conflicts
    assert {c.rule for c in conflicts} == {"trajectory", "prompt"}
    assert all(f"{row_id} of task set 'Lookups' v1 (frozen)" == c.other for c in conflicts)
    # Its request reworded, from another trajectory, is refused too.
    conflicts = refused_by(ingest("l-2", "Please look up customer C-17 for me"), holdout, user, "C-17").conflicts
    assert [c.rule for c in conflicts] == ["similar"] and "(frozen)" in conflicts[0].other


def test_a_case_of_a_frozen_version_never_becomes_a_task_once_removed(ingest, holdout, task_set, user):
    trajectory = ingest("l-1", "Look up customer C-17")
    case = promote(trajectory, holdout, user, "C-17")
    row_id = case.row_id
    version_freeze(version=holdout.versions.get(), user=user)  # a gate may have measured a model on it
    item_remove(item=case, user=user)
    conflicts = refused_by(trajectory, task_set, user, "C-17").conflicts
    assert {c.rule for c in conflicts} == {"trajectory", "prompt"}
    assert all(f"{row_id} of eval suite 'Held out' v1 (frozen)" == c.other for c in conflicts)


def test_a_removed_row_that_no_frozen_version_holds_may_change_sides(ingest, holdout, task_set, user):
    trajectory = ingest("l-1", "Look up customer C-17")
    item_remove(item=promote(trajectory, task_set, user, "C-17"), user=user)
    assert promote(trajectory, holdout, user, "C-17").trajectory_id == trajectory.pk


def test_a_trajectory_in_a_models_lineage_never_becomes_an_eval_case(ingest, holdout, project, user):
    from flywheel.registry.models import BaseModel, ModelVersion

    trajectory = ingest("l-1", "Look up customer C-17")
    base = BaseModel.objects.create(project=project, name="tiny", path="/models/tiny")
    ModelVersion.objects.create(project=project, number=1, base=base, lineage={"trajectories": [trajectory.pk]})
    conflicts = refused_by(trajectory, holdout, user, "C-17").conflicts
    assert [(c.rule, c.other) for c in conflicts] == [
        ("trajectory", f"trajectory #{trajectory.pk} in the lineage of model v1")]


def test_freezing_an_eval_version_sees_a_frozen_task_set_version(ingest, holdout, task_set, user):
    trajectory = ingest("l-1", "Look up customer C-17")
    task = promote(trajectory, task_set, user, "C-17")
    version_freeze(version=task_set.versions.get(), user=user)
    item_remove(item=task, user=user)
    # A case written straight to the suite (older than the guard's rule): its version cannot be frozen.
    holdout.cases.create(trajectory=trajectory, message_index=1, messages=trajectory.messages[:1], tools=TOOLS,
                         verifier={"type": "exact", "expected": "x"})
    with pytest.raises(leakage.LeakageError) as refused:
        version_freeze(version=version_create(collection=holdout, user=user), user=user)
    assert refused.value.conflicts[0].rule == "trajectory" and "(frozen)" in refused.value.conflicts[0].other


def test_the_training_side_lists_current_frozen_and_lineage_rows(ingest, holdout, task_set, project, user):
    from flywheel.registry.models import BaseModel, ModelVersion

    current, removed, in_lineage, evaluated = (ingest(f"l-{i}", f"Look up customer C-{i}") for i in range(2, 6))
    kept = promote(current, task_set, user, "C-2").row_id
    gone = promote(removed, task_set, user, "C-3")
    gone_id = gone.row_id
    version_freeze(version=task_set.versions.order_by("-number").first(), user=user)
    item_remove(item=gone, user=user)
    base = BaseModel.objects.create(project=project, name="tiny", path="/models/tiny")
    ModelVersion.objects.create(project=project, number=1, base=base, lineage={"trajectories": [in_lineage.pk]})
    promote(evaluated, holdout, user, "C-5")
    train = {c.trajectory_id: c.label for c in leakage.rows_on_side(project=project, side="train")}
    assert train == {current.pk: f"{kept} in task set 'Lookups'", removed.pk: f"{gone_id} of task set 'Lookups' v2 (frozen)",
                     in_lineage.pk: f"trajectory #{in_lineage.pk} in the lineage of model v1"}
    assert [c.trajectory_id for c in leakage.rows_on_side(project=project, side="eval")] == [evaluated.pk]


# --- where the guard is unsure -------------------------------------------------------------------------------

# The sentence vectors of these two have a cosine of 0.61, under the guard's threshold but within its band.
LOAN, EXTENSION = "Renew my library books.", "Can you extend the loan on my library books?"


def test_a_request_the_guard_is_unsure_of_needs_a_reviewers_reason(ingest, holdout, task_set, user):
    promote(ingest("l-1", LOAN), holdout, user, "C-17")
    unsure = ingest("l-2", EXTENSION)
    check = refused_by(unsure, task_set, user, "C-17")
    assert check.conflicts == [] and [(c.rule, c.confirmable) for c in check.doubts] == [("unsure", True)]
    assert "Held out" in check.doubts[0].other and LOAN in check.doubts[0].detail
    assert any("leakage_reason" in reason for reason in check.reasons())
    # A word is no reason.
    assert "leakage_reason" in refused_by(unsure, task_set, user, "C-17", reason="ok").errors
    reason = "One renews the books on loan, the other asks how long a loan can run"
    task = promote(unsure, task_set, user, "C-17", reason=reason)
    confirmation = task.leakage_confirmation
    assert confirmation["reason"] == reason and confirmation["by"] == user.username and confirmation["at"]
    assert [p["other"] for p in confirmation["pairs"]] == [check.doubts[0].other]
    # A person decided the pair: freezing the task set and a job's start do not refuse it again.
    version_freeze(version=task_set.versions.order_by("-number").first(), user=user)
    assert leakage.certain(leakage.rows_conflicts(rows=task_set.versions.order_by("-number").first().rows,
                                                  other_rows=holdout.versions.get().rows)) == []


def test_a_bulk_promotion_skips_what_the_guard_is_unsure_of(ingest, holdout, task_set, user):
    promote(ingest("l-1", LOAN), holdout, user, "C-17")
    result = promotion.selection_promote(
        items=[(ingest("l-2", EXTENSION), None)], target=task_set, user=user,
        data={"expect": "calls", "expected_calls": [{"name": "lookup_customer", "arguments": {"customer_id": "C-17"}}]})
    assert result.saved == [] and "the guard is unsure" in result.skipped[0][1][0]
    assert task_set.tasks.count() == 0


def test_leakage_vectors_keeps_the_vectors_of_rows_that_came_in_before(ingest, holdout, task_set, user, monkeypatch):
    from django.core.management import call_command

    from flywheel.evals.models import RequestVector
    from flywheel.failures.clustering import embedding

    promote(ingest("l-1", "Look up customer C-17"), holdout, user, "C-17")
    RequestVector.objects.all().delete()  # as before the guard kept vectors
    leakage._vector_cache.clear()
    out = io.StringIO()
    call_command("leakage_vectors", stdout=out)
    assert RequestVector.objects.count() == 1 and out.getvalue().startswith("1 request vector")
    leakage._vector_cache.clear()
    calls = []
    real = embedding.shared_model

    def counting():  # noqa: ANN202
        calls.append(1)
        return real()

    monkeypatch.setattr(embedding, "shared_model", counting)
    leakage._vectors(("Look up customer C-17",))
    assert calls == []  # read back, not run again
