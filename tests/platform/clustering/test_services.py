"""Clustering runs and decisions through the services, on the test database: the chosen set, a run's
suggestions, accept / merge / split / dismiss, decisions that persist across runs, and a run that fails."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from flywheel.failures.clustering import services
from flywheel.failures.clustering.models import ClusteringRun, ClusterSuggestion, Decision, DismissedGroup
from flywheel.failures.models import FailureMode, FailureModeAssignment
from flywheel.supervise import Refused
from flywheel.trajectories.models import Trajectory

CAUSES = ["stock_timeout", "sql_syntax_error", "weather_undeclared_tool"]


def _run(project, user=None, **filters) -> ClusteringRun:
    run = services.clustering_run_start(project=project, user=user, run_filter=services.RunFilter(**filters))
    return services.clustering_run_process(run_id=run.pk)


def _cause_of(suggestion: ClusterSuggestion, labels: dict[int, str]) -> str:
    causes = {labels[t] for t in suggestion.trajectory_ids}
    assert len(causes) == 1, causes  # every group is one cause
    return causes.pop()


@pytest.fixture
def clustered(db, embedder, project, user, labeled_failures):
    labels = labeled_failures(project, 12, CAUSES)
    run = _run(project, user)
    return run, labels


def test_a_run_groups_the_failures_by_cause(clustered):
    run, labels = clustered
    assert run.status == "done" and run.stage == "done" and run.percent == 100
    assert run.total == len(labels) == 36 and run.embedder.startswith("minilm-static-")
    suggestions = list(run.suggestions.all())
    assert sorted(_cause_of(s, labels) for s in suggestions) == sorted(CAUSES)
    for s in suggestions:
        assert s.size == len(s.trajectory_ids) == 12
        assert len(s.representative_ids) == 5 and set(s.representative_ids) <= set(s.trajectory_ids)
        assert s.label and s.terms and s.signals and len(s.centroid) > 100
    stock = next(s for s in suggestions if _cause_of(s, labels) == "stock_timeout")
    assert stock.signals == {"no_final_answer": 12, "tool_error": 12} and stock.tool == "get_stock_price"
    assert stock.label.startswith("get_stock_price")
    assert stock.suggested_category == "bad_planning"  # what triage suggested for its members


def test_the_default_set_is_recent_unassigned_failures(db, project, user, labeled_failures):
    old, recent, success, assigned = Trajectory.objects.filter(pk__in=labeled_failures(project, 1, CAUSES + ["sql_destructive"])).order_by("id")
    Trajectory.objects.filter(pk=old.pk).update(started_at=timezone.now() - timedelta(days=40))
    Trajectory.objects.filter(pk__in=[recent.pk, assigned.pk, success.pk]).update(started_at=timezone.now())
    Trajectory.objects.filter(pk=success.pk).update(reviewed_outcome="success")
    from flywheel.failures.services import failure_mode_assign, failure_mode_create

    mode = failure_mode_create(project=project, name="m", category_key="other", user=user)
    failure_mode_assign(failure_mode=mode, trajectories=[assigned], user=user)
    chosen = services.failures_selected(project=project, run_filter=services.RunFilter())
    assert list(chosen) == [recent]
    wider = services.failures_selected(project=project, run_filter=services.RunFilter(days=60, unassigned=False, outcome=""))
    assert set(wider) == {old, recent, success, assigned}


def test_a_bad_filter_gets_field_errors():
    with pytest.raises(ValidationError) as caught:
        services.run_filter_parse({"days": 0, "limit": "many", "signal": "nope", "outcome": "bad", "color": "red"})
    assert set(caught.value.message_dict) == {"days", "limit", "signal", "outcome", "filter"}
    assert "from 1 to 3,650" in caught.value.message_dict["days"][0]
    assert services.run_filter_parse({"days": "7", "unassigned": "false"}) == services.RunFilter(days=7, unassigned=False)


def test_one_run_at_a_time_per_project(db, project, user):
    services.clustering_run_start(project=project, user=user)
    with pytest.raises(services.ClusteringRefused):
        services.clustering_run_start(project=project, user=user)


def test_accepting_makes_a_mode_with_the_members_and_is_decided_once(clustered, user):
    run, labels = clustered
    suggestion = run.suggestions.first()
    mode = services.suggestion_accept(suggestion=suggestion, user=user, name="Stocks time out")
    assert mode.name == "Stocks time out" and mode.category.key == suggestion.suggested_category
    assigned = set(FailureModeAssignment.objects.filter(failure_mode=mode).values_list("trajectory_id", flat=True))
    assert assigned == set(suggestion.trajectory_ids)
    suggestion.refresh_from_db()
    assert (suggestion.decision, suggestion.failure_mode, suggestion.decided_by) == (Decision.ACCEPTED, mode, user)
    with pytest.raises(services.ClusteringRefused):
        services.suggestion_accept(suggestion=suggestion, user=user, name="Again")
    assert not FailureMode.objects.filter(name="Again").exists()


def test_merging_assigns_the_members_to_an_existing_mode(clustered, user, project):
    from flywheel.failures.services import failure_mode_create

    run, _ = clustered
    mode = failure_mode_create(project=project, name="Known", category_key="other", user=user)
    suggestion = run.suggestions.last()
    assert services.suggestion_merge(suggestion=suggestion, failure_mode=mode, user=user) == suggestion.size
    assert mode.assignments.count() == suggestion.size
    assert ClusterSuggestion.objects.get(pk=suggestion.pk).decision == Decision.MERGED


def test_a_dismissed_group_is_not_suggested_again(clustered, user, project):
    run, labels = clustered
    dismissed = run.suggestions.first()
    group = services.suggestion_dismiss(suggestion=dismissed, user=user)
    assert isinstance(group, DismissedGroup) and group.trajectory_ids == dismissed.trajectory_ids
    again = _run(project, user)
    assert again.status == "done" and again.skipped_dismissed == 1
    causes = {_cause_of(s, labels) for s in again.suggestions.all()}
    assert causes == set(CAUSES) - {_cause_of(dismissed, labels)}


def test_later_failures_like_an_accepted_mode_are_suggested_for_it(clustered, user, project, labeled_failures):
    run, labels = clustered
    stock = next(s for s in run.suggestions.all() if _cause_of(s, labels) == "stock_timeout")
    mode = services.suggestion_accept(suggestion=stock, user=user, name="Stock quotes time out")
    new = labeled_failures(project, 8, ["stock_timeout"], seed=9, prefix="later")
    again = _run(project, user)
    attached = [s for s in again.suggestions.all() if s.target_mode_id]
    assert len(attached) == 1 and attached[0].target_mode == mode
    taken = set(attached[0].trajectory_ids)
    assert taken == set(new) and again.attached == 8  # the accepted ones are assigned, so not in the set
    assert attached[0].label.startswith("Like «Stock quotes time out»")
    assert not any(_cause_of(s, labels | new) == "stock_timeout" for s in again.suggestions.filter(target_mode=None))
    services.suggestion_accept(suggestion=attached[0], user=user)  # accepting an attachment merges
    assert mode.assignments.count() == 12 + len(taken)


def test_splitting_clusters_the_members_again(db, embedder, project, user, labeled_failures):
    labels = labeled_failures(project, 12, ["stock_timeout", "sql_syntax_error"])
    run = services.clustering_run_start(project=project, user=user)
    # A coarse group, as a reviewer might find one: both causes in one suggestion.
    both = ClusterSuggestion.objects.create(
        run=run, project=project, size=len(labels), label="mixed", trajectory_ids=sorted(labels), representative_ids=[]
    )
    ClusteringRun.objects.filter(pk=run.pk).update(status="done")
    split = services.suggestion_split(suggestion=both, user=user)
    assert split.parent == both and ClusterSuggestion.objects.get(pk=both.pk).decision == Decision.SPLIT
    split = services.clustering_run_process(run_id=split.pk)
    assert split.status == "done"
    parts = list(split.suggestions.all())
    assert sorted(_cause_of(s, labels) for s in parts) == ["sql_syntax_error", "stock_timeout"]


def test_a_failure_mid_run_says_where_and_a_retry_finishes_it(db, embedder, project, user, labeled_failures):
    labeled_failures(project, 6, ["stock_timeout", "sql_syntax_error"])

    class Broken:
        name, dim = "broken", 3

        def encode(self, texts):
            raise RuntimeError("model file unreadable")

    run = services.clustering_run_start(project=project, user=user)
    run = services.clustering_run_process(run_id=run.pk, embedder=Broken())
    assert run.status == "failed" and run.error.startswith("Failed while embedding signatures: RuntimeError: model file unreadable")
    assert services.clustering_run_process(run_id=run.pk) .status == "failed"  # not queued: left alone
    services.clustering_run_retry(run=run)
    run = services.clustering_run_process(run_id=run.pk)
    assert run.status == "done" and run.attempt == 2 and run.error == "" and run.suggestions.count() == 2
    with pytest.raises(Refused, match="The clustering run is done: only a failed clustering run is retried"):
        services.clustering_run_retry(run=run)


def test_the_sweep_sends_again_a_run_nobody_took(db, project, user, monkeypatch):
    sent = []
    from flywheel import outbox

    monkeypatch.setattr(outbox, "send", lambda task, *args: sent.append((task.name, args)))
    run = services.clustering_run_start(project=project, user=user)
    assert services.clustering_sweep() == 0  # not waiting long yet
    ClusteringRun.objects.filter(pk=run.pk).update(queued_at=timezone.now() - timedelta(hours=1))
    assert services.clustering_sweep() == 1
    assert sent == [("flywheel.failures.clustering.run", (run.pk,))]
