"""A clustering run through the real Celery worker: queued after its commit, processed with its progress,
its suggestions saved."""

from __future__ import annotations

from django.db import transaction

from flywheel.failures.clustering import services
from flywheel.failures.clustering.models import ClusteringRun


def test_a_run_queued_on_commit_is_processed_by_the_worker(celery_worker, project, user, labeled_failures):
    labels = labeled_failures(project, 10, ["stock_timeout", "weather_undeclared_tool"])
    with transaction.atomic():
        run = services.clustering_run_start(project=project, user=user)
        assert ClusteringRun.objects.get(pk=run.pk).status == "queued"  # nothing sent before the commit
    # The worker loads the embedding model on its first run: allow for it on two busy cores.
    done = celery_worker.wait_for(
        lambda: ClusteringRun.objects.filter(pk=run.pk, status__in=["done", "failed"]).first(), timeout=180
    )
    assert done.status == "done", done.error
    assert done.total == len(labels) == 20 and done.percent == 100
    assert sorted(s.size for s in done.suggestions.all()) == [10, 10]
