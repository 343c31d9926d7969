"""Registry actions, one function each, called by the pages, the API, the tasks and the tests alike:
register a base model, add a model version, move an alias (promote, roll back), and sync the moves to
MLflow and the serving stack."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import DatabaseError, IntegrityError, transaction
from django.db.models import Max, Q
from django.utils import timezone

from flywheel import outbound, outbox, sealed
from flywheel.accounts.models import Project
from flywheel.accounts.services import project_lock
from flywheel.registry import serving, signals
from flywheel.registry.model_folder import OUTSIDE, lies_in
from flywheel.registry.models import (
    Alias,
    AliasAssignment,
    AliasEvent,
    AliasEventKind,
    BaseModel,
    GateDecision,
    ModelVersion,
    RegistrySettings,
    SyncState,
    WebhookDelivery,
)
from flywheel.registry.selectors import rollback_target

logger = logging.getLogger(__name__)

WEBHOOK_TIMEOUT_S = 10
# A failed MLflow mirror or webhook is retried after this, then twice as long each time, up to an hour.
RETRY_FIRST_S = 30
RETRY_MAX_S = 3600


class RegistryError(Exception):
    """A registry action that cannot be done as asked; the message says why."""


class StaleDecision(RegistryError):
    """A candidate's gate decision was judged against a production that no longer serves."""


# --- content ------------------------------------------------------------------------------------------------


