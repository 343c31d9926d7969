"""Eval runs, one function per action: start one (a GPU worker runs `python -m trainer evaluate`), record
one from a training job's own measurements, process one (the worker's side), and compare two runs of the
same suite version case by case with a paired test."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from flywheel import gpu_queue, outbound, outbox, runs, timelimits
from flywheel.accounts.services import gpus_visible, project_lock
from flywheel.evals.rows import Origin, origin_of
from flywheel.evals.run_models import EvalCaseResult, EvalRun, EvalRunStatus
from flywheel.supervise import supervise, trainer_env
from trainer import events, jobdir


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


def _origins(suite_version) -> dict[str, Origin]:
    return {str(row.get("id")): origin_of(row) for row in suite_version.rows}


def _store_results(run: EvalRun, cases: list[dict[str, Any]]) -> None:
    origins = _origins(run.suite_version)
    EvalCaseResult.objects.bulk_create([
        EvalCaseResult(
            run=run, case_id=str(case["id"])[:200], passed=bool(case.get("passed")),
            pass_rate=float(case.get("pass_rate", 0.0)), mean_reward=float(case.get("mean_reward", 0.0)),
            failures=case.get("failures") or {}, output=case_output(case)[:4000],
            failure_mode_id=origins.get(str(case["id"]), Origin()).failure_mode,
            trajectory_id=origins.get(str(case["id"]), Origin()).trajectory_id,
            latency_ms=case.get("latency_ms"), tokens=case.get("mean_completion_tokens"),
        )
        for case in cases
    ])


def evaluate_command(*, model_path: str, adapter_path: str = "", suite: Path, out: Path, samples: int,
                     temperature: float | None = None, max_new_tokens: int | None = None,
                     seed: int | None = None, max_turns: int | None = None, max_seq_len: int | None = None,
                     engine: str | None = None) -> list[str]:
    """`python -m trainer evaluate` for a model (and its adapter) on a suite file: the one command line that
    eval runs, a job's measurement of production and of its candidate, and the demo's play all run."""
    command = [sys.executable, "-m", "trainer", "evaluate", "--model", model_path, "--suite", str(suite),
               "--out", str(out), "--samples", str(samples)]
    for flag, value in (("--temperature", temperature), ("--max-new-tokens", max_new_tokens), ("--seed", seed),
                        ("--max-turns", max_turns), ("--max-seq-len", max_seq_len), ("--engine", engine)):
        if value is not None:
            command += [flag, str(value)]
    if adapter_path:
        command += ["--adapter", adapter_path]
    return command


def generations_problem(*, cases: int, samples: int) -> str:
    """Why measuring `cases` cases at `samples` samples a case is refused ("" when it is not): more generations
    than FLYWHEEL_MAX_EVAL_GENERATIONS, one measurement's bound on a GPU worker's time."""
    limit = settings.FLYWHEEL_MAX_EVAL_GENERATIONS
    if limit <= 0 or cases * samples <= limit:
        return ""
    most = limit // cases
    advice = f"take at most {most} samples a case" if most else "measure a smaller suite version"
    return (f"{cases} cases × {samples} samples a case is {cases * samples} generations, over the limit of {limit} "
            f"(FLYWHEEL_MAX_EVAL_GENERATIONS): {advice}.")


def eval_run_create(*, project, model_version, suite_version, user=None, samples: int | None = None,
                    purpose: str = "measure", options: dict[str, Any] | None = None) -> EvalRun:
    """Queue a measurement of `model_version` on `suite_version` for a GPU worker (`purpose`: what is done
    with it when it succeeds, see `_on_success`). Unset sampling settings are GRPOConfig's, as a training job's
    evaluation takes them (`samples`: its regression_samples_per_prompt on a regression suite, else its
    eval_samples_per_prompt).

    Refused with a field error when cases × samples is over FLYWHEEL_MAX_EVAL_GENERATIONS, and with Refused
    (409) when the project already has FLYWHEEL_MAX_EVAL_RUNS_PER_PROJECT runs waiting or running."""
    from flywheel.evals.models import SuiteKind
    from trainer.config import GRPOConfig

    if samples is None:
        config = GRPOConfig()
        regression = suite_version.suite.kind == SuiteKind.REGRESSION
        samples = config.regression_samples_per_prompt if regression else config.eval_samples_per_prompt
    if model_version.project_id != project.pk or suite_version.suite.project_id != project.pk:
        raise ValidationError({"model_version": "The version and the suite must be this project's."})
    if not 1 <= int(samples) <= 64:
        raise ValidationError({"samples": "Between 1 and 64 samples a case."})
    if not suite_version.size:
        raise ValidationError({"suite_version": "That suite version has no cases."})
    if problem := generations_problem(cases=suite_version.size, samples=int(samples)):
        raise ValidationError({"samples": problem})

    with transaction.atomic():
        project_lock(project=project)
        _limit_check(project)
        run = EvalRun.objects.create(project=project, model_version=model_version, suite_version=suite_version,
                                     samples=int(samples), created_by=user, queued_at=timezone.now(),
                                     purpose=purpose, options=options or {})
        outbox.send_on_commit(gpu_queue.gpu_turn_task, run.pk)
    return run


def _limit_check(project) -> None:
    runs.run_limit_check(EvalRun, project=project, statuses=EvalRun.ACTIVE,
                         limit=settings.FLYWHEEL_MAX_EVAL_RUNS_PER_PROJECT, setting="FLYWHEEL_MAX_EVAL_RUNS_PER_PROJECT")


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
    """The worker's side: claim the run, then run it (`eval_run_claimed`). A duplicate message finds it no longer
    queued."""
    if not runs.run_claim(EvalRun, run_id):
        return None
    return eval_run_claimed(run_id=run_id)


def eval_run_claimed(*, run_id: int) -> EvalRun:
    """`_eval_run_claimed`, its device time recorded on the run (flywheel.runs.device_time)."""
    with runs.device_time(EvalRun, run_id, gpus=gpus_visible()):
        run = _eval_run_claimed(run_id=run_id)
    run.refresh_from_db(fields=runs.USAGE_FIELDS)
    return run


def _eval_run_claimed(*, run_id: int) -> EvalRun:
    """A run this worker claimed: write the suite, run the trainer's evaluate (beating the heart and honouring
    cancel, like a training job), store the results."""
    run = EvalRun.objects.select_related("project", "model_version__base", "suite_version").get(pk=run_id)
    folder = _run_dir(run)
    folder.mkdir(parents=True, exist_ok=True)
    from trainer.config import write_jsonl

    suite = folder / jobdir.RUN_SUITE
    write_jsonl(suite, run.suite_version.rows)
    results = folder / jobdir.RUN_RESULTS
    results.unlink(missing_ok=True)  # an earlier attempt's
    version = run.model_version
    command = evaluate_command(model_path=version.base.path, adapter_path=version.adapter_path, suite=suite,
                               out=results, samples=run.samples)
    outcome = events.Outcome()

    def on_tick() -> bool:
        EvalRun.objects.filter(pk=run.pk).update(heartbeat_at=timezone.now())
        return EvalRun.objects.filter(pk=run.pk, cancel_requested=True).exists()

    stderr_path = jobdir.stderr_log(folder, run.attempt)
    try:
        status, cancelled = supervise(
            command, cwd=folder, env=trainer_env(),
            stderr_path=stderr_path, on_event=outcome.on_event, on_tick=on_tick,
            on_start=lambda pid: EvalRun.objects.filter(pk=run.pk).update(pid=pid))
        if cancelled:
            EvalRun.objects.filter(pk=run.pk).update(status=EvalRunStatus.CANCELLED, finished_at=timezone.now(),
                                                     pid=None, heartbeat_at=None)
        elif status != 0 or not outcome.finished or outcome.error is not None:
            tail = stderr_path.read_bytes()[-1500:].decode("utf-8", "replace").strip() if stderr_path.exists() else ""
            raise RuntimeError(outcome.error or tail or f"exit status {status}")
        else:
            with transaction.atomic():
                _store_results(run, jobdir.read_cases(results))
                EvalRun.objects.filter(pk=run.pk).update(status=EvalRunStatus.SUCCEEDED, finished_at=timezone.now(),
                                                         metrics=outcome.done.get("metrics", {}), pid=None, heartbeat_at=None)
                _on_success(run)
    except Exception as exc:  # noqa: BLE001 (the page says why; Retry runs it again)
        why = timelimits.stopped_reason(exc) if isinstance(exc, timelimits.SoftTimeLimitExceeded) else str(exc)
        EvalRun.objects.filter(pk=run.pk).update(status=EvalRunStatus.FAILED, error=outbound.redact(why)[:4000],
                                                 finished_at=timezone.now(), pid=None, heartbeat_at=None)
    run.refresh_from_db()
    return run


def _on_success(run: EvalRun) -> None:
    """What a run's purpose does with its results, in the transaction that stores them."""
    from flywheel.evals import regression

    if run.purpose == regression.PURPOSE:
        regression.regression_build_finish(run=run)


