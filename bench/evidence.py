"""What checking evidence tokens costs ingestion: `ingest_trajectories` on batches whose every record carries the
router's token, against the same batches without one, in the same run, on the database DATABASE_URL names.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/flywheel_bench .venv/bin/python bench/evidence.py \
        [--batches 10] [--batch 500]

Migrates that database first (on PostgreSQL it must exist), works in a project of its own ("bench-evidence",
deleted at the end) with two model versions, and alternates the two kinds of batch so that both see the same
load. The records are bench/ingest.py's support-agent runs (about 10 messages, 2.5 KB each). Prints milliseconds
per batch (median) for each and their ratio; the last line is JSON."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _drop(project) -> None:  # noqa: ANN001
    """The bench's project and what it wrote; versions first (a base model is protected by its versions)."""
    if project is not None:
        project.model_versions.all().delete()
        project.delete()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=10, help="batches of each kind")
    parser.add_argument("--batch", type=int, default=500, help="records a batch")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "platform"))
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "flywheel.settings")
    os.environ.setdefault("FLYWHEEL_TRIAGE", "false")  # the ingest alone, not the triage it queues
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    from flywheel.accounts.models import Project
    from flywheel.registry.models import BaseModel, ModelVersion
    from flywheel.router import evidence_sign
    from flywheel.trajectories.ingest import ingest_trajectories
    from flywheel.trajectories.vouch import evidence_keys

    call_command("migrate", verbosity=0)
    _drop(Project.objects.filter(slug="bench-evidence").first())
    project = Project.objects.create(slug="bench-evidence", name="bench")
    base = BaseModel.objects.create(project=project, name="b", path="/nonexistent")
    for number in (1, 2):
        ModelVersion.objects.create(project=project, base=base, number=number)
    key = evidence_keys(project.pk)[0]

    sys.path.insert(0, str(ROOT / "bench"))
    from ingest import synthetic  # bench/ingest.py's support-agent run: ~10 messages, ~2.5 KB

    def batch(vouched: bool) -> list[dict]:
        now, run = int(time.time()), uuid.uuid4().hex
        records = []
        for i in range(args.batch):
            record = synthetic(i, run)
            record["model_version"] = f"bench-evidence-v{1 + i % 2}"
            if vouched:
                token = evidence_sign(key, version=1 + i % 2, at=now, request_id=uuid.uuid4().hex)
                record["metadata"] = {**(record.get("metadata") or {}), "flywheel_evidence": token}
            records.append(record)
        return records

    times: dict[str, list[float]] = {"plain": [], "vouched": []}
    for _ in range(args.batches):
        for kind in ("plain", "vouched"):
            records = batch(kind == "vouched")
            start = time.perf_counter()
            result = ingest_trajectories(project=project, records=records, ingested_by="key:1")
            times[kind].append((time.perf_counter() - start) * 1000)
            assert result.accepted == args.batch
    figures = {kind: round(statistics.median(t), 1) for kind, t in times.items()}
    ratio = round(figures["vouched"] / figures["plain"], 3)
    print(f"{args.batch} records a batch, {args.batches} batches each ({connection.vendor}): without tokens "
          f"{figures['plain']} ms, with tokens {figures['vouched']} ms a batch (median); ratio {ratio}")
    _drop(project)
    print(json.dumps({"database": connection.vendor, "batch": args.batch, "batches": args.batches,
                      "plain_ms": figures["plain"], "vouched_ms": figures["vouched"], "ratio": ratio}))


if __name__ == "__main__":
    main()
