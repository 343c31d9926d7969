"""The endpoints eval suites (flywheel.evals.api) and task sets (flywheel.environments.api) share, built
for each by `collection_router`.

`/eval-suites` and `/task-sets` answer the same operations: list, create, read, versions, a version's JSONL
export, promotion of one trajectory (or a dry run of its checks), and bulk promotion of a selection or a
failure mode. A trajectory is named by its id or by its `external_id`, the id the agent sent. Keys: `read`
for GET, `review` for the writes (promotion is a reviewer's act), recorded as the person who made the key.
Freezing a version is a maintainer's act, in the UI.
"""

from __future__ import annotations

import functools
import inspect
from datetime import datetime
from typing import Annotated, Any, Literal

from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from ninja import Field, Query, Router, Schema, Status
from ninja.errors import HttpError

from flywheel.api import ObjectIn
from flywheel.api.auth import read_auth, review_auth
from flywheel.api.errors import ErrorOut, ValidationErrorOut
from flywheel.api.ids import Id, VersionNumber
from flywheel.api.text import NON_BLANK, NulFree, NulFreeJson, Text
from flywheel.evals import promotion, selectors
from flywheel.evals import rows as row_shape
from flywheel.evals.kinds import train_side
from flywheel.evals.models import EvalSuite, SuiteKind
from flywheel.evals.services import suite_create
from flywheel.trajectories.models import Trajectory

# A field of free JSON the promotion stores in the row (a verifier spec, a state): no NUL in any string.
FreeJson = Annotated[Any, NulFreeJson]


class CollectionIn(Schema):
    name: Text = Field(min_length=1, max_length=120, pattern=NON_BLANK, description="unique in the project")
    kind: Literal["holdout", "regression"] = Field(default=SuiteKind.REGRESSION, description="eval suites only")
    description: Text = ""
    server: Id | None = Field(default=None, description="task sets only: the id of a registered environment "
                               "server (`GET /api/v1/environment-servers`) whose episodes its tasks run in")


class CollectionOut(Schema):
    id: int
    name: str
    kind: str | None = Field(description="holdout | regression for a suite; null for a task set")
    description: str
    size: int
    last_version: int | None
    created_at: datetime


class VersionOut(Schema):
    collection: int = Field(description="The eval suite's or task set's id")
    number: int = Field(description="The version's number within it")
    content_hash: str = Field(description="SHA-256 of the JSONL export")
    size: int
    note: str
    created_at: datetime
    frozen_at: datetime | None
    export_url: str


class ItemOut(Schema):
    id: str = Field(description="the row's id in the JSONL export, e.g. case-12")
    trajectory_id: int | None
    message_index: int | None
    failure_mode_id: int | None
    env_type: str
    prompt: str
    row: dict[str, Any]
    leakage_confirmation: dict[str, Any] | None = Field(
        description="where the leakage guard was unsure, who let the row in, when and why, and the pairs")


class CollectionDetailOut(CollectionOut):
    items: list[ItemOut]
    versions: list[VersionOut]


class ScoreOut(Schema):
    passed: bool
    reward: float
    failure: str | None
    checks: dict[str, Any]


class ChecksOut(Schema):
    original: ScoreOut | None = Field(description="the verifier on the agent's output: should fail")
    reference: ScoreOut | None = Field(description="the verifier on the stated reference: must pass")
    warnings: list[str]


class ConflictOut(Schema):
    rule: str
    candidate: str
    other: str
    detail: str
    confirmable: bool = Field(default=False, description="the guard is unsure: a reviewer's reason lets it in")


