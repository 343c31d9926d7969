"""Celery tasks of the evals app. Thin: each calls one service."""

from __future__ import annotations

from celery import shared_task

from flywheel.evals.runs import eval_run_process


@shared_task(name="flywheel.evals.run")
def eval_run_task(run_id: int) -> str:
    """Measure a model version on a suite version (routed to the `gpu` queue)."""
    run = eval_run_process(run_id=run_id)
    return run.status if run else "nothing to do"
