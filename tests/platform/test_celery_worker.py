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
