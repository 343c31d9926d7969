"""bench/ingest_load.py, short: three clients for five seconds against gunicorn on the test's PostgreSQL
database, with replays, shared ids, bad records and requests cut off mid-body or before their answer.
Nothing acknowledged is lost, nothing else is stored, no answer is a 5xx; and the audit that says so does
catch a lost, a corrupted and a phantom trajectory."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from flywheel.trajectories.models import Trajectory

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def ingest_load(monkeypatch: pytest.MonkeyPatch):
    # bench/ is a folder of scripts, not a package: import the script as running it would.
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    return importlib.import_module("ingest_load")


@pytest.mark.django_db(transaction=True)
def test_a_short_load_loses_nothing(
    needs_postgres, subprocess_env, project, make_api_key, ingest_load, tmp_path
):
    from ingest import bench_env, gunicorn

    database_url = subprocess_env["DATABASE_URL"]
    key = make_api_key(project, scopes=["ingest"])
    # bench_env turns the per-key rate limit off: three clients share one key.
    env = bench_env(database_url, FLYWHEEL_VAR_DIR=subprocess_env["FLYWHEEL_VAR_DIR"])
    access_log = tmp_path / "access.log"
    with gunicorn(env, 2, *ingest_load.access_log_options(access_log)) as (_, port):
        ledger = ingest_load.run_load(port=port, key=key, clients=3, seconds=5, batch=20, bad_rate=0.1)
    figures = ingest_load.audit(
        ledger, database_url=database_url, project_slug=project.slug, access_log=access_log
    )

    assert figures["ok"], figures
    assert (figures["loss"], figures["phantom"], figures["corrupt"]) == (0, 0, 0)
    assert figures["client_5xx"] == figures["server_5xx"] == 0
    # The run did what it claims: every kind of cut by every client, bad records, replays, shared ids.
    kinds = ("torn", "torn with reset", "abandoned", "abandoned with reset")
    assert all(figures["disconnects"].get(kind, 0) >= 3 for kind in kinds), figures["disconnects"]
    assert sum(figures["bad_records"].values()) > 0
    assert figures["replays"] > 0 and figures["hot_writes"] > 0
    assert figures["acked_ids"] > 0 and figures["statuses"].get("200", 0) > 0
    assert figures["stored"] == Trajectory.objects.filter(project=project).count()

    # The audit catches what it is there to catch: a trajectory lost, one back at an older acknowledged
    # write, one whose content is not what any write sent, and one stored from a torn request.
    writes = ledger.writes()
    acked = sorted({w.external_id for w in writes if w.state == "acked"})
    acked_writes: dict[str, list] = {}
    for w in writes:
        if w.state == "acked" and w.external_id not in acked[:2]:
            acked_writes.setdefault(w.external_id, []).append(w)
    # An id written twice by its client, the second write sent after the first was answered.
    replayed = next(ws for ws in acked_writes.values() if len(ws) > 1 and ws[-1].start > ws[0].end)
    torn_only = sorted(
        {w.external_id for w in writes if w.state == "torn"}
        - {w.external_id for w in writes if w.state != "torn"}
    )
    Trajectory.objects.filter(project=project, external_id=acked[0]).delete()
    changed = Trajectory.objects.get(project=project, external_id=acked[1])
    changed.messages = changed.messages[:-1]
    changed.save()
    stale = Trajectory.objects.get(project=project, external_id=replayed[0].external_id)
    stale.metadata["load"]["version"] = replayed[0].version
    stale.save()
    Trajectory.objects.create(
        project=project, external_id=torn_only[0], messages=[{"role": "user", "content": "?"}]
    )
    again = ingest_load.audit(ledger, database_url=database_url, project_slug=project.slug)
    assert (again["loss"], again["corrupt"], again["phantom"]) == (2, 1, 1), again["examples"]
    assert not again["ok"]
