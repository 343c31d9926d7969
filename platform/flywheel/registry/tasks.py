"""Celery tasks of the registry. Thin: each calls one service."""

from __future__ import annotations

from celery import shared_task

from flywheel.registry.services import registry_sync


@shared_task(name="flywheel.registry.sync")
def registry_sync_task(project_id: int) -> dict[str, int]:
    """Mirror the project's versions and alias moves to MLflow and announce production's moves."""
    return registry_sync(project_id=project_id)
