"""What the API's rate limit costs a request: one token-bucket take (the atomic upsert), and the peek
an API key request makes of its address's failure bucket, timed on the database DATABASE_URL names.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/flywheel_bench .venv/bin/python bench/rate_limit.py [--n 2000]

Migrates that database first (on PostgreSQL it must exist), writes only `accounts_ratebucket` rows named
"bench:*" and deletes them at the end. Prints microseconds per take and per peek (p50, p95); the last line
is JSON."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="takes (and peeks) to time")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "platform"))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "flywheel.settings")
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    from flywheel.accounts import ratelimit
    from flywheel.accounts.models import RateBucket

    call_command("migrate", verbosity=0)
    figures = {}
    for label, call in (
        ("take", lambda: ratelimit.rate_bucket_take(name="bench:key", rate=50.0, burst=200.0)),
        ("peek", lambda: ratelimit.rate_bucket_peek(name="bench:addr", rate=1 / 6, burst=20.0)),
    ):
        call()  # the row exists from here on, as it does for any key in use
        times = []
        for _ in range(args.n):
            start = time.perf_counter()
            call()
            times.append((time.perf_counter() - start) * 1e6)
        times.sort()
        figures[label] = {
            "p50_us": round(statistics.median(times), 1),
            "p95_us": round(times[int(0.95 * len(times))], 1),
        }
        print(
            f"{label}: p50 {figures[label]['p50_us']} µs, p95 {figures[label]['p95_us']} µs ({args.n} calls)"
        )
    RateBucket.objects.filter(name__startswith="bench:").delete()
    print(json.dumps({"database": connection.vendor, "n": args.n, **figures}))


if __name__ == "__main__":
    main()
