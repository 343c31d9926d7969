"""Celery tasks of the evals app. Thin: each calls one service."""

from __future__ import annotations

from celery import shared_task

from flywheel import timelimits
from flywheel.evals.runs import eval_run_process


@shared_task(name="flywheel.evals.run", **timelimits.gpu())
def eval_run_task(run_id: int) -> str:
    """Measure a model version on a suite version (routed to the `gpu` queue)."""
    run = eval_run_process(run_id=run_id)
    return run.status if run else "nothing to do"


@shared_task(name="flywheel.evals.online", **timelimits.SCORING)
def online_eval_task(project_id: int) -> int:
    """Sample and score a project's new trajectories (`online.online_eval_process`)."""
    from flywheel.evals.online import online_eval_process

    return online_eval_process(project_id=project_id)


@shared_task(name="flywheel.evals.recurrence_check", **timelimits.SCORING)
def recurrence_check_task(mode_id: int) -> str:
    """Scan one fixed failure mode's new production traffic for its return (flywheel.evals.recurrence)."""
    from flywheel.evals.recurrence import recurrence_check

    return recurrence_check(mode_id=mode_id)


@shared_task(name="flywheel.evals.calibration", **timelimits.CALIBRATION)
def calibration_task(run_id: int) -> str:
    """Calibrate a verifier against the project's labeled trajectories (flywheel.evals.calibration)."""
    from flywheel.evals.calibration import calibration_run_process

    run = calibration_run_process(run_id=run_id)
    return run.status if run is not None else "gone"
