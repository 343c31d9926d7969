"""Task-set pages that eval suites do not have: synthetic variants of a task. The rest of the task-set
pages are the shared collection views (flywheel.evals.views)."""

from __future__ import annotations

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.urls import reverse
from django.views.decorators.http import require_POST

from flywheel.accounts.access import project_view
from flywheel.accounts.models import Project, Role
from flywheel.environments.models import TaskSet
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
