"""Eval run pages: the runs of the project with a form to start one, a run's per-case results, and two runs
of one suite version side by side with a paired test. Maintainers start, cancel and retry runs (GPU work, as
the API's `train` scope and training jobs); members read."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_POST

from flywheel.accounts.access import project_view
from flywheel.accounts.models import Project, Role
from flywheel.evals import runs
from flywheel.evals.models import EvalSuiteVersion
from flywheel.evals.run_models import EvalRun
from flywheel.registry.models import ModelVersion
from flywheel.supervise import Refused
from trainer.config import GRPOConfig


def _list_context(request: HttpRequest, project: Project, **extra) -> dict:
    return {
        "project": project,
        "runs": EvalRun.objects.filter(project=project).select_related("model_version", "suite_version__suite")[:100],
        "model_versions": ModelVersion.objects.filter(project=project).select_related("base")[:200],
        "suite_versions": EvalSuiteVersion.objects.filter(suite__project=project).select_related("suite")
        .order_by("suite__name", "-number")[:200],
        "can_run": request.membership.grants(Role.MAINTAINER),
        "sampling": GRPOConfig(),  # what a blank "samples" takes: a training job's evaluation settings
        **extra,
    }


@require_GET
@project_view()
def run_list(request: HttpRequest, project: Project) -> HttpResponse:
    return render(request, "evals/runs.html", _list_context(request, project))


def _pick(model, raw: str, field: str, **lookup):
    if not raw or not raw.isascii() or not raw.isdigit():
        raise ValidationError({field: "Choose one from the list."})
    found = model.objects.filter(pk=int(raw), **lookup).first()
    if found is None:
        raise ValidationError({field: "Not in this project."})
    return found


@require_POST
@project_view(Role.MAINTAINER)
def run_start(request: HttpRequest, project: Project) -> HttpResponse:
    try:
        model_version = _pick(ModelVersion, request.POST.get("model_version", ""), "model_version", project=project)
        suite_version = _pick(EvalSuiteVersion, request.POST.get("suite_version", ""), "suite_version",
                              suite__project=project)
        samples = request.POST.get("samples", "").strip()  # blank: what a training job samples on that suite
        run = runs.eval_run_create(project=project, model_version=model_version, suite_version=suite_version,
                                   user=request.user,
                                   samples=None if not samples else int(samples) if samples.isdigit() else 0)
    except ValidationError as exc:
        return render(request, "evals/runs.html", _list_context(request, project, errors=exc.message_dict),
                      status=422)
    except Refused as exc:  # the project's limit on runs
        return render(request, "evals/runs.html", _list_context(request, project, refused=str(exc)), status=409)
    return redirect("eval_run", project.slug, run.pk)


def _run(project: Project, eval_run_id: int) -> EvalRun:
    return get_object_or_404(EvalRun.objects.select_related("model_version__base", "suite_version__suite", "job"),
                             project=project, pk=eval_run_id)


def _run_context(request: HttpRequest, project: Project, run: EvalRun, **extra) -> dict:
    others = EvalRun.objects.filter(project=project, suite_version=run.suite_version, status="succeeded").exclude(
        pk=run.pk).select_related("model_version")[:50]
    return {"project": project, "run": run, "results": run.results.all()[:2000], "others": others,
            "can_run": request.membership.grants(Role.MAINTAINER), **extra}


@require_GET
@project_view()
def run_page(request: HttpRequest, project: Project, eval_run_id: int) -> HttpResponse:
    run = _run(project, eval_run_id)
    if request.htmx and not run.active:
        response = HttpResponse(status=204)
        response["HX-Refresh"] = "true"  # it ended while the page polled: reload it, results and all
        return response
    template = "evals/_run_status.html" if request.htmx else "evals/run.html"
    return render(request, template, _run_context(request, project, run))


def _act(request: HttpRequest, project: Project, eval_run_id: int, action) -> HttpResponse:
    run = _run(project, eval_run_id)
    try:
        action(run=run)
    except Refused as exc:
        run.refresh_from_db()
        return render(request, "evals/run.html", _run_context(request, project, run, action_error=str(exc)),
                      status=409)
    return redirect("eval_run", project.slug, run.pk)


@require_POST
@project_view(Role.MAINTAINER)
def run_cancel(request: HttpRequest, project: Project, eval_run_id: int) -> HttpResponse:
    return _act(request, project, eval_run_id, runs.eval_run_cancel)


@require_POST
@project_view(Role.MAINTAINER)
def run_retry(request: HttpRequest, project: Project, eval_run_id: int) -> HttpResponse:
    return _act(request, project, eval_run_id, runs.eval_run_retry)


@require_GET
@project_view()
def run_compare(request: HttpRequest, project: Project) -> HttpResponse:
    a_raw, b_raw = request.GET.get("a", ""), request.GET.get("b", "")
    if not (a_raw.isascii() and a_raw.isdigit() and b_raw.isascii() and b_raw.isdigit()):
        return render(request, "evals/compare.html", {"project": project, "error": "Choose two runs."}, status=400)
    qs = EvalRun.objects.filter(project=project).select_related("model_version", "suite_version__suite")
    a, b = get_object_or_404(qs, pk=int(a_raw)), get_object_or_404(qs, pk=int(b_raw))
    try:
        comparison = runs.eval_compare(a=a, b=b)
    except ValidationError as exc:
        return render(request, "evals/compare.html", {"project": project, "error": exc.messages[0]}, status=400)
    return render(request, "evals/compare.html", {"project": project, "a": a, "b": b, **comparison})
