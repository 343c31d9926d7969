"""The clustering endpoints of the JSON API: start a run over a filter, read its status, progress and clusters,
and decide on a suggestion (accept, merge, split, dismiss) as the page does.

Keys, scopes and errors are the API's shared ones (flywheel.api): the key decides the project; reading
needs `read`, starting a run and deciding need `review`. A run or decision is recorded as the person who made
the key."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from django.core.exceptions import ValidationError
from django.http import HttpRequest
from ninja import Field, Router, Schema, Status
from ninja.errors import HttpError
from pydantic import StrictBool

from flywheel.api import ObjectIn
from flywheel.api.auth import read_auth, review_auth
from flywheel.api.errors import ERRORS as _ERRORS
from flywheel.api.ids import Id
from flywheel.api.text import Text
from flywheel.failures.clustering import services
from flywheel.failures.clustering.models import ClusteringRun, ClusterSuggestion
from flywheel.failures.models import FailureMode

router = Router(tags=["clustering"])


class ClusteringIn(ObjectIn):
    """Which failures to cluster. Defaults: failed, assigned to no mode, the last 30 days, the newest 100,000."""

    days: int = Field(30, ge=1, le=3650)
    limit: int = Field(services.MAX_FAILURES, ge=2, le=services.MAX_FAILURES)
    outcome: Literal["failure", "success", "unknown", ""] = "failure"
    unassigned: StrictBool = Field(True, description="Only failures assigned to no failure mode")
    agent: Text = Field("", max_length=200)
    signal: Text = Field("", max_length=32, description="Only failures with this triage signal kind")


class CreatedOut(Schema):
    id: int


class ClusterOut(Schema):
    id: int
    size: int
    label: str
    trajectory_ids: list[int]
    representative_ids: list[int] = Field(description="The five members nearest the cluster's centre")
    signals: dict[str, int] = Field(description="Signal kind -> members carrying it")
    terms: list[str]
    suggested_category: str
    target_mode_id: int | None = Field(description="Set: its members sit among this existing mode's")
    decision: Literal["pending", "accepted", "merged", "split", "dismissed"]
    failure_mode_id: int | None = Field(description="The mode it became or was merged into")


class ClusteringOut(Schema):
    id: int
    status: Literal["queued", "running", "done", "failed"]
    stage: str
    progress: int = Field(description="Percent, 0-100")
    total: int
    error: str
    filter: dict[str, Any]
    parent_id: int | None = Field(description="A split: the suggestion whose members this run clusters")
    created_at: datetime
    finished_at: datetime | None
    clusters: list[ClusterOut]


class DecisionIn(ObjectIn):
    action: Literal["accept", "merge", "split", "dismiss"]
    name: Text = Field("", max_length=200, description="accept: the new mode's name (default: the label)")
    category: Text = Field("", max_length=32, description="accept: a taxonomy key (default: the members' usual)")
    failure_mode_id: Id | None = Field(None, description="merge: the mode to merge into")


def _cluster(s: ClusterSuggestion) -> dict[str, Any]:
    return {
        "id": s.pk,
        "size": s.size,
        "label": s.label,
        "trajectory_ids": s.trajectory_ids,
        "representative_ids": s.representative_ids,
        "signals": s.signals,
        "terms": s.terms,
        "suggested_category": s.suggested_category,
        "target_mode_id": s.target_mode_id,
        "decision": s.decision,
        "failure_mode_id": s.failure_mode_id,
    }


def _run_out(run: ClusteringRun) -> dict[str, Any]:
    return {
        "id": run.pk,
        "status": run.status,
        "stage": run.stage,
        "progress": run.percent,
        "total": run.total,
        "error": run.error,
        "filter": run.filter,
        "parent_id": run.parent_id,
        "created_at": run.created_at,
        "finished_at": run.finished_at,
        "clusters": [_cluster(s) for s in run.suggestions.all()],
    }


@router.post("/clusterings", auth=review_auth, response={201: CreatedOut, **_ERRORS}, summary="Start a clustering run")
def clustering_create(request: HttpRequest, body: ClusteringIn) -> Status:
    try:
        run_filter = services.run_filter_parse(body.model_dump())
        run = services.clustering_run_start(project=request.auth.project, user=request.auth.created_by, run_filter=run_filter)
    except services.ClusteringRefused as exc:
        raise HttpError(409, str(exc)) from None
    return Status(201, {"id": run.pk})


@router.get("/clusterings/{clustering_id}", auth=read_auth, response={200: ClusteringOut, **_ERRORS}, summary="A clustering run")
def clustering_get(request: HttpRequest, clustering_id: Id) -> dict:
    run = ClusteringRun.objects.filter(project=request.auth.project, pk=clustering_id).first()
    if run is None:
        raise HttpError(404, f"No clustering run {clustering_id} in project '{request.auth.project.slug}'.")
    return _run_out(run)


@router.post(
    "/clusterings/suggestions/{suggestion_id}/decision",
    auth=review_auth,
    response={200: ClusterOut, **_ERRORS},
    summary="Decide on a suggestion",
)
def suggestion_decide(request: HttpRequest, suggestion_id: Id, body: DecisionIn) -> dict:
    project = request.auth.project
    suggestion = ClusterSuggestion.objects.filter(project=project, pk=suggestion_id).select_related("run", "target_mode").first()
    if suggestion is None:
        raise HttpError(404, f"No suggestion {suggestion_id} in project '{project.slug}'.")
    user = request.auth.created_by
    try:
        if body.action == "accept":
            services.suggestion_accept(suggestion=suggestion, user=user, name=body.name, category_key=body.category)
        elif body.action == "merge":
            mode = FailureMode.objects.filter(project=project, pk=body.failure_mode_id or 0).first()
            if mode is None:
                raise ValidationError({"failure_mode_id": f"No failure mode {body.failure_mode_id} in this project."})
            services.suggestion_merge(suggestion=suggestion, failure_mode=mode, user=user)
        elif body.action == "split":
            services.suggestion_split(suggestion=suggestion, user=user)
        else:
            services.suggestion_dismiss(suggestion=suggestion, user=user)
    except services.ClusteringRefused as exc:
        raise HttpError(409, str(exc)) from None
    suggestion.refresh_from_db()
    return _cluster(suggestion)
