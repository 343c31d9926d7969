"""Reads of eval suites and task sets (the same queries serve both): lists with sizes, one collection with
its rows and versions, one version, what the promotion form offers as targets, and what a holdout version
can show."""

from __future__ import annotations

from typing import Any

from django.db.models import Count, Max, QuerySet

from flywheel.accounts.models import Project
from flywheel.evals.kinds import train_side
from flywheel.evals.models import EvalSuite
from flywheel.evals.run_models import EvalCaseResult, EvalRun, EvalRunStatus
from flywheel.registry.gate import power_report
from flywheel.registry.gate_runs import rules_for
from flywheel.registry.selectors import production_of


def collection_list(*, project: Project, model: type = EvalSuite) -> QuerySet:
    """The project's suites (or task sets) with `n_items` and `last_version` annotated."""
    items = "cases" if model is EvalSuite else "tasks"
    return (model.objects.filter(project=project)
            .annotate(n_items=Count(items, distinct=True), last_version=Max("versions__number"))
            .order_by("name", "id"))


def collection_get(*, project: Project, model: type, pk: int) -> Any:
    return model.objects.filter(project=project, pk=pk).first()


def collection_items(*, collection: Any) -> QuerySet:
    return collection.items.select_related("trajectory", "failure_mode").order_by("pk")


def collection_versions(*, collection: Any) -> QuerySet:
    # A list of versions never needs their rows.
    return collection.versions.defer("row_digests").select_related("created_by", "frozen_by").order_by("-number")


def version_get(*, collection: Any, number: int) -> Any:
    return collection.versions.select_related("created_by", "frozen_by").filter(number=number).first()


def promotion_targets(*, project: Project) -> dict[str, list[Any]]:
    return {"suites": list(EvalSuite.objects.filter(project=project).order_by("name")),
            "task_sets": list(train_side().collection.objects.filter(project=project).order_by("name"))}


def holdout_power(*, project: Project, suite_version, samples: int | None = None) -> dict:
    """What a holdout version can show before anyone trains (`gate.power_report`), from production's latest
    measurement on it (an eval run, or a job's measurement before training): its per-case pass rates. With
    `samples`, the figures for that many samples a case instead of the run's."""
    run = None
    production = production_of(project=project)
    if production is not None:
        run = (EvalRun.objects.filter(project=project, model_version=production, suite_version=suite_version,
                                      status=EvalRunStatus.SUCCEEDED).order_by("-finished_at", "-id").first())
    rates = list(EvalCaseResult.objects.filter(run=run).values_list("pass_rate", flat=True)) if run else []
    report = power_report(rates, cases=len(rates) or suite_version.size, samples=samples or (run.samples if run else 1),
                          rules=rules_for(project))
    report["measured_by"] = run.pk if run else None
    report["production"] = production.number if production else None
    return report
