"""Triage's detectors against the labels of a database's projects: precision and recall per detector, and the
size of the review queue, as the calibration page shows them (`evals.calibration.detector_calibrate`).

    DATABASE_URL=… .venv/bin/python bench/triage_calibration.py [--project demo --project workplace]
                                                                 [--labels outcome|reviewed] [--retriage]

Reads the database `DATABASE_URL` names (the SQLite file `make run` seeds when unset). `--labels outcome`
(the default here) measures against reviewers' labels where given and else the outcome the trajectory
recorded: the demo projects have no reviewers' labels, and their recorded outcomes are right by
construction (the support demo's are written with each conversation, the workplace demo's are the verifier's
verdict on the call the tiny model made). `--retriage` first triages every trajectory again under the
project's current policy and the current detectors, as the Triage page's re-run does (it writes signals).

Prints a table per project and, last, one JSON line: {slug: {"n", "failures", "queue", "detectors": {kind:
{"on_failures", "on_successes", "precision", "recall"}}}}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))


def _fmt(value: float | None) -> str:
    return "    —" if value is None else f"{value:5.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--project", action="append", default=[], help="a project's slug (default: every project)")
    parser.add_argument("--labels", choices=("outcome", "reviewed"), default="outcome")
    parser.add_argument("--retriage", action="store_true", help="triage every trajectory again first")
    args = parser.parse_args()

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "flywheel.settings")
    import django

    django.setup()
    from flywheel.accounts.models import Project
    from flywheel.evals.calibration import detector_calibrate
    from flywheel.failures.queue import queue_queryset
    from flywheel.trajectories import triage

    projects = Project.objects.order_by("pk")
    if args.project:
        projects = projects.filter(slug__in=args.project)
    out = {}
    for project in projects:
        if args.retriage:
            run = triage.triage_run_start(project=project)
            triage.triage_run_process(run_id=run.pk)
        result = detector_calibrate(project=project, labels=args.labels)
        queue = queue_queryset(project=project).count()
        print(f"\n{project.slug}: {result.n} labeled ({result.failures} failures, {result.successes} successes; "
              f"labels: {args.labels}), {result.untriaged} not triaged; review queue {queue}")
        print(f"  {'detector':<20} {'on fail':>7} {'on succ':>7} {'precision':>9} {'recall':>7}")
        for row in result.rows:
            print(f"  {row.kind:<20} {row.on_failures:>7} {row.on_successes:>7} {_fmt(row.precision):>9} "
                  f"{_fmt(row.recall):>7}")
        out[project.slug] = {
            "n": result.n, "failures": result.failures, "queue": queue,
            "detectors": {row.kind: {"on_failures": row.on_failures, "on_successes": row.on_successes,
                                     "precision": row.precision, "recall": row.recall} for row in result.rows},
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
