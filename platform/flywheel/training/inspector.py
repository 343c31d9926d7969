"""The checkpoint inspector: a checkpoint's holdout outputs beside production's on the same prompts, and the
signs of reward hacking the field warns about, read from the job's events:
- train reward rising while holdout success falls (the reward pays for something else);
- completion length growing (verbosity bought with reward);
- invalid outputs (format) above production's;
- unsafe actions above production's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flywheel.evals.runs import case_output
from flywheel.training.models import JobEvent, TrainingJob
from trainer import jobdir


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if isinstance(v, int | float)]
    return sum(values) / len(values) if values else None


def hacking_flags(*, steps: list[dict[str, Any]], evals: dict[int, dict[str, Any]], baseline: dict[str, Any] | None,
                  at_step: int, window: int = 3) -> list[dict[str, str]]:
    """The warnings for a checkpoint at `at_step`. `steps`: step events' data in order (with "step");
    `evals`: holdout metrics by step; `baseline`: production's holdout metrics (None when unmeasured)."""
    flags = []
    upto = [s for s in steps if s.get("step", 0) <= at_step]
    first, last = upto[:window], upto[-window:]
    reward_first = _mean([s.get("reward_mean") for s in first])
    reward_last = _mean([s.get("reward_mean") for s in last])
    here = evals.get(at_step) or {}
    reference = baseline or (evals[min(evals)] if evals else None)
    if reward_first is not None and reward_last is not None and reference and "success_rate" in here:
        if reward_last - reward_first > 0.05 and here["success_rate"] < reference.get("success_rate", 0):
            flags.append({"kind": "reward_vs_holdout", "message": (
                f"Train reward rose {reward_first:.3f} → {reward_last:.3f} while holdout success fell "
                f"{reference['success_rate']:.3f} → {here['success_rate']:.3f}: the reward may pay for something "
                "other than success.")})
    length_first = _mean([s.get("completion_length") for s in first])
    length_last = _mean([s.get("completion_length") for s in last])
    if length_first and length_last and len(upto) > window and length_last > 1.5 * length_first:
        flags.append({"kind": "length", "message": (
            f"Completions grew from {length_first:.1f} to {length_last:.1f} tokens on average.")})
    for key, label in (("invalid_output_rate", "Invalid outputs"), ("unsafe_action_rate", "Unsafe actions")):
        if reference and key in here and here[key] > reference.get(key, 0):
            flags.append({"kind": key, "message": (
                f"{label}: {here[key]:.3f} against production's {reference.get(key, 0):.3f}.")})
    return flags


def _cases(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    return {str(case["id"]): case for case in jobdir.read_cases(path)}


def checkpoint_view(*, job: TrainingJob, step: int, folder: Path) -> dict[str, Any]:
    steps = [dict(e.data, step=e.step) for e in JobEvent.objects.filter(job=job, kind="step").order_by("id")]
    evals = {e.step: (e.data.get("metrics") or {}) for e in JobEvent.objects.filter(job=job, kind="eval")
             .order_by("id") if e.step is not None and e.data.get("split", "holdout") == "holdout"}
    baseline = (job.advice or {}).get("metrics")
    production = _cases(jobdir.production_results(folder, "holdout"))
    candidate = _cases(jobdir.eval_results(folder, "holdout", step))
    rows = []
    for case_id in sorted(set(production) | set(candidate)):
        p, c = production.get(case_id), candidate.get(case_id)
        rows.append({
            "id": case_id,
            "production_pass": p.get("pass_rate") if p else None,
            "checkpoint_pass": c.get("pass_rate") if c else None,
            "production_output": case_output(p),
            "checkpoint_output": case_output(c),
            "changed": bool(p and c and bool(p.get("passed")) != bool(c.get("passed"))),
        })
    return {
        "metrics": evals.get(step, {}),
        "baseline": baseline,
        "flags": hacking_flags(steps=steps, evals=evals, baseline=baseline, at_step=step),
        "cases": rows,
    }
