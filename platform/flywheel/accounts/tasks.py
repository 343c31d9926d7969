"""Celery tasks of the accounts app, and what a worker reports when it starts. Thin: each calls one service."""

from __future__ import annotations

import logging

from celery import shared_task
from celery.signals import worker_ready

from flywheel import timelimits
from flywheel.accounts import services

logger = logging.getLogger(__name__)


@shared_task(name="flywheel.accounts.worker_heartbeat", ignore_result=True, **timelimits.HEARTBEAT)
def worker_heartbeat() -> None:
    """Record that this worker is alive and consuming the queue."""
    hostname = worker_heartbeat.request.hostname or "unknown"
    services.worker_heartbeat_record(hostname=hostname)


@worker_ready.connect
def worker_started(sender, **kwargs) -> None:
    """A worker that starts says which queues it consumes and how many GPUs it has (WorkerHeartbeat)."""
    task_consumer = getattr(sender, "task_consumer", None)
    queues = [queue.name for queue in task_consumer.queues] if task_consumer is not None else []
    try:
        services.worker_report(hostname=sender.hostname, queues=queues, gpus=services.gpus_visible())
    except Exception:  # noqa: BLE001 (a database away at start must not keep the worker from working)
        logger.exception("worker %s: could not report its queues and GPUs", sender.hostname)
