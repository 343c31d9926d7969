"""What a job ran with, and two or more jobs side by side.

`job_settings` is the job page's "Settings" panel: the algorithm, every GRPOConfig field resolved (the stored
config, read as the trainer reads it: a new job stored every field, an older one only those it set), the
task-set and suite versions, and the gate's rules the job was judged by. `compare_jobs` puts several jobs'
settings in rows (differences marked), their holdout curves, and their gate outcomes, as JSON-ready data for the
comparison page and the API. Both read a fixed number of queries whatever the number of jobs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from django.core.exceptions import ValidationError

from flywheel.accounts.models import Project
from flywheel.training.models import JobEvent, TrainingJob

# Fields whose None means "worked out from other fields": what the trainer will use, from its own properties.
_RESOLVED = {
    "epsilon_high": lambda c, algorithm: c.clip_high,
    "lr_scheduler_type": lambda c, algorithm: c.scheduler_name(algorithm),
    "dynamic_sampling": lambda c, algorithm: c.use_dynamic_sampling,
    "mask_truncated_completions": lambda c, algorithm: c.use_overlong_filter,
    "greater_is_better": lambda c, algorithm: c.best_metric_higher,
}
MAX_COMPARED = 20


def _versions(job: TrainingJob) -> list[dict[str, Any]]:
    """The frozen data the job trained and was measured on, as setting rows."""
    def label(version) -> str | None:
        return None if version is None else f"{version} · {version.size} rows · {version.content_hash[:12]}"

    def named(version, collection: str) -> dict[str, Any]:
        # The API's one convention for versioned things: the collection's id and the version's number.
        if version is None:
            return {collection: None, f"{collection}_version": None}
        owner_id = version.task_set_id if collection == "task_set" else version.suite_id
        return {collection: owner_id, f"{collection}_version": version.number}

    return [
        {"name": "task_set_version", "label": "Task set", "value": label(job.task_set_version),
         **named(job.task_set_version, "task_set")},
        {"name": "holdout_version", "label": "Holdout", "value": label(job.holdout_version),
         **named(job.holdout_version, "holdout")},
        {"name": "regression_version", "label": "Regression suite", "value": label(job.regression_version),
         **named(job.regression_version, "regression")},
        {"name": "base_version", "label": "Starts from", "value": f"v{job.base_version.number} · {job.base_version.base.name}",
         "model_version": job.base_version.number},
    ]


def _plain(value: Any) -> Any:
    """A value as JSON writes it (tuples as lists, NaN and infinities as text)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def resolved_config(*, algorithm: str, config: dict[str, Any]) -> list[dict[str, Any]]:
    """Every GRPOConfig field, in the dataclass's order: its value for this job (the stored config read through
    `trainer.config.resolve_config`, which a job made now stored whole and an older one in part), the default
    it would have had (the algorithm's own where it has one), whether the value is that default, the value the
    trainer works out for a field left at None, and the field's help. A stored key the trainer no longer knows
    is listed last."""
    from trainer.config import ALGORITHM_DEFAULTS, GRPOConfig, SpecError, resolve_config

    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    algorithm_defaults = ALGORITHM_DEFAULTS.get(algorithm, {})
    stored = {k: v for k, v in (config or {}).items() if k in known}
    try:
        resolved: GRPOConfig | None = resolve_config(stored, algorithm)
    except SpecError:
        resolved = None  # a config an older trainer took: show the stored values as they are
    base = GRPOConfig()
    rows = []
    for f in dataclasses.fields(GRPOConfig):
        default = algorithm_defaults.get(f.name, getattr(base, f.name))
        value = getattr(resolved, f.name) if resolved is not None else stored.get(f.name, default)
        row = {"name": f.name, "value": _plain(value), "default": _plain(default),
               "is_default": _plain(value) == _plain(default), "help": f.metadata.get("help", "")}
        if value is None and resolved is not None and f.name in _RESOLVED:
            row["resolved"] = _plain(_RESOLVED[f.name](resolved, algorithm))
        rows.append(row)
    for name in sorted(set(config or {}) - known):
        rows.append({"name": name, "value": _plain(config[name]), "default": None, "is_default": False,
                     "help": "Not a field of this trainer's GRPOConfig: ignored."})
    return rows


