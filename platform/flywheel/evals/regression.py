"""A regression suite built from production's reliable passes.

A case belongs in a regression suite only if production passes it reliably: production is measured on the
suite's cases with k samples each (an eval run on a GPU worker, default 16), and a case is kept only when the
one-sided 95% Wilson lower bound of its pass rate is at least 0.8 (`gate.reliable_pass`). At 95% that needs
at least 11 samples even for a case passed every time (8 of 8 gives 0.747), hence 16 by default: 16 of 16
is kept (0.855), 15 of 16 is not (0.74). The suite's new version holds the kept cases; the run's page shows
every case's measured rate, and the version's note says what was kept and why.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from flywheel.evals.models import EvalSuite, SuiteKind
from flywheel.evals.run_models import EvalRun
from flywheel.registry.gate import reliable_pass

PURPOSE = "regression_build"
DEFAULT_SAMPLES = 16
DEFAULT_MIN_RATE = 0.8
CONFIDENCE = 0.95


def reliable_cases(cases: list[dict[str, Any]], *, samples: int, min_rate: float = DEFAULT_MIN_RATE,
                   confidence: float = CONFIDENCE) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """The ids of the cases production passes reliably, and every case's measurement (passes, n, rate,
    lower bound, kept). `cases` are per-case results (`id`, `pass_rate`, and `passes`/`n` where known)."""
    kept: list[str] = []
    measured: dict[str, dict[str, Any]] = {}
    for case in cases:
        n = int(case.get("n") or samples)
        passes = case.get("passes")
        passes = int(round(float(case.get("pass_rate", 0.0)) * n)) if passes is None else int(passes)
        ok, lower = reliable_pass(passes, n, min_rate=min_rate, confidence=confidence)
        case_id = str(case["id"])
        measured[case_id] = {"passes": passes, "n": n, "rate": round(passes / n, 4), "lower": round(lower, 4),
                             "kept": ok}
        if ok:
            kept.append(case_id)
    return kept, measured


def regression_build_start(*, project, suite: EvalSuite, samples: int = DEFAULT_SAMPLES,
                           min_rate: float = DEFAULT_MIN_RATE, user=None) -> EvalRun:
    """Queue production's measurement on the suite's newest version; when it succeeds the suite gets a new
    version of the cases production passes reliably (`regression_build_finish`)."""
    from flywheel.evals.runs import eval_run_create
    from flywheel.registry.selectors import production_of

    if suite.project_id != project.pk:
        raise ValidationError({"suite": "That suite belongs to another project."})
    if suite.kind != SuiteKind.REGRESSION:
        raise ValidationError({"suite": "Only a regression suite is built from production's passes."})
    production = production_of(project=project)
    if production is None:
        raise ValidationError({"suite": "Nothing is in production yet: register a model first."})
    version = suite.versions.order_by("-number").first()
    if version is None or not version.size:
        raise ValidationError({"suite": "The suite has no cases to measure: promote candidate cases into it first."})
    try:
        min_rate = float(min_rate)
    except (TypeError, ValueError):
        raise ValidationError({"min_rate": "A rate between 0.5 and 1."}) from None
    if not 0.5 <= min_rate <= 1:
        raise ValidationError({"min_rate": "A rate between 0.5 and 1."})
    if not reliable_pass(int(samples), int(samples), min_rate=min_rate, confidence=CONFIDENCE)[0]:
        raise ValidationError({"samples": f"{samples} samples cannot show a pass rate of at least {min_rate} at "
                                          f"95% even when every sample passes: take more."})
    return eval_run_create(project=project, model_version=production, suite_version=version, user=user,
                           samples=samples, purpose=PURPOSE,
                           options={"suite": suite.pk, "min_rate": min_rate, "confidence": CONFIDENCE})


def regression_build_finish(*, run: EvalRun) -> Any:
    """The suite's new version from a succeeded build run: its cases that production passed reliably.
    Called by the worker in the transaction that stores the run's results; idempotent."""
    from flywheel.evals.services import version_create

    if run.purpose != PURPOSE or run.options.get("version"):
        return None
    suite = EvalSuite.objects.get(pk=run.options["suite"], project=run.project)
    cases = [{"id": r.case_id, "pass_rate": r.pass_rate, "n": run.samples}
             for r in run.results.all()]
    kept, measured = reliable_cases(cases, samples=run.samples, min_rate=run.options.get("min_rate", DEFAULT_MIN_RATE),
                                    confidence=run.options.get("confidence", CONFIDENCE))
    with transaction.atomic():
        keep = set(kept)
        dropped = [item for item in suite.items.all() if item.row_id not in keep]
        for item in dropped:
            item.delete()
        version = version_create(
            collection=suite, user=run.created_by,
            note=(f"production v{run.model_version.number}'s reliable passes: {len(kept)} of {len(measured)} "
                  f"cases at {run.samples} samples (95% Wilson lower bound >= {run.options.get('min_rate')})"),
        )
        run.options = {**run.options, "version": version.number, "kept": len(kept), "measured": len(measured)}
        EvalRun.objects.filter(pk=run.pk).update(options=run.options)
    return version
