"""Task-set pages that eval suites do not have: synthetic variants of a task, and the environment servers
(the list for every member; registration, a check again and a new task set on a server for maintainers). The
rest of the task-set pages are the shared collection views (flywheel.evals.views)."""

from __future__ import annotations

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from flywheel.accounts.access import project_view
from flywheel.accounts.models import Project, Role
from flywheel.environments import services
from flywheel.environments.forms import EnvironmentServerForm, ServerTaskSetForm
from flywheel.environments.models import EnvironmentServer, TaskSet
from flywheel.environments.variants import task_variants_create


@require_POST
@project_view(Role.REVIEWER)
def task_variants(request: HttpRequest, project: Project, task_set_id: int, task_id: int) -> HttpResponse:
    task_set = TaskSet.objects.filter(project=project, pk=task_set_id).first()
    if task_set is None:
        raise Http404("No such task set in this project.")
    task = get_object_or_404(task_set.tasks, pk=task_id)
    kinds = tuple(k for k in request.POST.getlist("kinds") if k in ("argument", "rephrase")) or ("argument", "rephrase")
    result = task_variants_create(task=task, user=request.user, kinds=kinds)
    if result.saved:
        messages.success(request, f"{len(result.saved)} variant(s) of {task.row_id} kept; version {result.version.number} made.")
    else:
        messages.info(request, f"No variant of {task.row_id} kept.")
    for what, why in result.skipped[:8]:
        messages.warning(request, f"Not kept: {what}: {why}")
    return redirect(reverse("taskset_detail", args=[project.slug, task_set.pk]) + f"#{task.row_id}")


# --- environment servers ---------------------------------------------------------------------------------


def _page(request: HttpRequest, project: Project, *, form: EnvironmentServerForm | None = None,
          errors: dict | None = None, status: int = 200, failed_server: int | None = None) -> HttpResponse:
    servers = (EnvironmentServer.objects.filter(project=project).select_related("created_by")
               .prefetch_related("task_sets"))
    context = {"project": project, "servers": servers, "form": form or EnvironmentServerForm(),
               "errors": errors or {}, "failed_server": failed_server,
               "can_maintain": request.membership.grants(Role.MAINTAINER),
               "can_review": request.membership.grants(Role.REVIEWER)}
    return render(request, "environments/servers.html", context, status=status)


@require_GET
@project_view()
def environment_servers(request: HttpRequest, project: Project) -> HttpResponse:
    return _page(request, project)


@require_POST
@project_view(Role.MAINTAINER)
def environment_server_register(request: HttpRequest, project: Project) -> HttpResponse:
    form = EnvironmentServerForm(request.POST)
    if not form.is_valid():
        return _page(request, project, form=form, errors=form.errors, status=422)
    try:
        server = services.environment_server_register(project=project, user=request.user, **form.cleaned_data)
    except ValidationError as exc:
        return _page(request, project, form=form, errors=exc.message_dict, status=422)
    messages.success(request, f"Environment server {server.name} registered: it answered /reset.")
    return redirect(reverse("environment_servers", args=[project.slug]) + f"#server-{server.pk}")


@require_POST
@project_view(Role.MAINTAINER)
def environment_server_recheck(request: HttpRequest, project: Project, server_id: int) -> HttpResponse:
    server = get_object_or_404(EnvironmentServer, project=project, pk=server_id)
    try:
        services.environment_server_recheck(server=server)
    except ValidationError as exc:
        errors = {f"server-{server.pk}": [m for ms in exc.message_dict.values() for m in ms]}
        return _page(request, project, errors=errors, status=422, failed_server=server.pk)
    messages.success(request, f"{server.name} answered /reset.")
    return redirect(reverse("environment_servers", args=[project.slug]) + f"#server-{server.pk}")


@require_POST
@project_view(Role.REVIEWER)  # as POST /api/v1/task-sets with `server` asks `review`
def environment_server_task_set(request: HttpRequest, project: Project, server_id: int) -> HttpResponse:
    server = get_object_or_404(EnvironmentServer, project=project, pk=server_id)
    form = ServerTaskSetForm(request.POST)
    try:
        if not form.is_valid():
            raise ValidationError({"name": "Name the task set."})
        task_set = services.task_set_create(project=project, name=form.cleaned_data["name"], user=request.user,
                                            server=server,
                                            description=f"Tasks that run on the environment server {server.name}.")
    except ValidationError as exc:
        errors = {f"server-{server.pk}": [m for ms in exc.message_dict.values() for m in ms]}
        return _page(request, project, errors=errors, status=422, failed_server=server.pk)
    return redirect(reverse("taskset_detail", args=[project.slug, task_set.pk]))
