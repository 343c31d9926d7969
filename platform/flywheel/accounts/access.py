"""Who may see what: the one check every page and htmx endpoint makes.

A user who is not a member of a project gets 404, not 403, so project slugs do not leak."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps

from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404

from flywheel.accounts.models import Project, Role
from flywheel.accounts.selectors import membership_get


def project_view(role: str = Role.VIEWER) -> Callable:
    """Decorate a view taking `project_slug`: it then gets `project`, and `request.membership` is set.

    Anonymous users go to the login page; non-members get 404; members without `role` get 403."""

    def decorator(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @wraps(view)
        def wrapper(request: HttpRequest, project_slug: str, *args, **kwargs) -> HttpResponse:
            if not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path())
            project = get_object_or_404(Project, slug=project_slug)
            membership = membership_get(user=request.user, project=project)
            if membership is None:
                raise Http404("No such project.")
            if not membership.grants(role):
                raise PermissionDenied(f"This needs the {Role(role).label.lower()} role in {project.slug}.")
            request.membership = membership
            return view(request, project, *args, **kwargs)

        return wrapper

    return decorator