def adapter_sha256(path: str | Path) -> str:
    """A content hash of a folder: every file's relative path and bytes, in a fixed order.

    A serving stack compares it with what it loaded; the same adapter copied elsewhere hashes the same."""
    root = Path(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = file.relative_to(root).as_posix().encode()
        digest.update(len(rel).to_bytes(8, "big") + rel)
        digest.update(file.stat().st_size.to_bytes(8, "big"))
        with file.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _check_model_dir(path: str, *, field: str, marker: str, what: str) -> Path:
    folder = Path(path)
    if not folder.is_absolute():
        raise ValidationError({field: f"Give an absolute path on the workers' disk, not {path!r}."})
    if not folder.is_dir():
        raise ValidationError({field: f"{path} is not a folder the web server can read."})
    if not (folder / marker).is_file():
        raise ValidationError({field: f"{path} holds no {marker}: it is not {what}."})
    return folder


# --- registering ---------------------------------------------------------------------------------------------


MODEL_FOLDER_CHECK = "flywheel_model_folder_check"  # the workers' remote-control command (registry/tasks.py)


def _model_queue() -> str:
    """The queue whose workers load base models: where an evaluation of a registered model is routed."""
    from flywheel.celery import app

    route = app.amqp.router.route({}, "flywheel.evals.run")
    queue = route.get("queue")
    return getattr(queue, "name", None) or str(queue or app.conf.task_default_queue)


def model_roots(*, project: Project) -> list[Path]:
    """The folders a project's base models may lie in: its own under FLYWHEEL_MODELS_DIR (`<dir>/<slug>`), and
    the one every project shares when the operator names it (FLYWHEEL_MODELS_SHARED)."""
    models = Path(settings.FLYWHEEL_MODELS_DIR)
    shared = settings.FLYWHEEL_MODELS_SHARED
    return [models / project.slug, *([models / shared] if shared else [])]


def model_folder_check(*, path: str, roots: list[Path] | None = None,
                       timeout: float | None = None) -> list[tuple[str, dict[str, str]]]:
    """Ask the workers to check the folder at `path` on their own disks (the web process may not see it), inside
    `roots` only (`model_roots`): each follows the path's links on its own disk before it looks.

    Answers [(worker, {part: problem})]: from the workers that load models (the evaluation's queue), or from
    every worker that answered when none of those did (`make run`'s workers share one disk; the compose file
    mounts the models folder on both kinds). [] when no worker answered within `timeout` seconds
    (FLYWHEEL_MODEL_CHECK_TIMEOUT_S): a broadcast waits that long for every answer."""
    from flywheel.celery import app
    from flywheel.registry.model_folder import folder_problems

    roots = [str(root) for root in roots or []]
    if app.conf.task_always_eager:  # tasks run in this process: so does the check
        return [("this process", folder_problems(path, roots=roots))]
    timeout = settings.FLYWHEEL_MODEL_CHECK_TIMEOUT_S if timeout is None else timeout
    replies = app.control.broadcast(MODEL_FOLDER_CHECK, arguments={"path": path, "roots": roots}, reply=True,
                                    timeout=timeout)
    answers = [(worker, body) for reply in replies or [] for worker, body in reply.items()
               if isinstance(body, dict) and isinstance(body.get("problems"), dict)]  # not "no such command"
    queue = _model_queue()
    loading = [(worker, body) for worker, body in answers if queue in body.get("queues", [])]
    return sorted((worker, body["problems"]) for worker, body in loading or answers)


def base_model_register_checked(*, project: Project, name: str, path: str, user=None) -> ModelVersion:
    """Register a base model for a person or a script (the Models page, the API): the workers check the
    folder first, and nothing is saved unless it holds every part (registry.model_folder.PARTS).

    The folder must lie in the project's own folder under the models directory, or the shared one
    (`model_roots`): as written here, then with its links followed on each worker's disk. A path outside is
    refused with one sentence that says nothing of what is there.

    Raises ValidationError with field errors: `name` (missing, taken), `path` (not absolute, outside the
    project's folders, no worker answered, or one sentence per missing part, naming the part and the worker
    that found it missing)."""
    name, path = (name or "").strip(), (path or "").strip()
    errors: dict[str, list[str]] = {}
    if not name:
        errors["name"] = ["Name the model."]
    elif BaseModel.objects.filter(project=project, name=name).exists():
        errors["name"] = [f"This project already has a base model named {name!r}."]
    if not path:
        errors["path"] = ["Give the folder's absolute path on the workers' disk."]
    elif not Path(path).is_absolute():
        errors["path"] = [f"Give an absolute path on the workers' disk, not {path!r}."]
    elif not lies_in(path, roots := model_roots(project=project), resolve=False):
        errors["path"] = [f"{path} {OUTSIDE} Put the model's folder in "
                          + " or ".join(f"{root}{os.sep}" for root in roots) + "."]
    if errors:
        raise ValidationError(errors)
    answers = model_folder_check(path=path, roots=roots)
    if not answers:
        raise ValidationError({"path": [
            f"No worker answered within {settings.FLYWHEEL_MODEL_CHECK_TIMEOUT_S:g} s, so {path} could not be "
            "checked, and nothing was saved. Is a worker running (and not busy with a task in a solo pool)?"]})
    found: dict[str, list[str]] = {}
    for worker, problems in answers:
        for problem in problems.values():
            found.setdefault(problem, []).append(worker)
    if found:
        raise ValidationError({"path": [f"{problem} (on {', '.join(workers)})" for problem, workers in found.items()]})
    return _base_model_create(project=project, name=name, path=path, user=user)


def base_model_register(*, project: Project, name: str, path: str, user=None) -> ModelVersion:
    """Register a base model by its path on this machine's disk, and its first version (the base alone).

    For code that runs beside the folder and made it (the demo's build on the worker, tests, benches): it
    checks only that config.json is there. People and scripts go through `base_model_register_checked`."""
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": "Name the model."})
    _check_model_dir(path, field="path", marker="config.json", what="a Hugging Face model folder")
    return _base_model_create(project=project, name=name, path=path, user=user)


def _base_model_create(*, project: Project, name: str, path: str, user=None) -> ModelVersion:
    """The base model's row and its first version. The first version registered in a project becomes
    `production`, so there is always something to beat."""
    with transaction.atomic():
        try:
            with transaction.atomic():
                base = BaseModel.objects.create(project=project, name=name, path=str(Path(path)), created_by=user)
        except IntegrityError:
            raise ValidationError({"name": f"This project already has a base model named {name!r}."}) from None
        version = model_version_create(project=project, base=base, user=user, description=f"Base model {name}")
        if not AliasAssignment.objects.filter(project=project, alias=Alias.PRODUCTION).exists():
            alias_move(project=project, alias=Alias.PRODUCTION, version=version, user=user,
                       kind=AliasEventKind.SET, reason="First model of the project.")
    return version


def model_version_create(
    *, project: Project, base: BaseModel, adapter_path: str = "", lineage: dict[str, Any] | None = None,
    description: str = "", user=None,
) -> ModelVersion:
    """A new version: `base` plus the adapter in `adapter_path` ("" for the base alone), with its lineage."""
    if base.project_id != project.pk:
        raise RegistryError("The base model belongs to another project.")
    digest = ""
    if adapter_path:
        folder = _check_model_dir(adapter_path, field="adapter_path", marker="adapter_config.json",
                                  what="a LoRA adapter")
        digest = adapter_sha256(folder)
    with transaction.atomic():
        # One writer numbers versions at a time: the project row is the lock.
        project_lock(project=project)
        number = (ModelVersion.objects.filter(project=project).aggregate(n=Max("number"))["n"] or 0) + 1
        version = ModelVersion.objects.create(
            project=project, number=number, base=base, adapter_path=adapter_path, adapter_sha256=digest,
            lineage=lineage or {}, description=description, created_by=user,
        )
        _sync_on_commit(project)
    return version


# --- aliases -------------------------------------------------------------------------------------------------


# The aliases whose moves the serving stack hears about (vLLM loads the adapter, the webhook says the split).
SERVED_ALIASES = (Alias.PRODUCTION, Alias.CANARY)


class MlflowUnavailable(RegistryError):
    """MLflow did not take the move: nothing changed, in the database or in MLflow."""


def _mirror_alias(*, project: Project, alias: str, version: ModelVersion) -> None:
    """Point MLflow's alias at `version`, registering the version there first when needed."""
    from flywheel.registry import mlflow_bridge

    try:
        if not version.mlflow_version:
            version.mlflow_version = mlflow_bridge.version_register(version)
            ModelVersion.objects.filter(pk=version.pk).update(mlflow_version=version.mlflow_version)
        mlflow_bridge.alias_set(project_slug=project.slug, alias=alias, mlflow_version=version.mlflow_version)
    except Exception as exc:  # noqa: BLE001 (whatever MLflow raises, the move must not half-happen)
        raise MlflowUnavailable(
            f"MLflow did not take the move ({type(exc).__name__}: {str(exc)[:300]}); nothing changed. "
            "Try again once MLflow is back."
        ) from exc


def _restore_alias(*, project: Project, alias: str, previous: ModelVersion | None) -> None:
    from flywheel.registry import mlflow_bridge

    if previous is None or not previous.mlflow_version:
        return
    try:
        mlflow_bridge.alias_set(project_slug=project.slug, alias=alias, mlflow_version=previous.mlflow_version)
    except Exception:  # noqa: BLE001 (the sync's reconcile puts it right later)
        logger.warning("registry: could not restore MLflow alias %s of %s", alias, project.slug)


def alias_move(
    *, project: Project, alias: str, version: ModelVersion, user=None, reason: str = "",
    kind: str = AliasEventKind.SET, actor: str = "", evidence: dict[str, Any] | None = None,
    weight: float | None = None,
) -> AliasEvent:
    """Point `alias` at `version` in the database and in MLflow together, record who, when, from, to and
    why, and queue the announcement to the serving stack.

    The one function every move goes through: promotion, rollback and a manual set. MLflow is written inside
    the database transaction, last: if MLflow refuses (MlflowUnavailable) the transaction rolls back and
    nothing changed anywhere; if the commit fails after MLflow moved, MLflow's alias is put back.
    `actor` names the rule that moved it ("gate", "canary", "watch"; "" for a person or the API) and
    `evidence` the figures it acted on; `weight` is the canary's share of traffic (the canary alias only)."""
    if alias not in Alias.values:
        raise RegistryError(f"Unknown alias {alias!r}; aliases are {', '.join(Alias.values)}.")
    if version.project_id != project.pk:
        raise RegistryError("That version belongs to another project.")
    previous: ModelVersion | None = None
    mirrored = False
    try:
        with transaction.atomic():
            project_lock(project=project)
            current = AliasAssignment.objects.filter(project=project, alias=alias).select_related("version").first()
            if current is not None and current.version_id == version.pk:
                raise RegistryError(f"{alias} already points at v{version.number}.")
            previous = current.version if current else None
            event = AliasEvent.objects.create(
                project=project, alias=alias, kind=kind, from_version=previous, to_version=version,
                reason=reason.strip(), user=user, mlflow_state=SyncState.DONE, actor=actor,
                evidence=evidence or {}, weight=weight if alias == Alias.CANARY else None,
                # Production and the canary are what serve: their moves are announced to the serving stack.
                webhook_state=SyncState.PENDING if alias in SERVED_ALIASES else SyncState.DONE,
            )
            if current is None:
                AliasAssignment.objects.create(project=project, alias=alias, version=version,
                                               weight=weight if alias == Alias.CANARY else None)
            else:
                current.version = version
                current.weight = weight if alias == Alias.CANARY else None
                current.save(update_fields=["version", "weight", "updated_at"])
            _mirror_alias(project=project, alias=alias, version=version)
            mirrored = True
            _sync_on_commit(project)
    except DatabaseError:
        if mirrored:
            _restore_alias(project=project, alias=alias, previous=previous)
        raise
    return event


def alias_end(
    *, project: Project, alias: str, user=None, reason: str = "", actor: str = "",
    evidence: dict[str, Any] | None = None,
) -> AliasEvent:
    """Point `alias` nowhere (a canary that ended): the assignment goes, an END event records the version it
    left (`to_version`), and MLflow's alias is deleted inside the transaction, last, as `alias_move` does.
    Production never ends: it is moved or rolled back."""
    if alias == Alias.PRODUCTION:
        raise RegistryError("Production cannot end; roll it back or promote another version.")
    from flywheel.registry import mlflow_bridge

    left: ModelVersion | None = None
    deleted = False
    try:
        with transaction.atomic():
            project_lock(project=project)
            current = AliasAssignment.objects.filter(project=project, alias=alias).select_related("version").first()
            if current is None:
                raise RegistryError(f"{alias} points at no version.")
            left = current.version
            event = AliasEvent.objects.create(
                project=project, alias=alias, kind=AliasEventKind.END, from_version=left, to_version=left,
                reason=reason.strip(), user=user, actor=actor, evidence=evidence or {}, weight=None,
                mlflow_state=SyncState.DONE,
                webhook_state=SyncState.PENDING if alias in SERVED_ALIASES else SyncState.DONE,
            )
            current.delete()
            try:
                mlflow_bridge.alias_delete(project_slug=project.slug, alias=alias)
            except Exception as exc:  # noqa: BLE001 (whatever MLflow raises, the end must not half-happen)
                raise MlflowUnavailable(
                    f"MLflow did not take the end of {alias} ({type(exc).__name__}: {str(exc)[:300]}); nothing "
                    "changed. Try again once MLflow is back."
                ) from exc
            deleted = True
            _sync_on_commit(project)
    except DatabaseError:
        if deleted and left is not None:
            _restore_alias(project=project, alias=alias, previous=left)
        raise
    return event


def promotable_check(*, project: Project, version: ModelVersion) -> AliasAssignment | None:
    """Refuse (RegistryError, StaleDecision) a version that may not serve in place of production: one whose
    latest gate decision did not pass, or passed against another production than the one serving now.
    Call it under the project's lock; answers production's assignment. Shared by a promotion and a canary."""
    decision = version.gate_decisions.order_by("-decided_at", "-id").first()
    if decision is None or not decision.passed:
        why = "has not been through the gate" if decision is None else "did not pass the gate"
        raise RegistryError(f"v{version.number} {why}; only a candidate that passed it is promoted.")
    current = AliasAssignment.objects.filter(project=project, alias=Alias.PRODUCTION).select_related(
        "version").first()
    if decision_stale(decision=decision, production_id=current.version_id if current else None):
        judged = f"v{decision.production.number}" if decision.production_id else "no production"
        raise StaleDecision(
            f"v{version.number} passed the gate against {judged}, but production is now "
            f"v{current.version.number}: it was never compared with what it would replace. Judge it again: "
            f"train or measure it against v{current.version.number}."
        )
    return current


def decision_stale(*, decision: GateDecision, production_id: int | None) -> bool:
    """A passed decision judged against another production than `production_id` (the one serving now) is
    stale: its candidate was never compared with what it would replace. One already serving is not."""
    return production_id is not None and production_id not in (decision.production_id, decision.candidate_id)


def model_promote(
    *, project: Project, version: ModelVersion, user=None, reason: str = "", actor: str = "",
    evidence: dict[str, Any] | None = None,
) -> AliasEvent:
    """Make `version` production: only a version whose latest gate decision passed against the production it
    replaces. A decision judged against another production is stale (v2 and v3 each beat v1; once v3 serves,
    v2 was never compared with it), checked under the project's lock so a move in between cannot slip by.

    In the same transaction (flywheel.registry.canary.after_production_move): a canary of this version ends
    as promoted, another canary ends (it was compared with a production that no longer serves), a running
    watch ends, and the watch of the new production starts."""
    from flywheel.registry import canary

    with transaction.atomic():
        project_lock(project=project)
        promotable_check(project=project, version=version)
        event = alias_move(project=project, alias=Alias.PRODUCTION, version=version, user=user, reason=reason,
                           kind=AliasEventKind.PROMOTE, actor=actor, evidence=evidence)
        canary.after_production_move(event=event)
        # Apps above the registry act in the same transaction: modes whose eval cases it passes count as fixed
        # (flywheel.evals.recurrence).
        signals.production_moved.send(sender=AliasEvent, event=event)
    return event


def model_rollback(
    *, project: Project, user=None, reason: str = "", to_version: ModelVersion | None = None, actor: str = "",
    evidence: dict[str, Any] | None = None,
) -> AliasEvent:
    """Move `production` back: to `to_version` (a version that served before), or to the one production held
    before the current version was promoted there (`selectors.rollback_target`). A person's rollback and the
    watch's are this one move; either ends a running watch and a canary (canary.after_production_move).
    A `to_version` newer than production is a promotion (`model_promote`: the gate's check, then the watch)."""
    from flywheel.registry import canary

    current = AliasAssignment.objects.filter(project=project, alias=Alias.PRODUCTION).first()
    if current is None:
        raise RegistryError("Nothing is in production yet.")
    served = AliasEvent.objects.filter(project=project, alias=Alias.PRODUCTION)
    if to_version is None:
        to_version = rollback_target(project=project)  # what the Models page's button names
        if to_version is None:
            raise RegistryError("Production has no earlier version to roll back to.")
    elif not served.filter(to_version=to_version).exists():
        raise RegistryError(f"v{to_version.number} never served in production; promote it instead.")
    elif to_version.number > current.version.number:
        # Forward to a version that served before (after a rollback from it) is a promotion, not a rollback:
        # it must still pass the gate against what serves now, and it is watched as any promotion is.
        return model_promote(project=project, version=to_version, user=user, actor=actor, evidence=evidence,
                             reason=reason or f"Promoted again: v{to_version.number} served before v"
                                              f"{current.version.number}.")
    with transaction.atomic():
        event = alias_move(project=project, alias=Alias.PRODUCTION, version=to_version, user=user,
                           reason=reason or f"Rolled back from v{current.version.number}.",
                           kind=AliasEventKind.ROLLBACK, actor=actor, evidence=evidence)
        canary.after_production_move(event=event)
    return event


# --- sync: MLflow and the serving stack ------------------------------------------------------------------------


def _sync_on_commit(project: Project) -> None:
    from flywheel.registry.tasks import registry_sync_task

    outbox.send_on_commit(registry_sync_task, project.pk)


def backoff(attempts: int) -> timedelta:
    """How long a failed delivery waits before its next attempt (alias moves and notifications alike)."""
    return timedelta(seconds=min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** max(0, attempts - 1)))


