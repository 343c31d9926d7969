"""The Celery worker fixture is real: a task queued after commit runs in another process and writes a row."""

from django.db import transaction

from flywheel.accounts.models import WorkerHeartbeat
from flywheel.accounts.services import worker_heartbeat_request


def test_task_queued_after_commit_runs_in_the_worker(celery_worker):
    with transaction.atomic():
        worker_heartbeat_request()
        # Nothing is sent before the commit, so the worker cannot race the transaction.
        assert not WorkerHeartbeat.objects.exists()

    heartbeat = celery_worker.wait_for(lambda: WorkerHeartbeat.objects.first())
    assert heartbeat.hostname.startswith("test-")
    assert heartbeat.tasks_seen == 1
    assert "flywheel.accounts.worker_heartbeat" in celery_worker.log()


def test_every_scheduled_task_is_one_a_worker_knows_and_the_heartbeat_is_among_them(settings):
    from flywheel.celery import app

    app.loader.import_default_modules()  # the apps' tasks modules, as a worker imports them
    schedule = settings.CELERY_BEAT_SCHEDULE
    assert {entry["task"] for entry in schedule.values()} <= set(app.tasks)
    # The project list's "worker last seen" stays within a sweep of now while the worker runs.
    [heartbeat] = [e for e in schedule.values() if e["task"] == "flywheel.accounts.worker_heartbeat"]
    assert heartbeat["schedule"] <= 60