class PromotionIn(ObjectIn):
    """The trajectory, by `trajectory_id` or by `external_id` (exactly one). Unset fields start from its
    prefill (expected = what the agent did)."""

    trajectory_id: Id | None = Field(default=None, description="The trajectory's id; or send external_id")
    external_id: Annotated[str, Field(min_length=1, max_length=255), NulFree] | None = Field(
        default=None, description="The external_id the agent sent it with; or send trajectory_id")
    message_index: int | None = None
    expect: Text | None = Field(default=None, description="calls | answer | state")
    expected_calls: FreeJson = Field(default=None, description='[{"name", "arguments": {arg: value or matcher}}]')
    reference_calls: FreeJson = Field(default=None, description="concrete calls; null = derived from the agent's")
    answer_match: Text | None = Field(default=None, description="exact | regex | json_schema")
    expected_answer: FreeJson = None
    reference_answer: Text | None = None
    expected_state: FreeJson = None
    env_type: Text | None = Field(default=None, description="single_turn | replay | workplace")
    observations: FreeJson = Field(default=None, description="replay rows: tool name -> the observation a corrected "
                                                        "call gets (prefilled from a recorded result that is not an error)")
    observation_error_expected: bool | None = Field(
        default=None, description="a stated observation that is an error is what the corrected call should get")
    initial_state: FreeJson = None
    max_turns: int | None = None
    accept_passing_original: bool = False
    leakage_reason: Annotated[str, Field(max_length=promotion.LEAKAGE_REASON_MAX), NulFree] | None = Field(
        default=None,
        description="where the leakage guard is unsure (`doubts`), why this request differs from the other "
                    "side's; kept with the row. Without it such a trajectory is not promoted")
    dry_run: bool = Field(default=False, description="run the checks, save nothing")


_DOUBTS = ("rows of the other side whose request the leakage guard is unsure differs from this one: a "
           "reviewer confirms with `leakage_reason`")


class PromotionOut(Schema):
    saved: bool
    item: ItemOut | None
    version: VersionOut | None
    checks: ChecksOut
    row: dict[str, Any] | None
    doubts: list[ConflictOut] = Field(description=_DOUBTS)


class PromotionRefusedOut(Schema):
    detail: str
    errors: dict[str, list[str]] = Field(description="field -> what is wrong with it")
    conflicts: list[ConflictOut]
    checks: ChecksOut
    doubts: list[ConflictOut] = Field(default_factory=list, description=_DOUBTS)


class BulkIn(ObjectIn):
    """Which trajectories: a failure mode's, or a selection by `trajectory_ids` or `external_ids` (exactly one
    of the three)."""

    failure_mode_id: Id | None = None
    trajectory_ids: list[Id] | None = Field(default=None, max_length=promotion.BULK_MAX)
    external_ids: list[Text] | None = Field(default=None, max_length=promotion.BULK_MAX)
    expect: Text | None = None
    expected_calls: FreeJson = None
    answer_match: Text | None = None
    expected_answer: FreeJson = None
    reference_answer: Text | None = None
    expected_state: FreeJson = None
    env_type: Text | None = None
    observations: FreeJson = Field(default=None, description="replay rows: tool name -> observation, for every trajectory")
    observation_error_expected: bool | None = None
    initial_state: FreeJson = None
    max_turns: int | None = None


class SkippedOut(Schema):
    trajectory_id: int
    reasons: list[str]


class BulkOut(Schema):
    saved: list[ItemOut]
    skipped: list[SkippedOut]
    version: VersionOut | None


def _score(score: Any) -> dict[str, Any] | None:
    return None if score is None else {"passed": score.passed, "reward": score.reward, "failure": score.failure,
                                       "checks": score.checks}


def checks_out(check: promotion.PromotionCheck) -> dict[str, Any]:
    return {"original": _score(check.original_score), "reference": _score(check.reference_score),
            "warnings": check.warnings}


def item_out(item: Any) -> dict[str, Any]:
    return {"id": item.row_id, "trajectory_id": item.trajectory_id, "message_index": item.message_index,
            "failure_mode_id": item.failure_mode_id, "env_type": item.env_type, "prompt": item.prompt_text,
            "row": item.row(), "leakage_confirmation": item.leakage_confirmation}


def trajectory_named(project: Any, *, trajectory_id: int | None, external_id: str | None) -> Trajectory:
    """The project's trajectory named by its id or by its external_id (exactly one): 422 naming the field when
    both or neither are sent, 404 when the project has no such trajectory."""
    if (trajectory_id is None) == (external_id is None):
        raise ValidationError({"trajectory_id" if trajectory_id is not None else "external_id":
                               "Send exactly one of trajectory_id and external_id."})
    if trajectory_id is not None:
        found = Trajectory.objects.filter(project=project, pk=trajectory_id).first()
        what = f"trajectory {trajectory_id}"
    else:
        found = Trajectory.objects.filter(project=project, external_id=external_id).first()
        what = f"trajectory with external_id {external_id!r}"
    if found is None:
        raise HttpError(404, f"No {what} in project '{project.slug}'.")
    return found


