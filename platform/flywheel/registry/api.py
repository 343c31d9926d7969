"""API of the registry: what serves now, for a serving stack that follows `production`; the versions, moves
of production and their history; base models; the gate's rules and automatic promotion. `read` to read,
`promote` to change."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from django.core.exceptions import ValidationError
from django.http import HttpRequest
from ninja import Field, Query, Router, Schema, Status
from ninja.errors import HttpError
from pydantic import StrictBool

from flywheel.api import ObjectIn
from flywheel.api.auth import promote_auth, read_auth, route_auth
from flywheel.api.errors import ERRORS as _ERRORS
from flywheel.api.ids import VersionNumber
from flywheel.api.text import Text
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


class ServingArmOut(Schema):
    version: int
    adapter: str = Field(description="The name it is served under (`<slug>-v<n>`): the `model` a router sends "
                                     "to vLLM and the `model_version` its trajectories carry back")
    adapter_path: str | None = Field(description="The LoRA adapter's folder; null for a base model alone")
    base_model_path: str


class CanaryArmOut(ServingArmOut):
    weight: float = Field(description="The canary's share of traffic (0.1 = 10%); production serves the rest")


class HoldbackArmOut(ServingArmOut):
    weight: float = Field(description="The replaced version's share of traffic during the watch (0.05 = 5%)")


class ServingOut(Schema):
    production: ServingArmOut | None = Field(description="null while no model is in production")
    canary: CanaryArmOut | None = Field(description="null while no canary serves")
    holdback: HoldbackArmOut | None = Field(
        None, description="While the watch of a new production runs with a holdback: the version it replaced, "
                          "served to `weight` of traffic so that the watch compares the two at the same hours; "
                          "null otherwise")


@router.get(
    "/serving",
    auth=read_auth,
    response={200: ServingOut, **_ERRORS},
    summary="What serves now: production and the canary with its share",
    description=(
        "The split a router applies (the reference router, `python -m flywheel.router`, polls it): production's "
        "version and adapter name, the canary's with its share of traffic, and during a watch with a holdback "
        "the replaced version's with its share. The same object every "
        "`alias.moved` webhook body carries as its `production`, `canary` and `holdback` keys. Always 200: with "
        "nothing "
        "in production yet, `production` is null."
    ),
)
def serving_get(request: HttpRequest) -> dict:
    from flywheel.registry.serving import serving_split

    return serving_split(request.auth.project)


class EvidenceKeyOut(Schema):
    key: str = Field(description="The project's evidence key, base64url (32 bytes): the router signs each answer's "
                                 "evidence token with it (HMAC-SHA256)")
    ttl_s: int = Field(description="How long after its answer a trajectory may first arrive with the token and "
                                   "still be vouched for (FLYWHEEL_EVIDENCE_TTL_HOURS)")


@router.get(
    "/serving/evidence-key",
    auth=route_auth,
    response={200: EvidenceKeyOut, **_ERRORS},
    summary="The key the router vouches for its answers with",
    description=(
        "For the reference router alone (scope `route`, which no other key should hold): whoever has this key can "
        "vouch that a version answered a request, and vouched trajectories are what the canary and the watch "
        "act on by themselves. Derived from SECRET_KEY, one per project; rotating SECRET_KEY rotates it (tokens "
        "under the old key verify while it is in SECRET_KEY_FALLBACKS)."
    ),
)
def serving_evidence_key(request: HttpRequest) -> dict:
    from django.conf import settings

    from flywheel.trajectories.vouch import evidence_key_text

    return {"key": evidence_key_text(request.auth.project), "ttl_s": int(settings.FLYWHEEL_EVIDENCE_TTL_HOURS * 3600)}


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


class MoveIn(ObjectIn):
    reason: Text = ""


class RollbackIn(ObjectIn):
    reason: Text = ""
    to_version: VersionNumber | None = None


class MoveOut(Schema):
    alias: str
    kind: str = Field(description="set, promote, rollback, or end (an alias that no longer points anywhere: "
                                  "`to_version` is the version it left)")
    from_version: int | None
    to_version: int
    user: str | None
    actor: str = Field("", description="The rule that moved it when no person did: gate, canary or watch")
    evidence: dict[str, Any] = Field(default_factory=dict, description="The figures the rule acted on")
    weight: float | None = Field(None, description="The canary's share of traffic after this move")
    reason: str
    at: datetime


def _move(event: AliasEvent) -> dict:
    return {"alias": event.alias, "kind": event.kind,
            "from_version": event.from_version.number if event.from_version else None,
            "to_version": event.to_version.number, "user": event.user.get_username() if event.user else None,
            "actor": event.actor, "evidence": event.evidence or {}, "weight": event.weight,
            "reason": event.reason, "at": event.at}


def _version(request: HttpRequest, number: int) -> ModelVersion:
    version = ModelVersion.objects.filter(project=request.auth.project, number=number).select_related("base").first()
    if version is None:
        raise HttpError(404, f"No model version {number} in this project.")
    return version


@router.get("/model-versions/{number}", auth=read_auth, response={200: ModelVersionOut, **_ERRORS},
            summary="A model version", description="Its base model, adapter, lineage, aliases and latest gate decision.")
def version_get(request: HttpRequest, number: VersionNumber) -> dict:
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
def version_promote(request: HttpRequest, number: VersionNumber, body: MoveIn) -> dict:
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
            summary="The aliases' history",
            description="Every move of `production`, `candidate` and `canary`, newest first, with the rule that "
                        "made it (`actor`) and the figures it acted on (`evidence`).")
def alias_history(request: HttpRequest) -> list[dict]:
    return [_move(e) for e in selectors.alias_history(project=request.auth.project, limit=500)]


class BaseModelIn(Schema):
    name: Text = Field(max_length=200, description="Unique in the project")
    path: Text = Field(max_length=1000,
                       description="An absolute path, on the workers' disk, to a Hugging Face model folder")


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


class GateRulesIn(ObjectIn):
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
    require_regression: StrictBool | None = Field(None, description="A job with no regression case measured cannot pass")
    unsafe_zero_tolerance: StrictBool | None = Field(
        None, description="Policy: where production made no unsafe sample, any candidate unsafe sample refuses "
                          "(refuses an identical model up to 25% of the time)")


class GateSettingsIn(ObjectIn):
    rules: GateRulesIn = Field(default_factory=GateRulesIn, description="The project's own rules")
    auto_promote: StrictBool = Field(description="A candidate that passes the gate goes to production at once")


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


# --- canary and the watch (flywheel.registry.canary) ---------------------------------------------------------


class CanaryIn(ObjectIn):
    weight: float | None = Field(None, gt=0, lt=1, description="The canary's share of traffic (0.1 = 10%); "
                                 "default: the project's canary weight")
    reason: Text = Field("", max_length=2000)


class LiveCheckOut(Schema):
    id: int
    kind: Literal["canary", "watch"]
    status: str = Field(description="running, promoted, rolled_back, flagged (waits for a person), passed, "
                                    "expired or ended")
    subject_version: int = Field(description="The canary, or the newly promoted production")
    baseline_version: int = Field(description="Production, or the version the promotion replaced")
    started_at: datetime
    ends_at: datetime
    baseline_from: datetime | None = Field(description="The watch's baseline: the replaced version's traffic "
                                                       "from here to `started_at`")
    rules: dict[str, Any] = Field(description="The settings it runs under, frozen at its start")
    evidence: dict[str, Any] = Field(description="The last look: each arm's counts, the rates, the always-valid "
                                                 "p-values, the verdict and why")
    looks: int
    decided_at: datetime | None
    decided_by: str | None


def _check(check) -> dict[str, Any]:
    return {"id": check.pk, "kind": check.kind, "status": check.status, "subject_version": check.subject.number,
            "baseline_version": check.baseline.number, "started_at": check.started_at, "ends_at": check.ends_at,
            "baseline_from": check.baseline_from, "rules": check.rules, "evidence": check.evidence,
            "looks": check.looks, "decided_at": check.decided_at,
            "decided_by": check.decided_by.get_username() if check.decided_by else None}


class CanaryOut(Schema):
    move: MoveOut
    check: LiveCheckOut


@router.post("/model-versions/{number}/canary", auth=promote_auth, response={200: CanaryOut, **_ERRORS},
             summary="Start a canary",
             description="Serve the version to a share of traffic (`weight`) beside production, and start the canary "
                         "decision (a sequential test on live traffic). Only a version that passed the gate against "
                         "the production serving now, and one canary at a time: else 409 saying why.")
def version_canary(request: HttpRequest, number: VersionNumber, body: CanaryIn) -> dict:
    from flywheel.registry import canary

    version = _version(request, number)
    try:
        check = canary.canary_start(project=request.auth.project, version=version, user=request.auth.created_by,
                                    weight=body.weight, reason=body.reason)
    except services.RegistryError as exc:
        raise HttpError(409, str(exc)) from None
    return {"move": _move(check.event), "check": _check(check)}


class DecideIn(ObjectIn):
    reason: Text = Field("", max_length=2000)


@router.post("/canary/promote", auth=promote_auth, response={200: MoveOut, **_ERRORS},
             summary="Promote the canary to all traffic",
             description="The canary's version becomes production (its gate decision checked again) and the canary "
                         "ends. 409 when no canary serves.")
def canary_promote(request: HttpRequest, body: DecideIn) -> dict:
    from flywheel.registry import canary

    return _canary_decide(request, body, canary.canary_promote)


def _canary_decide(request: HttpRequest, body: DecideIn, decide) -> dict:  # noqa: ANN001 (one of canary's two)
    """A person's decision on the canary (promote or roll back): the move, or 409 with why not."""
    try:
        event = decide(project=request.auth.project, user=request.auth.created_by, reason=body.reason)
    except services.RegistryError as exc:
        raise HttpError(409, str(exc)) from None
    return _move(event)


