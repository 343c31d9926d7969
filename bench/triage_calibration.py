"""Triage's detectors against labels: precision and recall per detector with their 95% Wilson intervals, as
the calibration page shows them (`evals.calibration`).

    DATABASE_URL=… .venv/bin/python bench/triage_calibration.py [--project demo --project workplace]
                                                                 [--labels outcome|reviewed] [--retriage]
    .venv/bin/python bench/triage_calibration.py --reference [PATH]

The first form reads the database `DATABASE_URL` names (the SQLite file `make run` seeds when unset).
`--labels outcome` (the default here) measures against reviewers' labels where given and else the outcome the
trajectory recorded. What those outcomes are decides what the figures mean:
- the support demo's (`demo`) are a person's, written with each conversation: a held-out measure, on 11
  trajectories (wide intervals);
- the workplace demo's (`workplace`) are the tool_call verifier's verdicts on the calls the tiny model made,
  the same checks the call-reading detectors run: their agreement holds by construction, and two detectors
  (no_final_answer, unsafe_action) were revised after looking at their precision on those same 300 plays.
`--retriage` first triages every trajectory again under the project's current policy and the current
detectors, as the Triage page's re-run does (it writes signals).

`--reference` needs no database: it runs the detectors on a set labeled by hand before they ever ran on it
(default: tests/platform/trajectories/data/triage_reference.jsonl, 76 trajectories of five agents) and
measures each detector against the person's judgement of which signals apply, and "any signal" against the
judged outcome (`calibration.detector_reference`).

Prints a table per project (or for the reference set) and, last, one JSON line: {name: {"n", "failures",
"queue" (a project's review queue; absent for the reference set), "detectors": {kind: {"on_failures",
"on_successes", "precision", "precision_ci", "recall", "recall_ci"}}}}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT))
REFERENCE = ROOT / "tests" / "platform" / "trajectories" / "data" / "triage_reference.jsonl"


def _fmt(value: float | None) -> str:
    return "    —" if value is None else f"{value:5.3f}"


def _ci(interval: tuple[float, float] | None) -> str:
    return "            —" if interval is None else f"[{interval[0]:.2f}, {interval[1]:.2f}]"


def _report(name: str, result, header: str, **extra) -> dict:
    print(f"\n{name}: {header}")
    print(f"  {'detector':<20} {'hit':>5} {'false':>5} {'precision':>9} {'95% interval':>13} {'recall':>7} "
          f"{'95% interval':>13}")
    for row in result.rows:
        print(f"  {row.kind:<20} {row.on_failures:>5} {row.on_successes:>5} {_fmt(row.precision):>9} "
              f"{_ci(row.precision_interval):>13} {_fmt(row.recall):>7} {_ci(row.recall_interval):>13}")
    return {"n": result.n, "failures": result.failures, **extra, "detectors": {
        row.kind: {"on_failures": row.on_failures, "on_successes": row.on_successes, "precision": row.precision,
                   "precision_ci": row.precision_interval, "recall": row.recall, "recall_ci": row.recall_interval}
        for row in result.rows}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--project", action="append", default=[], help="a project's slug (default: every project)")
    parser.add_argument("--labels", choices=("outcome", "reviewed"), default="outcome")
    parser.add_argument("--retriage", action="store_true", help="triage every trajectory again first")
    parser.add_argument("--reference", nargs="?", const=str(REFERENCE), default=None, metavar="PATH",
                        help="measure against a hand-labeled set instead of a database")
    args = parser.parse_args()

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "flywheel.settings")
    import django

    django.setup()
    from flywheel.evals.calibration import detector_calibrate, detector_reference

    out = {}
    if args.reference:
        path = Path(args.reference)
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        result = detector_reference(records)
        out[path.stem] = _report(
            path.stem, result, f"{result.n} trajectories labeled by hand ({result.failures} failures); per detector "
            "against the person's judgement that its signal applies ('hit': flagged where it applies, 'false': "
            "flagged where it does not); 'any' against the judged outcome")
        print(json.dumps(out))
        return

    from flywheel.accounts.models import Project
    from flywheel.failures.queue import queue_queryset
    from flywheel.trajectories import triage

    projects = Project.objects.order_by("pk")
    if args.project:
        projects = projects.filter(slug__in=args.project)
    for project in projects:
        if args.retriage:
            run = triage.triage_run_start(project=project)
            triage.triage_run_process(run_id=run.pk)
        result = detector_calibrate(project=project, labels=args.labels)
        queue = queue_queryset(project=project).count()
        out[project.slug] = _report(
            project.slug, result, f"{result.n} labeled ({result.failures} failures, {result.successes} successes; "
            f"labels: {args.labels}), {result.untriaged} not triaged; review queue {queue} ('hit': flagged "
            "failures, 'false': flagged successes)", queue=queue)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
