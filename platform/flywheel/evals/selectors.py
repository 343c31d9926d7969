"""Reads of eval suites and task sets (the same queries serve both): lists with sizes, one collection with
its rows and versions, one version, and what the promotion form offers as targets."""

from __future__ import annotations

from typing import Any

from django.db.models import Count, Max, QuerySet

from flywheel.accounts.models import Project
from flywheel.evals.models import EvalSuite


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
    from flywheel.environments.models import TaskSet

    return {"suites": list(EvalSuite.objects.filter(project=project).order_by("name")),
            "task_sets": list(TaskSet.objects.filter(project=project).order_by("name"))}
