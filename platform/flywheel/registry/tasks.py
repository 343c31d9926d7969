"""Celery tasks of the registry, and the workers' check of a base model's folder. Thin: each calls one
service."""

from __future__ import annotations

from celery import shared_task
from celery.worker.control import control_command

from flywheel import timelimits
from flywheel.registry.model_folder import folder_problems
from flywheel.registry.services import registry_sync


@shared_task(name="flywheel.registry.sync", **timelimits.SHORT)
def registry_sync_task(project_id: int) -> dict[str, int]:
    """Mirror the project's versions and alias moves to MLflow and announce production's moves."""
    return registry_sync(project_id=project_id)


@control_command(args=[("path", str)], signature="<path>")
def flywheel_model_folder_check(state, path: str, roots: list[str] | None = None) -> dict:
    """Check a base model's folder on this worker's disk (flywheel.registry.model_folder), answered with the
    queues this worker consumes. `roots`: the folders the project may use; a path outside them (its links
    followed on this disk) is refused without a look inside. Missing (a caller from before confinement): every
    path is refused.

    A remote-control command rather than a task: the worker's main process answers it at once, where a task
    would wait on the `gpu` queue behind a training job for hours, and every worker answers, so the platform
    hears from each one that may load the model. It reads a few small files and no weights."""
    consumer = getattr(state, "consumer", None)
    task_consumer = getattr(consumer, "task_consumer", None)
    queues = sorted(q.name for q in task_consumer.queues) if task_consumer is not None else []
    return {"problems": folder_problems(path, roots=roots or []), "queues": queues}


@shared_task(name="flywheel.registry.notification_deliver", **timelimits.SHORT)
def notification_deliver_task(notification_id: int) -> str:
    """Send one notification's webhook and e-mail (flywheel.registry.notify)."""
    from flywheel.registry.notify import notification_deliver

    return notification_deliver(notification_id=notification_id)


@shared_task(name="flywheel.registry.live_check_look", **timelimits.SHORT)
def live_check_task(check_id: int) -> str:
    """One look of a canary decision or a watch (flywheel.registry.canary)."""
    from flywheel.registry.canary import live_check_look

    return live_check_look(check_id=check_id)


@shared_task(name="flywheel.registry.live_rollup", **timelimits.SHORT)
def live_rollup_task() -> dict:
    """Recompute the live rollup's dirty buckets (flywheel.registry.live)."""
    from flywheel.registry.live import rollup_refresh

    return rollup_refresh().to_dict()
