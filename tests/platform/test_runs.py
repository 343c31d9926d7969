"""One life for the five kinds of supervised run (flywheel.runs): training jobs, eval runs, clustering runs,
triage re-runs and uploads. Each through its own service's names: the reaper fails a run whose worker
stopped answering and leaves one that beats, retry refuses an active run and queues a failed one (its task
sent once that commits), cancel refuses a finished run, and where a kind keeps one run at a time per
project, a second active one is refused."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from celery.app.task import Task
from django.db import IntegrityError, transaction
from django.utils import timezone

from flywheel import runs
from flywheel.evals import runs as eval_runs
from flywheel.evals.run_models import EvalRun
from flywheel.failures.clustering import services as clustering
from flywheel.failures.clustering.models import ClusteringRun
from flywheel.supervise import Refused
from flywheel.training import services as training
from flywheel.training.models import TrainingJob
from flywheel.trajectories import triage
from flywheel.trajectories import upload as uploads
from flywheel.trajectories.models import TriageRun, Upload
from tests.platform.training.worlds import tickets_world


@dataclass(frozen=True)
class Kind:
    model: type[runs.SupervisedRun]
    done: str  # the status of a run that succeeded
    retry: Callable[[Any], Any]  # the kind's own retry service
    sweep: Callable[[], int]  # the kind's outbox sweep, which reaps
    cancel: Callable[[Any], Any] = runs.run_cancel  # the kind's cancel service, where it has one
    one_active: bool = False


KINDS = {
    "training job": Kind(TrainingJob, "succeeded", lambda r: training.job_retry(job=r), training.training_sweep,
                         cancel=lambda r: training.job_cancel(job=r)),
    "eval run": Kind(EvalRun, "succeeded", lambda r: eval_runs.eval_run_retry(run=r), eval_runs.eval_sweep,
                     cancel=lambda r: eval_runs.eval_run_cancel(run=r)),
    "clustering run": Kind(ClusteringRun, "done", lambda r: clustering.clustering_run_retry(run=r),
                           clustering.clustering_sweep, one_active=True),
    "triage re-run": Kind(TriageRun, "done", lambda r: triage.triage_run_retry(run=r), triage.triage_sweep,
                          one_active=True),
    "upload": Kind(Upload, "done", lambda r: uploads.upload_retry(upload=r), uploads.upload_sweep),
}


@pytest.fixture(params=list(KINDS))
def kind(request) -> Kind:
    return KINDS[request.param]


@pytest.fixture
def make_run(kind, project, user, tmp_path, monkeypatch) -> Callable[..., runs.SupervisedRun]:
    """A row of `kind` in `status` (its model's own values), with any other fields given."""
    monkeypatch.setattr(uploads, "INLINE_MAX_BYTES", 0)  # a retried upload goes to a worker, as the others do
    world: dict[str, Any] = {}

    def make(status: str, *, in_project: Any = None, **fields: Any) -> runs.SupervisedRun:
        if kind.model in (TrainingJob, EvalRun) and not world:
            world.update(tickets_world(project, user, tmp_path / "model", holdout_cases=2))
        own: dict[str, Any] = {
            TrainingJob: lambda: {"task_set_version": world["train"], "base_version": world["production"],
                                  "advice": {"recommendation": "grpo"}},
            EvalRun: lambda: {"model_version": world["production"], "suite_version": world["holdout"]},
            ClusteringRun: dict,
            TriageRun: lambda: {"version": 1},
            Upload: lambda: {"filename": "a.jsonl", "content": b"{}\n", "size_bytes": 3},
        }[kind.model]()
        return kind.model.objects.create(project=in_project or project, status=status, **own, **fields)

    return make


@pytest.fixture
def sent(monkeypatch) -> list[tuple[str, tuple]]:
    """The tasks handed to the broker: (task name, arguments)."""
    handed: list[tuple[str, tuple]] = []
    monkeypatch.setattr(Task, "delay", lambda task, *args: handed.append((task.name, args)))
    return handed


def _lost(kind: Kind) -> dict[str, Any]:
    """Fields of a running row whose worker stopped answering an hour ago and has no attempt left."""
    hour_ago = timezone.now() - timedelta(hours=1)
    fields = {"heartbeat_at": hour_ago, "worker": "gone-host:4242", "attempt": kind.model.LOST_WORKER_ATTEMPTS}
    if kind.model is Upload:  # an upload's run is held by its lease
        fields["lease_expires_at"] = hour_ago
    return fields


def _beating(kind: Kind) -> dict[str, Any]:
    fields = {"heartbeat_at": timezone.now(), "worker": "live-host:1", "attempt": 1}
    if kind.model is Upload:
        fields["lease_expires_at"] = timezone.now() + timedelta(minutes=5)
    return fields


@pytest.mark.django_db
def test_the_reaper_fails_a_run_whose_worker_stopped_and_leaves_one_that_beats(kind, make_run, make_project, sent):
    lost = make_run(kind.model.RUNNING[0], **_lost(kind))
    # Another project's, for the kinds that run one at a time per project.
    fresh = make_run(kind.model.RUNNING[0], in_project=make_project(), **_beating(kind))

    kind.sweep()

    lost.refresh_from_db()
    assert lost.status == kind.model.FAILED and lost.finished_at is not None
    assert "gone-host:4242" in lost.error and "stopped answering" in lost.error and "since" in lost.error
    assert "Retry" in lost.error
    fresh.refresh_from_db()
    assert (fresh.status, fresh.error) == (kind.model.RUNNING[0], "")
    assert sent == []  # failed, not sent again


@pytest.mark.django_db
@pytest.mark.parametrize("kind", [k for k, v in KINDS.items() if v.model.LOST_WORKER_ATTEMPTS], indirect=True)
def test_a_kind_that_resumes_sends_a_lost_run_again_while_it_has_attempts_left(kind, make_run, sent):
    lost = make_run(kind.model.RUNNING[0], **{**_lost(kind), "attempt": 1})
    assert kind.sweep() == 1
    lost.refresh_from_db()
    assert (lost.status, lost.heartbeat_at, lost.worker) == (kind.model.QUEUED[0], None, "")
    assert [args for _, args in sent] == [(lost.pk,)]


@pytest.mark.django_db
def test_retry_refuses_an_active_run_and_queues_a_failed_one(
    kind, make_run, sent, django_capture_on_commit_callbacks,
):
    running = make_run(kind.model.RUNNING[0], **_beating(kind))
    with pytest.raises(Refused, match=rf"The {kind.model.NOUN} is \w+: only a failed"):
        kind.retry(running)
    assert type(running).objects.get(pk=running.pk).status == kind.model.RUNNING[0]
    running.delete()

    failed = make_run(kind.model.FAILED, error="it broke", finished_at=timezone.now(), **_lost(kind))
    with django_capture_on_commit_callbacks(execute=True):
        retried = kind.retry(failed)
    assert retried.status in kind.model.QUEUED and retried.active
    assert (retried.error, retried.finished_at, retried.heartbeat_at, retried.worker) == ("", None, None, "")
    assert [args for _, args in sent] == [(failed.pk,)]  # sent once the retry committed


@pytest.mark.django_db
def test_cancel_refuses_a_finished_run(kind, make_run):
    done = make_run(kind.done, finished_at=timezone.now())
    refusal = "there is nothing to cancel" if kind.model.CANCELLED else "cannot be cancelled"
    with pytest.raises(Refused, match=refusal):
        kind.cancel(done)
    assert type(done).objects.get(pk=done.pk).status == kind.done


@pytest.mark.django_db
@pytest.mark.parametrize("kind", [k for k, v in KINDS.items() if v.model.CANCELLED], indirect=True)
def test_cancel_stops_a_queued_run_at_once_and_asks_a_running_one(kind, make_run):
    queued = make_run(kind.model.QUEUED[0], queued_at=timezone.now())
    assert kind.cancel(queued).status == kind.model.CANCELLED
    running = make_run(kind.model.RUNNING[0], **_beating(kind))
    asked = kind.cancel(running)
    assert (asked.status, asked.cancel_requested) == (kind.model.RUNNING[0], True)  # its worker stops it


@pytest.mark.django_db
@pytest.mark.parametrize("kind", [k for k, v in KINDS.items() if v.one_active], indirect=True)
def test_one_active_run_per_project_where_the_kind_keeps_one(kind, make_run):
    make_run(kind.model.QUEUED[0], queued_at=timezone.now())
    failed = make_run(kind.model.FAILED)
    with pytest.raises(IntegrityError), transaction.atomic():
        make_run(kind.model.RUNNING[0])
    with pytest.raises(Refused, match=rf"Another {kind.model.NOUN} of this project is already on its way"):
        kind.retry(failed)
    assert type(failed).objects.get(pk=failed.pk).status == kind.model.FAILED
