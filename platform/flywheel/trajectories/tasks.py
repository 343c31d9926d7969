"""Celery tasks of the trajectories app. Thin: each calls one service."""

from __future__ import annotations

from celery import shared_task

from flywheel import timelimits
from flywheel.trajectories.triage import triage_project, triage_run_process
from flywheel.trajectories.upload import upload_process


@shared_task(name="flywheel.trajectories.upload_process", **timelimits.LONG_RUN)
def upload_process_task(upload_id: int) -> str:
    """Ingest an uploaded JSONL file. A failure is recorded on the upload (status, reason) for a retry; a
    duplicate delivery, or one for an upload another run holds, does nothing."""
    return upload_process(upload_id=upload_id).status


@shared_task(name="flywheel.trajectories.triage_project", **timelimits.TRIAGE)
def triage_project_task(project_id: int) -> int:
    """Triage the project's untriaged trajectories (sent after an ingest commits, and by the sweep); how many.
    A duplicate message finds nothing left to do; a large backlog is taken a slice at a time."""
    return triage_project(project_id=project_id, slice_s=timelimits.TRIAGE_SLICE_S)


@shared_task(name="flywheel.trajectories.triage_run", **timelimits.TRIAGE_RERUN)
def triage_run_task(run_id: int) -> str:
    """A maintainer's re-run of triage over the whole project, with its progress on the run."""
    run = triage_run_process(run_id=run_id)
    return run.status if run is not None else "gone"
