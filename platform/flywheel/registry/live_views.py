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
from flywheel.registry import live, selectors
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


def _window(request: HttpRequest) -> str:
    window = request.GET.get("window", live.DEFAULT_WINDOW)
    return window if window in live.WINDOWS else live.DEFAULT_WINDOW


def live_panel_context(*, request: HttpRequest, project: Project) -> dict[str, Any]:
    """What registry/_live.html needs on the Models page; the window comes from ?window= (24h by default)."""
    summary = live.live_summary(project=project, window=_window(request))
    for row in summary["rows"]:
        row["cells"] = _metric_cells(row["metrics"])
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
        "signals": [{**s, "pct": _pct(s["rate"])} for s in metrics["signals"]],
        "windows": list(live.WINDOWS), "window": window,
        "aliases": [alias for alias, v in aliases.items() if v is not None and v.pk == version.pk],
        "chart": {"step": metrics["series"]["step"], "versions": [{"version": version.number,
                                                                   "series": metrics["series"]}]},
        "is_maintainer": request.membership.grants(Role.MAINTAINER), "live_state": live.rollup_state(),
    })