def _failed(event: AliasEvent, field: str, error: str) -> None:
    event.attempts += 1
    event.last_error = outbound.redact(error)[:2000]
    event.next_attempt_at = timezone.now() + backoff(event.attempts)
    setattr(event, field, SyncState.FAILED)
    event.save(update_fields=[field, "attempts", "last_error", "next_attempt_at"])


def webhook_body(event: AliasEvent) -> bytes:
    version = event.to_version
    payload = {
        "event": "alias.moved",
        "id": event.pk,
        "project": event.project.slug,
        "alias": event.alias,
        "kind": event.kind,
        "version": version.number,
        "from_version": event.from_version.number if event.from_version else None,
        "base_model_path": version.base.path,
        "adapter_path": version.adapter_path or None,
        "adapter_sha256": version.adapter_sha256 or None,
        "vllm_lora_name": serving.adapter_name(event.project.slug, version.number),
        "reason": event.reason,
        "actor": event.actor,
        "evidence": event.evidence,
        "weight": event.weight,
        "at": event.at.isoformat(),
        # What serves when this is sent (moves are sent in order), production and the canary with its weight:
        # a router applies it as is.
        **serving.serving_split(event.project),
    }
    return json.dumps(payload, sort_keys=True).encode()


def webhook_signature(secret: str, timestamp: str, body: bytes) -> str:
    """HMAC-SHA256 over "<timestamp>.<body>": a receiver checks it and refuses old timestamps (replays)."""
    return "sha256=" + hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def _post(url: str, body: bytes, headers: dict[str, str]) -> int:
    # Through the outbound guard: a URL a maintainer set may name only a destination the operator allows,
    # checked on the resolved address now, and a redirect is a failed delivery, never followed.
    response = outbound.post(url, body=body, headers={"Content-Type": "application/json", **headers},
                             timeout=WEBHOOK_TIMEOUT_S)
    return response.status


