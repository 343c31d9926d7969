"""Review pages: the trajectory list and the trajectory page, plus the htmx endpoints reviewers write with.

Here, not in the trajectories app, because the pages show and assign failure modes and the review history:
trajectories sit below failures (tests/platform/test_import_layers.py).
Views stay thin: reads come from the trajectories app's `selectors` (view-models from `presentation`), writes
go through `review`.
Every view is wrapped in `access.project_view`, so anonymous users go to login, non-members get 404 and
viewers get 403 on writes.
An htmx request gets the fragment it swaps; a plain form post is redirected back to the page."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBadRequest
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from flywheel.accounts.access import project_view
from flywheel.accounts.models import Project, Role
from flywheel.demo_status import demo_status_of
from flywheel.failures import review
from flywheel.failures.history import review_history
from flywheel.failures.selectors import assignable_modes
from flywheel.failures.views import trajectory_review_context
from flywheel.trajectories import presentation, selectors
from flywheel.trajectories.models import SOURCES, Outcome, SignalKind, Tag, Trajectory


def _can_review(request: HttpRequest) -> bool:
    return request.membership.grants(Role.REVIEWER)


@require_GET
@project_view()
def trajectory_list(request: HttpRequest, project: Project) -> HttpResponse:
    filters = selectors.TrajectoryFilters.from_params(request.GET)
    cursor = selectors.PageCursor.from_params(request.GET)
    counts = selectors.trajectory_outcome_counts(project=project, filters=filters)
    # The count of what the page shows (its outcome's, or all) tells the page query how to read.
    shown = next(c for c in counts if c.outcome == filters.outcome).exact
    page = selectors.trajectory_page(
        project=project,
        filters=filters,
        after=cursor.after,
        before=cursor.before,
        sparse=shown is not None and shown <= selectors.SPARSE_MATCHES,
    )
    context = {
        "project": project,
        "filters": filters,
        "page": page,
        "counts": counts,
        "ignored": filters.errors + cursor.errors,
        "count_cap": selectors.COUNT_CAP,
        "carry_qs": filters.querystring(),
        "carry_suffix": f"?{filters.querystring()}" if filters.active else "",
        # Bulk assignment: the rows get checkboxes, and the bar offers the project's modes.
        "bulk": _can_review(request),
        "failure_modes": assignable_modes(project=project) if _can_review(request) else [],
        "demo_status": demo_status_of(project=project),
    }
    if request.htmx and request.htmx.target == "results":
        response = render(request, "trajectories/_trajectory_results.html", context)
        # The address bar gets the canonical query (no empty fields the form sent), so it can be shared.
        query = filters.querystring(**cursor.params())
        response["HX-Push-Url"] = request.path + (f"?{query}" if query else "")
        return response
    agents = selectors.trajectory_filter_options(project=project, column="agent")
    model_versions = selectors.trajectory_filter_options(project=project, column="model_version")
    # A value from a shared link stays selectable even past the options' limit.
    if filters.agent and filters.agent not in agents:
        agents.append(filters.agent)
    if filters.model_version and filters.model_version not in model_versions:
        model_versions.append(filters.model_version)
    context |= {
        "outcomes": Outcome.choices,
        "agents": agents,
        "model_versions": model_versions,
        "signal_kinds": SignalKind.choices,
        "sources": SOURCES,
        "tags": selectors.project_tag_names(project=project),
        "mode_options": _mode_options(project),
    }
    if filters.tag and filters.tag not in context["tags"]:
        context["tags"].append(filters.tag)
    return render(request, "trajectories/trajectory_list.html", context)


def _mode_options(project: Project) -> list[tuple[int, str]]:
    """(id, name) of the project's failure modes, for the list's filter."""
    return list(project.failure_modes.order_by("name").values_list("id", "name")[: selectors.OPTION_LIMIT])


def _detail_context(request: HttpRequest, project: Project, trajectory: Trajectory) -> dict:
    filters = selectors.TrajectoryFilters.from_params(request.GET)
    comments = list(trajectory.comments.select_related("author"))
    signals = selectors.trajectory_signals(trajectory=trajectory)
    newer, older = selectors.trajectory_neighbours(project=project, filters=filters, trajectory_id=trajectory.id)
    return {
        "project": project,
        "trajectory": trajectory,
        "filters": filters,
        "ignored": filters.errors,
        "carry_qs": filters.querystring(),
        "newer_id": newer,
        "older_id": older,
        "conversation": presentation.conversation_build(trajectory=trajectory, comments=comments, signals=signals),
        "signals": signals,
        "trajectory_comments": [c for c in comments if c.message_index is None],
        "usage": presentation.usage_summary(trajectory.usage),
        "tool_problems": presentation.tool_schema_problems(trajectory.tools),
        "outcomes": Outcome.choices,
        "can_review": _can_review(request),
        "tag_suggestions": selectors.project_tag_names(project=project),
    } | trajectory_review_context(request=request, project=project, trajectory=trajectory)


@require_GET
@project_view()
def trajectory_detail(request: HttpRequest, project: Project, trajectory_id: int) -> HttpResponse:
    trajectory = selectors.trajectory_get(project=project, trajectory_id=trajectory_id)
    if trajectory is None:
        raise Http404("No such trajectory in this project.")
    return render(request, "trajectories/trajectory_detail.html", _detail_context(request, project, trajectory))


def _trajectory_or_404(project: Project, trajectory_id: int) -> Trajectory:
    return get_object_or_404(Trajectory, project=project, pk=trajectory_id)


def _back(project: Project, trajectory: Trajectory, anchor: str = "") -> HttpResponse:
    url = reverse("trajectory_detail", args=[project.slug, trajectory.id])
    return redirect(f"{url}#{anchor}" if anchor else url)


def _first_error(exc: ValidationError) -> str:
    return next(iter(exc.messages), "Invalid input.")


@require_POST
@project_view(Role.REVIEWER)
def trajectory_outcome_set(request: HttpRequest, project: Project, trajectory_id: int) -> HttpResponse:
    trajectory = _trajectory_or_404(project, trajectory_id)
    error = ""
    try:
        review.trajectory_outcome_set(trajectory=trajectory, outcome=request.POST.get("outcome", ""), user=request.user)
    except ValidationError as exc:
        error = _first_error(exc)
    if not request.htmx:
        return _back(project, trajectory)
    trajectory.refresh_from_db()
    context = {
        "project": project,
        "trajectory": trajectory,
        "outcomes": Outcome.choices,
        "can_review": True,
        "oob": True,
        "history": review_history(trajectory=trajectory),  # swapped in beside it (out of band)
    }
    return render(request, "trajectories/_outcome.html", context | {"error": error}, status=422 if error else 200)


@require_POST
@project_view(Role.REVIEWER)
def trajectory_comment_add(request: HttpRequest, project: Project, trajectory_id: int) -> HttpResponse:
    trajectory = _trajectory_or_404(project, trajectory_id)
    try:
        message_index = review.message_index_parse(request.POST.get("message_index", ""))
    except ValidationError as exc:
        # Only a hand-made request gets here (the page sends the index itself): there is no comment box
        # of that message to answer into, so a plain 400.
        return HttpResponseBadRequest(_first_error(exc), content_type="text/plain; charset=utf-8")
    error = ""
    try:
        review.trajectory_comment_add(
            trajectory=trajectory, author=request.user, body=request.POST.get("body", ""), message_index=message_index
        )
    except ValidationError as exc:
        error = _first_error(exc)
    anchor = f"m{message_index}" if message_index is not None else "comments"
    if not request.htmx:
        return _back(project, trajectory, anchor)
    comments = trajectory.comments.select_related("author").filter(message_index=message_index)
    context = {
        "project": project,
        "trajectory": trajectory,
        "comments": comments,
        "message_index": message_index,
        "can_review": True,
        "error": error,
        "body": request.POST.get("body", "") if error else "",
    }
    return render(request, "trajectories/_comments.html", context, status=422 if error else 200)


def _tags_response(request: HttpRequest, project: Project, trajectory: Trajectory, error: str = "") -> HttpResponse:
    context = {
        "project": project,
        "trajectory": trajectory,
        "can_review": True,
        "tag_suggestions": selectors.project_tag_names(project=project),
        "error": error,
        "history": review_history(trajectory=trajectory),  # swapped in beside it (out of band)
        "oob_history": True,
    }
    return render(request, "trajectories/_tags.html", context, status=422 if error else 200)


@require_POST
@project_view(Role.REVIEWER)
def trajectory_tag_add(request: HttpRequest, project: Project, trajectory_id: int) -> HttpResponse:
    trajectory = _trajectory_or_404(project, trajectory_id)
    error = ""
    try:
        review.trajectory_tag_add(trajectory=trajectory, name=request.POST.get("name", ""), user=request.user)
    except ValidationError as exc:
        error = _first_error(exc)
    if not request.htmx:
        return _back(project, trajectory)
    return _tags_response(request, project, trajectory, error)


@require_POST
@project_view(Role.REVIEWER)
def trajectory_tag_remove(request: HttpRequest, project: Project, trajectory_id: int, tag_id: int) -> HttpResponse:
    trajectory = _trajectory_or_404(project, trajectory_id)
    tag = get_object_or_404(Tag, project=project, pk=tag_id)
    review.trajectory_tag_remove(trajectory=trajectory, tag=tag, user=request.user)
    if not request.htmx:
        return _back(project, trajectory)
    return _tags_response(request, project, trajectory)
