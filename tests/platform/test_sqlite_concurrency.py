"""`make run` on SQLite: the web server and the worker write the same file at once. Two processes ingest
overlapping batches into one SQLite database at the same moment; both must succeed (no "database is
locked") and leave each trajectory once, with the content its last writer sent.

The database is this test's own file, whatever DATABASE_URL the suite runs on (CI's is PostgreSQL): the
processes are started with DATABASE_URL=sqlite:///… in a temporary folder."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from django.conf import settings

REPO_DIR = Path(settings.BASE_DIR)
ROUNDS = 40
BATCH = 25

# A writer: Django set up on the SQLite file, wait for the go file, then ROUNDS batches through the one
# ingest service. Writer "a" sends ids 0..BATCH*2-1, writer "b" ids BATCH..BATCH*3-1: half of each batch
# overlaps the other's, so both read and write the same rows in the same moments.
WRITER = textwrap.dedent(
    """
    import json, os, sys, time
    import django
    django.setup()
    from flywheel.accounts.models import Project
    from flywheel.trajectories.ingest import ingest_trajectories
    name, rounds, batch, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    first = 0 if name == "a" else batch
    project = Project.objects.get(slug="demo-sqlite")
    while not os.path.exists(go):
        time.sleep(0.01)
    for round_ in range(rounds):
        records = [
            {
                "external_id": f"t-{i}",
                "messages": [{"role": "user", "content": f"{name} round {round_}"}],
                "metadata": {"writer": name, "round": round_},
            }
            for i in range(first, first + 2 * batch)
        ]
        result = ingest_trajectories(project=project, records=records, source="cli")
        assert result.accepted == len(records) and not result.rejected, result
    print("ok", name)
    """
)


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=300
    )


def test_two_writers_at_once_on_sqlite_both_succeed(tmp_path):
    db_path = tmp_path / "flywheel.sqlite3"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "flywheel.settings",
        "DATABASE_URL": f"sqlite:///{db_path}",
        "CELERY_BROKER_URL": "filesystem://",
        "FLYWHEEL_VAR_DIR": str(tmp_path / "var"),
        "PYTHONUNBUFFERED": "1",
    }
    migrated = _run(["manage.py", "migrate", "--noinput", "-v", "0"], env)
    assert migrated.returncode == 0, migrated.stderr
    made = _run(
        ["manage.py", "shell", "-c", "from flywheel.accounts.services import project_create; project_create(slug='demo-sqlite')"],
        env,
    )
    assert made.returncode == 0, made.stderr

    go = tmp_path / "go"
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, name, str(ROUNDS), str(BATCH), str(go)],
            cwd=REPO_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for name in ("a", "b")
    ]
    # Both have set Django up before either writes: their batches overlap in time, not only in ids.
    time.sleep(0.2)
    go.touch()
    outputs = [writer.communicate(timeout=300) for writer in writers]
    for writer, (out, err) in zip(writers, outputs, strict=True):
        assert writer.returncode == 0, f"a writer failed:\n{err[-3000:]}"
        assert out.startswith("ok"), out

    import sqlite3

    with sqlite3.connect(db_path) as db:
        rows = db.execute(
            "SELECT external_id, json_extract(metadata, '$.writer'), json_extract(metadata, '$.round'),"
            " json_extract(messages, '$[0].content') FROM trajectories_trajectory"
        ).fetchall()
    by_id = {external_id: (writer, round_, content) for external_id, writer, round_, content in rows}
    assert len(rows) == len(by_id) == 3 * BATCH  # each id once
    last = ROUNDS - 1
    for i in range(3 * BATCH):
        writer, round_, content = by_id[f"t-{i}"]
        if i < BATCH:
            assert writer == "a"  # only a writes these
        elif i >= 2 * BATCH:
            assert writer == "b"
        assert round_ == last  # the last batch of whichever writer wrote last
        assert content == f"{writer} round {last}"  # the row is one record's, whole
