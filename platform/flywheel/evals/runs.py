"""Eval runs, one function per action: start one (a GPU worker runs `python -m trainer evaluate`), record
one from a training job's own measurements, process one (the worker's side), and compare two runs of the
same suite version case by case with a paired test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from flywheel import outbox
from flywheel.evals.run_models import EvalCaseResult, EvalRun, EvalRunStatus

EVALUATE_TIMEOUT_S = 6 * 3600


def case_output(case: dict[str, Any] | None) -> str:
    """The first sample's answer as text (tool calls as name(arguments)), for reading, not scoring."""
    if not case:
        return ""
    for sample in case.get("samples") or []:
        for message in sample.get("messages") or []:
            if message.get("role") != "assistant":
                continue
            calls = message.get("tool_calls") or []
            if calls:
                return "; ".join(f"{c.get('function', {}).get('name')}({c.get('function', {}).get('arguments')})"
                                 for c in calls)
            return str(message.get("content") or "")
    return ""


def _origins(suite_version) -> dict[str, dict[str, Any]]:
    return {str(row.get("id")): (row.get("origin") or {}) for row in suite_version.rows}


def _store_results(run: EvalRun, cases: list[dict[str, Any]]) -> None:
    origins = _origins(run.suite_version)
    EvalCaseResult.objects.bulk_create([
        EvalCaseResult(
            run=run, case_id=str(case["id"])[:200], passed=bool(case.get("passed")),
            pass_rate=float(case.get("pass_rate", 0.0)), mean_reward=float(case.get("mean_reward", 0.0)),
            failures=case.get("failures") or {}, output=case_output(case)[:4000],
            failure_mode_id=origins.get(str(case["id"]), {}).get("failure_mode"),
            trajectory_id=origins.get(str(case["id"]), {}).get("trajectory_id"),
            latency_ms=case.get("latency_ms"), tokens=case.get("mean_completion_tokens"),
        )
        for case in cases
    ])


def read_cases(path: Path) -> list[dict[str, Any]]:
    """The per-case rows `python -m trainer evaluate --out` wrote."""
    from trainer.config import read_jsonl

    return read_jsonl(path)


def evaluate_command(*, model_path: str, adapter_path: str = "", suite: Path, out: Path, samples: int,
                     temperature: float | None = None, max_new_tokens: int | None = None,
                     seed: int | None = None) -> list[str]:
    """`python -m trainer evaluate` for a model (and its adapter) on a suite file: the one command line that
    eval runs, a job's measurement of production and the demo's play all run."""
    command = [sys.executable, "-m", "trainer", "evaluate", "--model", model_path, "--suite", str(suite),
               "--out", str(out), "--samples", str(samples)]
    for flag, value in (("--temperature", temperature), ("--max-new-tokens", max_new_tokens), ("--seed", seed)):
        if value is not None:
            command += [flag, str(value)]
    if adapter_path:
        command += ["--adapter", adapter_path]
    return command


def eval_run_create(*, project, model_version, suite_version, user=None, samples: int = 4) -> EvalRun:
    """Queue a measurement of `model_version` on `suite_version` for a GPU worker."""
    if model_version.project_id != project.pk or suite_version.suite.project_id != project.pk:
        raise ValidationError({"model_version": "The version and the suite must be this project's."})
    if not 1 <= int(samples) <= 64:
        raise ValidationError({"samples": "Between 1 and 64 samples a case."})
    if not suite_version.size:
        raise ValidationError({"suite_version": "That suite version has no cases."})
    from flywheel.evals.tasks import eval_run_task

    with transaction.atomic():
        run = EvalRun.objects.create(project=project, model_version=model_version, suite_version=suite_version,
                                     samples=int(samples), created_by=user, queued_at=timezone.now())
        outbox.send_on_commit(eval_run_task, run.pk)
    return run


def eval_run_record(*, project, model_version, suite_version, cases: list[dict[str, Any]], metrics: dict[str, Any],
                    job=None, step: int | None = None) -> EvalRun:
    """A run already measured elsewhere (a training job's files): stored like any other."""
    with transaction.atomic():
        run = EvalRun.objects.create(
            project=project, model_version=model_version, suite_version=suite_version, job=job, source="job",
            step=step, status=EvalRunStatus.SUCCEEDED, metrics=metrics, finished_at=timezone.now(),
            samples=max((len(c.get("samples") or []) for c in cases), default=0),
        )
        _store_results(run, cases)
    return run


