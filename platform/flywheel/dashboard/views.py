"""The flywheel dashboard page, /p/<project_slug>/dashboard/: reads from `flywheel.dashboard.selectors`."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from flywheel.accounts.access import project_view
from flywheel.accounts.models import Project
from flywheel.dashboard import selectors as dashboard
from flywheel.demo_status import demo_status_of
from flywheel.registry import selectors
from flywheel.registry.models import ModelVersion
from flywheel.trajectories.models import Trajectory


def _number(raw: str) -> int | None:
    """A whole number from a query parameter, or None (ASCII digits only: int() would take "²" or "１")."""
    return int(raw) if raw and len(raw) <= 9 and raw.isascii() and raw.isdigit() else None


@require_GET
@project_view()
def dashboard_page(request: HttpRequest, project: Project) -> HttpResponse:
    """The flywheel dashboard: the funnel, a version's lineage (`?version=N`, else production's), the versions
    a trajectory helped train (`?trajectory=ID`, else the newest such trajectories), failure modes: what is
    behind each and its pass rate on each version."""
    notes = []
    raw_version, raw_trajectory = request.GET.get("version", ""), request.GET.get("trajectory", "")
    number = _number(raw_version)
    version = ModelVersion.objects.filter(project=project, number=number).select_related("base").first() \
        if number is not None else None
    if raw_version and version is None:
        notes.append(f"No version v{raw_version[:20]} in this project: showing production's lineage.")
    version = version or selectors.production_of(project=project)
    trajectory_id = _number(raw_trajectory)
    looked_up = None
    if raw_trajectory:
        trajectory = Trajectory.objects.filter(project=project, pk=trajectory_id).only(
            "id", "external_id", "title").first() if trajectory_id is not None else None
        if trajectory is None:
            notes.append(f"No trajectory #{raw_trajectory[:20]} in this project.")
        else:
            looked_up = dashboard.TrajectoryForward(trajectory, dashboard.versions_by_trajectory(
                project=project, trajectory_ids=[trajectory.pk]).get(trajectory.pk, []))
    return render(request, "registry/dashboard.html", {
        "project": project,
        "notes": notes,
        "demo_status": demo_status_of(project=project),
        "funnel": dashboard.funnel(project=project),
        "versions": selectors.versions_of(project=project),
        "lineage": dashboard.version_lineage(project=project, version=version) if version else None,
        "looked_up": looked_up,
        "forward": dashboard.recent_trajectories_forward(project=project),
        "modes": dashboard.mode_coverage(project=project),
        "pass_rates": dashboard.mode_pass_rates(project=project),
        "promotions": dashboard.promotion_costs(project=project),
    })
