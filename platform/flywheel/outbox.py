"""Work a worker must do after a commit, kept in the database so that it is never lost: the row's status is
the outbox.

A service writes the row as waiting (e.g. an upload `queued`, with `queued_at`) in its transaction and sends
the task once that commits (`send_on_commit`), so a worker never sees a row that is not there yet. When the
broker is down at that moment, or a message is lost, the row still says it waits: the sweep, which Celery
beat runs every FLYWHEEL_SWEEP_INTERVAL_S (`flywheel.outbox_sweep`), calls each function of SWEEPS, and
each sends again its rows that have waited longer than FLYWHEEL_REQUEUE_AFTER_S without a live lease. A task
claims its row with a compare-and-set on the status (and a lease), so a message sent twice runs once.

Follow-up work of another kind (a trajectory's triage, say) adds a status to its row, a task that claims it,
and its sweep function to SWEEPS."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from celery import Task
from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import transaction
from django.utils.module_loading import import_string

logger = logging.getLogger(__name__)

# Dotted paths of the sweep functions: each takes no argument and returns how many rows it sent again.
SWEEPS = (
    "flywheel.trajectories.upload.upload_sweep",
    "flywheel.trajectories.triage.triage_sweep",
    "flywheel.failures.clustering.services.clustering_sweep",
    "flywheel.evals.calibration.calibration_sweep",
    "flywheel.registry.services.registry_sweep",
    "flywheel.registry.notify.notification_sweep",
    "flywheel.registry.live.rollup_sweep",
    "flywheel.registry.canary.live_check_sweep",
    "flywheel.evals.recurrence.recurrence_sweep",
    "flywheel.training.services.training_sweep",
    "flywheel.evals.runs.eval_sweep",
    "flywheel.evals.online.online_eval_sweep",
)


class BrokerUnavailable(Exception):
    """The task could not be handed to the broker; the row keeps waiting for the next sweep."""


def requeue_after() -> timedelta:
    """How long a row may wait for a worker before the sweep sends it again."""
    return timedelta(seconds=settings.FLYWHEEL_REQUEUE_AFTER_S)


def send(task: Task, *args: Any) -> None:
    """Hand `task(*args)` to the broker now; BrokerUnavailable when the broker cannot take it."""
    try:
        task.delay(*args)
    except Exception as exc:  # kombu's and redis's errors alike: the broker is down or unreachable
        raise BrokerUnavailable(f"{type(exc).__name__}: {exc}") from exc


def send_on_commit(task: Task, *args: Any) -> None:
    """Send `task(*args)` once the current transaction commits. A broker that is down is logged, not raised:
    the request that committed the row succeeded, and the sweep sends the row again."""

    def after_commit() -> None:
        try:
            send(task, *args)
        except BrokerUnavailable as exc:
            logger.warning("could not queue %s%r (%s); the sweep sends it again", task.name, args, exc)

    transaction.on_commit(after_commit)


def outbox_sweep() -> dict[str, int]:
    """Run every sweep; {sweep: rows sent again}. A sweep that fails is logged and the others still run."""
    sent: dict[str, int] = {}
    for path in SWEEPS:
        try:
            sent[path] = import_string(path)()
        except SoftTimeLimitExceeded:
            raise  # the time limit is the whole sweep's: the next one goes on from what this one left
        except Exception:
            logger.exception("sweep %s failed", path)
            sent[path] = 0
    return sent
