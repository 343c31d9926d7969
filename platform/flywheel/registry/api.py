"""API of the registry: what serves now, for a serving stack that follows `production`."""

from __future__ import annotations

from datetime import datetime

from django.http import HttpRequest
from ninja import Router, Schema
from ninja.errors import HttpError

from flywheel.accounts.models import Scope
from flywheel.api import api
from flywheel.registry import selectors, services
from flywheel.registry.models import AliasEvent, ModelVersion
from flywheel.trajectories.api import ApiKeyAuth, ErrorOut, ValidationErrorOut, read_auth

router = Router(tags=["models"])
promote_auth = ApiKeyAuth(Scope.PROMOTE)
_ERRORS = {401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 409: ErrorOut, 422: ValidationErrorOut, 429: ErrorOut,
           503: ErrorOut}


class ProductionOut(Schema):
    project: str
    version: int
    base_model: str
    base_model_path: str
    adapter_path: str | None
    adapter_sha256: str | None
    mlflow_registered_model: str
    mlflow_version: str | None
    since: datetime | None
    reason: str


@router.get(
    "/models/production",
    auth=read_auth,
    response={200: ProductionOut, **_ERRORS},
    summary="The production model",
    description=(
        "The model version the `production` alias points at in the key's project: its base model's path, its "
        "adapter's location and content hash (SHA-256 over the adapter folder's files), so a serving stack "
        "can load it and check what it loaded. 404 while no model is registered."
    ),
)
def production_get(request: HttpRequest) -> dict:
    from flywheel.registry.mlflow_bridge import registered_model_name

    project = request.auth.project
    version = selectors.production_of(project=project)
    if version is None:
        raise HttpError(404, "No model is in production in this project yet.")
    since = selectors.alias_since(project=project)
    return {
        "project": project.slug,
        "version": version.number,
        "base_model": version.base.name,
        "base_model_path": version.base.path,
        "adapter_path": version.adapter_path or None,
        "adapter_sha256": version.adapter_sha256 or None,
        "mlflow_registered_model": registered_model_name(project.slug),
        "mlflow_version": version.mlflow_version or None,
        "since": since.at if since else None,
        "reason": since.reason if since else "",
    }


class VersionOut(Schema):
    version: int
    base_model: str
    base_model_path: str
    adapter_path: str | None
    adapter_sha256: str | None
    lineage: dict
    aliases: list[str]
    gate: dict | None
    created_at: datetime


class MoveIn(Schema):
    reason: str = ""


class RollbackIn(Schema):
    reason: str = ""
    to_version: int | None = None


class MoveOut(Schema):
    alias: str
    kind: str
    from_version: int | None
    to_version: int
    user: str | None
    reason: str
    at: datetime


def _move(event: AliasEvent) -> dict:
    return {"alias": event.alias, "kind": event.kind,
            "from_version": event.from_version.number if event.from_version else None,
            "to_version": event.to_version.number, "user": event.user.get_username() if event.user else None,
            "reason": event.reason, "at": event.at}


def _version(request: HttpRequest, number: int) -> ModelVersion:
    version = ModelVersion.objects.filter(project=request.auth.project, number=number).select_related("base").first()
    if version is None:
        raise HttpError(404, f"No model version {number} in this project.")
    return version


@router.get("/model-versions/{number}", auth=read_auth, response={200: VersionOut, **_ERRORS},
            summary="A model version", description="Its base model, adapter, lineage, aliases and latest gate decision.")
def version_get(request: HttpRequest, number: int) -> dict:
    version = _version(request, number)
    decision = version.gate_decisions.first()
    return {
        "version": version.number, "base_model": version.base.name, "base_model_path": version.base.path,
        "adapter_path": version.adapter_path or None, "adapter_sha256": version.adapter_sha256 or None,
        "lineage": version.lineage, "aliases": list(version.aliases.values_list("alias", flat=True)),
        "gate": ({"id": decision.pk, "passed": decision.passed, "rules": decision.report.get("rules", []),
                  "error": decision.error} if decision else None),
        "created_at": version.created_at,
    }


@router.post("/model-versions/{number}/promote", auth=promote_auth, response={200: MoveOut, **_ERRORS},
             summary="Promote a version to production",
             description="Only a version whose latest gate decision passed: else 409 with the failing rules. With MLflow "
                         "away, 409 and nothing changes.")
def version_promote(request: HttpRequest, number: int, body: MoveIn) -> dict:
    version = _version(request, number)
    try:
        event = services.model_promote(project=request.auth.project, version=version, user=request.auth.created_by,
                                       reason=body.reason)
    except services.RegistryError as exc:
        decision = version.gate_decisions.first()
        failing = [r["name"] for r in (decision.report.get("rules", []) if decision else []) if not r["passed"]]
        raise HttpError(409, str(exc) + (f" Failing rules: {', '.join(failing)}." if failing else "")) from None
    return _move(event)


@router.post("/models/production/rollback", auth=promote_auth, response={200: MoveOut, **_ERRORS},
             summary="Roll production back",
             description="To the version production replaced, or `to_version` (one that served before).")
def production_rollback(request: HttpRequest, body: RollbackIn) -> dict:
    to_version = _version(request, body.to_version) if body.to_version is not None else None
    try:
        event = services.model_rollback(project=request.auth.project, user=request.auth.created_by,
                                        reason=body.reason, to_version=to_version)
    except services.RegistryError as exc:
        raise HttpError(409, str(exc)) from None
    return _move(event)


@router.get("/models/history", auth=read_auth, response={200: list[MoveOut], **_ERRORS},
            summary="The aliases' history", description="Every move of `production` and `candidate`, newest first.")
def alias_history(request: HttpRequest) -> list[dict]:
    return [_move(e) for e in selectors.alias_history(project=request.auth.project, limit=500)]


api.add_router("", router)
