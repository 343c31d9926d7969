"""Running the gate for a training job: read both models' per-case results from the job directory, judge them
with `gate.gate_evaluate`, and store the decision with its report.

Production's results come from the measurement before training (`production-holdout.jsonl`,
`production-regression.jsonl`); the candidate's from the trainer's evals of its best checkpoint
(`evals/holdout-step-N.jsonl`, `evals/regression-step-N.jsonl`). Same cases, same sampling settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flywheel.registry.gate import CaseResult, GateRules, gate_evaluate
from flywheel.registry.models import GateDecision, RegistrySettings


def _cases(path: Path, *, rates: bool) -> list[CaseResult]:
    from flywheel.evals.runs import read_cases

    results = []
    for case in read_cases(path):
        samples = case.get("samples") or []
        n = max(1, len(samples))
        results.append(CaseResult(
            case_id=str(case["id"]),
            success=float(case["pass_rate"]) if rates else float(bool(case["passed"])),
            invalid=sum(s.get("failure") == "invalid_format" for s in samples) / n,
            unsafe=sum(s.get("failure") == "unsafe_action" for s in samples) / n,
            latency_ms=case.get("latency_ms"),
            tokens=case.get("mean_completion_tokens"),
        ))
    return results


def rules_for(project) -> GateRules:
    config = RegistrySettings.objects.filter(project=project).first()
    return GateRules(**(config.gate_rules if config and config.gate_rules else {}))


def gate_decide_for_job(*, job) -> GateDecision:
    from flywheel.training.services import job_dir

    rules = rules_for(job.project)
    folder = job_dir(job)
    best = (job.result or {}).get("best_step")
    rates = rules.test == "bootstrap"
    report: dict[str, Any] = {}
    error = ""
    passed = False
    try:
        if job.holdout_version is None:
            raise FileNotFoundError("The job had no holdout suite: the gate cannot judge a candidate without one.")
        production = _cases(folder / "production-holdout.jsonl", rates=rates)
        candidate = _cases(folder / "evals" / f"holdout-step-{int(best or 0):06d}.jsonl", rates=rates)
        prod_reg: list[CaseResult] = []
        cand_reg: list[CaseResult] = []
        if job.regression_version is not None:
            prod_reg = _cases(folder / "production-regression.jsonl", rates=False)
            cand_reg = _cases(folder / "evals" / f"regression-step-{int(best or 0):06d}.jsonl", rates=False)
        outcome = gate_evaluate(production=production, candidate=candidate, production_regression=prod_reg,
                                candidate_regression=cand_reg, rules=rules)
        report, passed = outcome.to_dict(), outcome.passed
    except (OSError, ValueError, KeyError) as exc:
        error = f"The gate could not judge: {exc}"
    return GateDecision.objects.create(
        project=job.project, job=job, candidate=job.candidate_version, production=job.base_version,
        passed=passed, rules=rules.__dict__, report=report, error=error,
    )
