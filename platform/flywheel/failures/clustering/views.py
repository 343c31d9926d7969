"""The project's Clusters page: start a clustering run (reviewers), follow its progress (htmx polls the run's
partial), and decide on its suggestions: accept as a new mode, merge into a mode, split, dismiss.

Views stay thin: runs and decisions are `services`; a refused action re-renders the page with why."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from flywheel.accounts.access import project_view
from flywheel.accounts.models import Project, Role
from flywheel.failures import selectors as failure_selectors
from flywheel.failures.clustering import services
from flywheel.failures.clustering.models import ClusteringRun, ClusterSuggestion, Decision, DismissedGroup
from flywheel.failures.models import FailureMode
from flywheel.supervise import Refused
from flywheel.trajectories.models import SignalKind, Trajectory

RUNS_SHOWN = 8
SIGNAL_LABELS = dict(SignalKind.choices)


def _suggestion_rows(suggestions: list[ClusterSuggestion]) -> list[dict]:
    """Each suggestion with its representatives (those still there: one query for all) and a readable signal mix."""
    ids = {i for s in suggestions for i in s.representative_ids}
    present = set(Trajectory.objects.filter(id__in=ids).values_list("id", flat=True))
    return [
        {
            "s": s,
            "representatives": [e for e in s.examples if e.get("id") in present],
            "signals": [(SIGNAL_LABELS.get(k, k), n, n * 100 // max(1, s.size)) for k, n in s.signals.items()],
        }
        for s in suggestions
    ]


def _context(request: HttpRequest, project: Project, run: ClusteringRun | None = None, **extra) -> dict:
    runs = list(ClusteringRun.objects.filter(project=project).select_related("created_by", "parent")[:RUNS_SHOWN])
    run = run or (runs[0] if runs else None)
    suggestions = list(run.suggestions.select_related("target_mode", "failure_mode", "decided_by")) if run else []
    return {
        "project": project,
        "here": "clusters",
        "run": run,
        "runs": runs,
        "rows": _suggestion_rows(suggestions),
        "pending": sum(1 for s in suggestions if s.decision == Decision.PENDING),
        "can_review": request.membership.grants(Role.REVIEWER),
        "modes": failure_selectors.assignable_modes(project=project),
        "categories": failure_selectors.taxonomy(project=project),
        "signal_kinds": SignalKind.choices,
        "dismissed": DismissedGroup.objects.filter(project=project).count(),
        "form": {"days": 30, "limit": services.MAX_FAILURES, "signal": "", "agent": ""},
        "max_failures": services.MAX_FAILURES,
        **extra,
    }


def _page(request: HttpRequest, project: Project, status: int = 200, **extra) -> HttpResponse:
    return render(request, "clustering/clusters.html", _context(request, project, **extra), status=status)


@require_GET
@project_view()
def clusters_page(request: HttpRequest, project: Project) -> HttpResponse:
    run = None
    if request.GET.get("run", "").isdigit():
        run = ClusteringRun.objects.filter(project=project, pk=int(request.GET["run"])).first()
    return render(request, "clustering/clusters.html", _context(request, project, run=run))


@require_POST
@project_view(Role.REVIEWER)
def clustering_run_start(request: HttpRequest, project: Project) -> HttpResponse:
    form = {k: request.POST.get(k, "") for k in ("days", "limit", "signal", "agent")}
    try:
        if not form["days"].strip():
            # Stated, not defaulted: a form that sent nothing is not a request to cluster everything.
            raise ValidationError({"days": "How many days back to look: a whole number from 1 to 3650."})
        run_filter = services.run_filter_parse({k: v for k, v in form.items() if v != ""})
        run = services.clustering_run_start(project=project, user=request.user, run_filter=run_filter)
    except ValidationError as exc:
        return _page(request, project, 422, form=form, form_errors=exc.message_dict)
    except services.ClusteringRefused as exc:
        return _page(request, project, 409, form=form, action_error=str(exc))
    return redirect(reverse("clusters_page", args=[project.slug]) + f"?run={run.pk}#run")


@require_POST
@project_view(Role.REVIEWER)
def clustering_run_retry(request: HttpRequest, project: Project, clustering_id: int) -> HttpResponse:
    run = get_object_or_404(ClusteringRun, project=project, pk=clustering_id)
    try:
        services.clustering_run_retry(run=run)
    except Refused as exc:
        return _page(request, project, 409, action_error=str(exc))
    return redirect(reverse("clusters_page", args=[project.slug]) + f"?run={run.pk}#run")


@require_GET
@project_view()
def clustering_run_status(request: HttpRequest, project: Project, clustering_id: int) -> HttpResponse:
    """The run's progress, the fragment the page polls while the run is queued or running."""
    run = get_object_or_404(ClusteringRun, project=project, pk=clustering_id)
    response = render(request, "clustering/_run.html", {"project": project, "run": run})
    if not run.active and request.GET.get("polling"):
        # The run just ended: reload the page, which lists its suggestions.
        response["HX-Refresh"] = "true"
    return response


def _decide(request: HttpRequest, project: Project, suggestion_id: int, action) -> HttpResponse:
    suggestion = get_object_or_404(ClusterSuggestion, project=project, pk=suggestion_id)
    try:
        target = action(suggestion)
    except ValidationError as exc:
        errors = "; ".join(f"{field}: {', '.join(messages)}" for field, messages in exc.message_dict.items())
        return _page(request, project, 422, run=suggestion.run, action_error=errors, error_suggestion=suggestion.pk)
    except services.ClusteringRefused as exc:
        return _page(request, project, 409, run=suggestion.run, action_error=str(exc), error_suggestion=suggestion.pk)
    if isinstance(target, ClusteringRun):
        return redirect(reverse("clusters_page", args=[project.slug]) + f"?run={target.pk}#run")
    return redirect(reverse("clusters_page", args=[project.slug]) + f"?run={suggestion.run_id}#s{suggestion.pk}")


@require_POST
@project_view(Role.REVIEWER)
def suggestion_accept(request: HttpRequest, project: Project, suggestion_id: int) -> HttpResponse:
    return _decide(
        request,
        project,
        suggestion_id,
        lambda s: services.suggestion_accept(
            suggestion=s,
            user=request.user,
            name=request.POST.get("name", ""),
            category_key=request.POST.get("category", ""),
        ),
    )


@require_POST
@project_view(Role.REVIEWER)
def suggestion_merge(request: HttpRequest, project: Project, suggestion_id: int) -> HttpResponse:
    def merge(s: ClusterSuggestion) -> int:
        raw = request.POST.get("mode", "")
        mode = FailureMode.objects.filter(project=project, pk=int(raw)).first() if raw.isdigit() else None
        if mode is None:
            raise ValidationError({"mode": "Choose a failure mode of this project to merge into."})
        return services.suggestion_merge(suggestion=s, failure_mode=mode, user=request.user)

    return _decide(request, project, suggestion_id, merge)


@require_POST
@project_view(Role.REVIEWER)
def suggestion_split(request: HttpRequest, project: Project, suggestion_id: int) -> HttpResponse:
    return _decide(request, project, suggestion_id, lambda s: services.suggestion_split(suggestion=s, user=request.user))


@require_POST
@project_view(Role.REVIEWER)
def suggestion_dismiss(request: HttpRequest, project: Project, suggestion_id: int) -> HttpResponse:
    return _decide(request, project, suggestion_id, lambda s: services.suggestion_dismiss(suggestion=s, user=request.user))
