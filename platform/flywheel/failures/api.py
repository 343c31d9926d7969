"""The failure-mode endpoints of the JSON API: list and create modes, assign and unassign trajectories (by
id or by the list's filter), and the review queue (claim the next item, complete it).

Keys, scopes and errors are the API's shared ones (flywheel.api): the key decides the project; reading
needs `read`, every write needs `review`. A write is recorded in the review history as the person who made
the key, and the queue holds its claims for that person: a key nobody made (made outside the settings page)
cannot claim."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from django.core.exceptions import ValidationError
from django.http import HttpRequest
from ninja import Field, Router, Schema, Status
from ninja.errors import HttpError

from flywheel.api import ObjectIn
from flywheel.api.auth import read_auth, review_auth
from flywheel.api.errors import ERRORS as _ERRORS
from flywheel.api.ids import Id
from flywheel.api.text import Text
from flywheel.failures import queue, selectors, services
from flywheel.failures.models import FailureMode
from flywheel.trajectories.models import Trajectory
from flywheel.trajectories.selectors import TrajectoryFilters, trajectory_queryset

router = Router(tags=["failure modes"])
MAX_IDS = 10_000


class FailureModeOut(Schema):
    id: int
    name: str
    description: str
    category: str = Field(description="The key of its taxonomy category")
    status: Literal["open", "being_fixed", "fixed"]
    trajectory_count: int
    created_at: datetime
    fixed_at: datetime | None = Field(None, description="When it counted as fixed (a person, or a promotion)")
    fixed_version_number: int | None = Field(None, description="The registry version serving production then")
    reopened_at: datetime | None = Field(None, description="When production traffic brought it back")
    recurrence: dict[str, Any] = Field(default_factory=dict, description="Why it reopened: rules, figures, ids")


class FailureModeIn(Schema):
    name: Text = Field(min_length=1, max_length=200)
    category: Text = Field("other", max_length=32, description="A category key of the project's taxonomy")
    description: Text = Field("", max_length=10_000)
    status: Literal["open", "being_fixed", "fixed"] = "open"


class Selection(ObjectIn):
    """Which trajectories: `trajectory_ids`, or `filter` (the list page's query parameters: outcome, agent,
    model_version, date_from, date_to, tool_error, q, signal, reviewed, source, tag, mode). Exactly one."""

    trajectory_ids: list[Id] | None = Field(None, max_length=MAX_IDS)
    filter: dict[Text, Text] | None = Field(None, description="The list page's filter, e.g. {\"signal\": \"loop\"}")
    message_index: int | None = Field(None, ge=0, description="The message the mode shows at (assign only)")
    note: Text = Field("", max_length=10_000)


class CountOut(Schema):
    count: int = Field(description="Trajectories newly assigned (assign) or that carried the mode (unassign)")


class QueueFilter(ObjectIn):
    filter: dict[Text, Text] | None = Field(None, description="Narrows the queue with the list page's filter")


class ClaimOut(Schema):
    trajectory_id: int | None = Field(description="null: nothing left in the queue for this key's person")
    expires_at: datetime | None


class CompleteIn(ObjectIn):
    outcome: Literal["success", "failure", "unknown", ""] = Field(
        "", description="Empty: failure when it carries a mode or the agent said so, else the agent's outcome"
    )


class CompleteOut(Schema):
    trajectory_id: int
    reviewed_outcome: str


def _filters(raw: dict[str, str] | None, field: str) -> TrajectoryFilters:
    """The list page's filter from an API body: a value the page would ignore is refused here, by name."""
    filters = TrajectoryFilters.from_params(raw or {})
    if filters.errors:
        raise ValidationError({field: " ".join(filters.errors)})
    return filters


def _mode(request: HttpRequest, mode_id: int) -> FailureMode:
    mode = FailureMode.objects.filter(project=request.auth.project, pk=mode_id).select_related("project").first()
    if mode is None:
        raise HttpError(404, f"No failure mode {mode_id} in project '{request.auth.project.slug}'.")
    return mode


def _out(mode: FailureMode, count: int) -> dict[str, Any]:
    return {
        "id": mode.pk,
        "name": mode.name,
        "description": mode.description,
        "category": mode.category.key,
        "status": mode.status,
        "trajectory_count": count,
        "created_at": mode.created_at,
        "fixed_at": mode.fixed_at,
        "fixed_version_number": mode.fixed_version_number,
        "reopened_at": mode.reopened_at,
        "recurrence": mode.recurrence or {},
    }