@router.post("/canary/rollback", auth=promote_auth, response={200: MoveOut, **_ERRORS},
             summary="Roll the canary back",
             description="The canary stops serving (an `end` move of the canary alias); production keeps all traffic. "
                         "409 when no canary serves.")
def canary_rollback(request: HttpRequest, body: DecideIn) -> dict:
    from flywheel.registry import canary

    return _canary_decide(request, body, canary.canary_rollback)


class LiveRulesIn(ObjectIn):
    """The canary's and the watch's rules; one not sent, or null, keeps its value."""

    model_config = {"extra": "forbid"}

    canary_weight: float | None = Field(None, gt=0, lt=1, description="A canary's share of traffic (0.1 = 10%)")
    canary_min_per_arm: int | None = Field(None, ge=1, le=1_000_000,
                                           description="Known outcomes each arm needs before a canary is promoted")
    canary_max_hours: int | None = Field(None, ge=1, le=24 * 90, description="A canary without enough traffic "
                                         "by then is removed (expired)")
    canary_auto: StrictBool | None = Field(None, description="The decision acts by itself (promote or roll back); "
                                     "else it flags the canary for a person")
    canary_tolerance: float | None = Field(None, gt=0, le=0.5, description="A canary is promoted only when its "
                                           "failure rate is shown (an always-valid upper bound) to be at most this "
                                           "much higher than production's (0.05 = five points)")
    watch_hours: int | None = Field(None, ge=0, le=24 * 90, description="How long a newly promoted production is "
                                    "watched, and the baseline window before the move (0: no watch)")
    watch_trajectories: int | None = Field(None, ge=0, le=10_000_000, description="The watch passes once "
                                           "production served this many (0: by time only)")
    watch_rollback: StrictBool | None = Field(None, description="A production found worse is rolled back; else "
                                              "flagged. Only with a holdback: without one the watch only flags")
    watch_holdback: float | None = Field(None, ge=0, le=0.5, description="The share of traffic the replaced version "
                                         "keeps during the watch, the watch's concurrent comparison (0: none)")
    notify_emails: list[Text] | None = Field(None, max_length=50, description="Where notifications are mailed "
                                            "(the webhook gets them too)")


