"""The `gpu` queue takes projects in turn (flywheel.gpu_queue): a project that queued many runs gets every
other turn while another project waits, instead of the next many, as Celery's first-in-first-out queue gave."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from flywheel import gpu_queue
from flywheel.evals.models import EvalSuite
from flywheel.evals.run_models import EvalRun, EvalRunStatus
from flywheel.evals.runs import eval_run_create
from flywheel.registry.models import BaseModel, ModelVersion
from flywheel.training.models import JobStatus, TrainingJob


def _world(project):
    """A model version and a one-case suite version of `project` (rows only: nothing here runs a model)."""
    base = BaseModel.objects.create(project=project, name="tiny", path=f"/models/{project.slug}/tiny")
    version = ModelVersion.objects.create(project=project, number=1, base=base)
    suite = EvalSuite.objects.create(project=project, name="holdout", kind="holdout")
    rows = [{"id": "c1", "messages": [{"role": "user", "content": "hi"}], "verifier": {"type": "exact", "expected": "x"}}]
    return version, suite.versions.create(number=1, rows=rows, size=1, content_hash="0" * 64)


def _worker_takes_turns(turns: int) -> list[str]:
    """What one GPU worker runs, turn by turn: it claims the work whose turn it is and finishes it."""
    ran = []
    for _ in range(turns):
        item = gpu_queue.gpu_claim()
        if item is None:
            break
        ran.append(f"{item.kind.model.objects.get(pk=item.pk).project.slug} {item.kind.name}")
        item.kind.model.objects.filter(pk=item.pk).update(status="succeeded", finished_at=timezone.now(),
                                                          heartbeat_at=None)
    return ran


def test_two_projects_take_turns_however_many_runs_one_queued_first(make_project, settings):
    settings.FLYWHEEL_MAX_EVAL_RUNS_PER_PROJECT = 0
    busy, other = make_project("busy"), make_project("other")
    for project, count in ((busy, 4), (other, 2)):  # busy queues all of its runs before other queues any
        version, suite_version = _world(project)
        for _ in range(count):
            eval_run_create(project=project, model_version=version, suite_version=suite_version, samples=1)
    assert _worker_takes_turns(10) == ["busy eval run", "other eval run", "busy eval run", "other eval run",
                                       "busy eval run", "busy eval run"]


def test_a_job_waiting_for_its_measurement_takes_its_turn_among_eval_runs(make_project, settings):
    settings.FLYWHEEL_MAX_EVAL_RUNS_PER_PROJECT = 0
    busy, other = make_project("busy"), make_project("other")
    version, suite_version = _world(busy)
    for _ in range(3):
        eval_run_create(project=busy, model_version=version, suite_version=suite_version, samples=1)
    other_version, other_suite = _world(other)
    task_set = other.task_sets.create(name="t")
    TrainingJob.objects.create(project=other, base_version=other_version, status=JobStatus.EVALUATING,
                               queued_at=timezone.now(), task_set_version=task_set.versions.create(
                                   number=1, rows=[], size=0, content_hash="0" * 64))
    assert _worker_takes_turns(10) == ["busy eval run", "other measure production", "busy eval run", "busy eval run"]


def test_a_project_with_work_running_waits_behind_one_without(make_project, settings):
    """Two workers: while one runs the busy project's work, the next turn goes to the project running none,
    even though the busy project started last longer ago."""
    settings.FLYWHEEL_MAX_EVAL_RUNS_PER_PROJECT = 0
    busy, other = make_project("busy"), make_project("other")
    version, suite_version = _world(busy)
    first = eval_run_create(project=busy, model_version=version, suite_version=suite_version, samples=1)
    eval_run_create(project=busy, model_version=version, suite_version=suite_version, samples=1)
    other_version, other_suite = _world(other)
    done = eval_run_create(project=other, model_version=other_version, suite_version=other_suite, samples=1)
    EvalRun.objects.filter(pk=done.pk).update(status=EvalRunStatus.SUCCEEDED, started_at=timezone.now())
    waiting = eval_run_create(project=other, model_version=other_version, suite_version=other_suite, samples=1)
    EvalRun.objects.filter(pk=first.pk).update(status=EvalRunStatus.RUNNING, heartbeat_at=timezone.now(),
                                               started_at=timezone.now() - timedelta(hours=1))
    assert gpu_queue.gpu_claim().pk == waiting.pk


def test_a_run_another_worker_took_is_not_taken_again(make_project, settings):
    settings.FLYWHEEL_MAX_EVAL_RUNS_PER_PROJECT = 0
    project = make_project("busy")
    version, suite_version = _world(project)
    first, second = (eval_run_create(project=project, model_version=version, suite_version=suite_version, samples=1)
                     for _ in range(2))
    kind = next(kind for kind in gpu_queue.kinds() if kind.model is EvalRun)
    assert kind.claim(first.pk) and not kind.claim(first.pk)  # another worker's claim; a second one loses
    assert gpu_queue.gpu_claim().pk == second.pk
    assert gpu_queue.gpu_claim() is None


@pytest.mark.parametrize("queued_by", ["create", "retry"])
def test_every_waiting_run_sends_a_turn_to_the_gpu_queue(make_project, settings, django_capture_on_commit_callbacks,
                                                         monkeypatch, queued_by):
    """The message is a turn on the `gpu` queue, whichever run asked for it."""
    from flywheel.evals.runs import eval_run_retry

    sent = []
    monkeypatch.setattr(gpu_queue.gpu_turn_task, "delay", lambda *args: sent.append(args))  # the broker's door
    project = make_project("busy")
    version, suite_version = _world(project)
    with django_capture_on_commit_callbacks(execute=True):
        run = eval_run_create(project=project, model_version=version, suite_version=suite_version, samples=1)
    if queued_by == "retry":
        EvalRun.objects.filter(pk=run.pk).update(status=EvalRunStatus.FAILED)
        with django_capture_on_commit_callbacks(execute=True):
            eval_run_retry(run=EvalRun.objects.get(pk=run.pk))
    assert sent == [(run.pk,)] * (1 if queued_by == "create" else 2)
    assert gpu_queue.queue_name() == "gpu"
