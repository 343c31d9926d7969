"""Reads of the registry for its pages and the API."""

from __future__ import annotations

from django.db.models import Q

from flywheel.accounts.models import Project
from flywheel.registry.models import (
    Alias,
    AliasAssignment,
    AliasEvent,
    AliasEventKind,
    GateDecision,
    ModelVersion,
    RegistrySettings,
    WebhookDelivery,
)


def aliases_of(*, project: Project) -> dict[str, ModelVersion]:
    rows = AliasAssignment.objects.filter(project=project).select_related("version__base")
    return {row.alias: row.version for row in rows}


def production_of(*, project: Project) -> ModelVersion | None:
    return aliases_of(project=project).get(Alias.PRODUCTION)


def alias_since(*, project: Project, alias: str = Alias.PRODUCTION) -> AliasEvent | None:
    return AliasEvent.objects.filter(project=project, alias=alias).select_related("user").first()


def versions_of(*, project: Project, limit: int = 200) -> list[ModelVersion]:
    return list(ModelVersion.objects.filter(project=project).select_related("base", "created_by")[:limit])


def alias_history(*, project: Project, limit: int = 100) -> list[AliasEvent]:
    return list(
        AliasEvent.objects.filter(project=project)
        .select_related("user", "from_version", "to_version")[:limit]
    )


def served_version_ids(*, project: Project) -> set[int]:
    """Versions that were production at some time: the ones a rollback may return to."""
    return set(
        AliasEvent.objects.filter(project=project, alias=Alias.PRODUCTION).values_list("to_version_id", flat=True)
    )


def rollback_target(*, project: Project) -> ModelVersion | None:
    """The version a plain rollback returns production to: the one production held before the current version
    was promoted (or set) there. Not the version a rollback just left: rolling back twice goes further back,
    never forth again. None when there is none (the first version, or nothing in production)."""
    current = AliasAssignment.objects.filter(project=project, alias=Alias.PRODUCTION).first()
    if current is None:
        return None
    arrival = (AliasEvent.objects.filter(project=project, alias=Alias.PRODUCTION, to_version_id=current.version_id)
               .exclude(kind=AliasEventKind.ROLLBACK).select_related("from_version").first())
    if arrival is None or arrival.from_version is None or arrival.from_version_id == current.version_id:
        return None
    return arrival.from_version


def latest_gate_decisions(*, project: Project) -> dict[int, GateDecision]:
    """Per version (by id), the gate decision that counts for it: its latest."""
    latest: dict[int, GateDecision] = {}
    for decision in GateDecision.objects.filter(project=project).order_by("decided_at", "id"):
        latest[decision.candidate_id] = decision
    return latest


def settings_of(*, project: Project) -> RegistrySettings:
    return RegistrySettings.objects.filter(project=project).first() or RegistrySettings(project=project)


def gate_decisions(*, project: Project, limit: int = 50) -> list[GateDecision]:
    return list(GateDecision.objects.filter(project=project).select_related("candidate", "production", "job")[:limit])


def passed_gate_ids(*, project: Project) -> set[int]:
    """Versions whose latest gate decision passed: the ones that may be promoted."""
    latest: dict[int, bool] = {}
    for candidate_id, passed in (GateDecision.objects.filter(project=project)
                                 .order_by("decided_at", "id").values_list("candidate_id", "passed")):
        latest[candidate_id] = passed
    return {pk for pk, passed in latest.items() if passed}


def latest_gate_decision(*, version: ModelVersion | None) -> GateDecision | None:
    """The decision that counts for `version` (the latest), with both sides for the page."""
    if version is None:
        return None
    return (GateDecision.objects.filter(candidate=version).select_related("production")
            .order_by("-decided_at", "-id").first())


def deliveries_of(*, project: Project, limit: int = 20) -> list[WebhookDelivery]:
    """The delivery log: each attempt to announce a move of an alias, or to send a notification, newest first."""
    return list(WebhookDelivery.objects.filter(Q(event__project=project) | Q(notification__project=project))
                .select_related("event__to_version", "notification")[:limit])


def gate_rules_of(*, project: Project) -> dict:
    """The rules the gate judges this project's candidates by: the project's own over the defaults."""
    from dataclasses import asdict

    from flywheel.registry.gate_runs import rules_for

    return asdict(rules_for(project))
