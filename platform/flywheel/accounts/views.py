"""Accounts pages: the project list and a project's settings (members and API keys).

Views stay thin: `project_view(role)` checks access, forms check input, services change things. Each
settings section is a partial (`_members.html`, `_api_keys.html`) that htmx swaps in place; without
JavaScript the same forms post and the whole page comes back. A refused change answers 422 with the section
and its error message, which app.js swaps in like a success."""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from axes.helpers import get_client_username, get_cool_off
from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from flywheel.accounts import ratelimit, selectors, services
from flywheel.accounts.access import project_view
from flywheel.accounts.forms import ApiKeyCreateForm, MemberAddForm, MemberRoleForm
from flywheel.accounts.models import Membership, Project, Role


@require_GET
@login_required
def project_list(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "accounts/project_list.html",
        {
            "memberships": selectors.memberships_for_user(user=request.user),
            "worker": selectors.worker_last_seen(),
            "a_minute_ago": timezone.now() - timedelta(minutes=1),  # "0 minutes ago" reads as a glitch
        },
    )


def _settings_context(request: HttpRequest, project: Project, **extra) -> dict:
    is_maintainer = request.membership.grants(Role.MAINTAINER)
    context = {
        "project": project,
        "is_maintainer": is_maintainer,
        "members": selectors.members_for_project(project=project),
        "roles": Role.choices,
        "member_form": MemberAddForm(),
        "member_error": None,
    }
    if is_maintainer:
        context |= {
            "api_keys": selectors.api_keys_for_project(project=project),
            "key_form": ApiKeyCreateForm(),
        }
    return context | extra


def _section(
    request: HttpRequest, project: Project, partial: str, status: int = 200, **extra
) -> HttpResponse:
    """The section's partial for htmx, the whole settings page otherwise."""
    template = partial if request.htmx else "accounts/project_settings.html"
    return render(request, template, _settings_context(request, project, **extra), status=status)


@require_GET
@project_view(Role.VIEWER)
def project_settings(request: HttpRequest, project: Project) -> HttpResponse:
    # Every member sees who has access; only maintainers see keys and change anything.
    return render(request, "accounts/project_settings.html", _settings_context(request, project))


@require_POST
@project_view(Role.MAINTAINER)
def member_add(request: HttpRequest, project: Project) -> HttpResponse:
    form = MemberAddForm(request.POST)
    error = None
    if form.is_valid():
        try:
            services.membership_add(
                project=project, username=form.cleaned_data["username"], role=form.cleaned_data["role"]
            )
            form = MemberAddForm()
        except services.MembershipError as exc:
            error = str(exc)
    else:
        error = "; ".join(f"{field}: {' '.join(errs)}" for field, errs in form.errors.items())
    return _section(
        request,
        project,
        "accounts/_members.html",
        status=422 if error else 200,
        member_form=form,
        member_error=error,
    )


def _member(project: Project, user_id: int) -> Membership:
    membership = Membership.objects.filter(project=project, user_id=user_id).select_related("user").first()
    if membership is None:
        raise Http404("No such member.")
    return membership


@require_POST
@project_view(Role.MAINTAINER)
def member_update(request: HttpRequest, project: Project, user_id: int) -> HttpResponse:
    membership = _member(project, user_id)
    form = MemberRoleForm(request.POST)
    error = None
    if not form.is_valid():
        error = f"role: {' '.join(form.errors.get('role', ['invalid']))}"
    else:
        try:
            services.membership_set(project=project, user=membership.user, role=form.cleaned_data["role"])
        except services.MembershipError as exc:
            error = str(exc)
    return _section(
        request, project, "accounts/_members.html", status=422 if error else 200, member_error=error
    )


@require_POST
@project_view(Role.MAINTAINER)
def member_remove(request: HttpRequest, project: Project, user_id: int) -> HttpResponse:
    membership = _member(project, user_id)
    error = None
    try:
        services.membership_remove(project=project, user=membership.user)
    except services.MembershipError as exc:
        error = str(exc)
    return _section(
        request, project, "accounts/_members.html", status=422 if error else 200, member_error=error
    )


@require_POST
@project_view(Role.MAINTAINER)
def api_key_create(request: HttpRequest, project: Project) -> HttpResponse:
    form = ApiKeyCreateForm(request.POST)
    if not form.is_valid():
        return _section(request, project, "accounts/_api_keys.html", status=422, key_form=form)
    issued = services.api_key_create(
        project=project,
        name=form.cleaned_data["name"],
        scopes=form.cleaned_data["scopes"],
        created_by=request.user,
    )
    # The raw key exists only in this response: it is never stored, and no later page can show it.
    response = _section(request, project, "accounts/_api_keys.html", status=201, issued=issued)
    response["Cache-Control"] = "no-store"
    return response


@require_POST
@project_view(Role.MAINTAINER)
def api_key_revoke(request: HttpRequest, project: Project, key_id: int) -> HttpResponse:
    api_key = selectors.api_key_get(project=project, key_id=key_id)
    if api_key is None:
        raise Http404("No such key.")
    services.api_key_revoke(api_key=api_key)
    return _section(request, project, "accounts/_api_keys.html", revoked=api_key)


def _next_minute(moment: datetime) -> datetime:
    # The page shows minutes: round up, so that "after 10:16" is never a minute too early.
    whole = moment.replace(second=0, microsecond=0)
    return whole if whole == moment else whole + timedelta(minutes=1)


def login_locked_out(
    request: HttpRequest, original_response: HttpResponse | None = None, credentials: dict | None = None
) -> HttpResponse:
    """django-axes's lockout answer (AXES_LOCKOUT_CALLABLE), for the login page and the admin's: 429 with
    Retry-After and a page that says when logging in works again."""
    now = timezone.now()
    retry_at = ratelimit.login_lockout_end(
        address=getattr(request, "axes_ip_address", None),
        username=get_client_username(request, credentials),
        now=now,
    )
    cool_off = get_cool_off(request)
    # A row counts while its latest failure is within the cool-off, end included: say the next whole second.
    seconds = int((retry_at - now).total_seconds()) + 1 if retry_at else int(cool_off.total_seconds())
    response = render(
        request,
        "registration/locked_out.html",
        {
            "failure_limit": settings.AXES_FAILURE_LIMIT,
            "cool_off_minutes": math.ceil(cool_off.total_seconds() / 60),
            "retry_at": retry_at,
            "retry_at_shown": retry_at and _next_minute(retry_at),
            "retry_minutes": math.ceil(seconds / 60),
        },
        status=429,
    )
    response["Retry-After"] = str(seconds)
    return response
