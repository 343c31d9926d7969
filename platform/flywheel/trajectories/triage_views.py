"""The project's Triage page: the unsafe-action policy (maintainers edit it), how many trajectories wait for
triage or were triaged under an older policy, and the re-run with its progress (htmx polls the run's partial).

Views stay thin: the policy is parsed and saved by `triage_policy`, runs are started by `triage`."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from flywheel.accounts.access import project_view
from flywheel.accounts.models import Project, Role
from flywheel.supervise import Refused
from flywheel.trajectories import triage, triage_policy
from flywheel.trajectories.models import Severity, SignalKind, Trajectory, TriageRun
from flywheel.trajectories.selectors import COUNT_CAP
from flywheel.trajectories.triage import CATEGORY, SEVERITY


def _capped_count(qs) -> tuple[int, bool]:
    n = qs.order_by().values("id")[: COUNT_CAP + 1].count()
    return min(n, COUNT_CAP), n > COUNT_CAP


def _context(request: HttpRequest, project: Project, **extra) -> dict:
    policy = triage_policy.policy_for(project_id=project.pk)
    mine = Trajectory.objects.filter(project=project)
    untriaged = _capped_count(mine.filter(triage_version=0))
    outdated = _capped_count(mine.filter(triage_version__gt=0, triage_version__lt=policy.version))
    runs = list(TriageRun.objects.filter(project=project).select_related("started_by")[:5])
    return {
        "project": project,
        "policy": policy,
        "policy_text": triage_policy.policy_text(policy),
        "default_text": triage_policy.policy_text_of(triage_policy.DEFAULT_UNSAFE_RULES),
        "is_maintainer": request.membership.grants(Role.MAINTAINER),
        "untriaged": untriaged,
        "outdated": outdated,
        "run": runs[0] if runs else None,
        "runs": runs,
        "kinds": [(value, label, Severity(SEVERITY[value]).label, CATEGORY[value]) for value, label in SignalKind.choices],
        "triage_on": triage.triage_enabled(),
        **extra,
    }


@require_GET
@project_view()
def triage_page(request: HttpRequest, project: Project) -> HttpResponse:
    return render(request, "trajectories/triage.html", _context(request, project))


@require_POST
@project_view(Role.MAINTAINER)
def triage_policy_save(request: HttpRequest, project: Project) -> HttpResponse:
    text = request.POST.get("unsafe")
    try:
        if text is None:
            raise ValidationError({"unsafe": "The form sent no policy (the field `unsafe`)."})
        triage_policy.policy_set(project_id=project.pk, text=text, user=request.user)
    except ValidationError as exc:
        errors = exc.message_dict.get("unsafe", exc.messages)
        context = _context(request, project, policy_text=text, policy_errors=errors)
        return render(request, "trajectories/triage.html", context, status=422)
    return redirect(reverse("triage_page", args=[project.slug]) + "?saved=1")


@require_POST
@project_view(Role.MAINTAINER)
def triage_run_start(request: HttpRequest, project: Project) -> HttpResponse:
    try:
        triage.triage_run_start(project=project, user=request.user)
    except Refused as exc:
        return render(request, "trajectories/triage.html", _context(request, project, run_error=str(exc)), status=409)
    return redirect(reverse("triage_page", args=[project.slug]) + "#run")


@require_POST
@project_view(Role.MAINTAINER)
def triage_run_retry(request: HttpRequest, project: Project, run_id: int) -> HttpResponse:
    """Queue a failed re-run again (flywheel.runs); it goes on with what is still out of date."""
    run = get_object_or_404(TriageRun, project=project, pk=run_id)
    try:
        triage.triage_run_retry(run=run)
    except Refused as exc:
        return render(request, "trajectories/triage.html", _context(request, project, run_error=str(exc)), status=409)
    return redirect(reverse("triage_page", args=[project.slug]) + "#run")


@require_GET
@project_view()
def triage_run_status(request: HttpRequest, project: Project, run_id: int) -> HttpResponse:
    """The run's progress, the fragment the page polls while the run is queued or running."""
    run = get_object_or_404(TriageRun, project=project, pk=run_id)
    return render(request, "trajectories/_triage_run.html", {
        "project": project, "run": run, "is_maintainer": request.membership.grants(Role.MAINTAINER)})
