"""The task-set endpoints of the JSON API: the operations eval suites share (flywheel.api.collections), plus
synthetic variants of a task."""

from __future__ import annotations

from typing import Any, Literal

from django.http import HttpRequest
from ninja import Field, Schema
from ninja.errors import HttpError

from flywheel.api.auth import review_auth
from flywheel.api.collections import ItemOut, item_out, register
from flywheel.api.errors import ERRORS
from flywheel.environments.models import Task, TaskSet
from flywheel.environments.variants import task_variants_create

router = register(model=TaskSet, prefix="task-sets", tag="task-sets", id_name="task_set_id")


class VariantsIn(Schema):
    kinds: list[Literal["argument", "rephrase"]] = Field(default=["argument", "rephrase"], max_length=2)


class VariantsOut(Schema):
    saved: list[ItemOut]
    skipped: list[dict[str, str]] = Field(description="[{what, why}] for each variant not kept")
    version: int | None = Field(description="the task set's new version (its number), when any variant was kept")


@router.post(
    "/task-sets/{task_set_id}/tasks/{task_id}/variants", auth=review_auth,
    response={200: VariantsOut, **ERRORS},
    summary="Make synthetic variants of a task",
    description="Argument values the project's trajectories passed to the same tool and argument, and "
                "rephrased requests; each kept only if its verifier passes its reference and the leakage "
                "guard lets it in.",
    operation_id="task-sets_variants",
)
def task_variants(request: HttpRequest, task_set_id: int, task_id: int, body: VariantsIn) -> dict[str, Any]:
    task = Task.objects.filter(task_set__project=request.auth.project, task_set_id=task_set_id, pk=task_id).first()
    if task is None:
        raise HttpError(404, f"No task {task_id} in task set {task_set_id} of project '{request.auth.project.slug}'.")
    result = task_variants_create(task=task, user=request.auth.created_by, kinds=tuple(body.kinds))
    return {"saved": [item_out(t) for t in result.saved],
            "skipped": [{"what": what, "why": why} for what, why in result.skipped],
            "version": result.version.number if result.version else None}
