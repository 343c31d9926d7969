"""The task-set endpoints of the JSON API: the operations eval suites share (flywheel.api.collections), plus
synthetic variants of a task, and the project's environment servers."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from django.http import HttpRequest
from ninja import Field, Schema, Status
from ninja.errors import HttpError

from flywheel.api import ObjectIn
from flywheel.api.auth import read_auth, review_auth, train_auth
from flywheel.api.collections import ItemOut, collection_router, item_out
from flywheel.api.errors import ERRORS
from flywheel.api.ids import Id
from flywheel.api.text import NON_BLANK, Text
from flywheel.environments.models import EnvironmentServer, Task, TaskSet
from flywheel.environments.services import environment_server_register
from flywheel.environments.variants import task_variants_create

router = collection_router(model=TaskSet, prefix="task-sets", tag="task-sets", id_name="task_set_id")


class VariantsIn(ObjectIn):
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
def task_variants(request: HttpRequest, task_set_id: Id, task_id: Id, body: VariantsIn) -> dict[str, Any]:
    task = Task.objects.filter(task_set__project=request.auth.project, task_set_id=task_set_id, pk=task_id).first()
    if task is None:
        raise HttpError(404, f"No task {task_id} in task set {task_set_id} of project '{request.auth.project.slug}'.")
    result = task_variants_create(task=task, user=request.auth.created_by, kinds=tuple(body.kinds))
    return {"saved": [item_out(t) for t in result.saved],
            "skipped": [{"what": what, "why": why} for what, why in result.skipped],
            "version": result.version.number if result.version else None}


class EnvironmentServerIn(Schema):
    name: Text = Field(min_length=1, max_length=120, pattern=NON_BLANK, description="unique in the project")
    url: Text = Field(min_length=1, max_length=500, description="under a prefix FLYWHEEL_ENV_URL_ALLOWLIST lists")
    description: Text = Field(default="", max_length=2000)


class EnvironmentServerOut(Schema):
    id: int
    name: str
    url: str
    description: str
    checked_at: datetime | None = Field(description="the last time it answered /reset")
    created_at: datetime


def _server_out(server: EnvironmentServer) -> dict[str, Any]:
    return {"id": server.pk, "name": server.name, "url": server.url, "description": server.description,
            "checked_at": server.checked_at, "created_at": server.created_at}


@router.get("/environment-servers", auth=read_auth, response={200: list[EnvironmentServerOut], **ERRORS},
            summary="List the project's environment servers", operation_id="environment-servers_list")
def environment_servers_list(request: HttpRequest) -> list[dict[str, Any]]:
    return [_server_out(s) for s in EnvironmentServer.objects.filter(project=request.auth.project)]


@router.post(
    "/environment-servers", auth=train_auth, response={201: EnvironmentServerOut, **ERRORS},
    summary="Register an environment server",
    description="A team's own environment server (the trainer's `http` environment; scope `train`, as the page asks "
                "a maintainer), at a URL the operator allows "
                "(FLYWHEEL_ENV_URL_ALLOWLIST, and the outbound allowlist for a private address). It is saved only "
                "once it answered `POST /reset`; 422 names the field otherwise. A task set made with its id as "
                "`server` runs its tasks there.",
    operation_id="environment-servers_register",
)
def environment_servers_register(request: HttpRequest, body: EnvironmentServerIn) -> Status:
    server = environment_server_register(project=request.auth.project, name=body.name, url=body.url,
                                         description=body.description, user=request.auth.created_by)
    return Status(201, _server_out(server))
