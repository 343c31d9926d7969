"""Failure-mode pages under /p/<project_slug>/: the modes and their page, the taxonomy, assigning modes to
one trajectory or to a selection of the list, and the review queue.

Views stay thin: reads come from `selectors` and `queue`, writes go through `services` and `queue`. Every view
is wrapped in `access.project_view`: viewers read, reviewers assign and claim, maintainers edit the taxonomy.
Forms post and are redirected back (htmx swaps the partial where the page asks for one)."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import Http404, HttpRequest, HttpResponse, QueryDict
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import NoReverseMatch, reverse
from django.views.decorators.http import require_GET, require_POST

from flywheel.accounts.access import project_view
from flywheel.accounts.models import Project, Role
from flywheel.failures import queue, recurrence, selectors, services
from flywheel.failures.history import review_history
from flywheel.failures.models import FailureMode, FailureModeStatus, QueueSkip, ReviewChange, TaxonomyCategory
from flywheel.failures.review import message_index_parse
from flywheel.trajectories import selectors as trajectory_selectors
from flywheel.trajectories.models import Trajectory
from flywheel.trajectories.presentation import conversation_build

QUEUE_KEYS = 9  # modes reachable by a number key in the queue
UNDO_DEPTH = 20  # queue actions a reviewer can undo, newest first
UNDO_SESSION_KEY = "failures.queue_undo"


def _first_error(exc: ValidationError) -> str:
    return next(iter(exc.messages), "Invalid input.")


def _can(request: HttpRequest, role: str) -> bool:
    return request.membership.grants(role)


# --- failure modes -----------------------------------------------------------------------------------------


@require_GET
@project_view()
def failure_mode_list(request: HttpRequest, project: Project) -> HttpResponse:
    status = request.GET.get("status", "")
    status = status if status in FailureModeStatus.values else ""
    context = {
        "project": project,
        "modes": selectors.failure_modes(project=project, status=status),
        "status": status,
        "statuses": FailureModeStatus.choices,
        "categories": selectors.taxonomy(project=project),
        "can_review": _can(request, Role.REVIEWER),
    }
    return render(request, "failures/failure_mode_list.html", context)


def _mode_form(request: HttpRequest) -> dict[str, str]:
    return {
        "name": request.POST.get("name", ""),
        "category_key": request.POST.get("category", ""),
        "description": request.POST.get("description", ""),
        "status": request.POST.get("status", FailureModeStatus.OPEN),
    }


@require_POST
@project_view(Role.REVIEWER)
def failure_mode_create(request: HttpRequest, project: Project) -> HttpResponse:
    form = _mode_form(request)
    try:
        mode = services.failure_mode_create(project=project, user=request.user, **form)
    except ValidationError as exc:
        context = {
            "project": project,
            "modes": selectors.failure_modes(project=project),
            "statuses": FailureModeStatus.choices,
            "categories": selectors.taxonomy(project=project),
            "can_review": True,
            "form": form,
            "error": _first_error(exc),
        }
        return render(request, "failures/failure_mode_list.html", context, status=422)
    messages.success(request, f"Failure mode “{mode.name}” created.")
    return redirect("failure_mode_detail", project.slug, mode.pk)


def _url_or_blank(name: str, *args: Any) -> str:
    """The address of a page another app adds (evals' promotion), or "" where it is not installed."""
    try:
        return reverse(name, args=args)
    except NoReverseMatch:
        return ""


def _promotion_url(project: Project, trajectory: Trajectory) -> str:
    """The promotion form of `trajectory` when the app that promotes (evals) is installed, else ""."""
    return _url_or_blank("promotion_form", project.slug, trajectory.pk)


@require_GET
@project_view()
def failure_mode_detail(request: HttpRequest, project: Project, mode_id: int) -> HttpResponse:
    mode = selectors.failure_mode_get(project=project, mode_id=mode_id)
    if mode is None:
        raise Http404("No such failure mode in this project.")
    filters = trajectory_selectors.TrajectoryFilters(mode=mode.pk)
    cursor = trajectory_selectors.PageCursor.from_params(request.GET)
    page = trajectory_selectors.trajectory_page(
        project=project, filters=filters, after=cursor.after, before=cursor.before, size=25, sparse=True
    )
    context = {
        "project": project,
        "mode": mode,
        "page": page,
        "filters": filters,
        "carry_suffix": f"?{filters.querystring()}",
        "weeks": selectors.failure_mode_weeks(failure_mode=mode),
        "signals": selectors.failure_mode_signals(failure_mode=mode),
        "origins": selectors.failure_mode_origins(failure_mode=mode),
        "categories": selectors.taxonomy(project=project),
        "statuses": FailureModeStatus.choices,
        "can_review": _can(request, Role.REVIEWER),
        "can_maintain": _can(request, Role.MAINTAINER),
        "ignored": cursor.errors,
        "bulk_promotion_url": _url_or_blank("bulk_promotion", project.slug),
        "recurrence_matches": recurrence.recurrence_matches(failure_mode=mode),
        # The per-version part is the registry's (this app does not import it), loaded into the page by htmx.
        "versions_url": _url_or_blank("registry_failure_mode_versions", project.slug, mode.pk),
    }
    return render(request, "failures/failure_mode_detail.html", context)


@require_POST
@project_view(Role.REVIEWER)
def failure_mode_update(request: HttpRequest, project: Project, mode_id: int) -> HttpResponse:
    mode = get_object_or_404(FailureMode, project=project, pk=mode_id)
    try:
        services.failure_mode_update(failure_mode=mode, **_mode_form(request))
        messages.success(request, "Failure mode saved.")
    except ValidationError as exc:
        messages.error(request, _first_error(exc))
    return redirect("failure_mode_detail", project.slug, mode_id)


@require_POST
@project_view(Role.MAINTAINER)
def failure_mode_delete(request: HttpRequest, project: Project, mode_id: int) -> HttpResponse:
    mode = get_object_or_404(FailureMode, project=project, pk=mode_id)
    name = mode.name
    services.failure_mode_delete(failure_mode=mode, user=request.user)
    messages.success(request, f"Failure mode “{name}” deleted; the history of its trajectories keeps it.")
    return redirect("failure_mode_list", project.slug)


# --- taxonomy ----------------------------------------------------------------------------------------------


@require_GET
@project_view()
def taxonomy_page(request: HttpRequest, project: Project) -> HttpResponse:
    context = {
        "project": project,
        "categories": selectors.taxonomy(project=project),
        "can_maintain": _can(request, Role.MAINTAINER),
    }
    return render(request, "failures/taxonomy.html", context)


@require_POST
@project_view(Role.MAINTAINER)
def taxonomy_category_create(request: HttpRequest, project: Project) -> HttpResponse:
    try:
        category = services.taxonomy_category_create(
            project=project, name=request.POST.get("name", ""), description=request.POST.get("description", "")
        )
        messages.success(request, f"Category “{category.name}” added.")
    except ValidationError as exc:
        messages.error(request, _first_error(exc))
    return redirect("taxonomy_page", project.slug)


@require_POST
@project_view(Role.MAINTAINER)
def taxonomy_category_update(request: HttpRequest, project: Project, category_id: int) -> HttpResponse:
    category = get_object_or_404(TaxonomyCategory, project=project, pk=category_id)
    try:
        services.taxonomy_category_update(
            category=category, name=request.POST.get("name", ""), description=request.POST.get("description", "")
        )
        messages.success(request, f"Category “{category.name}” saved.")
    except ValidationError as exc:
        messages.error(request, _first_error(exc))
    return redirect("taxonomy_page", project.slug)


@require_POST
@project_view(Role.MAINTAINER)
def taxonomy_category_delete(request: HttpRequest, project: Project, category_id: int) -> HttpResponse:
    category = get_object_or_404(TaxonomyCategory, project=project, pk=category_id)
    try:
        services.taxonomy_category_delete(category=category)
        messages.success(request, f"Category “{category.name}” deleted.")
    except ValidationError as exc:
        messages.error(request, _first_error(exc))
    return redirect("taxonomy_page", project.slug)


# --- assigning modes to a trajectory -----------------------------------------------------------------------


def trajectory_review_context(*, request: HttpRequest, project: Project, trajectory: Trajectory) -> dict[str, Any]:
    """What the trajectory page's failure-mode and history panels need (also used by the queue)."""
    return {
        "assignments": selectors.trajectory_assignments(trajectory=trajectory),
        "assignable_modes": selectors.assignable_modes(project=project),
        "history": review_history(trajectory=trajectory),
        "categories": selectors.taxonomy(project=project),
    }


def _modes_response(request: HttpRequest, project: Project, trajectory: Trajectory, error: str = "") -> HttpResponse:
    context = {
        "project": project,
        "trajectory": trajectory,
        "can_review": True,
        "error": error,
        "oob_history": True,
    } | trajectory_review_context(request=request, project=project, trajectory=trajectory)
    return render(request, "failures/_trajectory_modes.html", context, status=422 if error else 200)


def _back_to_trajectory(project: Project, trajectory: Trajectory) -> HttpResponse:
    return redirect(reverse("trajectory_detail", args=[project.slug, trajectory.pk]) + "#modes")


def _mode_from_post(request: HttpRequest, project: Project) -> FailureMode:
    """The mode a form names: `mode` (an id), or a new one from `new_name` and `category`."""
    new_name = request.POST.get("new_name", "").strip()
    if new_name:
        return services.failure_mode_create(
            project=project,
            name=new_name,
            category_key=request.POST.get("category", "other") or "other",
            description=request.POST.get("description", ""),
            user=request.user,
        )
    raw = request.POST.get("mode", "").strip()
    mode = FailureMode.objects.filter(project=project, pk=int(raw)).first() if raw.isascii() and raw.isdigit() else None
    if mode is None:
        raise ValidationError({"mode": "Pick a failure mode, or name a new one."})
    return mode


@require_POST
@project_view(Role.REVIEWER)
def trajectory_mode_assign(request: HttpRequest, project: Project, trajectory_id: int) -> HttpResponse:
    trajectory = get_object_or_404(Trajectory, project=project, pk=trajectory_id)
    error = ""
    try:
        message_index = message_index_parse(request.POST.get("message_index", ""))
        mode = _mode_from_post(request, project)
        added = services.failure_mode_assign(
            failure_mode=mode,
            trajectories=[trajectory],
            user=request.user,
            message_index=message_index,
            note=request.POST.get("note", ""),
        )
        if not added:
            error = f"This trajectory already carries “{mode.name}”."
    except ValidationError as exc:
        error = _first_error(exc)
    if not request.htmx:
        if error:
            messages.error(request, error)
        return _back_to_trajectory(project, trajectory)
    return _modes_response(request, project, trajectory, error)


@require_POST
@project_view(Role.REVIEWER)
def trajectory_mode_unassign(request: HttpRequest, project: Project, trajectory_id: int, mode_id: int) -> HttpResponse:
    trajectory = get_object_or_404(Trajectory, project=project, pk=trajectory_id)
    mode = get_object_or_404(FailureMode, project=project, pk=mode_id)
    services.failure_mode_unassign(failure_mode=mode, trajectories=[trajectory], user=request.user)
    if not request.htmx:
        return _back_to_trajectory(project, trajectory)
    return _modes_response(request, project, trajectory)


@require_POST
@project_view(Role.REVIEWER)
def bulk_assign(request: HttpRequest, project: Project) -> HttpResponse:
    """Assign one mode to the ticked rows of the list, or to every trajectory matching the list's filter
    (`all_matching`, with the filter's query string in `filter_qs`: the list's own filter, read again here)."""
    filter_qs = request.POST.get("filter_qs", "")
    filters = trajectory_selectors.TrajectoryFilters.from_params(QueryDict(filter_qs))
    back = reverse("trajectory_list", args=[project.slug]) + (f"?{filters.querystring()}" if filters.active else "")
    try:
        mode = _mode_from_post(request, project)
        if request.POST.get("all_matching") == "1":
            selection: Any = trajectory_selectors.trajectory_queryset(project=project, filters=filters)
            what = "matching the filter" if filters.active else "of the project"
        else:
            raw_ids = request.POST.getlist("ids")
            selection = [int(i) for i in raw_ids if i.isascii() and i.isdigit()]
            if not selection:
                raise ValidationError({"ids": "Tick some trajectories first, or choose all matching the filter."})
            what = "selected"
        added = services.failure_mode_assign(failure_mode=mode, trajectories=selection, user=request.user)
    except ValidationError as exc:
        messages.error(request, _first_error(exc))
        return redirect(back)
    messages.success(request, f"“{mode.name}” added to {added:,} trajectories {what} (those that carried it already were left as they were).")
    return redirect(back)


# --- the review queue --------------------------------------------------------------------------------------


def _queue_filters(request: HttpRequest) -> trajectory_selectors.TrajectoryFilters:
    return trajectory_selectors.TrajectoryFilters.from_params(request.GET)


def _queue_redirect(project: Project, filters: trajectory_selectors.TrajectoryFilters, **extra: Any) -> HttpResponse:
    query = filters.querystring(**extra)
    return redirect(reverse("queue_page", args=[project.slug]) + (f"?{query}" if query else ""))


def _undo_push(request: HttpRequest, entry: dict[str, Any]) -> None:
    stack = request.session.get(UNDO_SESSION_KEY, {})
    entries = stack.get(str(request.membership.project_id), [])
    entries = [*entries, entry][-UNDO_DEPTH:]
    stack[str(request.membership.project_id)] = entries
    request.session[UNDO_SESSION_KEY] = stack


def _undo_pop(request: HttpRequest) -> dict[str, Any] | None:
    stack = request.session.get(UNDO_SESSION_KEY, {})
    entries = stack.get(str(request.membership.project_id), [])
    if not entries:
        return None
    entry = entries.pop()
    stack[str(request.membership.project_id)] = entries
    request.session[UNDO_SESSION_KEY] = stack
    return entry


@require_GET
@project_view(Role.REVIEWER)
def queue_page(request: HttpRequest, project: Project) -> HttpResponse:
    filters = _queue_filters(request)
    trajectory = queue.queue_current(project=project, user=request.user)
    context: dict[str, Any] = {
        "project": project,
        "filters": filters,
        "carry_qs": filters.querystring(),
        "ignored": filters.errors,
        "progress": queue.queue_progress(project=project, filters=filters),
        "trajectory": trajectory,
        "can_review": True,
        "can_undo": bool(request.session.get(UNDO_SESSION_KEY, {}).get(str(project.pk))),
        "skipped": QueueSkip.objects.filter(project=project, user=request.user).count(),
    }
    if trajectory is not None:
        trajectory = trajectory_selectors.trajectory_get(project=project, trajectory_id=trajectory.pk)
        signals = trajectory_selectors.trajectory_signals(trajectory=trajectory)
        comments = list(trajectory.comments.select_related("author"))
        review = trajectory_review_context(request=request, project=project, trajectory=trajectory)
        carried = {a.failure_mode_id for a in review["assignments"]}
        keyed = selectors.queue_keyed_modes(project=project, limit=QUEUE_KEYS)
        selected = request.GET.get("m", "")
        context |= review | {
            "trajectory": trajectory,
            "claim": trajectory.queue_claim,
            "signals": signals,
            "conversation": conversation_build(
                trajectory=trajectory, comments=comments, signals=signals
            ),
            "keyed_modes": [(i + 1, mode, mode.pk in carried) for i, mode in enumerate(keyed)],
            "selected_message": int(selected) if selected.isascii() and selected.isdigit() else "",
            "promotion_url": _promotion_url(project, trajectory),
        }
    return render(request, "failures/queue.html", context)


@require_POST
@project_view(Role.REVIEWER)
def queue_claim(request: HttpRequest, project: Project) -> HttpResponse:
    filters = _queue_filters(request)
    if queue.queue_claim_next(project=project, user=request.user, filters=filters) is None:
        messages.info(request, "Nothing left to review in this queue.")
    return _queue_redirect(project, filters)


def _held_or_message(request: HttpRequest, project: Project, trajectory_id: int) -> Trajectory | None:
    trajectory = get_object_or_404(Trajectory, project=project, pk=trajectory_id)
    if not queue.queue_held(trajectory=trajectory, user=request.user):
        messages.error(request, f"You no longer hold trajectory {trajectory_id} (its claim expired or was taken); claim again.")
        return None
    return trajectory


@require_POST
@project_view(Role.REVIEWER)
def queue_assign(request: HttpRequest, project: Project, trajectory_id: int) -> HttpResponse:
    """Assign a mode (by number key, or a new one) to the held item, at the message the reviewer is on."""
    filters = _queue_filters(request)
    raw_index = request.POST.get("message_index", "")
    trajectory = _held_or_message(request, project, trajectory_id)
    if trajectory is not None:
        try:
            message_index = message_index_parse(raw_index)
            mode = _mode_from_post(request, project)
            added = services.failure_mode_assign(
                failure_mode=mode, trajectories=[trajectory], user=request.user, message_index=message_index
            )
            if added:
                change = ReviewChange.objects.filter(trajectory=trajectory, field="modes").order_by("-id").first()
                _undo_push(request, {"change": change.pk, "trajectory": trajectory.pk})
            else:
                messages.info(request, f"It already carries “{mode.name}”.")
        except ValidationError as exc:
            messages.error(request, _first_error(exc))
    return _queue_redirect(project, filters, m=raw_index if raw_index.isdigit() else None)


@require_POST
@project_view(Role.REVIEWER)
def queue_unassign(request: HttpRequest, project: Project, trajectory_id: int, mode_id: int) -> HttpResponse:
    filters = _queue_filters(request)
    trajectory = _held_or_message(request, project, trajectory_id)
    if trajectory is not None:
        mode = get_object_or_404(FailureMode, project=project, pk=mode_id)
        if services.failure_mode_unassign(failure_mode=mode, trajectories=[trajectory], user=request.user):
            change = ReviewChange.objects.filter(trajectory=trajectory, field="modes").order_by("-id").first()
            _undo_push(request, {"change": change.pk, "trajectory": trajectory.pk})
    return _queue_redirect(project, filters)


@require_POST
@project_view(Role.REVIEWER)
def queue_complete(request: HttpRequest, project: Project, trajectory_id: int) -> HttpResponse:
    """Mark the held item reviewed, then claim the next one."""
    filters = _queue_filters(request)
    trajectory = get_object_or_404(Trajectory, project=project, pk=trajectory_id)
    try:
        change = queue.queue_complete(
            project=project, trajectory=trajectory, user=request.user, outcome=request.POST.get("outcome", "")
        )
        if change is not None:
            _undo_push(request, {"change": change.pk, "trajectory": trajectory.pk, "reclaim": True})
        queue.queue_claim_next(project=project, user=request.user, filters=filters)
    except ValidationError as exc:
        messages.error(request, _first_error(exc))
    return _queue_redirect(project, filters)


@require_POST
@project_view(Role.REVIEWER)
def queue_skip(request: HttpRequest, project: Project, trajectory_id: int) -> HttpResponse:
    filters = _queue_filters(request)
    trajectory = get_object_or_404(Trajectory, project=project, pk=trajectory_id)
    queue.queue_skip(project=project, trajectory=trajectory, user=request.user)
    _undo_push(request, {"skip": trajectory.pk})
    queue.queue_claim_next(project=project, user=request.user, filters=filters)
    return _queue_redirect(project, filters)


@require_POST
@project_view(Role.REVIEWER)
def queue_undo(request: HttpRequest, project: Project) -> HttpResponse:
    """Undo the reviewer's last queue action: an assignment, a completion (the item comes back to them)
    or a skip."""
    filters = _queue_filters(request)
    entry = _undo_pop(request)
    if entry is None:
        messages.info(request, "Nothing to undo.")
        return _queue_redirect(project, filters)
    try:
        if "skip" in entry:
            trajectory = get_object_or_404(Trajectory, project=project, pk=entry["skip"])
            queue.queue_release(project=project, user=request.user)
            queue.queue_skip_undo(project=project, trajectory=trajectory, user=request.user)
            messages.info(request, f"Skip undone: trajectory {trajectory.pk} is back.")
        else:
            change = get_object_or_404(ReviewChange, project=project, pk=entry["change"])
            if entry.get("reclaim"):
                # The completed item comes back to the reviewer: the one claimed after it is released.
                queue.queue_release(project=project, user=request.user)
            services.review_change_revert(change=change, user=request.user)
            if entry.get("reclaim"):
                queue.queue_claim(project=project, trajectory=change.trajectory, user=request.user)
            messages.info(request, f"Undone: {change.get_field_display().lower()} of trajectory {change.trajectory_id}.")
    except ValidationError as exc:
        messages.error(request, _first_error(exc))
    return _queue_redirect(project, filters)


@require_POST
@project_view(Role.REVIEWER)
def queue_skips_clear(request: HttpRequest, project: Project) -> HttpResponse:
    """Offer the items this reviewer skipped again."""
    QueueSkip.objects.filter(project=project, user=request.user).delete()
    return _queue_redirect(project, _queue_filters(request))
