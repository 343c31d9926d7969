"""Triage throughput: the detectors on one core, the triage task with its database writes, and ingestion with
automatic triage on and off.

    .venv/bin/python bench/triage.py [--trajectories 20000] [--ingest 10000] [--batch 500] [--rounds 2]
                                     [--broker filesystem://] [--no-ingest]

1. Detectors: `triage.detect` + `suggest_category` over `--trajectories` realistic trajectories (bench/ingest.py's
   support-agent conversations, with some made to fail: loops, arguments that are not JSON, undeclared tools,
   unsafe refunds, negative feedback, human interventions), each a fresh object as the database hands it over,
   in this one process: trajectories per second on one core (goal: at least 5,000).
2. Ingestion through the real HTTP API (gunicorn, a scratch PostgreSQL database, bench/ingest.py's harness),
   `--rounds` times off then on: with FLYWHEEL_TRIAGE=false, and with it on, where each request also hands a
   triage message to the broker (`--broker`; the filesystem broker keeps the bench's messages in its own folder,
   `--broker redis://…` measures Redis). No worker runs: the request path is what is measured.
3. The triage task itself on what was ingested (`triage_project`, database reads and writes included), for scale.

The last line is JSON: {"triage_per_s": …, "ingest_per_s_triage_on": …, "ingest_per_s_triage_off": …, …}.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "platform"))

import ingest  # noqa: E402  (bench/ingest.py, beside this file)
from ingest import (  # noqa: E402
    PY,
    CpuMeter,
    bench_env,
    create_api_key,
    gunicorn,
    measure,
    scratch_database,
    synthetic,
)


def realistic(i: int, run: str) -> dict:
    """bench/ingest.py's conversation, with one of several failures in some of them (about 4 in 10)."""
    record = synthetic(i, run)
    messages = record["messages"]
    calls = [m for m in messages if m.get("tool_calls")]
    if i % 7 == 0:  # a loop: the customer looked up three times in a row
        lookup, result = messages[2], messages[3]
        messages[4:4] = [copy.deepcopy(lookup), copy.deepcopy(result), copy.deepcopy(lookup), copy.deepcopy(result)]
    if i % 11 == 0:
        calls[0]["tool_calls"][0]["function"]["arguments"] = '{"email": "user@example.com"'  # cut short
    if i % 13 == 0:
        calls[1]["tool_calls"][0]["function"]["name"] = "fetch_order_v2"  # not declared
    if i % 17 == 0:
        calls[2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"order_id": "1", "amount": 250})
    if i % 9 == 0:
        record["feedback"] = {"thumbs": "down", "comment": "still no refund"}
    if i % 50 == 0:
        record["human_intervention"] = {"by": "supervisor", "note": "refund reversed"}
    return record


def bench_detectors(n: int) -> dict:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "flywheel.settings")
    os.environ.setdefault("FLYWHEEL_VAR_DIR", "/tmp/flywheel-bench-triage")
    import django

    django.setup()
    from flywheel.trajectories.models import TriagePolicy
    from flywheel.trajectories.triage import detect, suggest_category
    from flywheel.trajectories.triage_policy import DEFAULT_UNSAFE_RULES, policy_spec

    spec = policy_spec(TriagePolicy(pk=1, unsafe=DEFAULT_UNSAFE_RULES, version=1))
    # Fresh objects per trajectory (no shared tools list), as rows read from the database are.
    records = [json.loads(json.dumps(realistic(i, "detect"))) for i in range(n)]
    for r in records[:200]:  # warm the verifier's caches (schemas compiled once per distinct tool)
        detect(messages=r["messages"], tools=r["tools"], unsafe_spec=spec)
    kinds: dict[str, int] = {}
    started = time.process_time()
    wall = time.perf_counter()
    for r in records:
        signals = detect(
            messages=r["messages"],
            tools=r["tools"],
            unsafe_spec=spec,
            feedback=r.get("feedback"),
            human_intervention=r.get("human_intervention"),
        )
        suggest_category(signals)
        for s in signals:
            kinds[str(s.kind)] = kinds.get(str(s.kind), 0) + 1
    cpu = time.process_time() - started
    wall = time.perf_counter() - wall
    return {
        "trajectories": n,
        "cpu_s": round(cpu, 3),
        "wall_s": round(wall, 3),
        "triage_per_s": round(n / cpu, 1),  # CPU time of this one process: one core, whatever the neighbours do
        "signals": dict(sorted(kinds.items())),
    }


