"""Clustering through the client: failures ingested with it, a run started and processed by the real Celery
worker, its suggestions read back and one accepted as a failure mode."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from flywheel_client import Flywheel

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def labeled_failures(count: int) -> list[dict]:
    """bench/clustering_fixture.py's failures of two known causes (a folder of scripts, imported as the bench does)."""
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    fixture = importlib.import_module("clustering_fixture")
    return [record for _, record in fixture.failures(count, seed=0, prefix="cl",
                                                     causes=["stock_timeout", "weather_undeclared_tool"])]


def test_a_run_started_by_the_client_suggests_clusters_and_one_is_accepted(live_server, celery_worker, project,
                                                                           make_api_key, user):
    key = make_api_key(project, scopes=["ingest", "read", "review"])
    key.api_key.created_by = user  # decisions are recorded as the key's maker
    key.api_key.save(update_fields=["created_by"])
    with Flywheel(live_server.url, key) as fw:
        ingested = fw.ingest(labeled_failures(20))
        assert ingested.accepted == 20
        started = fw.start_clustering(days=30)
        assert started.status in ("queued", "running", "done")
        run = fw.wait_clustering(started.id, timeout=240)
        assert (run.status, run.error, run.total) == ("done", "", 20), run.raw
        assert run.clusters and sum(c.size for c in run.clusters) <= 20
        members = {i for c in run.clusters for i in c.trajectory_ids}
        assert members <= {r.id for r in ingested.records}
        decided = fw.decide(run.clusters[0].id, "accept", name="Seen by the client")
        assert decided["decision"] == "accepted" and decided["failure_mode_id"]
        assert fw.clustering(run.id).clusters[0].decision == "accepted"