def _run_dir(run: EvalRun) -> Path:
    return Path(settings.FLYWHEEL_JOBS_DIR) / run.project.slug / f"eval-{run.pk}"


def eval_run_process(*, run_id: int) -> EvalRun | None:
    """The worker's side: claim the run, write the suite, run the trainer's evaluate, store the results."""
    from flywheel.training.services import _die_with_parent

    if not EvalRun.objects.filter(pk=run_id, status=EvalRunStatus.QUEUED).update(
        status=EvalRunStatus.RUNNING, started_at=timezone.now()
    ):
        return None  # a duplicate message
    run = EvalRun.objects.select_related("project", "model_version__base", "suite_version").get(pk=run_id)
    folder = _run_dir(run)
    folder.mkdir(parents=True, exist_ok=True)
    from trainer.config import write_jsonl

    suite = folder / "suite.jsonl"
    write_jsonl(suite, run.suite_version.rows)
    version = run.model_version
    command = evaluate_command(model_path=version.base.path, adapter_path=version.adapter_path, suite=suite,
                               out=folder / "results.jsonl", samples=run.samples)
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=folder, timeout=EVALUATE_TIMEOUT_S,
                              preexec_fn=_die_with_parent,  # noqa: PLW1509 (own process group, dies with us)
                              env={**os.environ, "FLYWHEEL_ENV_ENTRY_POINTS": "0"})
        events = [json.loads(line) for line in done.stdout.splitlines() if line.strip().startswith("{")]
        final = events[-1] if events else {}
        if done.returncode != 0 or final.get("event") != "done":
            message = final.get("message") or done.stderr.strip()[-1500:] or f"exit status {done.returncode}"
            raise RuntimeError(message)
        with transaction.atomic():
            _store_results(run, read_cases(folder / "results.jsonl"))
            EvalRun.objects.filter(pk=run.pk).update(status=EvalRunStatus.SUCCEEDED, metrics=final.get("metrics", {}),
                                                     finished_at=timezone.now())
    except Exception as exc:  # noqa: BLE001 (the page says why; a new run retries)
        EvalRun.objects.filter(pk=run.pk).update(status=EvalRunStatus.FAILED, error=str(exc)[:4000],
                                                 finished_at=timezone.now())
    run.refresh_from_db()
    return run


def eval_sweep() -> int:
    """The outbox sweep: runs still queued after the requeue delay are sent again."""
    from flywheel.evals.tasks import eval_run_task

    stale = timezone.now() - outbox.requeue_after()
    sent = 0
    for run_id in EvalRun.objects.filter(status=EvalRunStatus.QUEUED, queued_at__lt=stale).values_list("id", flat=True):
        try:
            outbox.send(eval_run_task, run_id)
        except outbox.BrokerUnavailable:
            break
        EvalRun.objects.filter(pk=run_id).update(queued_at=timezone.now())
        sent += 1
    return sent


def eval_compare(*, a: EvalRun, b: EvalRun) -> dict[str, Any]:
    """Two runs on the same suite version: per-case differences and an exact McNemar test (b better than a)."""
    from flywheel.registry.gate import mcnemar_exact

    if a.suite_version_id != b.suite_version_id:
        raise ValidationError({"b": "Compare two runs of the same suite version."})
    left = {r.case_id: r for r in a.results.all()}
    right = {r.case_id: r for r in b.results.all()}
    rows = []
    for case_id in sorted(set(left) | set(right)):
        x, y = left.get(case_id), right.get(case_id)
        rows.append({"case_id": case_id, "a": x, "b": y,
                     "change": ("fixed" if x and y and not x.passed and y.passed else
                                "broken" if x and y and x.passed and not y.passed else "")})
    fixed = sum(1 for r in rows if r["change"] == "fixed")
    broken = sum(1 for r in rows if r["change"] == "broken")
    return {
        "rows": rows, "fixed": fixed, "broken": broken,
        "p_b_better": mcnemar_exact(fixed, broken), "p_a_better": mcnemar_exact(broken, fixed),
        "a_success": sum(r.passed for r in left.values()) / max(1, len(left)),
        "b_success": sum(r.passed for r in right.values()) / max(1, len(right)),
    }