def signed_headers(*, secret: str, event_type: str, delivery: str, body: bytes) -> dict[str, str]:
    """The webhook's headers: its event type, timestamp and delivery id, and the signature where a secret is set."""
    timestamp = str(int(time.time()))
    headers = {"X-Flywheel-Event": event_type, "X-Flywheel-Timestamp": timestamp, "X-Flywheel-Delivery": delivery}
    if secret:
        headers["X-Flywheel-Signature"] = webhook_signature(secret, timestamp, body)
    return headers


def deliver(*, target: str, url: str, body: bytes, headers: dict[str, str], ok_codes: tuple[int, ...] = (),
            event: AliasEvent | None = None, notification=None) -> None:
    """POST and log the attempt under the alias move or notification it is for; raises when the receiver did not
    take it. The log and the error carry the URL without its credentials or query (outbound.redact)."""
    started = time.monotonic()
    status, error = None, ""
    try:
        status = _post(url, body, headers)
        if not 200 <= status < 300 and status not in ok_codes:
            error = f"HTTP {status}"
    except Exception as exc:  # noqa: BLE001 (refused, timed out, bad address: all a failed delivery)
        error = f"{type(exc).__name__}: {exc}"
    _delivery_log(target=target, url=url, status=status, error=error, started=started, event=event,
                  notification=notification)
    if error:
        raise RuntimeError(f"{target} {outbound.redact_url(url)}: {outbound.redact(error)}")


