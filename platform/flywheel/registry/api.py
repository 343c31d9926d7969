"""API of the registry: what serves now, for a serving stack that follows `production`; the versions, moves
of production and their history; base models; the gate's rules and automatic promotion. `read` to read,
`promote` to change."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from django.core.exceptions import ValidationError
from django.http import HttpRequest
from ninja import Field, Router, Schema, Status
from ninja.errors import HttpError
from pydantic import field_validator

from flywheel.api import api
from flywheel.api.auth import promote_auth, read_auth
from flywheel.api.errors import ERRORS as _ERRORS
from flywheel.registry import selectors, services
from flywheel.registry.models import AliasEvent, ModelVersion

router = Router(tags=["models"])


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


class ModelVersionOut(Schema):
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


@router.get("/model-versions/{number}", auth=read_auth, response={200: ModelVersionOut, **_ERRORS},
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


# No stored text holds a NUL (PostgreSQL's text cannot): refused here, by name, before any query.
_NO_NUL = {"pattern": "^[^\\x00]*$"}


class BaseModelIn(Schema):
    name: str = Field(max_length=200, description="Unique in the project", json_schema_extra=_NO_NUL)
    path: str = Field(max_length=1000, json_schema_extra=_NO_NUL,
                      description="An absolute path, on the workers' disk, to a Hugging Face model folder")

    @field_validator("name", "path")
    @classmethod
    def _no_nul(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError("must not contain a NUL character")
        return value


class BaseModelOut(Schema):
    version: int = Field(description="The model version registered with it (the base alone)")
    base_model: str
    base_model_path: str
    production: bool = Field(description="It became production: the project's first model")


@router.post("/base-models", auth=promote_auth, response={201: BaseModelOut, **_ERRORS},
             summary="Register a base model",
             description="The workers check the folder on their disks (config, tokenizer, weights, chat "
                         "template); then it is registered as a base model with its first version (the base alone), "
                         "as the Models page does, and the project's first model becomes production. 422 names the "
                         "wrong field: a name the project has; a path that is not absolute, that no worker could "
                         "check, or that misses a part (each part named, with the worker that found it missing).")
def base_model_register(request: HttpRequest, body: BaseModelIn) -> Status:
    version = services.base_model_register_checked(project=request.auth.project, name=body.name, path=body.path,
                                                   user=request.auth.created_by)
    production = selectors.production_of(project=request.auth.project)
    return Status(201, {"version": version.number, "base_model": version.base.name,
                        "base_model_path": version.base.path,
                        "production": production is not None and production.pk == version.pk})


class GateRulesIn(Schema):
    """The rules a project may set (flywheel.registry.gate.GateRules); one not sent, or null, takes its default."""

    model_config = {"extra": "forbid"}

    success_margin: float | None = Field(None, ge=0, lt=1, description="The gain the success test must beat")
    test: Literal["permutation", "mcnemar", "bootstrap"] | None = Field(None, description="The success test")
    confidence: float | None = Field(None, ge=0.5, lt=1)
    latency_tolerance: float | None = Field(None, ge=0, le=10, description="0.1: refused only when the candidate "
                                            "is shown more than 10% slower per generated token")
    latency_cases: int | None = Field(None, ge=0, le=1000, description="Holdout cases timed on both models, one "
                                      "request at a time (0: latency not measured)")
    tokens_tolerance: float | None = Field(None, ge=0, le=10, description="0.1: tokens per case may grow 10%")
    invalid_test: Literal["harm", "noninferiority"] | None = None
    invalid_tolerance: float | None = Field(None, ge=0, lt=1, description="Above 0 for a non-inferiority test")
    expected_gain: float | None = Field(None, gt=0, le=1, description="The gain the holdout must be able to show")
    require_regression: bool | None = Field(None, description="A job with no regression case measured cannot pass")


class GateSettingsIn(Schema):
    rules: GateRulesIn = Field(default_factory=GateRulesIn, description="The project's own rules")
    auto_promote: bool = Field(description="A candidate that passes the gate goes to production at once")


class GateSettingsOut(Schema):
    rules: dict[str, Any] = Field(description="The rules the gate judges by now: the project's over the defaults")
    own: dict[str, Any] = Field(description="What the project set; every other rule is the default")
    auto_promote: bool


def _gate_settings(request: HttpRequest) -> dict[str, Any]:
    project = request.auth.project
    config = selectors.settings_of(project=project)
    return {"rules": selectors.gate_rules_of(project=project), "own": config.gate_rules or {},
            "auto_promote": config.auto_promote}


@router.get("/gate-settings", auth=read_auth, response={200: GateSettingsOut, **_ERRORS},
            summary="The gate's rules and automatic promotion",
            description="What a candidate must show against production to pass, and whether a passing one is "
                        "promoted at once: the Models page's gate settings.")
def gate_settings_get(request: HttpRequest) -> dict[str, Any]:
    return _gate_settings(request)


@router.put("/gate-settings", auth=promote_auth, response={200: GateSettingsOut, **_ERRORS},
            summary="Set the gate's rules and automatic promotion",
            description="Replaces the project's rules with `rules` (a rule not sent takes its default) and sets "
                        "`auto_promote`. Each wrong rule is a 422 naming it (`rules.<name>`); nothing changes then.")
def gate_settings_set(request: HttpRequest, body: GateSettingsIn) -> dict[str, Any]:
    # The service reads the form's text (and checks what only the rules together say); null is a rule not sent.
    data = {name: ("" if value is None else str(value).lower() if isinstance(value, bool) else str(value))
            for name, value in body.rules.model_dump().items()}
    try:
        services.gate_rules_set(project=request.auth.project, data=data, auto_promote=body.auto_promote)
    except ValidationError as exc:
        raise ValidationError({f"rules.{name}": messages for name, messages in exc.message_dict.items()}) from None
    return _gate_settings(request)


api.add_router("", router)