def _path_param(name: str) -> Any:
    """Give a handler written with `collection_id` the path parameter `name` (suite_id, task_set_id).

    Why: one set of handlers serves both collections, but each URL names its own id, so that an id is never
    mistaken for the other kind's (the authorization tests fill every parameter by name). django-ninja reads
    parameters from `inspect.signature`, which honours `__signature__`."""

    def rename(fn: Any) -> Any:
        signature = inspect.signature(fn, eval_str=True)
        params = [p.replace(name=name) if p.name == "collection_id" else p for p in signature.parameters.values()]

        @functools.wraps(fn)
        def handler(request: HttpRequest, **kwargs: Any) -> Any:
            kwargs["collection_id"] = kwargs.pop(name)
            return fn(request, **kwargs)

        handler.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        return handler

    return rename


class PowerOut(Schema):
    cases: int
    samples: int
    confidence: float
    production: int | None = Field(description="the production version whose rates were used")
    measured_by: int | None = Field(description="the eval run that measured them; null: not measured yet")
    production_success: float | None
    smallest_gain: float | None = Field(description="the smallest gain shown with 80% power; null: none")
    expected_gain: float
    cases_for_expected_gain: int | None
    enough: bool = Field(description="the holdout can show the project's expected gain")
    sentence: str


def collection_router(*, model: type, prefix: str, tag: str, id_name: str) -> Router:
    """The router of the collection endpoints under `/{prefix}` for `model` (EvalSuite or TaskSet); `id_name`
    is the path parameter of its id. The app's API module adds its own endpoints to it; the URLconf
    (flywheel.api_urls) mounts it."""
    router = Router(tags=[tag])
    by_id = _path_param(id_name)
    label = model.LABEL
    is_suite = model is EvalSuite

    def version_out(collection: Any, version: Any) -> dict[str, Any]:
        return {"collection": collection.pk, "number": version.number, "content_hash": version.content_hash, "size": version.size,
                "note": version.note, "created_at": version.created_at, "frozen_at": version.frozen_at,
                "export_url": f"/api/v1/{prefix}/{collection.pk}/versions/{version.number}.jsonl"}

    def collection_out(c: Any, size: int | None = None, last: int | None = None) -> dict[str, Any]:
        return {"id": c.pk, "name": c.name, "kind": c.kind if is_suite else None, "description": c.description,
                "size": c.n_items if size is None else size, "last_version": c.last_version if last is None else last,
                "created_at": c.created_at}

    def get(request: HttpRequest, pk: int) -> Any:
        collection = selectors.collection_get(project=request.auth.project, model=model, pk=pk)
        if collection is None:
            raise HttpError(404, f"No {label} {pk} in project '{request.auth.project.slug}'.")
        return collection

    # 422 from django-ninja when a parameter does not parse; the writes add their own refusals to it.
    errors = {401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 422: ValidationErrorOut, 429: ErrorOut, 503: ErrorOut}
    refused = PromotionRefusedOut | ValidationErrorOut

    @router.get(f"/{prefix}", auth=read_auth, response={200: list[CollectionOut], **errors},
                summary=f"List {label}s", operation_id=f"{tag}_list")
    def collection_list(request: HttpRequest) -> list[dict[str, Any]]:
        return [collection_out(c) for c in selectors.collection_list(project=request.auth.project, model=model)]

    @router.post(f"/{prefix}", auth=review_auth, response={**errors, 201: CollectionOut, 400: ErrorOut, 422: refused},
                 summary=f"Create a {label}", operation_id=f"{tag}_create")
    def collection_create(request: HttpRequest, body: CollectionIn) -> Any:
        try:
            if is_suite:
                c = suite_create(project=request.auth.project, name=body.name, kind=body.kind,
                                 description=body.description, user=request.auth.created_by)
            else:
                server = None
                if body.server is not None:
                    server = train_side().server.objects.filter(project=request.auth.project, pk=body.server).first()
                    if server is None:
                        raise ValidationError({"server": f"No environment server {body.server} in this project."})
                c = train_side().create(project=request.auth.project, name=body.name,
                                        description=body.description, user=request.auth.created_by, server=server)
        except ValidationError as exc:
            return Status(422, {"detail": f"The {label} was not created.", "errors": exc.message_dict, "conflicts": [],
                                "checks": {"original": None, "reference": None, "warnings": []}})
        return Status(201, collection_out(c, size=0, last=0))

    @router.get(f"/{prefix}/{{{id_name}}}", auth=read_auth, response={200: CollectionDetailOut, **errors},
                summary=f"Read a {label}: its rows and versions", operation_id=f"{tag}_read")
    @by_id
    def collection_read(request: HttpRequest, collection_id: Id) -> dict[str, Any]:
        c = get(request, collection_id)
        items = list(selectors.collection_items(collection=c))
        versions = list(selectors.collection_versions(collection=c))
        return {**collection_out(c, size=len(items), last=versions[0].number if versions else 0),
                "items": [item_out(i) for i in items], "versions": [version_out(c, v) for v in versions]}

    @router.get(f"/{prefix}/{{{id_name}}}/versions", auth=read_auth, response={200: list[VersionOut], **errors},
                summary=f"A {label}'s versions, newest first", operation_id=f"{tag}_versions")
    @by_id
    def collection_versions(request: HttpRequest, collection_id: Id) -> list[dict[str, Any]]:
        c = get(request, collection_id)
        return [version_out(c, v) for v in selectors.collection_versions(collection=c)]

    if is_suite:
        @router.get(f"/{prefix}/{{{id_name}}}/versions/{{number}}/power", auth=read_auth,
                    response={200: PowerOut, **errors}, summary="What a holdout version can show",
                    description="The smallest gain this suite version shows with 80% power at the gate's "
                                "confidence, from production's latest per-case pass rates on it, and the cases "
                                "that would show the project's expected gain. `samples` asks for the figures at "
                                "that many samples a case.",
                    operation_id=f"{tag}_power")
        @by_id
        def collection_power(request: HttpRequest, collection_id: Id, number: VersionNumber,
                             samples: int | None = Query(None, ge=1, le=64)) -> dict[str, Any]:
            c = get(request, collection_id)
            version = selectors.version_get(collection=c, number=number)
            if version is None:
                raise HttpError(404, f"{label} {collection_id} has no version {number}.")
            return selectors.holdout_power(project=request.auth.project, suite_version=version, samples=samples)

    @router.get(f"/{prefix}/{{{id_name}}}/versions/{{number}}.jsonl", auth=read_auth,
                response={200: None, **errors}, summary=f"Export a {label} version as JSONL",
                description="One row a line in the trainer's shape (`python -m trainer evaluate --suite FILE`, "
                            "`train`); the file's SHA-256 is the version's content_hash.",
                operation_id=f"{tag}_export")
    @by_id
    def collection_export(request: HttpRequest, collection_id: Id, number: VersionNumber) -> HttpResponse:
        c = get(request, collection_id)
        version = selectors.version_get(collection=c, number=number)
        if version is None:
            raise HttpError(404, f"{label} {collection_id} has no version {number}.")
        return export_response(c, version)

    @router.post(f"/{prefix}/{{{id_name}}}/promotions", auth=review_auth,
                 response={**errors, 200: PromotionOut, 201: PromotionOut, 400: ErrorOut, 422: refused},
                 summary=f"Promote a trajectory into a {label}",
                 description="Runs the verifier on the agent's output (must fail) and on the reference (must "
                             "pass), and the leakage guard; 201 with the new row and version, 200 for a dry "
                             "run, 422 with field errors, conflicts and both checks when refused. Where the "
                             "guard is unsure (`doubts`), send `leakage_reason`: why the requests differ.",
                 operation_id=f"{tag}_promote")
    @by_id
    def collection_promote(request: HttpRequest, collection_id: Id, body: PromotionIn) -> Any:
        c = get(request, collection_id)
        trajectory = trajectory_named(request.auth.project, trajectory_id=body.trajectory_id,
                                      external_id=body.external_id)
        data = promotion.promotion_prefill(trajectory=trajectory, message_index=body.message_index)
        data.update(body.dict(exclude_none=True, exclude={"trajectory_id", "external_id", "accept_passing_original",
                                                          "dry_run"}))
        if body.dry_run:
            check = promotion.promotion_check(trajectory=trajectory, data=data, target=c)
            return Status(200, {"saved": False, "item": None, "version": None, "checks": checks_out(check),
                                "row": check.row, "doubts": [vars(x) for x in check.doubts]})
        try:
            item, check = promotion.trajectory_promote(trajectory=trajectory, data=data, target=c,
                                                       user=request.auth.created_by,
                                                       accept_passing_original=body.accept_passing_original)
        except promotion.PromotionRefused as refused:
            check = refused.check
            return Status(422, {"detail": "Not promoted: " + "; ".join(check.reasons()), "errors": check.errors,
                                "conflicts": [vars(x) for x in check.conflicts], "checks": checks_out(check),
                                "doubts": [vars(x) for x in check.doubts]})
        version = c.versions.order_by("-number").first()
        return Status(201, {"saved": True, "item": item_out(item), "version": version_out(c, version),
                            "checks": checks_out(check), "row": item.row(),
                            "doubts": [vars(x) for x in check.doubts]})

    def bulk(project: Any, c: Any, body: BulkIn, data: dict[str, Any], user: Any) -> promotion.BulkResult | None:
        named = [name for name in ("failure_mode_id", "trajectory_ids", "external_ids")
                 if getattr(body, name) is not None]
        if len(named) > 1:
            raise ValidationError({named[1]: f"Send one of failure_mode_id, trajectory_ids and external_ids, "
                                             f"not {' and '.join(named)}."})
        if body.external_ids:
            found = {t.external_id: t for t in Trajectory.objects.filter(project=project,
                                                                           external_id__in=body.external_ids)}
            missing = [i for i in body.external_ids if i not in found]
            if missing:
                raise HttpError(404, f"No trajectory with external_id {missing[0]!r} in project '{project.slug}'.")
            return promotion.selection_promote(items=[(found[i], None) for i in dict.fromkeys(body.external_ids)],
                                               data=data, target=c, user=user)
        if body.failure_mode_id is not None:
            from flywheel.failures.models import FailureMode

            mode = FailureMode.objects.filter(project=project, pk=body.failure_mode_id).first()
            if mode is None:
                raise HttpError(404, f"No failure mode {body.failure_mode_id} in project '{project.slug}'.")
            return promotion.failure_mode_promote(failure_mode=mode, data=data, target=c, user=user)
        if body.trajectory_ids:
            found = {t.pk: t for t in Trajectory.objects.filter(project=project, pk__in=body.trajectory_ids)}
            missing = [i for i in body.trajectory_ids if i not in found]
            if missing:
                raise HttpError(404, f"No trajectory {missing[0]} in project '{project.slug}'.")
            return promotion.selection_promote(items=[(found[i], None) for i in dict.fromkeys(body.trajectory_ids)],
                                               data=data, target=c, user=user)
        return None

    @router.post(f"/{prefix}/{{{id_name}}}/promotions/bulk", auth=review_auth,
                 response={**errors, 200: BulkOut, 400: ErrorOut, 422: ErrorOut | ValidationErrorOut},
                 summary=f"Promote a selection or a failure mode into a {label}",
                 description="One draft per trajectory under one stated expectation; saves the drafts that "
                             "pass both checks and the leakage guard, lists the others with the reason.",
                 operation_id=f"{tag}_promote_bulk")
    @by_id
    def collection_promote_bulk(request: HttpRequest, collection_id: Id, body: BulkIn) -> Any:
        c = get(request, collection_id)
        project = request.auth.project
        data = body.dict(exclude_none=True, exclude={"failure_mode_id", "trajectory_ids", "external_ids"})
        try:
            result = bulk(project, c, body, data, request.auth.created_by)
        except promotion.BulkTooLarge as exc:
            return Status(422, {"detail": str(exc)})
        if result is None:
            return Status(422, {"detail": "Name failure_mode_id, trajectory_ids or external_ids."})
        return Status(200, {"saved": [item_out(i) for i in result.saved],
                            "skipped": [{"trajectory_id": t.pk, "reasons": r} for t, r in result.skipped],
                            "version": version_out(c, result.version) if result.version else None})

    return router


def export_response(collection: Any, version: Any) -> HttpResponse:
    """The version's JSONL file, as a download (the page and the API serve the same bytes)."""
    body = row_shape.export_jsonl(version.rows)
    kind = "suite" if isinstance(collection, EvalSuite) else "taskset"
    response = HttpResponse(body, content_type="application/x-ndjson; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{kind}-{collection.pk}-v{version.number}.jsonl"'
    response["ETag"] = f'"{version.content_hash}"'
    return response