def _delivery_log(*, target: str, url: str, status: int | None, error: str, started: float,
                  event: AliasEvent | None, notification) -> None:
    WebhookDelivery.objects.create(event=event, notification=notification, target=target,
                                   url=outbound.redact_url(url)[:1000], status_code=status,
                                   error=outbound.redact(error)[:2000],
                                   duration_ms=int((time.monotonic() - started) * 1000))


def webhook_deliver(*, config: RegistrySettings, event_type: str, delivery: str, body: bytes,
                    event: AliasEvent | None = None, notification=None) -> None:
    """POST `body` to the project's webhook, signed under its secret where one is set. A secret that is set
    but that no key of this server opens (SECRET_KEY rotated without SECRET_KEY_FALLBACKS) fails the delivery,
    saying why: the receiver is never sent unsigned what it expects signed."""
    try:
        secret = sealed.readable(config.webhook_secret)
    except sealed.Unreadable as exc:
        error = f"not sent: the webhook secret {exc}"
        _delivery_log(target="webhook", url=config.webhook_url, status=None, error=error, started=time.monotonic(),
                      event=event, notification=notification)
        raise RuntimeError(f"webhook {outbound.redact_url(config.webhook_url)}: {error}") from None
    headers = signed_headers(secret=secret, event_type=event_type, delivery=delivery, body=body)
    deliver(target="webhook", url=config.webhook_url, body=body, headers=headers, event=event,
            notification=notification)