def eval_run_cancel(*, run: EvalRun) -> EvalRun:
    """Stop a run: a queued one at once, a running one by killing its trainer at the worker's next beat."""
    return runs.run_cancel(run)


def eval_run_retry(*, run: EvalRun) -> EvalRun:
    """Queue a failed or cancelled run again; it starts over (results are stored only when a run completes).
    Refused, like a new run, when the project has as many waiting or running as its limit."""
    with transaction.atomic():
        project_lock(project=run.project)
        _limit_check(run.project)
        return runs.run_retry(run, task=gpu_queue.gpu_turn_task)


def eval_run_reap() -> int:
    """Fail running runs whose heartbeat stopped: their worker vanished. Retry runs them again."""
    return len(runs.run_reap(EvalRun)[0])


def eval_sweep() -> int:
    """The outbox sweep: reap runs whose worker vanished, and send again runs still queued after the requeue
    delay."""
    return eval_run_reap() + runs.run_requeue(EvalRun, task=gpu_queue.gpu_turn_task)


# What the `gpu` queue's turns run of this app (flywheel.gpu_queue.KINDS).
GPU_WORK = (
    gpu_queue.GpuWork(name="eval run", model=EvalRun, waiting=Q(status=EvalRunStatus.QUEUED, cancel_requested=False),
                      claim=lambda pk: runs.run_claim(EvalRun, pk), run=lambda pk: eval_run_claimed(run_id=pk)),
)


def eval_compare(*, a: EvalRun, b: EvalRun) -> dict[str, Any]:
    """Two runs on the same suite version: per-case differences and the gate's paired test on per-case pass
    rates (the sign-flip test, which is exact McNemar when each case has one sample), each way. Success is the
    mean of per-case pass rates, the figure the gate and the job page show."""
    from flywheel.registry.gate import sign_flip_pvalue

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
    diffs = [r["b"].pass_rate - r["a"].pass_rate for r in rows if r["a"] and r["b"]]
    return {
        "rows": rows, "fixed": fixed, "broken": broken,
        "p_b_better": sign_flip_pvalue(diffs), "p_a_better": sign_flip_pvalue([-d for d in diffs]),
        "a_success": sum(r.pass_rate for r in left.values()) / max(1, len(left)),
        "b_success": sum(r.pass_rate for r in right.values()) / max(1, len(right)),
    }
