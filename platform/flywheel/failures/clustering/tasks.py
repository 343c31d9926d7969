"""Celery tasks of the clustering app. Thin: each calls one service."""

from __future__ import annotations

from celery import shared_task

from flywheel import timelimits
from flywheel.failures.clustering.services import clustering_run_process


@shared_task(name="flywheel.failures.clustering.run", **timelimits.LONG_RUN)
def clustering_run_task(run_id: int) -> str:
    """Cluster a run's failures, with its progress on the run. A duplicate message finds the run taken."""
    run = clustering_run_process(run_id=run_id)
    return run.status if run is not None else "gone"
