"""The `gpu` queue takes projects in turn, so one project's queued work cannot starve the others'.

A message on Celery's `gpu` queue is a turn, not a named job: every training job or eval run that starts to wait
sends one (`gpu_turn_task`), and the worker that takes it runs the waiting work whose project is owed the turn:
the project with the fewest GPU runs running now, then the one whose GPU work last started longest ago (never
first), then the work that has waited longest. A project that queued a hundred runs thus gets every other
turn while another project waits, not the next hundred. Celery's queue alone is first in, first out.

Each app declares its kinds of GPU work (`GpuWork`: which rows wait, how a worker claims one and runs it) at
a dotted path in `KINDS`, as the outbox's sweeps are found, so this module imports no app."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from celery import shared_task
from django.db.models import Count, Max, Q
from django.utils.module_loading import import_string

from flywheel import timelimits

logger = logging.getLogger(__name__)

# Dotted paths of tuples of GpuWork, one per app that runs work on the `gpu` queue.
KINDS = ("flywheel.training.services.GPU_WORK", "flywheel.evals.runs.GPU_WORK")
NEVER = datetime.min.replace(tzinfo=UTC)


@dataclass(frozen=True)
class GpuWork:
    """One kind of GPU work: `model`'s rows matching `waiting` wait for a worker; `claim(pk)` takes one for this
    worker (a compare-and-set: False when another took it first, or it stopped waiting); `run(pk)` does the work
    of a claimed one. `model` is a flywheel.runs.SupervisedRun with a `project`."""

    name: str
    model: Any
    waiting: Q
    claim: Callable[[int], bool]
    run: Callable[[int], Any]


@dataclass(frozen=True, order=True)
class Waiting:
    """A waiting row, ordered by whose turn it is: its project's running count, its project's last start,
    how long it has waited."""

    running: int
    last_started: datetime
    queued_at: datetime
    pk: int
    project_id: int = field(compare=False)
    kind: GpuWork = field(compare=False)


def queue_name() -> str:
    """The queue turns are routed to (CELERY_TASK_ROUTES): the one GPU workers consume."""
    from flywheel.celery import app

    queue = app.amqp.router.route({}, gpu_turn_task.name).get("queue")
    return getattr(queue, "name", None) or str(queue or app.conf.task_default_queue)


def kinds() -> list[GpuWork]:
    return [kind for path in KINDS for kind in import_string(path)]


def turn_order(waiting: Iterable[Waiting]) -> list[Waiting]:
    """The waiting work in the order workers take it (see the module's docstring)."""
    return sorted(waiting)


def gpu_waiting() -> list[Waiting]:
    """Every waiting row of every kind, with its project's running count and last start."""
    all_kinds = kinds()
    rows = [(kind, pk, project_id, queued_at)
            for kind in all_kinds
            for pk, project_id, queued_at in kind.model.objects.filter(kind.waiting).values_list(
                "pk", "project_id", "queued_at")]
    projects = {project_id for _, _, project_id, _ in rows}
    running: dict[int, int] = dict.fromkeys(projects, 0)
    last: dict[int, datetime] = dict.fromkeys(projects, NEVER)
    for model in {kind.model for kind in all_kinds}:
        busy = Q(status__in=model.RUNNING, heartbeat_at__isnull=False)
        for row in (model.objects.filter(project_id__in=projects).values("project_id")
                    .annotate(last=Max("started_at"), running=Count("pk", filter=busy))):
            running[row["project_id"]] += row["running"]
            last[row["project_id"]] = max(last[row["project_id"]], row["last"] or NEVER)
    return [Waiting(running=running[project_id], last_started=last[project_id], queued_at=queued_at or NEVER,
                    pk=pk, project_id=project_id, kind=kind)
            for kind, pk, project_id, queued_at in rows]


def gpu_claim() -> Waiting | None:
    """Claim, for this worker, the waiting work whose turn it is (the next in order when another worker took it
    first); None when nothing waits."""
    for item in turn_order(gpu_waiting()):
        if item.kind.claim(item.pk):
            return item
    return None


def gpu_turn() -> str:
    """A turn on the `gpu` queue: claim the work whose turn it is and run it."""
    item = gpu_claim()
    if item is None:
        return "nothing waiting"
    item.kind.run(item.pk)
    return f"{item.kind.name} {item.pk}"


# A turn runs a job or an eval run to its end: the gpu queue's bound, as the tasks it stands for.
@shared_task(name="flywheel.gpu_turn", **timelimits.gpu())
def gpu_turn_task(asked_by: int | None = None) -> str:
    """One turn on the `gpu` queue (routed there by CELERY_TASK_ROUTES). `asked_by`: the id of the row whose
    waiting sent this turn, for the log; the turn itself goes to whichever project is owed it."""
    return gpu_turn()
