"""Live metrics on the pages: the Models page's panel (registry/_live.html: each version's traffic with small
series, the window chooser, the unmapped strings and the mapped names), mapping and unmapping a string
(maintainers), and a version's own page with its full live metrics (registry/version.html)."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from flywheel.accounts.access import project_view
from flywheel.accounts.models import Project, Role
from flywheel.registry import cost, live, selectors
from flywheel.registry.cost import gpu_time, money
from flywheel.registry.models import ModelVersion


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def _mean(value: float | None, unit: str = "") -> str:
    return "—" if value is None else f"{value:,.0f}{unit}"


def _metric_cells(metrics: dict[str, Any]) -> dict[str, str]:
    """The figures as the pages print them."""
    return {"failure_rate": _pct(metrics["failure_rate"]),
            "tokens": _mean(metrics["tokens_per_trajectory"]),
            "latency": _mean(metrics["latency_ms_per_trajectory"], " ms")}


def cost_cells(figures: dict[str, Any]) -> dict[str, str]:
    """A version's cost per 1,000 requests (flywheel.registry.cost.cost_of) as the pages print it."""
    share = figures["priced_share"]
    return {"tokens": money(figures["token_cost_per_1k"]),
            "priced": "" if share is None or figures["token_cost_per_1k"] is None or share >= 0.995
            else f"from {share:.0%} of its trajectories",
            "gpu": gpu_time(figures["gpu_seconds_per_1k"]),
            "price": ("—" if figures["price_input_per_m"] is None and figures["price_output_per_m"] is None else
                      f"{money(figures['price_input_per_m'])} in / {money(figures['price_output_per_m'])} out per 1M"),
            "source": figures["price_source"]}


def _window(request: HttpRequest) -> str:
    window = request.GET.get("window", live.DEFAULT_WINDOW)
    return window if window in live.WINDOWS else live.DEFAULT_WINDOW


def live_panel_context(*, request: HttpRequest, project: Project) -> dict[str, Any]:
    """What registry/_live.html needs on the Models page; the window comes from ?window= (24h by default)."""
    summary = live.live_summary(project=project, window=_window(request))
    for row in summary["rows"]:
        row["cells"] = _metric_cells(row["metrics"])
        row["cost_cells"] = cost_cells(row["cost"])
        row["unsafe_pct"] = _pct(row["unsafe"]["rate"])
    chart = {"step": summary["rows"][0]["series"]["step"] if summary["rows"] else "hour",
             "versions": [{"version": r["number"], "series": r["series"]} for r in summary["rows"]]}
    return {"live": summary, "live_chart": chart, "version_names": live.version_names(project=project),
            "live_state": live.rollup_state()}


def _models_page(request: HttpRequest, project: Project, **extra: Any) -> HttpResponse:
    from flywheel.registry.views import _context  # the Models page's context (views imports this module)

    return render(request, "registry/models.html", _context(request, project, **extra), status=422)


def _back(project: Project, note: str) -> HttpResponse:
    return redirect(reverse("registry_page", args=[project.slug]) + f"?done={note}#live")


@require_POST
@project_view(Role.MAINTAINER)
def version_name_set(request: HttpRequest, project: Project) -> HttpResponse:
    name, number = request.POST.get("name", ""), request.POST.get("version", "")
    try:
        live.version_name_set(project=project, name=name, version_number=number, user=request.user)
    except ValidationError as exc:
        return _models_page(request, project, names_errors=exc.message_dict, names_form={"name": name, "version": number})
    return _back(project, "name-mapped")


@require_POST
@project_view(Role.MAINTAINER)
def version_name_remove(request: HttpRequest, project: Project) -> HttpResponse:
    live.version_name_remove(project=project, name=request.POST.get("name", ""))
    return _back(project, "name-removed")


@require_GET
@project_view()
def version_page(request: HttpRequest, project: Project, version_number: int) -> HttpResponse:
    return _version_page(request, project, version_number)


def _version_page(request: HttpRequest, project: Project, version_number: int, status: int = 200,
                  **extra: Any) -> HttpResponse:
    version = get_object_or_404(ModelVersion.objects.select_related("base", "created_by"), project=project,
                                number=version_number)
    window = request.GET.get("window", live.DEFAULT_WINDOW)
    try:
        metrics = live.live_metrics(project=project, version=version, window=window)
    except live.WindowError as exc:
        return HttpResponseBadRequest(str(exc))
    aliases = selectors.aliases_of(project=project)
    return render(request, "registry/version.html", {
        "project": project, "version": version, "live": metrics, "cells": _metric_cells(metrics["metrics"]),
        "cost": metrics["cost"], "cost_cells": cost_cells(metrics["cost"]),
        "price_forms": extra.pop("price_forms", None) or {
            "version": {f: _price_text(getattr(version, f)) for f in cost.PRICE_FIELDS},
            "base": {f: _price_text(getattr(version.base, f)) for f in cost.PRICE_FIELDS}},
        "signals": [{**s, "pct": _pct(s["rate"])} for s in metrics["signals"]],
        "windows": list(live.WINDOWS), "window": window,
        "aliases": [alias for alias, v in aliases.items() if v is not None and v.pk == version.pk],
        "chart": {"step": metrics["series"]["step"], "versions": [{"version": version.number,
                                                                   "series": metrics["series"]}]},
        "is_maintainer": request.membership.grants(Role.MAINTAINER), "live_state": live.rollup_state(),
        **extra,
    }, status=status)


def _price_text(value: float | None) -> str:
    return "" if value is None else f"{value:g}"


@require_POST
@project_view(Role.MAINTAINER)
def version_price_set(request: HttpRequest, project: Project, version_number: int) -> HttpResponse:
    """The version page's price forms: the version's own price, or its base model's (`on`)."""
    version = get_object_or_404(ModelVersion.objects.select_related("base"), project=project, number=version_number)
    on = "base" if request.POST.get("on") == "base" else "version"
    data = {f: request.POST.get(f, "") for f in cost.PRICE_FIELDS}
    try:
        cost.price_set(target=version.base if on == "base" else version, data=data)
    except ValidationError as exc:
        forms = {"version": {f: _price_text(getattr(version, f)) for f in cost.PRICE_FIELDS},
                 "base": {f: _price_text(getattr(version.base, f)) for f in cost.PRICE_FIELDS}}
        forms[on] = data
        return _version_page(request, project, version_number, status=422, price_forms=forms,
                             price_errors={on: exc.message_dict})
    return redirect(reverse("registry_version", args=[project.slug, version_number]) + "?done=price#price")