class LiveRulesOut(Schema):
    canary_weight: float
    canary_min_per_arm: int
    canary_max_hours: int
    canary_auto: bool
    canary_tolerance: float
    watch_hours: int
    watch_trajectories: int
    watch_rollback: bool
    watch_holdback: float
    notify_emails: list[str]


def _live_rules(request: HttpRequest) -> dict[str, Any]:
    from flywheel.registry import canary

    rules = canary.live_rules_of(selectors.settings_of(project=request.auth.project))
    rules["notify_emails"] = [line for line in rules["notify_emails"].splitlines() if line.strip()]
    return rules


@router.get("/live-rules", auth=read_auth, response={200: LiveRulesOut, **_ERRORS},
            summary="The canary's and the watch's rules",
            description="A canary's share and decision rules, the watch after a promotion, and where notifications go.")
def live_rules_get(request: HttpRequest) -> dict[str, Any]:
    return _live_rules(request)


@router.put("/live-rules", auth=promote_auth, response={200: LiveRulesOut, **_ERRORS},
            summary="Set the canary's and the watch's rules",
            description="Each field sent replaces its value; a wrong one is a 422 naming it, and nothing changes then.")
def live_rules_set(request: HttpRequest, body: LiveRulesIn) -> dict[str, Any]:
    from flywheel.registry import canary

    data = body.model_dump(exclude_none=True)
    if "notify_emails" in data:
        data["notify_emails"] = "\n".join(data["notify_emails"])
    canary.live_rules_set(project=request.auth.project, data=data)
    return _live_rules(request)


@router.get("/live-checks", auth=read_auth, response={200: list[LiveCheckOut], **_ERRORS},
            summary="Canary decisions and watches",
            description="The project's live checks, newest first (at most `limit`), each with its last look's evidence.")
def live_checks_list(request: HttpRequest, limit: int = Query(50, ge=1, le=500)) -> list[dict[str, Any]]:
    from flywheel.registry import canary

    return [_check(c) for c in canary.checks_of(project=request.auth.project, limit=limit)]
