"""Celery tasks of the trajectories app. Thin: each calls one service."""

from __future__ import annotations

from celery import shared_task

from flywheel.trajectories.upload import upload_process


@shared_task(name="flywheel.trajectories.upload_process")
def upload_process_task(upload_id: int) -> str:
    """Ingest an uploaded JSONL file. A failure is recorded on the upload (status, reason) for a retry."""
    return upload_process(upload_id=upload_id).status