def _announce(event: AliasEvent, config: RegistrySettings | None) -> None:
    """Tell the serving stack: a vLLM server loads the adapter under a name of its own, then the webhook."""
    version = event.to_version
    # An ended canary loads nothing (its adapter stays loaded: requests routed before the end may still come).
    if config and config.vllm_url and version.adapter_path and event.kind != AliasEventKind.END:
        body = json.dumps({"lora_name": serving.adapter_name(event.project.slug, version.number),
                           "lora_path": version.adapter_path}).encode()
        # vLLM answers 400 when that name is loaded already (a retry after a lost answer): done.
        deliver(target="vllm", url=config.vllm_url.rstrip("/") + "/v1/load_lora_adapter", body=body, headers={},
                ok_codes=(400,), event=event)
    if config and config.webhook_url:
        webhook_deliver(config=config, event_type="alias.moved", delivery=str(event.pk), body=webhook_body(event),
                        event=event)


def registry_sync(*, project_id: int) -> dict[str, int]:
    """Make MLflow and the serving stack agree with the database, for one project. Safe to run again.

    The database already holds every move; this only mirrors it. A failure is recorded on the event and
    retried by the sweep, with backoff: the pages say what is waiting and why."""
    done = {"versions": 0, "aliases": 0, "webhooks": 0, "failed": 0}
    project = Project.objects.filter(pk=project_id).first()
    if project is None:
        return done  # deleted since the move was queued: nothing left to mirror
    from flywheel.registry import mlflow_bridge

    for version_id in ModelVersion.objects.filter(project=project, mlflow_version="").values_list("id", flat=True):
        try:
            # Under the project's lock, like a move that registers its version: never registered twice.
            with transaction.atomic():
                project_lock(project=project)
                version = (ModelVersion.objects.select_related("base", "project")
                           .filter(pk=version_id, mlflow_version="").first())
                if version is None:
                    continue
                mlflow_version = mlflow_bridge.version_register(version)
                ModelVersion.objects.filter(pk=version.pk).update(mlflow_version=mlflow_version)
        except Exception as exc:  # noqa: BLE001 (MLflow being away must not lose the move)
            logger.warning("registry: MLflow registration of version id %s failed: %s", version_id,
                           outbound.redact(str(exc)))
            done["failed"] += 1
            AliasEvent.objects.filter(project=project, mlflow_state=SyncState.PENDING).update(
                mlflow_state=SyncState.FAILED, last_error=f"MLflow: {exc}"[:2000],
                next_attempt_at=timezone.now() + backoff(1),
            )
            return done
        done["versions"] += 1

    # Reconcile: MLflow's aliases follow the database's (a move whose commit failed after MLflow moved,
    # an alias someone set in MLflow's own UI). Under the project's row lock, the one every move holds while
    # it writes MLflow and commits: a reconcile that read the assignments before a move committed would
    # otherwise put MLflow's alias back to where the database no longer points.
    waiting = AliasEvent.objects.filter(project=project).exclude(mlflow_state=SyncState.DONE)
    try:
        with transaction.atomic():
            project_lock(project=project)
            assigned = set()
            for assignment in AliasAssignment.objects.filter(project=project).select_related("version"):
                assigned.add(assignment.alias)
                mlflow_version = assignment.version.mlflow_version
                if mlflow_version and mlflow_bridge.alias_get(project_slug=project.slug,
                                                              alias=assignment.alias) != mlflow_version:
                    mlflow_bridge.alias_set(project_slug=project.slug, alias=assignment.alias,
                                            mlflow_version=mlflow_version)
                    done["aliases"] += 1
            # An alias that ended here (a canary) ends in MLflow too.
            for alias in (Alias.CANARY,):
                if alias not in assigned and AliasEvent.objects.filter(project=project, alias=alias).exists() \
                        and mlflow_bridge.alias_get(project_slug=project.slug, alias=alias) is not None:
                    mlflow_bridge.alias_delete(project_slug=project.slug, alias=alias)
                    done["aliases"] += 1
            waiting.update(mlflow_state=SyncState.DONE)
    except Exception as exc:  # noqa: BLE001
        for event in waiting:
            _failed(event, "mlflow_state", f"MLflow: {exc}")
        done["failed"] += 1

    config = RegistrySettings.objects.filter(project=project).first()
    pending = AliasEvent.objects.filter(project=project).exclude(webhook_state=SyncState.DONE).order_by("at", "id")
    for event_id in pending.values_list("id", flat=True):
        with transaction.atomic():
            # Two sync runs at once never announce one move twice: the row is held while it is sent.
            event = (AliasEvent.objects.select_for_update(skip_locked=True, of=("self",))
                     .select_related("project", "to_version__base", "from_version")
                     .filter(pk=event_id).exclude(webhook_state=SyncState.DONE).first())
            if event is None:
                continue
            try:
                _announce(event, config)
            except Exception as exc:  # noqa: BLE001
                _failed(event, "webhook_state", f"Webhook: {exc}")
                done["failed"] += 1
                break  # keep the order: a later move is not announced before an earlier one
            event.webhook_state = SyncState.DONE
            event.save(update_fields=["webhook_state"])
            done["webhooks"] += 1
    return done


