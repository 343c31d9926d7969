"""Every Celery task has a soft and a hard time limit (flywheel.timelimits), and what reaches its soft limit
leaves a state its page explains: the outbox sweep stops for the next one, a run says it was stopped."""

from __future__ import annotations

import pytest
from celery.exceptions import SoftTimeLimitExceeded

from flywheel import outbox
from flywheel.celery import app


def _flywheel_tasks() -> dict:
    app.loader.import_default_modules()  # what a worker does at start: every app's tasks module
    return {name: task for name, task in app.tasks.items() if name.startswith("flywheel.")}


def test_every_task_has_a_soft_and_a_hard_time_limit():
    tasks = _flywheel_tasks()
    assert {"flywheel.trajectories.triage_project", "flywheel.evals.calibration", "flywheel.training.run",
            "flywheel.outbox_sweep"} <= set(tasks)
    for name, task in tasks.items():
        soft, hard = task.soft_time_limit, task.time_limit
        assert soft and hard and 0 < soft < hard, f"{name}: soft {soft}, hard {hard}"


def test_the_default_queues_tasks_stop_within_an_hour_and_the_gpu_ones_at_the_operators_bound(settings):
    gpu = {name for name, task in _flywheel_tasks().items() if any(
        name.startswith(prefix.rstrip("*")) for prefix in settings.CELERY_TASK_ROUTES)}
    assert gpu == {"flywheel.training.run", "flywheel.training.evaluate", "flywheel.evals.run",
                   "flywheel.registry.demo_model", "flywheel.seed.demo_traffic", "flywheel.gpu_turn"}
    for name, task in _flywheel_tasks().items():
        if name in gpu:
            assert task.soft_time_limit == settings.FLYWHEEL_GPU_TASK_TIME_LIMIT_S, name
        else:
            assert task.time_limit <= 3660, name  # a worker of the default queue is never held for longer


def _stopped() -> int:
    raise SoftTimeLimitExceeded()


def _later() -> int:
    raise AssertionError("a sweep ran after the time limit")


def test_the_outbox_sweep_stops_at_its_time_limit_and_leaves_the_rest_to_the_next(monkeypatch):
    """Each sweep's failure is logged and the others still run, except the time limit: it is the whole
    sweep's, and what the sweeps after it would do waits for the next sweep."""
    monkeypatch.setattr(outbox, "SWEEPS", (f"{__name__}._stopped", f"{__name__}._later"))
    with pytest.raises(SoftTimeLimitExceeded):
        outbox.outbox_sweep()
