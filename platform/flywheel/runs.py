"""One life for the runs a worker carries out in the background (training jobs, eval runs, clustering runs,
triage re-runs, uploads): the fields they share, which of a kind's statuses mean waiting, running, failed and
cancelled, and the actions on them: claim, cancel, retry, reap (a run whose worker stopped answering) and
requeue (a run no worker took), each refusing what the run's state does not allow with
`flywheel.supervise.Refused`, whose message a person reads.

A kind's model inherits `SupervisedRun` and declares its statuses; its service calls these functions with
its model or row and its task. This module knows no app, so every app may use it."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, ClassVar, TypeVar

from celery import Task
from django.conf import settings
from django.db import IntegrityError, models, transaction
from django.db.models import F, Q
from django.utils import timezone

from flywheel import outbox
from flywheel.supervise import Refused, worker_name

R = TypeVar("R", bound="SupervisedRun")
SWEEP_BATCH = 100  # rows one sweep reaps or sends again; the next sweep takes the rest


class SupervisedRun(models.Model):
    """A row a worker runs: waiting since `queued_at`, held by `worker` with a `heartbeat_at` it renews while
    it runs, ended at `finished_at`, with `error` saying why it failed. `attempt` counts the workers that
    took it.

    Each kind declares what its status values mean; the defaults are the plain queued/running/failed run that
    cannot be cancelled."""

    # Waiting for a worker: the requeue sends these again. The first is where retry and requeue put a run.
    QUEUED: ClassVar[tuple[str, ...]] = ("queued",)
    # Held by a worker that beats: the reaper looks at these. The first is where a claim puts a run.
    RUNNING: ClassVar[tuple[str, ...]] = ("running",)
    FAILED: ClassVar[str] = "failed"
    CANCELLED: ClassVar[str | None] = None  # None: the kind cannot be cancelled
    ACTIVE: ClassVar[tuple[str, ...]] = ("queued", "running")
    RETRYABLE: ClassVar[tuple[str, ...]] = ("failed",)
    # What a person calls one ("job", "run", "upload"), in refusals and in the reaper's message.
    NOUN: ClassVar[str] = "run"
    # How long a running row may stay silent before the reaper takes it as lost; None: the setting
    # FLYWHEEL_JOB_HEARTBEAT_TIMEOUT_S, which the trainer's heartbeat is sized for.
    HEARTBEAT_TIMEOUT: ClassVar[timedelta | None] = None
    # A run that lost its worker goes back to the queue while it has had fewer attempts than this, then
    # fails (a run that kills its worker must not do so forever). 0: it fails at once, for a person to retry.
    LOST_WORKER_ATTEMPTS: ClassVar[int] = 0
    # The kind's own columns a new attempt starts from (retry, or the reaper queueing a run again).
    RESET_ON_QUEUE: ClassVar[Mapping[str, Any]] = {}
    # The kind's own columns the reaper sets when it fails a run (F expressions allowed).
    SET_ON_LOST: ClassVar[Mapping[str, Any]] = {}

    error = models.TextField(blank=True, default="")  # why it failed, shown on its page
    created_at = models.DateTimeField(auto_now_add=True)
    queued_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    attempt = models.PositiveIntegerField(default=0)
    worker = models.CharField(max_length=200, blank=True, default="")  # host:pid of the worker that holds it

    class Meta:
        abstract = True

    @property
    def active(self) -> bool:
        return self.status in self.ACTIVE

    @property
    def retryable(self) -> bool:
        return self.status in self.RETRYABLE

    @classmethod
    def heartbeat_timeout(cls) -> timedelta:
        return cls.HEARTBEAT_TIMEOUT or timedelta(seconds=settings.FLYWHEEL_JOB_HEARTBEAT_TIMEOUT_S)

    @classmethod
    def lost(cls, now: datetime) -> Q:
        """Rows whose worker stopped answering: running, silent for longer than the heartbeat timeout."""
        return Q(status__in=cls.RUNNING, heartbeat_at__lt=now - cls.heartbeat_timeout())

    def retry_refusal(self) -> str:
        """Why this run cannot be retried now."""
        which = "failed or cancelled" if self.CANCELLED else "failed"
        return f"The {self.NOUN} is {_display(self)}: only a {which} {self.NOUN} is retried."

    def lost_message(self) -> str:
        """Why the reaper failed it: which worker stopped answering, and since when."""
        since = self.heartbeat_at or self.started_at
        when = f"no heartbeat since {since:%Y-%m-%d %H:%M:%S} UTC" if since else "it never beat"
        times = f"; it lost its worker {self.attempt} times" if self.LOST_WORKER_ATTEMPTS else ""
        return (f"The worker running this {self.NOUN} ({self.worker or 'unknown'}) stopped answering ({when}){times}. "
                "Retry runs it again.")


class CancellableRun(SupervisedRun):
    """A run a person may stop: a waiting one at once, a running one by its worker, which reads
    `cancel_requested` at its next beat."""

    CANCELLED: ClassVar[str | None] = "cancelled"
    RETRYABLE: ClassVar[tuple[str, ...]] = ("failed", "cancelled")
    # Statuses a cancel ends at once (no worker to stop); RUNNING ones ask their worker.
    CANCEL_AT_ONCE: ClassVar[tuple[str, ...]] = ("queued",)
    RESET_ON_QUEUE: ClassVar[Mapping[str, Any]] = {"cancel_requested": False}

    cancel_requested = models.BooleanField(default=False)

    class Meta:
        abstract = True


class DeviceUsage(models.Model):
    """What a run held a worker's devices for, summed over its attempts and phases (a training job's measurement
    of production, then its training): the wall time of the work, and that time times the devices it held.
    `device` says which kind: "gpu" (`device_seconds` are GPU-seconds) or "cpu" (a worker with no GPU: one CPU
    device a run). Recorded by `device_time` around the work, however it ends; a worker killed mid-run records
    nothing of that attempt."""

    device = models.CharField(max_length=8, blank=True, default="")  # "gpu" | "cpu" | "" (never ran)
    devices = models.PositiveSmallIntegerField(default=0)  # how many its last attempt held
    wall_seconds = models.FloatField(default=0.0)
    device_seconds = models.FloatField(default=0.0)

    class Meta:
        abstract = True

    @property
    def gpu_hours(self) -> float:
        return self.device_seconds / 3600 if self.device == "gpu" else 0.0

    @property
    def device_hours(self) -> float:
        return self.device_seconds / 3600

    @property
    def usage_text(self) -> str:
        """As the pages print it: "0.42 GPU-hours (2 GPUs) · wall 12.6 min"; "" before it ran."""
        if not self.device:
            return ""
        kind = "GPU" if self.device == "gpu" else "CPU"
        held = f" ({self.devices} {kind}s)" if self.devices > 1 else ""
        wall = self.wall_seconds
        wall_text = f"{wall / 3600:.2f} h" if wall >= 3600 else f"{wall / 60:.1f} min" if wall >= 60 else f"{wall:.0f} s"
        return f"{self.device_hours:.3g} {kind}-hours{held} · wall {wall_text}"

    def usage(self) -> dict[str, Any]:
        """The figures the API and the pages show."""
        return {"device": self.device, "devices": self.devices, "wall_seconds": round(self.wall_seconds, 3),
                "device_hours": round(self.device_hours, 6), "gpu_hours": round(self.gpu_hours, 6)}


USAGE_FIELDS = ("device", "devices", "wall_seconds", "device_seconds")


@contextmanager
def device_time(model: type[DeviceUsage], pk: int, *, gpus: int, processes: int = 1) -> Iterator[None]:
    """Add the time the block takes to run `pk`'s usage: `processes` GPUs of the `gpus` this worker sees (one
    process a GPU, as the trainer's launch), or one CPU when it sees none. Added even when the block raises:
    a failed attempt held the device as long."""
    device, count = ("gpu", max(1, min(processes, gpus))) if gpus > 0 else ("cpu", 1)
    start = time.monotonic()
    try:
        yield
    finally:
        seconds = time.monotonic() - start
        model.objects.filter(pk=pk).update(device=device, devices=count, wall_seconds=F("wall_seconds") + seconds,
                                           device_seconds=F("device_seconds") + seconds * count)


def one_active_per_project(name: str, active: Iterable[str]) -> models.UniqueConstraint:
    """The constraint that keeps one run of a kind at a time per project: a second start while one is on its
    way fails with IntegrityError (the start and `run_retry` turn it into Refused)."""
    return models.UniqueConstraint(fields=["project"], condition=Q(status__in=list(active)), name=name)


def run_limit_check(model: type[SupervisedRun], *, project: Any, statuses: Iterable[str], limit: int,
                    setting: str) -> None:
    """Refuse one more run of `model` for `project` when it has `limit` in `statuses` already (0: no limit), with
    Refused (409) naming the limit and the setting that holds it. Call it in the transaction that adds the run,
    after `accounts.services.project_lock`, so that two starts at once cannot both pass."""
    if limit <= 0:
        return
    count = model.objects.filter(project=project, status__in=list(statuses)).count()
    if count >= limit:
        noun = model.NOUN if limit == 1 else f"{model.NOUN}s"
        raise Refused(f"This project has {count} {noun} waiting or running, its limit ({setting}={limit}): wait "
                      f"for one to end, or cancel one.")


def _display(run: SupervisedRun) -> str:
    return run.get_status_display().lower()  # type: ignore[attr-defined]  # every kind's status has choices


def _locked(run: R) -> R:
    """The row again, locked for this transaction; what the caller left out (an upload's file) stays out."""
    return type(run).objects.select_for_update().defer(*run.get_deferred_fields()).get(pk=run.pk)


def _task_for(run: SupervisedRun, task: Task | Mapping[str, Task]) -> Task:
    return task[run.status] if isinstance(task, Mapping) else task


def run_claim(model: type[SupervisedRun], pk: int, **fields: Any) -> bool:
    """Take a queued run for this worker (compare-and-set: of two messages for it, one wins); False when it is
    no longer queued (a duplicate message) or, for a cancellable kind, a cancel came first."""
    now = timezone.now()
    waiting = Q(pk=pk, status=model.QUEUED[0])
    if issubclass(model, CancellableRun):
        waiting &= Q(cancel_requested=False)
    return bool(model.objects.filter(waiting).update(
        status=model.RUNNING[0], started_at=now, heartbeat_at=now, worker=worker_name(), attempt=F("attempt") + 1,
        error="", **fields,
    ))


def run_cancel(run: R) -> R:
    """Stop a run: one nobody runs yet at once, a running one by asking its worker. Refused for a kind that
    cannot be cancelled and for a run that has ended."""
    model = type(run)
    if not issubclass(model, CancellableRun):
        raise Refused(f"A {model.NOUN} cannot be cancelled; it stops on its own.")
    with transaction.atomic():
        run = _locked(run)
        if run.status in model.CANCEL_AT_ONCE:
            run.status, run.finished_at = model.CANCELLED, timezone.now()
            run.save(update_fields=["status", "finished_at"])
        elif run.status in model.RUNNING:
            run.cancel_requested = True
            run.save(update_fields=["cancel_requested"])
        else:
            raise Refused(f"The {model.NOUN} is {_display(run)}: there is nothing to cancel.")
    return run


def _queue_fields(model: type[SupervisedRun], now: datetime) -> dict[str, Any]:
    return {"status": model.QUEUED[0], "queued_at": now, "heartbeat_at": None, "worker": "", **model.RESET_ON_QUEUE}


def run_retry(run: R, *, task: Task | None, status: str | None = None) -> R:
    """Queue a failed (or cancelled) run again, from a clean slate, and send `task(run.pk)` once that commits
    (None: the caller runs it itself). `status`: where it waits, when the kind has more than one queue.
    Refused when the run is not retryable, or when another run of its project is already on its way."""
    model = type(run)
    try:
        with transaction.atomic():
            run = _locked(run)
            if not run.retryable:
                raise Refused(run.retry_refusal())
            fields = {**_queue_fields(model, timezone.now()), "finished_at": None, "error": ""}
            if status is not None:
                fields["status"] = status
            model.objects.filter(pk=run.pk).update(**fields)
            if task is not None:
                outbox.send_on_commit(task, run.pk)
    except IntegrityError:
        raise Refused(f"Another {model.NOUN} of this project is already on its way; wait for it to finish.") from None
    run.refresh_from_db()
    return run


def run_reap(model: type[R], *, task: Task | Mapping[str, Task] | None = None) -> tuple[list[R], int]:
    """Deal with the runs whose worker stopped answering: queue one again (and send `task`) while it has
    attempts left (`LOST_WORKER_ATTEMPTS`), else fail it with `lost_message`. Each row is changed by a
    compare-and-set, so of two sweeps at once one acts. Returns (the runs it failed, how many it sent again)."""
    now = timezone.now()
    lost = model.lost(now)
    failed: list[R] = []
    sent = 0
    for run in model.objects.filter(lost).order_by("pk")[:SWEEP_BATCH]:
        if run.attempt < model.LOST_WORKER_ATTEMPTS and task is not None:
            if not model.objects.filter(lost, pk=run.pk).update(**_queue_fields(model, now)):
                continue
            run.refresh_from_db()
            try:
                outbox.send(_task_for(run, task), run.pk)
            except outbox.BrokerUnavailable:
                continue  # it waits as queued: the requeue of a later sweep sends it
            sent += 1
        elif model.objects.filter(lost, pk=run.pk).update(
            status=model.FAILED, finished_at=now, error=run.lost_message()[:4000], **model.SET_ON_LOST,
        ):
            run.refresh_from_db()
            failed.append(run)
    return failed, sent


def run_requeue(model: type[SupervisedRun], *, task: Task | Mapping[str, Task]) -> int:
    """Send again the runs still waiting after `outbox.requeue_after()` that no worker has begun (their message
    was lost, or the broker was down); stop at the first BrokerUnavailable (the rest wait for the next sweep).
    `task`: one task, or one per waiting status. Returns how many were sent."""
    now = timezone.now()
    waiting = Q(status__in=model.QUEUED, queued_at__lt=now - outbox.requeue_after(), heartbeat_at__isnull=True)
    sent = 0
    for run in model.objects.filter(waiting).order_by("pk")[:SWEEP_BATCH]:
        # Compare-and-set first, so that of two sweeps at once one sends it.
        if not model.objects.filter(waiting, pk=run.pk).update(queued_at=now):
            continue
        try:
            outbox.send(_task_for(run, task), run.pk)
        except outbox.BrokerUnavailable:
            break
        sent += 1
    return sent


def run_sweep(model: type[SupervisedRun], *, task: Task | Mapping[str, Task]) -> int:
    """The outbox sweep of a kind: reap the runs whose worker stopped answering, then send again the runs no
    worker took. Returns how many were sent again."""
    _, sent = run_reap(model, task=task)
    return sent + run_requeue(model, task=task)
