"""The project's Models page: what serves (production) and what waits (candidate), every version with its
lineage, the alias history with who moved it and why, and one-click promote and roll back (maintainers)."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from flywheel.accounts.access import project_view
from flywheel.accounts.models import Project, Role
from flywheel.demo_status import demo_status_of
from flywheel.registry import cost, model_folder, selectors, services
from flywheel.registry.canary_views import live_context
from flywheel.registry.cost import money
from flywheel.registry.live_views import cost_cells, live_panel_context
from flywheel.registry.models import Alias, GateDecision, ModelVersion


def _context(request: HttpRequest, project: Project, **extra) -> dict:
    aliases = selectors.aliases_of(project=project)
    versions = selectors.versions_of(project=project)
    decisions = selectors.latest_gate_decisions(project=project)
    return {
        "project": project,
        "production": aliases.get(Alias.PRODUCTION),
        "candidate": aliases.get(Alias.CANDIDATE),
        "candidate_decision": selectors.latest_gate_decision(version=aliases.get(Alias.CANDIDATE)),
        "since": selectors.alias_since(project=project),
        "versions": versions,
        # Each version with the gate decision that counts for it (None: never judged).
        "version_rows": [(v, decisions.get(v.pk)) for v in versions],
        "rollback_to": selectors.rollback_target(project=project),
        "history": selectors.alias_history(project=project),
        "served": selectors.served_version_ids(project=project),
        "config": selectors.settings_of(project=project),
        "deliveries": selectors.deliveries_of(project=project),
        "gate_rules": selectors.gate_rules_of(project=project),
        "passed_gate": selectors.passed_gate_ids(project=project),
        "decisions": selectors.gate_decisions(project=project),
        "is_maintainer": request.membership.grants(Role.MAINTAINER),
        "demo_status": demo_status_of(project=project),
        "model_parts": model_folder.PARTS,
        "model_roots": services.model_roots(project=project),
        **live_context(project=project),  # the canary and the watch (registry/_canary.html)
        **live_panel_context(request=request, project=project),  # live metrics (registry/_live.html)
        **extra,
    }


def _back(project: Project, note: str = "") -> HttpResponse:
    return redirect(reverse("registry_page", args=[project.slug]) + (f"?done={note}" if note else ""))


@require_GET
@project_view()
def registry_page(request: HttpRequest, project: Project) -> HttpResponse:
    return render(request, "registry/models.html", _context(request, project))


@require_POST
@project_view(Role.MAINTAINER)
def base_model_register(request: HttpRequest, project: Project) -> HttpResponse:
    name, path = request.POST.get("name", ""), request.POST.get("path", "")
    try:
        services.base_model_register_checked(project=project, name=name, path=path, user=request.user)
    except ValidationError as exc:
        context = _context(request, project, base_errors=exc.message_dict, base_form={"name": name, "path": path})
        return render(request, "registry/models.html", context, status=422)
    return _back(project, "registered")


@require_POST
@project_view(Role.MAINTAINER)
def version_promote(request: HttpRequest, project: Project, version_number: int) -> HttpResponse:
    version = get_object_or_404(ModelVersion, project=project, number=version_number)
    try:
        services.model_promote(project=project, version=version, user=request.user,
                               reason=request.POST.get("reason", ""))
    except services.RegistryError as exc:
        return render(request, "registry/models.html", _context(request, project, action_error=str(exc)), status=409)
    return _back(project, "promoted")


@require_POST
@project_view(Role.MAINTAINER)
def production_rollback(request: HttpRequest, project: Project) -> HttpResponse:
    number = request.POST.get("to", "")
    to_version = None
    if number:
        if not number.isascii() or not number.isdigit():
            return render(request, "registry/models.html",
                          _context(request, project, action_error="Choose a version to roll back to."), status=400)
        to_version = get_object_or_404(ModelVersion, project=project, number=int(number))
    try:
        event = services.model_rollback(project=project, user=request.user, reason=request.POST.get("reason", ""),
                                        to_version=to_version)
    except services.RegistryError as exc:
        return render(request, "registry/models.html", _context(request, project, action_error=str(exc)), status=409)
    return _back(project, "promoted" if event.kind == "promote" else "rolled-back")


@require_POST
@project_view(Role.MAINTAINER)
def registry_settings_save(request: HttpRequest, project: Project) -> HttpResponse:
    secret = request.POST.get("webhook_secret", "") or None  # blank keeps the secret: it is never shown back
    if request.POST.get("webhook_secret_clear"):
        secret = ""
    try:
        services.serving_settings_set(project=project, webhook_url=request.POST.get("webhook_url", ""),
                                      webhook_secret=secret, vllm_url=request.POST.get("vllm_url", ""))
    except ValidationError as exc:
        # The form shows what was typed, with the stored secret's state as it is.
        config = selectors.settings_of(project=project)
        config.webhook_url = request.POST.get("webhook_url", "").strip()
        config.vllm_url = request.POST.get("vllm_url", "").strip()
        context = _context(request, project, config=config, settings_errors=exc.message_dict)
        return render(request, "registry/models.html", context, status=422)
    return _back(project, "saved")


@require_POST
@project_view(Role.MAINTAINER)
def gate_rules_save(request: HttpRequest, project: Project) -> HttpResponse:
    data = {name: request.POST.get(name, "") for name in services.GATE_RULE_FIELDS}
    for name in services.GATE_BOOLEAN_RULES:  # a checkbox: absent when unticked
        data[name] = "true" if request.POST.get(name) == "on" else "false"
    try:
        services.gate_rules_set(project=project, data=data, auto_promote=request.POST.get("auto_promote") == "on")
    except ValidationError as exc:
        context = _context(request, project, rules_errors=exc.message_dict, rules_form=data)
        return render(request, "registry/models.html", context, status=422)
    return _back(project, "gate-rules")


@require_GET
@project_view()
def gate_decision_page(request: HttpRequest, project: Project, decision_id: int) -> HttpResponse:
    decision = get_object_or_404(
        GateDecision.objects.select_related("project", "candidate__base", "production__base", "job"), project=project,
        pk=decision_id,
    )
    in_production = selectors.production_of(project=project)
    stale = decision.passed and services.decision_stale(
        decision=decision, production_id=in_production.pk if in_production else None)
    costs = cost.gate_cost(decision=decision)
    for side in costs:
        side["cells"] = {"holdout": money(side["holdout_cost_per_1k"]), **cost_cells(side["live"])}
    return render(request, "registry/gate.html", {
        "project": project, "decision": decision, "stale": stale, "costs": costs, "cost_window": cost.GATE_WINDOW,
        "is_maintainer": request.membership.grants(Role.MAINTAINER), "in_production": in_production,
    })
