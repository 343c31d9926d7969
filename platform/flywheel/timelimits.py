"""The time limits of the Celery tasks, one per kind of work, and how a run says it reached one.

No task may hold a worker for ever: the default queue runs two at a time, and triage, webhooks, live checks,
online evaluation and the outbox all wait behind whatever holds it. At its soft limit Celery raises
SoftTimeLimitExceeded inside the task; the task's own failure handling records that on the row its page shows
(a run's error, an upload's reason, online evaluation's last problem) and its retry, a person's or the outbox
sweep's, goes on from what was committed: work commits in chunks, so nothing is half applied. The hard limit,
a little later, kills the worker process: the backstop for code that never returns to Python.

Limits are enforced by a prefork worker (production's `celery worker`); the `solo` pool that `make run` and the
tests use runs tasks in its main thread and enforces none."""

from __future__ import annotations

from typing import Any

from celery import current_task
from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings

__all__ = ["CALIBRATION", "HEARTBEAT", "LONG_RUN", "SCORING", "SHORT", "SWEEP", "TRIAGE", "TRIAGE_RERUN",
           "TRIAGE_SLICE_S", "SoftTimeLimitExceeded", "gpu", "stopped_reason"]


def _limits(soft_s: float, grace_s: float = 30.0) -> dict[str, float]:
    """Celery's task options: the soft limit, and the hard one `grace_s` later (time to record the failure)."""
    return {"soft_time_limit": soft_s, "time_limit": soft_s + grace_s}


# One row written: the worker's heartbeat.
HEARTBEAT = _limits(15, grace_s=15)
# The outbox sweep runs every FLYWHEEL_SWEEP_INTERVAL_S and handles at most a batch of rows per kind; one
# stopped half way is followed by the next, which finds what it left.
SWEEP = _limits(120)
# One delivery, one look of a canary or a watch, a rollup of the dirty buckets, a mirror to MLflow: each call
# out has its own deadline, and a failed one is recorded on its row and tried again by the sweep.
SHORT = _limits(300)
# The triage of a project's new trajectories. The task stops taking chunks after TRIAGE_SLICE_S and sends itself
# again for the rest, so only a chunk that never ends meets the soft limit.
TRIAGE = _limits(300)
TRIAGE_SLICE_S = 120.0
# A maintainer's re-run of triage over a whole project, with its progress: a failed one says why and Retry goes
# on with what is still out of date.
TRIAGE_RERUN = _limits(3600, grace_s=60)
# Scoring a batch of live trajectories (online evaluation) or scanning a fixed mode's new traffic.
SCORING = _limits(600)
# Verifier calibration: at most calibration.MAX_TRAJECTORIES trajectories scored in the platform's process.
CALIBRATION = _limits(600)
# An upload's ingest (up to FLYWHEEL_MAX_UPLOAD_BYTES) and a clustering run (embedding up to its limit of
# failures): minutes at most; a failed one is retried from the page.
LONG_RUN = _limits(1800, grace_s=60)
# What runs on the gpu queue (training, the measurement of production, eval runs, the demo model): a supervised
# child process with its own heartbeat and cancel (flywheel.supervise). The limit only bounds a run nobody
# stops; at the soft limit the child's process group is killed and the run fails, and a retried training job
# resumes from its last checkpoint. The operator sizes it (FLYWHEEL_GPU_TASK_TIME_LIMIT_S); read when the tasks
# are defined, after Django's settings (this module is imported while they load).


def gpu() -> dict[str, float]:
    return _limits(settings.FLYWHEEL_GPU_TASK_TIME_LIMIT_S, grace_s=300)


def stopped_reason(exc: BaseException) -> str:
    """Why a run stopped, as its page says it: its time limit in words, anything else as `Type: message`."""
    if isinstance(exc, SoftTimeLimitExceeded):
        limit: Any = getattr(current_task, "soft_time_limit", None) if current_task else None
        within = f" of {_duration(limit)}" if isinstance(limit, int | float) else ""
        return f"It ran past its time limit{within} and was stopped."
    return f"{type(exc).__name__}: {exc}"


def _duration(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"