def registry_sweep() -> int:
    """The outbox sweep: projects with a move still to mirror or announce whose retry time has come."""
    from flywheel.registry.tasks import registry_sync_task

    now = timezone.now()
    stale = now - outbox.requeue_after()
    due = AliasEvent.objects.filter(
        Q(mlflow_state=SyncState.FAILED) | Q(webhook_state=SyncState.FAILED), next_attempt_at__lte=now
    ) | AliasEvent.objects.filter(
        Q(mlflow_state=SyncState.PENDING) | Q(webhook_state=SyncState.PENDING), at__lte=stale
    )
    projects = set(due.values_list("project_id", flat=True))
    projects |= set(ModelVersion.objects.filter(mlflow_version="", created_at__lte=stale)
                    .values_list("project_id", flat=True))
    for project_id in sorted(projects):
        try:
            outbox.send(registry_sync_task, project_id)
        except outbox.BrokerUnavailable:
            break
    return len(projects)


# --- the gate's rules ----------------------------------------------------------------------------------------

GATE_RULE_FIELDS = ("success_margin", "test", "confidence", "latency_tolerance", "latency_cases", "tokens_tolerance",
                    "invalid_test", "invalid_tolerance", "expected_gain", "require_regression", "unsafe_zero_tolerance")
GATE_BOOLEAN_RULES = ("require_regression", "unsafe_zero_tolerance")
_INTEGER_RULES = ("latency_cases",)
_CHOICE_RULES = ("test", "invalid_test")


