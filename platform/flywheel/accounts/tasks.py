"""Celery tasks of the accounts app. Thin: each calls one service."""

from __future__ import annotations

from celery import shared_task

from flywheel import timelimits
from flywheel.accounts import services


@shared_task(name="flywheel.accounts.worker_heartbeat", ignore_result=True, **timelimits.HEARTBEAT)
def worker_heartbeat() -> None:
    """Record that this worker is alive and consuming the queue."""
    hostname = worker_heartbeat.request.hostname or "unknown"
    services.worker_heartbeat_record(hostname=hostname)
