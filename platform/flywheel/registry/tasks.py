"""Celery tasks of the registry. Thin: each calls one service."""

from __future__ import annotations

from celery import shared_task

from flywheel.registry.services import registry_sync


@shared_task(name="flywheel.registry.sync")
def registry_sync_task(project_id: int) -> dict[str, int]:
    """Mirror the project's versions and alias moves to MLflow and announce production's moves."""
    return registry_sync(project_id=project_id)


@shared_task(name="flywheel.registry.demo_model")
def demo_model_task(project_id: int) -> str:
    """Build and register the demo project's tiny model (`make run`)."""
    from flywheel.registry.demo import demo_model_build

    return demo_model_build(project_id=project_id)