def gate_rules_rows(rules: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each GateRules field with its value, its default and whether it is the default."""
    from flywheel.registry.gate import GateRules

    judged = GateRules.from_dict(rules)
    base = GateRules()
    return [{"name": f.name, "value": _plain(getattr(judged, f.name)), "default": _plain(getattr(base, f.name)),
             "is_default": getattr(judged, f.name) == getattr(base, f.name)}
            for f in dataclasses.fields(GateRules)]


def _decision_out(decision) -> dict[str, Any] | None:
    if decision is None:
        return None
    report = decision.report or {}
    success = next((r for r in report.get("rules", []) if "success" in str(r.get("name", ""))), None)
    return {
        "id": decision.pk, "passed": decision.passed, "decided_at": decision.decided_at.isoformat(),
        "error": decision.error, "candidate": decision.candidate.number, "production": decision.production.number,
        "cases": report.get("cases"), "samples": report.get("samples"),
        "production_success": success.get("production") if success else None,
        "candidate_success": success.get("candidate") if success else None,
        "rules": [{"name": r.get("name"), "production": _plain(r.get("production")),
                   "candidate": _plain(r.get("candidate")), "passed": r.get("passed"), "detail": r.get("detail", "")}
                  for r in report.get("rules", [])],
    }


def _decisions(jobs: Sequence[TrainingJob]) -> dict[int, Any]:
    """Each job's latest gate decision, in one query."""
    from flywheel.registry.models import GateDecision

    latest: dict[int, Any] = {}
    for decision in (GateDecision.objects.filter(job__in=[j.pk for j in jobs])
                     .select_related("candidate", "production").order_by("-decided_at", "-id")):
        latest.setdefault(decision.job_id, decision)
    return latest


def job_settings(*, job: TrainingJob, decision=None, project_rules: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the job ran with. `decision`: its gate decision (its rules are the ones it was judged by); without
    one, `project_rules` (the project's rules now, which will judge it) or the defaults."""
    judged = decision is not None
    config = resolved_config(algorithm=job.algorithm, config=job.config)
    return {
        "algorithm": job.algorithm,
        "algorithm_label": job.get_algorithm_display(),
        "num_gpus": job.num_gpus,
        "versions": _versions(job),
        "config": config,
        "set_count": sum(not row["is_default"] for row in config),
        "default_count": sum(row["is_default"] for row in config),
        "gate_rules": gate_rules_rows(decision.rules if judged else project_rules),
        "gate_rules_judged": judged,
        "stages": job_stages(job),
    }


def job_stages(job: TrainingJob) -> list[dict[str, Any]]:
    """The stages of a job that has several (sft_grpo: SFT, then GRPO), as the trainer announced them in its
    latest attempt; planned from the config while it has not started. Empty for a one-stage algorithm."""
    if job.algorithm != "sft_grpo":
        return []
    announced = {
        e["stage"]: e for e in JobEvent.objects.filter(job=job, attempt=job.attempt, kind="stage")
        .order_by("id").values_list("data", flat=True) if isinstance(e, dict) and "stage" in e
    }
    config = {row["name"]: row["value"] for row in resolved_config(algorithm=job.algorithm, config=job.config)}
    sft_last, last = int(config["sft_steps"]), int(config["max_steps"])
    planned = [("sft", "SFT on the references", 1, sft_last), ("grpo", "GRPO", sft_last + 1, last)]
    return [{"stage": name, "label": label, "first_step": first, "last_step": end,
             "examples": (announced.get(name) or {}).get("examples"), "started": name in announced}
            for name, label, first, end in planned]


def jobs_queryset(project: Project):
    return TrainingJob.objects.filter(project=project).select_related(
        "task_set_version__task_set", "holdout_version__suite", "regression_version__suite", "base_version__base",
        "candidate_version")


def _holdout_curves(jobs: Sequence[TrainingJob]) -> dict[int, dict[str, list]]:
    """Each job's holdout success by step, from its eval events, in one query."""
    curves: dict[int, dict[str, list]] = {j.pk: {"step": [], "success_rate": []} for j in jobs}
    events = (JobEvent.objects.filter(job__in=list(curves), kind="eval", step__isnull=False)
              .order_by("job_id", "id").values_list("job_id", "step", "data"))
    for job_id, step, data in events:
        if (data or {}).get("split", "holdout") != "holdout" or "case" in (data or {}):
            continue
        curves[job_id]["step"].append(step)
        curves[job_id]["success_rate"].append((data.get("metrics") or {}).get("success_rate"))
    return curves


def _rows_side_by_side(per_job: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rows named alike across jobs joined into one row with a value per job; `differs` when they are not
    all equal."""
    order: list[str] = []
    by_name: dict[str, list] = {}
    for i, rows in enumerate(per_job):
        for row in rows:
            if row["name"] not in by_name:
                order.append(row["name"])
                by_name[row["name"]] = [None] * len(per_job)
            by_name[row["name"]][i] = row
    out = []
    for name in order:
        cells = by_name[name]
        values = [c["value"] if c else None for c in cells]
        first = next(c for c in cells if c)
        out.append({
            "name": name, "label": first.get("label", name), "help": first.get("help", ""),
            "values": values, "defaults": [bool(c and c.get("is_default")) for c in cells],
            "resolved": [c.get("resolved") if c else None for c in cells],
            "differs": any(v != values[0] for v in values[1:]),
        })
    return out


def _outcomes_side_by_side(gates: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """The gate's rules as rows, each job's outcome of the rule in its column (None: not judged by it)."""
    names: list[str] = []
    for gate in gates:
        for rule in (gate or {}).get("rules", []):
            if rule["name"] not in names:
                names.append(rule["name"])
    return [{"name": name, "cells": [next((r for r in (g or {}).get("rules", []) if r["name"] == name), None)
                                     for g in gates]}
            for name in names]


def compare_jobs(*, project: Project, jobs: list[TrainingJob]) -> dict[str, Any]:
    """Two or more jobs of `project` side by side: settings (a row per setting, a value per job, `differs`
    where they are not all the same), holdout curves (one series per job, production's success before training
    as its baseline), and gate outcomes (passed or refused, each rule, the holdout figures). JSON-ready.

    A job of another project, fewer than two jobs, more than MAX_COMPARED or one named twice is a
    ValidationError on `ids`."""
    ids = [job.pk for job in jobs]
    if len(ids) < 2:
        raise ValidationError({"ids": "Choose two or more jobs to compare."})
    if len(ids) > MAX_COMPARED:
        raise ValidationError({"ids": f"Compare at most {MAX_COMPARED} jobs at a time."})
    if len(set(ids)) != len(ids):
        raise ValidationError({"ids": "A job is named twice."})
    found = {job.pk: job for job in jobs_queryset(project).filter(pk__in=ids)}
    missing = [pk for pk in ids if pk not in found]
    if missing:
        raise ValidationError({"ids": f"No job {', '.join(map(str, missing))} in this project."})
    ordered = [found[pk] for pk in ids]
    decisions = _decisions(ordered)
    rules_now = None
    if any(job.pk not in decisions for job in ordered):
        from flywheel.registry.gate_runs import rules_for

        rules_now = rules_for(project).__dict__
    settings = [job_settings(job=job, decision=decisions.get(job.pk), project_rules=rules_now) for job in ordered]
    curves = _holdout_curves(ordered)
    gates = [_decision_out(decisions.get(job.pk)) for job in ordered]
    head = [[{"name": "algorithm", "label": "Algorithm", "value": s["algorithm"], "is_default": s["algorithm"] == "grpo"},
             {"name": "num_gpus", "label": "GPUs", "value": s["num_gpus"], "is_default": s["num_gpus"] == 1},
             *s["versions"]] for s in settings]
    return {
        "project": project.slug,
        "jobs": [{
            "id": job.pk, "status": job.status, "status_label": job.get_status_display(), "algorithm": job.algorithm,
            "step": job.step, "max_steps": job.max_steps,
            "created_at": job.created_at.isoformat() if job.created_at else None,
            "finished_at": job.finished_at.isoformat() if job.finished_at else None,
            "base_version": job.base_version.number,
            "candidate_version": job.candidate_version.number if job.candidate_version else None,
        } for job in ordered],
        "data": _rows_side_by_side(head),
        "settings": _rows_side_by_side([s["config"] for s in settings]),
        "gate_rules": _rows_side_by_side([s["gate_rules"] for s in settings]),
        "gate_rules_judged": [s["gate_rules_judged"] for s in settings],
        "curves": [{"job": job.pk, **curves[job.pk],
                    "production_success": (job.advice or {}).get("metrics", {}).get("success_rate")}
                   for job in ordered],
        "gates": gates,
        "gate_outcomes": _outcomes_side_by_side(gates),
    }
