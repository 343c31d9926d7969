"""Celery tasks of training jobs, routed to the `gpu` queue (CELERY_TASK_ROUTES: one job per GPU worker,
acks late, prefetch 1). Thin: each calls one service."""

from __future__ import annotations

from celery import shared_task

from flywheel import timelimits
from flywheel.training.services import job_evaluate, job_run


@shared_task(name="flywheel.training.evaluate", **timelimits.gpu())
def training_evaluate_task(job_id: int) -> str:
    """Measure production on the job's holdout and regression suites; the advice then waits for a person."""
    job = job_evaluate(job_id=job_id)
    return job.status if job else "nothing to do"


@shared_task(name="flywheel.training.run", **timelimits.gpu())
def training_run_task(job_id: int) -> str:
    """Run the trainer for a confirmed job, recording its events; a duplicate delivery does nothing."""
    job = job_run(job_id=job_id)
    return job.status if job else "nothing to do"
