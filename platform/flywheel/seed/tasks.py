"""The demo's Celery task. Thin: it calls one service."""

from __future__ import annotations

from celery import shared_task

from flywheel import timelimits


# The name it had in the registry app: a message queued before the move still finds it, and the route to the
# `gpu` queue (settings.CELERY_TASK_ROUTES) is unchanged.
@shared_task(name="flywheel.registry.demo_model", **timelimits.gpu())
def demo_model_task(project_id: int) -> str:
    """Build and register the demo project's tiny model (`make run`)."""
    from flywheel.seed.demo import demo_model_build

    return demo_model_build(project_id=project_id)


@shared_task(name="flywheel.seed.demo_traffic", **timelimits.gpu())
def demo_traffic_task() -> dict:
    """A round of the workplace demo's live traffic while a canary or a watch runs there (`make run`)."""
    from flywheel.seed.traffic import demo_traffic_round

    return demo_traffic_round()
