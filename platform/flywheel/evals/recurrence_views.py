"""The per-version part of a failure mode's page, loaded by htmx from the failures app's page (which cannot
import the registry or evals): each version's share of production traffic that matches the mode, beside its results
on the mode's eval cases."""

from __future__ import annotations

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from flywheel.accounts.access import project_view
from flywheel.accounts.models import Project
from flywheel.evals.recurrence import mode_version_rates
from flywheel.failures.models import FailureMode


@require_GET
@project_view()
def failure_mode_versions(request: HttpRequest, project: Project, mode_id: int) -> HttpResponse:
    mode = FailureMode.objects.filter(project=project, pk=mode_id).select_related("project").first()
    if mode is None:
        raise Http404("No such failure mode in this project.")
    return render(request, "registry/_failure_mode_versions.html", {
        "project": project, "mode": mode, "rows": mode_version_rates(failure_mode=mode),
    })