def _selection(request: HttpRequest, body: Selection) -> Any:
    if (body.trajectory_ids is None) == (body.filter is None):
        raise ValidationError({"trajectory_ids": "Send exactly one of trajectory_ids and filter."})
    if body.filter is not None:
        return trajectory_queryset(project=request.auth.project, filters=_filters(body.filter, "filter"))
    return body.trajectory_ids


def _person(request: HttpRequest) -> Any:
    person = request.auth.created_by
    if person is None:
        raise HttpError(409, "This key was not made by a person (on the project's settings page), so it cannot hold queue items.")
    return person


@router.get("/failure-modes", auth=read_auth, response={200: list[FailureModeOut], **_ERRORS}, summary="List failure modes")
def failure_modes_list(request: HttpRequest, status: Literal["open", "being_fixed", "fixed"] | None = None) -> list[dict]:
    """The project's failure modes, most carried first."""
    modes = selectors.failure_modes(project=request.auth.project, status=status or "")
    return [_out(mode, mode.trajectory_count) for mode in modes]


@router.post("/failure-modes", auth=review_auth, response={201: FailureModeOut, **_ERRORS}, summary="Create a failure mode")
def failure_modes_create(request: HttpRequest, body: FailureModeIn) -> Status:
    """A new mode; 422 names the field at fault (a name the project already has, a category it has not)."""
    mode = services.failure_mode_create(
        project=request.auth.project,
        name=body.name,
        category_key=body.category,
        description=body.description,
        status=body.status,
        user=request.auth.created_by,
    )
    return Status(201, _out(mode, 0))


@router.post(
    "/failure-modes/{mode_id}/assign", auth=review_auth, response={200: CountOut, **_ERRORS}, summary="Assign trajectories"
)
def failure_mode_assign(request: HttpRequest, mode_id: Id, body: Selection) -> dict:
    """Assign the mode to trajectories by id or by the list's filter. A trajectory that carries it already is
    left as it is, and ids of other projects are ignored: `count` is how many were newly assigned. An empty
    `trajectory_ids`, like a filter that matches nothing, changes nothing: `count` 0."""
    mode = _mode(request, mode_id)
    count = services.failure_mode_assign(
        failure_mode=mode,
        trajectories=_selection(request, body),
        user=request.auth.created_by,
        message_index=body.message_index,
        note=body.note,
    )
    return {"count": count}


@router.post(
    "/failure-modes/{mode_id}/unassign", auth=review_auth, response={200: CountOut, **_ERRORS}, summary="Unassign trajectories"
)
def failure_mode_unassign(request: HttpRequest, mode_id: Id, body: Selection) -> dict:
    mode = _mode(request, mode_id)
    count = services.failure_mode_unassign(
        failure_mode=mode, trajectories=_selection(request, body), user=request.auth.created_by
    )
    return {"count": count}


@router.post("/queue/claim", auth=review_auth, response={200: ClaimOut, **_ERRORS}, summary="Claim the next queue item")
def queue_claim(request: HttpRequest, body: QueueFilter) -> dict:
    """The next failed or flagged trajectory nobody reviewed, held for the key's person until `expires_at`
    (or the item they hold already). `trajectory_id` null: the queue is empty for them."""
    filters = _filters(body.filter, "filter") if body.filter else None
    claim = queue.queue_claim_next(project=request.auth.project, user=_person(request), filters=filters)
    if claim is None:
        return {"trajectory_id": None, "expires_at": None}
    return {"trajectory_id": claim.trajectory.pk, "expires_at": claim.expires_at}


@router.post(
    "/queue/{trajectory_id}/complete", auth=review_auth, response={200: CompleteOut, **_ERRORS}, summary="Complete a queue item"
)
def queue_complete(request: HttpRequest, trajectory_id: Id, body: CompleteIn) -> dict:
    """Mark the trajectory reviewed and release it; 409 while another person holds it."""
    trajectory = Trajectory.objects.filter(project=request.auth.project, pk=trajectory_id).first()
    if trajectory is None:
        raise HttpError(404, f"No trajectory {trajectory_id} in project '{request.auth.project.slug}'.")
    try:
        queue.queue_complete(project=request.auth.project, trajectory=trajectory, user=_person(request), outcome=body.outcome)
    except ValidationError as exc:
        raise HttpError(409, " ".join(exc.messages)) from None
    trajectory.refresh_from_db()
    return {"trajectory_id": trajectory.pk, "reviewed_outcome": trajectory.reviewed_outcome}
