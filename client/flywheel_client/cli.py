"""The `flywheel` command line: ingest, train, promote, roll back and see what serves, from a shell or CI.

The server and key come from FLYWHEEL_URL and FLYWHEEL_API_KEY (or --url and --key).

Exit codes, for CI to branch on:
  0  done: every record accepted; the job succeeded and the gate passed; the move was made
  1  an error: a record rejected, a request refused (with the server's reason), the server unreachable or of
     another API version
  2  the command line itself is wrong (argparse)
  3  the gate refused the candidate (the job succeeded; the report names the failing rules)
  4  the training job failed or was cancelled
  5  --timeout passed before the job finished (the job goes on)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from flywheel_client import __version__
from flywheel_client.client import Flywheel
from flywheel_client.errors import FlywheelError
from flywheel_client.types import AliasMove, Rejection, TrainingJob

OK, ERROR, USAGE, GATE_REFUSED, JOB_FAILED, TIMED_OUT = 0, 1, 2, 3, 4, 5


def _collection(text: str) -> tuple[int, int | None]:
    """`ID` or `ID:VERSION` (a task set's or eval suite's id, and a version number)."""
    ident, _, version = text.partition(":")
    try:
        return int(ident), (int(version) if version else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected ID or ID:VERSION, e.g. 3 or 3:2") from None


def _setting(text: str) -> tuple[str, Any]:
    """`key=value`; the value is read as JSON when it is JSON (2, 1e-3, true, [..]), else kept as text."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected key=value, e.g. max_steps=20")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flywheel", description="Drive a Flywheel server from the command line.",
                                epilog="Exit codes: 0 done, 1 error or rejected records, 2 usage, 3 the gate "
                                       "refused, 4 the job failed or was cancelled, 5 timed out waiting.")
    p.add_argument("--version", action="version", version=f"flywheel-client {__version__}")
    p.add_argument("--url", help="the server (default: FLYWHEEL_URL)")
    p.add_argument("--key", help="a project API key (default: FLYWHEEL_API_KEY)")
    sub = p.add_subparsers(dest="command", required=True)

    ingest = sub.add_parser("ingest", help="send trajectories from a JSONL file (one trajectory a line; - for stdin)")
    ingest.add_argument("file")

    train = sub.add_parser("train", help="start a training job")
    train.add_argument("--task-set", required=True, type=_collection, metavar="ID[:VERSION]",
                       help="the task set and its version (default: its latest)")
    train.add_argument("--holdout", type=_collection, metavar="ID[:VERSION]", help="the holdout eval suite")
    train.add_argument("--regression", type=_collection, metavar="ID[:VERSION]", help="the regression eval suite")
    train.add_argument("--config", type=_setting, action="append", default=[], metavar="KEY=VALUE",
                       help="a GRPOConfig field (repeat the option for more)")
    train.add_argument("--algorithm", default="grpo")
    train.add_argument("--wait", action="store_true", help="wait for the job and the gate; exit 3 when it refuses")
    train.add_argument("--timeout", type=float, help="seconds to wait at most (exit 5 past it)")

    promote = sub.add_parser("promote", help="move production to model version N (it must have passed the gate)")
    promote.add_argument("version", type=int)
    promote.add_argument("--reason", default="")

    rollback = sub.add_parser("rollback", help="move production back to the version it replaced")
    rollback.add_argument("--to", type=int, dest="to_version", help="a version that served before")
    rollback.add_argument("--reason", default="")

    canary = sub.add_parser("canary", help="serve model version N to a share of traffic beside production; "
                                           "`canary promote` / `canary rollback` decide it")
    canary.add_argument("version", help="a version number, or promote, or rollback")
    canary.add_argument("--weight", type=float, help="the canary's share of traffic (default: the project's, 0.1)")
    canary.add_argument("--reason", default="")

    sub.add_parser("checks", help="canary decisions and watches after promotions, with their evidence")

    sub.add_parser("status", help="what serves (production first, then a canary), the candidate, recent moves, "
                                  "running checks and jobs")

    jobs = sub.add_parser("jobs", help="list training jobs")
    jobs.add_argument("--status")

    cancel = sub.add_parser("cancel", help="cancel a training job")
    cancel.add_argument("job", type=int)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not (args.key or os.environ.get("FLYWHEEL_API_KEY")):
        print("flywheel: no API key: set FLYWHEEL_API_KEY or pass --key (a project's key, from its settings page)",
              file=sys.stderr)
        return USAGE
    try:
        with Flywheel(args.url, args.key) as client:
            return COMMANDS[args.command](client, args)
    except FlywheelError as exc:
        print(f"flywheel: {exc}", file=sys.stderr)
        return ERROR
    except KeyboardInterrupt:
        return 130


# --- commands -----------------------------------------------------------------------------------------------------


