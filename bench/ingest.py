"""Ingestion throughput through the real HTTP API: gunicorn on 127.0.0.1 against a fresh PostgreSQL database.

    .venv/bin/python bench/ingest.py [--trajectories 20000] [--batch 500] [--workers 3] [--clients 3]

Creates a scratch database (dropped at the end), migrates it, makes a project and an API key, starts
gunicorn, and POSTs synthetic trajectories (10 messages each: three tool calls with their results) as
JSON arrays from `--clients` keep-alive connections. Prints trajectories per second and request latency
p50/p95 for the batched run and for a baseline of one trajectory per request, side by side with their
ratio, then a replay of the batched run (every record an update). Request bodies are encoded before the
clock starts, so the figures are the server's. Beside wall-clock throughput it reports the CPU time the
gunicorn workers and the PostgreSQL backends spent per trajectory (read from /proc), and the rate two idle
cores would sustain at that cost: on a shared machine the wall-clock figure moves with the neighbours'
load, the CPU cost does not. The last line is JSON.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def synthetic(i: int, run: str) -> dict:
    """About 10 messages with three tool calls, ~2.5 KB of JSON: what a support agent run looks like."""
    order = f"{100000 + i}"
    calls = [
        ("lookup_customer", {"email": f"user{i}@example.com"}, {"customer_id": f"c{i}", "tier": "gold"}),
        ("get_order", {"order_id": order}, {"order_id": order, "status": "delayed", "eta_days": i % 7}),
        (
            "issue_refund",
            {"order_id": order, "amount": 12.5},
            {"error": "refund limit exceeded"} if i % 5 == 0 else {"ok": True},
        ),
    ]
    messages = [
        {
            "role": "system",
            "content": "You are a support agent for an online shop. Use the tools; never guess order data.",
        },
        {
            "role": "user",
            "content": f"Hi, my order {order} is late and I want a refund. My email is user{i}@example.com.",
        },
    ]
    for n, (name, args, result) in enumerate(calls):
        call_id = f"call_{i}_{n}"
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(args)},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)})
    messages.append(
        {
            "role": "assistant",
            "content": f"I am sorry about the delay of order {order}. The refund has been requested.",
        }
    )
    messages.append({"role": "user", "content": "Thanks!"})
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"{name} tool",
                "parameters": {"type": "object", "properties": {k: {"type": "string"} for k in args}},
            },
        }
        for name, args, _ in calls
    ]
    return {
        "external_id": f"{run}-{i}",
        "agent": "support-bot",
        "model_version": f"qwen-0.5b-v{i % 3}",
        "messages": messages,
        "tools": tools,
        "outcome": ("success", "failure", "unknown")[i % 3],
        "latency_ms": 800 + i % 400,
        "usage": {"prompt_tokens": 900, "completion_tokens": 120},
        "metadata": {"region": "eu", "session": f"s{i // 4}"},
        "started_at": "2026-12-01T10:00:00Z",
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def psql(admin_url: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(sql)


def post_all(port: int, key: str, bodies: list[bytes], clients: int) -> tuple[float, list[float], list[dict]]:
    """POST every body from `clients` keep-alive connections; (wall seconds, latencies, answers)."""
    work: queue.Queue = queue.Queue()
    for body in bodies:
        work.put(body)
    latencies: list[float] = []
    answers: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        while True:
            try:
                body = work.get_nowait()
            except queue.Empty:
                break
            start = time.perf_counter()
            conn.request("POST", "/api/v1/trajectories", body=body, headers=headers)
            response = conn.getresponse()
            payload = response.read()
            elapsed = time.perf_counter() - start
            with lock:
                latencies.append(elapsed)
                if response.status != 200:
                    errors.append(f"{response.status}: {payload[:300]!r}")
                else:
                    answers.append(json.loads(payload))
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, first: {errors[0]}")
    return wall, latencies, answers


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def _children(ppid: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == ppid:
                pids.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return pids


class CpuMeter:
    """CPU seconds spent by the gunicorn workers and by the PostgreSQL backends serving the bench database:
    a figure that other load on the machine does not inflate, unlike wall-clock throughput."""

    def __init__(self, server_pid: int, admin_url: str, db_name: str) -> None:
        self.server_pid, self.admin_url, self.db_name = server_pid, admin_url, db_name

    def read(self) -> dict[int, float]:
        import psycopg

        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s", [self.db_name]
            ).fetchall()
        return {pid: _cpu_seconds(pid) for pid in _children(self.server_pid) + [r[0] for r in rows]}


METER: CpuMeter | None = None


def measure(name: str, port: int, key: str, records: list[dict], batch: int, clients: int) -> dict:
    bodies = [json.dumps(records[i : i + batch]).encode() for i in range(0, len(records), batch)]
    before = METER.read() if METER else {}
    wall, latencies, answers = post_all(port, key, bodies, clients)
    after = METER.read() if METER else {}
    cpu = sum(after[pid] - before.get(pid, 0.0) for pid in after)
    latencies.sort()
    p95 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.95))]
    return {
        "run": name,
        "trajectories": len(records),
        "batch": batch,
        "requests": len(bodies),
        "seconds": round(wall, 3),
        "trajectories_per_s": round(len(records) / wall, 1),
        "p50_ms": round(statistics.median(latencies) * 1000, 1),
        "p95_ms": round(p95 * 1000, 1),
        "created": sum(a["created"] for a in answers),
        "updated": sum(a["updated"] for a in answers),
        "rejected": sum(len(a["rejected"]) for a in answers),
        "mb_sent": round(sum(map(len, bodies)) / 1e6, 1),
        "cpu_ms_per_trajectory": round(cpu * 1000 / len(records), 3),
        # What two otherwise idle cores would sustain at that CPU cost per trajectory.
        "cpu_bound_per_s_on_2_cores": round(2 * len(records) / cpu, 1) if cpu else None,
    }


def bench_env(db_url: str, **extra: str) -> dict[str, str]:
    """The environment of a server (and of `manage.py`) on `db_url`: production-like, no broker, quiet, and
    no per-key rate limit (a bench measures ingestion, not the limiter; bench/rate_limit.py measures that)."""
    name = urlsplit(db_url).path.lstrip("/") or "bench"
    return {
        **os.environ,
        "DATABASE_URL": db_url,
        "DEBUG": "false",
        "DATABASE_CONN_MAX_AGE": "600",
        "FLYWHEEL_VAR_DIR": str(Path(os.environ.get("TMPDIR", "/tmp")) / name),
        "CELERY_BROKER_URL": "memory://",
        "PYTHONPATH": str(ROOT),
        "LOG_LEVEL": "WARNING",
        "FLYWHEEL_API_RATE_PER_S": "0",
        **extra,
    }


@contextmanager
def scratch_database(admin_url: str) -> Iterator[str]:
    """A new database on the server `admin_url` names, migrated; yields its URL and drops it afterwards."""
    db_name = f"flywheel_bench_{uuid.uuid4().hex[:8]}"
    db_url = urlsplit(admin_url)._replace(path=f"/{db_name}").geturl()
    psql(admin_url, f'CREATE DATABASE "{db_name}"')
    try:
        subprocess.run([PY, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=bench_env(db_url), check=True)
        yield db_url
    finally:
        psql(admin_url, f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')


def create_api_key(env: dict[str, str], slug: str = "bench") -> str:
    """A new project `slug` in the database of `env` and a raw API key of it with the ingest scope."""
    return subprocess.run(
        [PY, "manage.py", "shell", "-c",
         "from flywheel.accounts.services import project_create, api_key_create;"
         f"p = project_create(slug={slug!r});"
         "print(api_key_create(project=p, name='bench', scopes=['ingest']).raw_key)"],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True,
    ).stdout.strip().splitlines()[-1]  # fmt: skip


@contextmanager
def gunicorn(env: dict[str, str], workers: int, *options: str) -> Iterator[tuple[subprocess.Popen, int]]:
    """gunicorn serving the app on a free port of 127.0.0.1, up (GET /healthz answers) before it is yielded
    as (process, port); stopped gracefully afterwards, so that every request it took has finished."""
    port = free_port()
    server = subprocess.Popen(
        [PY, "-m", "gunicorn", "flywheel.wsgi", "-w", str(workers), "-b", f"127.0.0.1:{port}",
         "--keep-alive", "30", "--timeout", "120", "--log-level", "warning", *options],
        cwd=ROOT, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("gunicorn did not come up")
            time.sleep(0.2)
        yield server, port
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument(
        "--baseline-trajectories", type=int, default=1_500, help="for the one-per-request run"
    )
    parser.add_argument("--workers", type=int, default=3, help="gunicorn workers")
    parser.add_argument("--clients", type=int, default=3, help="concurrent client connections")
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"),
    )
    args = parser.parse_args()

    with scratch_database(args.database_url) as db_url:
        env = bench_env(db_url)
        key = create_api_key(env)
        with gunicorn(env, args.workers) as (server, port):
            global METER
            METER = CpuMeter(server.pid, args.database_url, urlsplit(db_url).path.lstrip("/"))
            # Warm every worker (imports, connections) before any clock starts.
            measure("warm-up", port, key, [synthetic(i, "warm") for i in range(60)], 5, args.workers * 2)

            batched = [synthetic(i, "batched") for i in range(args.trajectories)]
            single = [synthetic(i, "single") for i in range(args.baseline_trajectories)]
            results = [
                measure(f"batch of {args.batch}", port, key, batched, args.batch, args.clients),
                measure("one per request (baseline)", port, key, single, 1, args.clients),
                measure(f"replay, batch of {args.batch}", port, key, batched, args.batch, args.clients),
            ]

    print(
        f"{'run':<28} {'trajectories':>12} {'requests':>8} {'traj/s':>9} {'p50 ms':>8} {'p95 ms':>8} "
        f"{'created':>8} {'updated':>8} {'cpu ms/traj':>11} {'cpu-bound/s':>11}"
    )
    for r in results:
        print(
            f"{r['run']:<28} {r['trajectories']:>12} {r['requests']:>8} {r['trajectories_per_s']:>9.1f} "
            f"{r['p50_ms']:>8.1f} {r['p95_ms']:>8.1f} {r['created']:>8} {r['updated']:>8} "
            f"{r['cpu_ms_per_trajectory']:>11.3f} {r['cpu_bound_per_s_on_2_cores'] or 0:>11.1f}"
        )
    print(
        f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (other processes share these cores)"
    )
    ratio = results[0]["trajectories_per_s"] / results[1]["trajectories_per_s"]
    print(
        f"batched / baseline: {ratio:.1f}x   (goal: >= 2000 trajectories/s; {os.cpu_count()} CPUs, {args.workers} gunicorn workers)"
    )
    print(
        json.dumps(
            {"results": results, "ratio": round(ratio, 1), "cpus": os.cpu_count(), "workers": args.workers}
        )
    )


if __name__ == "__main__":
    main()
