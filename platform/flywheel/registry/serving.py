"""What serves now: production's version and adapter name, the canary's with its share of traffic, and during
the watch of a new production the replaced version's holdback with its share.

One answer for everyone who routes requests: the signed webhook's body carries it on every move, `GET
/api/v1/serving` answers it to a serving stack or the reference router (`python -m flywheel.router`) that
polls, and the pages show it."""

from __future__ import annotations

import re
from typing import Any

from flywheel.accounts.models import Project
from flywheel.registry.models import Alias, AliasAssignment, ModelVersion


def adapter_name(project_slug: str, number: int) -> str:
    """The name a version is served under: a new name per version, since vLLM may serve a stale prefix cache for
    a name reloaded in place. Production traffic that carries it as `model_version` maps to the version by
    itself (flywheel.registry.live)."""
    return f"{project_slug}-v{number}"


def adapter_number(project_slug: str, name: str) -> int | None:
    """n when `name` is `adapter_name(project_slug, n)`, else None (the inverse, for traffic's `model_version`)."""
    match = re.fullmatch(re.escape(project_slug) + r"-v([1-9][0-9]{0,8})", name)
    return int(match.group(1)) if match else None


def _arm(project: Project, version: ModelVersion) -> dict[str, Any]:
    return {"version": version.number, "adapter": adapter_name(project.slug, version.number),
            "adapter_path": version.adapter_path or None, "base_model_path": version.base.path}


def serving_split(project: Project) -> dict[str, Any]:
    """`{"production": {version, adapter, …} | None, "canary": {version, adapter, …, weight} | None,
    "holdback": {version, adapter, …, weight} | None}`.

    The weights a router applies: the canary's share goes to the canary's adapter, the holdback's (while the
    watch of a new production runs with one: the version it replaced, the watch's concurrent comparison) to the
    replaced version's, the rest to production's."""
    from flywheel.registry.models import LiveCheck, LiveCheckKind, LiveCheckStatus

    assigned = {a.alias: a for a in AliasAssignment.objects.filter(
        project=project, alias__in=[Alias.PRODUCTION, Alias.CANARY]).select_related("version__base")}
    production = assigned.get(Alias.PRODUCTION)
    canary = assigned.get(Alias.CANARY)
    out: dict[str, Any] = {"production": _arm(project, production.version) if production else None,
                           "canary": None}
    if canary is not None:
        out["canary"] = {**_arm(project, canary.version), "weight": canary.weight}
    out["holdback"] = None
    watch = (LiveCheck.objects.filter(project=project, kind=LiveCheckKind.WATCH,
                                      status__in=[LiveCheckStatus.RUNNING, LiveCheckStatus.FLAGGED])
             .select_related("baseline__base").order_by("-started_at", "-id").first())
    weight = float((watch.rules or {}).get("holdback") or 0) if watch is not None else 0.0
    if production is not None and watch is not None and weight > 0 and watch.subject_id == production.version_id \
            and watch.baseline_id != production.version_id:
        out["holdback"] = {**_arm(project, watch.baseline), "weight": weight}
    return out