def ingest(client: Flywheel, args: argparse.Namespace) -> int:
    stream = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")  # noqa: SIM115
    records: list[Any] = []
    lines: list[int] = []  # the file's line (from 1) of each record sent
    local: list[Rejection] = []
    with stream:
        for number, text in enumerate(stream, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except ValueError as exc:
                local.append(Rejection(index=number, errors=[_error(f"not valid JSON: {exc}")]))
                continue
            records.append(record)
            lines.append(number)
    result = client.ingest(records)
    rejected = [(r.index, r) for r in local] + [(lines[r.index], r) for r in result.rejected]
    print(f"{result.accepted} accepted ({result.created} new, {result.updated} updated), {len(rejected)} rejected")
    for line, rejection in sorted(rejected, key=lambda pair: pair[0]):
        who = f" ({rejection.external_id})" if rejection.external_id is not None else ""
        print(f"line {line}{who}: " + "; ".join(map(str, rejection.errors)), file=sys.stderr)
    return ERROR if rejected else OK


def _error(message: str) -> Any:
    from flywheel_client.types import FieldError

    return FieldError(message=message)


def train(client: Flywheel, args: argparse.Namespace) -> int:
    task_set, task_set_version = args.task_set
    holdout, holdout_version = args.holdout or (None, None)
    regression, regression_version = args.regression or (None, None)
    job = client.start_training(task_set, task_set_version, holdout=holdout, holdout_version=holdout_version,
                                regression=regression, regression_version=regression_version,
                                config=dict(args.config), algorithm=args.algorithm, confirm=True)
    print(f"training job {job.id} started ({job.status})")
    if not args.wait:
        return OK
    try:
        job = client.wait(job.id, timeout=args.timeout)
    except TimeoutError as exc:
        print(f"flywheel: {exc}", file=sys.stderr)
        return TIMED_OUT
    return _outcome(job)


def _outcome(job: TrainingJob) -> int:
    if job.status != "succeeded":
        where = f" at step {job.failed_step}" if job.failed_step is not None else ""
        print(f"training job {job.id} {job.status}{where}" + (f": {job.error}" if job.error else ""), file=sys.stderr)
        return JOB_FAILED
    print(f"training job {job.id} succeeded; candidate: version {job.candidate_version}")
    if job.gate is None:
        print("no gate decision (the job had no holdout to judge it on)")
        return OK
    print("gate: " + job.gate.summary())
    return OK if job.gate.passed and not job.gate.error else GATE_REFUSED


def _move(move: AliasMove) -> str:
    by = f" by {move.user}" if move.user else (f" by the {move.actor}" if move.actor else "")
    why = f": {move.reason}" if move.reason else ""
    if move.kind == "end":  # the alias points nowhere now: to_version is the version it left
        return f"{move.alias} ended: version {move.to_version} no longer serves{by} at {move.at}{why}"
    share = f" at {move.weight:.0%} of traffic" if move.weight is not None and move.alias == "canary" else ""
    if move.from_version is None:  # the alias pointed nowhere before: a first move, not a change
        return f"{move.alias} {move.kind}: version {move.to_version}{share}{by} at {move.at}{why}"
    return f"{move.alias} {move.kind}: version {move.from_version} -> {move.to_version}{share}{by} at {move.at}{why}"


def promote(client: Flywheel, args: argparse.Namespace) -> int:
    print(_move(client.promote(args.version, reason=args.reason)))
    return OK


def rollback(client: Flywheel, args: argparse.Namespace) -> int:
    print(_move(client.rollback(reason=args.reason, to_version=args.to_version)))
    return OK


def status(client: Flywheel, args: argparse.Namespace) -> int:
    state = client.status()
    production = state.production
    if production is None:
        print("production: none (no model registered yet)")
    else:
        print(f"production: version {production.version} ({production.base_model}"
              + (f", adapter {production.adapter_sha256[:12]}" if production.adapter_sha256 else "")
              + f") since {production.since}" + (f": {production.reason}" if production.reason else ""))
    serving = client.serving()
    if serving.get("canary"):
        canary = serving["canary"]
        print(f"canary: version {canary['version']} ({canary['adapter']}) serves {canary['weight']:.0%} of traffic")
    print(f"candidate: version {state.candidate}" if state.candidate is not None else "candidate: none")
    for check in client.live_checks(limit=5):
        if check.status in ("running", "flagged"):
            print("  " + check.summary())
    for move in state.history:
        print("  " + _move(move))
    for job in state.jobs:
        print(f"job {job.id}: {job.status}, step {job.step}/{job.max_steps}")
    return OK


def canary(client: Flywheel, args: argparse.Namespace) -> int:
    if args.version == "promote":
        print(_move(client.canary_promote(reason=args.reason)))
    elif args.version == "rollback":
        print(_move(client.canary_rollback(reason=args.reason)))
    elif args.version.isdigit():
        started = client.canary(int(args.version), weight=args.weight, reason=args.reason)
        print(_move(started.move))
        print("  " + started.check.summary())
    else:
        print(f"flywheel: canary: expected a version number, promote or rollback, not {args.version!r}",
              file=sys.stderr)
        return USAGE
    return OK


def checks(client: Flywheel, args: argparse.Namespace) -> int:
    for check in client.live_checks():
        print(f"check {check.id}: {check.summary()}")
    return OK


def jobs(client: Flywheel, args: argparse.Namespace) -> int:
    for job in client.training_jobs(status=args.status):
        gate = "" if job.gate is None else (" gate passed" if job.gate.passed else " gate refused")
        print(f"job {job.id}: {job.status}, step {job.step}/{job.max_steps}"
              + (f", candidate version {job.candidate_version}" if job.candidate_version else "") + gate)
    return OK


def cancel(client: Flywheel, args: argparse.Namespace) -> int:
    job = client.cancel(args.job)
    print(f"training job {job.id}: {job.status}")
    return OK


COMMANDS = {"ingest": ingest, "train": train, "promote": promote, "rollback": rollback, "status": status,
            "jobs": jobs, "cancel": cancel, "canary": canary, "checks": checks}


if __name__ == "__main__":
    sys.exit(main())