TASK_SCRIPT = """
import json, time, django
django.setup()
from flywheel.accounts.models import Project
from flywheel.trajectories.models import Trajectory, TriageSignal
from flywheel.trajectories.triage import triage_project
project = Project.objects.get(slug="bench")
waiting = Trajectory.objects.filter(project=project, triage_version=0).count()
t0 = time.perf_counter(); c0 = time.process_time()
done = triage_project(project_id=project.pk)
wall = time.perf_counter() - t0; cpu = time.process_time() - c0
print(json.dumps({"trajectories": done, "waiting": waiting, "wall_s": round(wall, 2), "worker_cpu_s": round(cpu, 2),
                  "task_per_s": round(done / wall, 1), "signals": TriageSignal.objects.count()}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=20_000, help="for the detectors")
    parser.add_argument("--ingest", type=int, default=10_000, help="trajectories per ingestion run")
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternated")
    parser.add_argument("--workers", type=int, default=3, help="gunicorn workers")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--broker", default="filesystem://", help="where triage-on requests send their message")
    parser.add_argument("--no-ingest", action="store_true", help="the detectors only (no PostgreSQL needed)")
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"),
    )
    args = parser.parse_args()

    detectors = bench_detectors(args.trajectories)
    print(
        f"detectors: {detectors['trajectories']} trajectories in {detectors['cpu_s']} s of CPU on one core: "
        f"{detectors['triage_per_s']:.0f} trajectories/s (goal >= 5000)"
    )
    print(f"  signals found: {detectors['signals']}")
    summary: dict = {"triage_per_s": detectors["triage_per_s"], "detectors": detectors}
    if args.no_ingest:
        summary |= {"ingest_per_s_triage_on": None, "ingest_per_s_triage_off": None}
        print(json.dumps(summary))
        return

    runs: dict[str, list[dict]] = {"off": [], "on": []}
    with scratch_database(args.database_url) as db_url:
        base = bench_env(db_url)
        key = create_api_key(base)
        for round_ in range(args.rounds):
            for mode in ("off", "on"):
                env = {**base, "FLYWHEEL_TRIAGE": "true" if mode == "on" else "false", "CELERY_BROKER_URL": args.broker}
                with gunicorn(env, args.workers) as (server, port):
                    # CPU seconds of the gunicorn workers and PostgreSQL backends: neighbours' load does not move it.
                    ingest.METER = CpuMeter(server.pid, args.database_url, urlsplit(db_url).path.lstrip("/"))
                    # Warm every worker (imports, connections, the broker's connection) before the clock starts.
                    measure("warm-up", port, key, [realistic(i, f"w{round_}{mode}") for i in range(60)], 5, args.workers * 2)
                    records = [realistic(i, f"r{round_}-{mode}") for i in range(args.ingest)]
                    result = measure(f"triage {mode}", port, key, records, args.batch, args.clients)
                runs[mode].append(result)
                print(
                    f"ingest, triage {mode:<3} round {round_ + 1}: {result['trajectories_per_s']:8.1f} trajectories/s "
                    f"(p50 {result['p50_ms']} ms, p95 {result['p95_ms']} ms, {result['cpu_ms_per_trajectory']} ms CPU each)",
                    flush=True,
                )
        task = subprocess.run(
            [PY, "-c", TASK_SCRIPT], cwd=ROOT, env={**base, "DJANGO_SETTINGS_MODULE": "flywheel.settings"},
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        task_result = json.loads(task.stdout.strip().splitlines()[-1])
    print(
        f"triage task with the database: {task_result['trajectories']} trajectories in {task_result['wall_s']} s "
        f"({task_result['task_per_s']:.0f}/s, {task_result['signals']} signals written)"
    )
    on = statistics.median(r["trajectories_per_s"] for r in runs["on"])
    off = statistics.median(r["trajectories_per_s"] for r in runs["off"])
    cpu_on = statistics.median(r["cpu_ms_per_trajectory"] for r in runs["on"])
    cpu_off = statistics.median(r["cpu_ms_per_trajectory"] for r in runs["off"])
    print(
        f"ingestion: triage on {on:.0f}/s vs off {off:.0f}/s ({on / off:.2f}x); CPU per trajectory "
        f"{cpu_on:.3f} vs {cpu_off:.3f} ms; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    summary |= {
        "ingest_per_s_triage_on": round(on, 1),
        "ingest_per_s_triage_off": round(off, 1),
        "ingest_cpu_ms_triage_on": cpu_on,
        "ingest_cpu_ms_triage_off": cpu_off,
        "task": task_result,
        "runs": runs,
        "broker": args.broker,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
