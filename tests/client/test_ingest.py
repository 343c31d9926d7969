"""Ingestion through the client and the `flywheel` command against the live test server: each rejected record
named with its reason and the exit code saying so, batches split to the server's limit, replays updating."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from flywheel_client import Flywheel

from flywheel.trajectories.models import Trajectory

FLYWHEEL = str(Path(sys.executable).with_name("flywheel"))  # the console script pip installed


def good(external_id: str) -> dict:
    return {"external_id": external_id, "agent": "support", "outcome": "failure",
            "messages": [{"role": "user", "content": "Where is order A1?"},
                         {"role": "assistant", "content": "It shipped."}]}


def run_cli(live_server, key, *args):
    env = {**os.environ, "FLYWHEEL_URL": live_server.url, "FLYWHEEL_API_KEY": key}
    return subprocess.run([FLYWHEEL, *args], env=env, capture_output=True, text=True, timeout=60)


def test_the_cli_exits_1_and_names_each_rejected_record_with_its_line_and_reason(live_server, project, make_api_key,
                                                                                 tmp_path):
    key = make_api_key(project, scopes=["ingest"])
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join([
        json.dumps(good("cli-a")),
        "",
        json.dumps({"external_id": "cli-bad", "messages": [{"role": "tool", "content": "{}"}]}),
        "{not json",
        json.dumps(good("cli-b")),
    ]) + "\n")
    run = run_cli(live_server, key, "ingest", str(path))
    assert run.returncode == 1, (run.stdout, run.stderr)
    assert run.stdout.strip() == "2 accepted (2 new, 0 updated), 2 rejected"
    assert run.stderr.splitlines() == [
        "line 3 (cli-bad): messages[0].tool_call_id: a tool message needs tool_call_id (or at least name)",
        "line 4: not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
    ]
    assert set(Trajectory.objects.filter(project=project).values_list("external_id", flat=True)) == {"cli-a", "cli-b"}

    path.write_text(json.dumps(good("cli-a")) + "\n" + json.dumps(good("cli-b")) + "\n")
    run = run_cli(live_server, key, "ingest", str(path))
    assert (run.returncode, run.stdout.strip(), run.stderr) == (0, "2 accepted (0 new, 2 updated), 0 rejected", "")
    assert Trajectory.objects.filter(project=project).count() == 2


def test_batches_follow_the_server_limit_and_rejections_keep_their_place(live_server, project, make_api_key,
                                                                         settings):
    settings.FLYWHEEL_MAX_BATCH_RECORDS = 2  # the server's limit; the client sends 3 a request and splits on 413
    records = [good(f"batch-{i}") for i in range(7)]
    records[4] = {"external_id": "batch-4", "messages": [], "outcome": "bad"}
    with Flywheel(live_server.url, make_api_key(project, scopes=["ingest"]), batch_records=3) as client:
        result = client.ingest(records)
    assert (result.accepted, result.created, result.updated) == (6, 6, 0)
    assert [(r.index, r.external_id, [e.field for e in r.errors]) for r in result.rejected] == [
        (4, "batch-4", ["messages", "outcome"])]
    stored = dict(Trajectory.objects.filter(project=project).values_list("external_id", "pk"))
    assert [(r.index, r.external_id, r.id) for r in result.records] == [
        (i, f"batch-{i}", stored[f"batch-{i}"]) for i in (0, 1, 2, 3, 5, 6)]
