"""The one Celery app. Tasks live in each app's `tasks.py` and are found by autodiscovery; the outbox sweep,
which serves every app, is defined here and scheduled by CELERY_BEAT_SCHEDULE (settings)."""

import os

from celery import Celery

from flywheel import timelimits

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "flywheel.settings")

app = Celery("flywheel")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@app.task(name="flywheel.outbox_sweep", ignore_result=True, **timelimits.SWEEP)
def outbox_sweep_task() -> dict[str, int]:
    """Send again the work that never reached a worker (flywheel.outbox)."""
    from flywheel.outbox import outbox_sweep  # Django is set up by the time a worker runs a task

    return outbox_sweep()
