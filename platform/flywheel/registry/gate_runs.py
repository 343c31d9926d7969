"""Running the gate for a training job: read both models' per-case results from the job directory, judge them
with `gate.gate_evaluate`, and store the decision with its report.

Production's results come from the measurement before training (`production-holdout.jsonl`,
`production-regression.jsonl`). The candidate's come from the worker's measurement of the best checkpoint on
fresh samples (`gate/holdout.jsonl`, `gate/regression.jsonl`) when the trainer picked it among several holdout
evaluations, and otherwise from the trainer's single evaluation of it (`evals/holdout-step-N.jsonl`,
`evals/regression-step-N.jsonl`). Same cases, same sampling settings. The latency rule reads both models'
per-case timings from `gate/latency.jsonl` (`python -m trainer latency`), or why there are none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flywheel.registry.gate import (
    CaseResult,
    GateRules,
    LatencyCase,
    gate_evaluate,
    power_of,
    regression_power,
)
from flywheel.registry.models import GateDecision, RegistrySettings
from trainer import jobdir


def read_results(path: Path) -> list[CaseResult]:
    """A model's per-case results as the trainer's evaluate wrote them (`--out`)."""
    return [CaseResult.from_eval_case(case) for case in jobdir.read_cases(path)]


def candidate_results(folder: Path, split: str, best_step: int) -> Path:
    """The file of the candidate's per-case results the gate judges for `split` (see the module's text)."""
    fresh = jobdir.gate_results(folder, split)
    return fresh if fresh.exists() else jobdir.eval_results(folder, split, best_step)


def read_latency(folder: Path) -> tuple[list[LatencyCase], str]:
    """Both models' per-case timings from the worker's latency probe, or (nothing, why not)."""
    from trainer.config import read_jsonl

    path = jobdir.gate_dir(folder) / jobdir.LATENCY_RESULTS
    if not path.exists():
        why = jobdir.gate_dir(folder) / jobdir.LATENCY_NOT_MEASURED
        return [], why.read_text()[:500] if why.exists() else ""
    try:
        return [LatencyCase.from_row(row) for row in read_jsonl(path)], ""
    except (ValueError, TypeError, AttributeError) as exc:
        return [], f"{path.name} could not be read: {exc}"


def rules_for(project) -> GateRules:
    config = RegistrySettings.objects.filter(project=project).first()
    return GateRules.from_dict(config.gate_rules if config else None)


def gate_decide_for_job(*, job, folder: Path) -> GateDecision:
    """Judge a training job's candidate from its job directory `folder` (the training app knows where that
    is) and store the decision."""
    rules = rules_for(job.project)
    best = int((job.result or {}).get("best_step") or 0)
    report: dict[str, Any] = {}
    error = ""
    passed = False
    try:
        if job.holdout_version is None:
            raise FileNotFoundError("The job had no holdout suite: the gate cannot judge a candidate without one.")
        production = read_results(jobdir.production_results(folder, "holdout"))
        holdout_file = candidate_results(folder, "holdout", best)
        candidate = read_results(holdout_file)
        prod_reg: list[CaseResult] = []
        cand_reg: list[CaseResult] = []
        if job.regression_version is not None:
            prod_reg = read_results(jobdir.production_results(folder, "regression"))
            cand_reg = read_results(candidate_results(folder, "regression", best))
        looks = jobdir.holdout_looks(folder)
        latency, latency_why = read_latency(folder)
        outcome = gate_evaluate(production=production, candidate=candidate, production_regression=prod_reg,
                                candidate_regression=cand_reg, rules=rules, looks=max(1, len(looks)),
                                latency=latency, latency_not_measured=latency_why)
        report, passed = outcome.to_dict(), outcome.passed
        report["power"] = power_of(production, rules)
        if prod_reg:
            report["regression_power"] = regression_power(prod_reg, rules, refusing=len(outcome.refusing))
        fresh = holdout_file == jobdir.gate_results(folder, "holdout")
        report["measurement"] = {"step": best, "looks": looks, "fresh": fresh,
                                 "seed": jobdir.FRESH_SEED if fresh else None}
    except (OSError, ValueError, KeyError) as exc:
        error = f"The gate could not judge: {exc}"
    return GateDecision.objects.create(
        project=job.project, job=job, candidate=job.candidate_version, production=job.base_version,
        passed=passed, rules=rules.__dict__, report=report, error=error,
    )