def serving_settings_set(*, project: Project, webhook_url: str, webhook_secret: str | None,
                         vllm_url: str) -> RegistrySettings:
    """Where moves of production are announced: the webhook (and its signing secret) and the vLLM server.

    `webhook_secret` None keeps the stored secret, "" clears it. The secret is bound to the webhook's origin:
    a webhook moved to another origin needs it given again (or cleared), else the new address would receive
    payloads signed with a secret meant for the old one. Raises ValidationError naming each wrong field."""
    with transaction.atomic():
        config = (RegistrySettings.objects.select_for_update().filter(project=project).first()
                  or RegistrySettings(project=project))
        rebind = outbound.secret_rebind_error(
            old_url=config.webhook_url, new_url=webhook_url.strip(), secret_set=bool(config.webhook_secret),
            secret_given=webhook_secret is not None, what="webhook secret",
            clear_hint="tick \"Remove the stored secret\"")
        config.webhook_url, config.vllm_url = webhook_url.strip(), vllm_url.strip()
        if webhook_secret is not None:
            config.webhook_secret = webhook_secret
        errors: dict[str, list[str]] = {}
        try:
            config.full_clean(exclude=["project"])
        except ValidationError as exc:
            errors = exc.message_dict
        if rebind:
            errors.setdefault("webhook_secret", []).append(rebind)
        if errors:
            raise ValidationError(errors)
        config.save()
    return config


def gate_rules_set(*, project: Project, data: dict[str, Any], auto_promote: bool) -> RegistrySettings:
    """A project's gate rules (blank: the default) and whether a passing candidate is promoted at once.
    Each wrong value is an error on its field."""
    from flywheel.registry.gate import GateRules

    defaults = GateRules()
    rules: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for name in GATE_RULE_FIELDS:
        raw = str(data.get(name, "") or "").strip()
        if raw == "":
            continue
        if name in _CHOICE_RULES:
            rules[name] = raw
        elif name in GATE_BOOLEAN_RULES:
            if raw.lower() not in {"true", "false", "on", "off", "1", "0"}:
                errors[name] = "true or false."
                continue
            rules[name] = raw.lower() in {"true", "on", "1"}
        elif name in _INTEGER_RULES:
            if not (raw.isascii() and raw.isdigit()):
                errors[name] = f"A whole number, like {getattr(defaults, name)}."
                continue
            rules[name] = int(raw)
        else:
            try:
                rules[name] = float(raw)
            except ValueError:
                errors[name] = f"A number, like {getattr(defaults, name)}."
                continue
        try:
            # Each field on its own, with the tolerance a non-inferiority test needs to be checked alone.
            GateRules(**({"invalid_tolerance": 0.01} if name == "invalid_test" else {}), **{name: rules[name]})
        except (ValueError, TypeError) as exc:
            errors[name] = str(exc)
    if not errors:
        try:  # rules that only make sense together (non-inferiority needs a tolerance above 0)
            GateRules(**rules)
        except (ValueError, TypeError) as exc:
            errors["invalid_tolerance" if "invalid_tolerance" in str(exc) else "test"] = str(exc)
    for name in ("latency_tolerance", "tokens_tolerance"):
        if name in rules and name not in errors and not 0 <= rules[name] <= 10:
            errors[name] = "Between 0 and 10 (0.1 = 10% above production's)."
    if errors:
        raise ValidationError(errors)
    with transaction.atomic():
        config, _ = RegistrySettings.objects.select_for_update().get_or_create(project=project)
        config.gate_rules = rules
        config.auto_promote = bool(auto_promote)
        config.save(update_fields=["gate_rules", "auto_promote"])
    return config
