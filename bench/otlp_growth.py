"""What an OTLP export of a long-running trace costs as the trace grows: one trace sent in N exports of k spans.

    .venv/bin/python bench/otlp_growth.py [--exports 60] [--spans 20] [--pattern tool|llm] \
        [--database-url postgres://postgres@127.0.0.1:5432/postgres]

Creates a scratch PostgreSQL database on the server of --database-url (default BENCH_DATABASE_URL, as
bench/ingest.py; dropped at the end), migrates it, and POSTs the exports to the real endpoint in process
(Django's test client: no network, the figures are the server's work). Patterns: `llm`, an OpenInference agent whose every LLM span re-sends the whole history (what
instrumentations do; such an export carries the history, so it cannot cost less than reading it), and
`tool`, OTel GenAI `execute_tool` spans that carry only their own call (an export's size stays k spans).
Prints the cost of the first and last exports (mean of five) and their ratio, as wall-clock time and
as CPU time (this process plus its PostgreSQL backend, read from /proc: on a shared machine the wall clock
moves with the neighbours' load, the CPU cost does not), the stored message count and the export's answer
at the end; the last line is JSON. A flat ratio for `tool` means an export costs what it carries, not what
the trace has accumulated. FLYWHEEL_OTLP_MAX_MESSAGES_PER_TRACE / _SPANS_ apply as set in the environment.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
T0 = 1_764_000_000_000_000_000


def attr(key: str, value: object) -> dict:
    if isinstance(value, bool):
        return {"key": key, "value": {"boolValue": value}}
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}
    return {"key": key, "value": {"stringValue": str(value)}}


def span(trace: str, sid: int, name: str, attrs: dict) -> dict:
    start = T0 + sid * 1_000_000
    return {
        "traceId": trace,
        "spanId": f"{sid:016x}",
        "parentSpanId": f"{1:016x}",
        "name": name,
        "startTimeUnixNano": str(start),
        "endTimeUnixNano": str(start + 500_000),
        "attributes": [attr(k, v) for k, v in attrs.items()],
    }


def llm_span(trace: str, sid: int, history: list[tuple[str, str]], step: int) -> dict:
    attrs: dict = {"openinference.span.kind": "LLM", "llm.model_name": "m", "llm.token_count.prompt": 10}
    for i, (role, content) in enumerate(history):
        attrs[f"llm.input_messages.{i}.message.role"] = role
        attrs[f"llm.input_messages.{i}.message.content"] = content
    attrs["llm.output_messages.0.message.role"] = "assistant"
    attrs["llm.output_messages.0.message.content"] = f"Step {step}: let me look that up for you, one moment."
    return span(trace, sid, "ChatCompletion", attrs)


def tool_span(trace: str, sid: int, step: int) -> dict:
    attrs = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "get_order",
        "gen_ai.tool.call.id": f"call_{step}",
        "gen_ai.tool.call.arguments": json.dumps({"order_id": str(100000 + step)}),
        "gen_ai.tool.call.result": json.dumps(
            {"order_id": str(100000 + step), "status": "shipped", "eta": step}
        ),
    }
    return span(trace, sid, "execute_tool get_order", attrs)


def exports(pattern: str, n: int, k: int) -> list[bytes]:
    """The N request bodies, built before the clock starts."""
    trace = uuid.uuid4().hex
    history: list[tuple[str, str]] = [("system", "You are a support agent."), ("user", "Where is my order?")]
    bodies, sid, step = [], 2, 0
    for _ in range(n):
        spans = []
        for _ in range(k):
            step += 1
            if pattern == "llm":
                spans.append(llm_span(trace, sid, history, step))
                history = [
                    *history,
                    ("assistant", f"Step {step}: let me look that up for you, one moment."),
                    ("user", f"Thanks, and order {step}?"),
                ]
            else:
                spans.append(tool_span(trace, sid, step))
            sid += 1
        payload = {
            "resourceSpans": [
                {
                    "resource": {"attributes": [attr("service.name", "bench")]},
                    "scopeSpans": [{"spans": spans}],
                }
            ]
        }
        bodies.append(json.dumps(payload).encode())
    return bodies


def backend_cpu(pid: int) -> float:
    """CPU seconds (user + system) the PostgreSQL backend `pid` has used; it runs on this machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exports", type=int, default=60)
    parser.add_argument("--spans", type=int, default=20, help="spans per export")
    parser.add_argument("--pattern", choices=["llm", "tool"], default="tool")
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"),
        help="a PostgreSQL server the scratch database is made on (as bench/ingest.py)",
    )
    args = parser.parse_args()
    admin_url = args.database_url
    import psycopg

    db_name = f"flywheel_bench_otlp_{uuid.uuid4().hex[:8]}"
    parts = urlsplit(admin_url)
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db_name}"')
    os.environ["DATABASE_URL"] = urlunsplit(parts._replace(path=f"/{db_name}"))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "flywheel.settings")
    try:
        import django

        django.setup()
        from django.conf import settings
        from django.core.management import call_command
        from django.db import connection
        from django.test import Client

        settings.ALLOWED_HOSTS = ["*"]
        call_command("migrate", verbosity=0)
        from flywheel.accounts.services import api_key_create, project_create
        from flywheel.trajectories.models import Trajectory

        project = project_create(slug="bench")
        key = api_key_create(project=project, name="bench", scopes=["ingest"]).raw_key
        client = Client(headers={"Authorization": f"Bearer {key}"})
        bodies = exports(args.pattern, args.exports, args.spans)
        for body in exports(args.pattern, 2, args.spans):  # warm-up (imports, caches), another trace, untimed
            client.post("/api/v1/otlp/v1/traces", body, content_type="application/json")
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            backend = cursor.fetchone()[0]
        times, cpu, db_cpu, answer = [], [], [], {}
        for body in bodies:
            start, start_app, start_db = time.perf_counter(), time.process_time(), backend_cpu(backend)
            response = client.post("/api/v1/otlp/v1/traces", body, content_type="application/json")
            times.append(time.perf_counter() - start)
            db_cpu.append(backend_cpu(backend) - start_db)
            cpu.append(time.process_time() - start_app + db_cpu[-1])
            assert response.status_code == 200, response.content
            answer = response.json()
        trajectory = Trajectory.objects.filter(project=project).order_by("-message_count").first()
        first, last = statistics.mean(times[:5]), statistics.mean(times[-5:])
        first_cpu, last_cpu = statistics.mean(cpu[:5]), statistics.mean(cpu[-5:])
        first_db, last_db = statistics.mean(db_cpu[:5]), statistics.mean(db_cpu[-5:])
        print(f"pattern {args.pattern}: {args.exports} exports x {args.spans} spans of one trace")
        print(
            f"wall: first exports {first * 1000:.1f} ms, last exports {last * 1000:.1f} ms, ratio {last / first:.2f}"
        )
        print(
            f"cpu:  first exports {first_cpu * 1000:.1f} ms, last exports {last_cpu * 1000:.1f} ms, "
            f"ratio {last_cpu / first_cpu:.2f} (of which PostgreSQL {first_db * 1000:.1f} ms, {last_db * 1000:.1f} ms)"
        )
        print(
            f"stored: {trajectory.message_count} messages, "
            f"{len(trajectory.metadata['otlp'].get('spans', {}))} span entries; last answer {answer}"
        )
        print(
            json.dumps(
                {
                    "pattern": args.pattern,
                    "exports": args.exports,
                    "spans": args.spans,
                    "first_ms": round(first * 1000, 2),
                    "last_ms": round(last * 1000, 2),
                    "ratio": round(last / first, 2),
                    "first_cpu_ms": round(first_cpu * 1000, 2),
                    "last_cpu_ms": round(last_cpu * 1000, 2),
                    "cpu_ratio": round(last_cpu / first_cpu, 2),
                    "messages": trajectory.message_count,
                }
            )
        )
        connection.close()
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
