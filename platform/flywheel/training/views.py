"""Training pages: the jobs list with the new-job form, a job's page (the settings it ran with, advice,
progress, live curves, event log, checkpoints, cancel, retry, the gate's decision), and two or more jobs
compared. Maintainers start and stop jobs; members read."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from flywheel.accounts.access import project_view
from flywheel.accounts.models import Project, Role
from flywheel.demo_status import demo_status_of
from flywheel.environments.models import TaskSetVersion
from flywheel.evals import selectors as evals_selectors
from flywheel.evals.leakage import LeakageError
from flywheel.evals.models import EvalSuiteVersion
from flywheel.registry import selectors as registry_selectors
from flywheel.supervise import Refused
from flywheel.training import comparison, forms, selectors, services
from flywheel.training.models import JobEvent, TrainingJob


def _choices(project: Project) -> dict:
    return {
        "task_set_versions": TaskSetVersion.objects.filter(task_set__project=project).select_related("task_set")
        .order_by("task_set__name", "-number")[:200],
        "suite_versions": EvalSuiteVersion.objects.filter(suite__project=project).select_related("suite")
        .order_by("suite__name", "-number")[:200],
    }


def _defaults(request: HttpRequest, project: Project) -> dict:
    """The new-job form's choices before anyone picks: what the link asked for (`?task_set_version=ID`, from a
    task set's page), else the newest task-set version and the newest holdout and regression versions, so
    that a project with one of each trains in one click."""
    def newest(qs):
        found = qs.order_by("-created_at", "-id").values_list("pk", flat=True).first()
        return str(found) if found else ""

    suites = EvalSuiteVersion.objects.filter(suite__project=project)
    asked = request.GET.get("task_set_version", "")
    return {
        "task_set_version": asked if asked.isdigit() else newest(TaskSetVersion.objects.filter(task_set__project=project)),
        "holdout_version": newest(suites.filter(suite__kind="holdout")),
        "regression_version": newest(suites.filter(suite__kind="regression")),
    }


def _holdout_power(project: Project, form) -> dict | None:
    """What the chosen holdout can show, from production's latest measurement on it (None: none chosen)."""
    raw = str(form.get("holdout_version", "") or "")
    version = EvalSuiteVersion.objects.filter(suite__project=project, pk=raw).first() if raw.isdigit() else None
    return evals_selectors.holdout_power(project=project, suite_version=version) if version else None


def _list_context(request: HttpRequest, project: Project, **extra) -> dict:
    form = request.POST if request.method == "POST" else _defaults(request, project)
    return {
        "holdout_power": _holdout_power(project, form),
        "project": project,
        "jobs": selectors.job_list(project=project),
        "production": registry_selectors.production_of(project=project),
        "is_maintainer": request.membership.grants(Role.MAINTAINER),
        "config_fields": forms.config_fields(project),
        "saved_defaults": services.project_defaults(project),
        "form": form,
        "demo_status": demo_status_of(project=project),
        **_choices(project),
        **extra,
    }


@require_GET
@project_view()
def job_list(request: HttpRequest, project: Project) -> HttpResponse:
    return render(request, "training/jobs.html", _list_context(request, project))


def _version(model, project: Project, raw: str, owner: str):
    if not raw:
        return None
    if not raw.isascii() or not raw.isdigit():
        raise ValidationError({owner: "Choose one from the list."})
    lookup = {"task_set__project": project} if model is TaskSetVersion else {"suite__project": project}
    version = model.objects.filter(pk=int(raw), **lookup).first()
    if version is None:
        raise ValidationError({owner: "No such version in this project."})
    return version


# The form's fields by the key of their errors: (what the form calls them, the id of their input).
_FIELDS = {
    "task_set_version": ("Train on", "task-set-version"),
    "holdout_version": ("Holdout", "holdout-version"),
    "regression_version": ("Regression suite", "regression-version"),
    "algorithm": ("Algorithm", "algorithm"),
    "num_gpus": ("GPUs", "num-gpus"),
}


def error_summary(errors: dict[str, list[str]]) -> list[dict[str, str]]:
    """One line per field in error, each linking to its input: the form is long, and a refusal at its foot
    (an Advanced field) is out of sight when the page comes back."""
    lines = []
    for key, messages in errors.items():
        if key.startswith("config."):
            label, anchor = key.removeprefix("config."), f"cfg-{key.removeprefix('config.')}"
        else:
            label, anchor = _FIELDS.get(key, (key.replace("_", " "), "new-job"))
        lines.append({"label": label, "message": messages[0] if messages else "", "anchor": anchor})
    return lines


def job_new(request: HttpRequest, project_slug: str) -> HttpResponse:
    """POST starts a job; GET (a reload or a bookmark of the form's address) goes to the form, on the jobs page."""
    if request.method == "GET":
        return _job_form(request, project_slug=project_slug)
    return _job_create(request, project_slug=project_slug)


@require_GET
@project_view()
def _job_form(request: HttpRequest, project: Project) -> HttpResponse:
    query = request.GET.urlencode()
    return redirect(reverse("training_jobs", args=[project.slug]) + (f"?{query}" if query else "") + "#new-job")


@require_POST
@project_view(Role.MAINTAINER)
def _job_create(request: HttpRequest, project: Project) -> HttpResponse:
    post = request.POST
    config, config_errors = forms.config_from_post(post, algorithm=post.get("algorithm", "grpo"), project=project)
    try:
        errors: dict = {}
        versions = {}
        for field, model in (("task_set_version", TaskSetVersion), ("holdout_version", EvalSuiteVersion),
                             ("regression_version", EvalSuiteVersion)):
            try:
                versions[field] = _version(model, project, post.get(field, ""), field)
            except ValidationError as exc:
                errors.update(exc.message_dict)
        gpus = post.get("num_gpus", "1")
        if not gpus.isascii() or not gpus.isdigit():
            errors["num_gpus"] = ["A whole number of GPUs."]
        if errors or config_errors:
            raise ValidationError({**errors, **{f"config.{k}": [v] for k, v in config_errors.items()}})
        job = services.job_create(project=project, algorithm=post.get("algorithm", "grpo"), config=config,
                                  num_gpus=int(gpus), user=request.user, **versions)
        if post.get("save_defaults") and config:
            # The values typed here, over what the project had saved: the next job starts from them.
            services.defaults_save(project=project, config={**services.project_defaults(project), **config},
                                   user=request.user)
    except ValidationError as exc:
        context = _list_context(request, project, errors=exc.message_dict,
                                error_summary=error_summary(exc.message_dict))
        return render(request, "training/jobs.html", context, status=422)
    except LeakageError as exc:
        context = _list_context(request, project, leakage=[str(c) for c in exc.conflicts])
        return render(request, "training/jobs.html", context, status=409)
    except Refused as exc:  # the project's limit on jobs
        return render(request, "training/jobs.html", _list_context(request, project, refused=str(exc)), status=409)
    return redirect("training_job", project.slug, job.pk)


@require_POST
@project_view(Role.MAINTAINER)
def defaults_clear(request: HttpRequest, project: Project) -> HttpResponse:
    """Forget the project's own recipe: new jobs start from the field's again."""
    services.defaults_save(project=project, config={}, user=request.user)
    return redirect("training_jobs", project.slug)


def _job(project: Project, job_id: int) -> TrainingJob:
    return get_object_or_404(
        TrainingJob.objects.select_related("task_set_version__task_set", "holdout_version__suite",
                                           "regression_version__suite", "base_version__base", "candidate_version",
                                           "created_by"),
        project=project, pk=job_id,
    )


def _job_context(request: HttpRequest, project: Project, job: TrainingJob, **extra) -> dict:
    decision = job.gate_decisions.select_related("candidate", "production").first()
    return {
        "project": project,
        "job": job,
        "events": list(JobEvent.objects.filter(job=job).exclude(kind="step").order_by("-id")[:200]),
        "checkpoints": list(job.checkpoints.all()),
        "decision": decision,
        "is_maintainer": request.membership.grants(Role.MAINTAINER),
        **extra,
    }


def _settings(project: Project, job: TrainingJob, decision) -> dict:
    """The job's settings panel: the rules its decision was judged by, else the project's rules now."""
    from flywheel.registry.gate_runs import rules_for

    rules_now = None if decision is not None else rules_for(project).__dict__
    return comparison.job_settings(job=job, decision=decision, project_rules=rules_now)


@require_GET
@project_view()
def job_page(request: HttpRequest, project: Project, job_id: int) -> HttpResponse:
    job = _job(project, job_id)
    context = _job_context(request, project, job)
    if request.htmx:  # the status partial, polled while the job runs: the settings do not change
        response = render(request, "training/_job_status.html", context)
        if not job.active:
            # It ended while the page polled: the checkpoints, the curve and the verdict outside the partial
            # were drawn while it ran ("None yet", "not judged yet"), so the whole page is drawn again.
            response["HX-Refresh"] = "true"
        return response
    return render(request, "training/job.html", {**context, "settings": _settings(project, job, context["decision"])})


@require_GET
@project_view()
def job_compare(request: HttpRequest, project: Project) -> HttpResponse:
    """Two or more jobs side by side: `?ids=1&ids=2` (or `?ids=1,2`). Another project's job is a 404."""
    try:
        jobs = selectors.compared_jobs(project=project, raw_ids=request.GET.getlist("ids"))
        data = comparison.compare_jobs(project=project, jobs=jobs)
    except ValidationError as exc:
        return render(request, "training/compare.html", {"project": project, "error": exc.messages[0]}, status=400)
    groups = [{"name": name, "rows": rows, "differ": sum(row["differs"] for row in rows)}
              for name, rows in (("Data", data["data"]), ("Config", data["settings"]),
                                 ("The gate's rules", data["gate_rules"]))]
    differ = sum(group["differ"] for group in groups)
    return render(request, "training/compare.html", {
        "project": project, "compare": data, "groups": groups, "differ_count": differ,
        "same_count": sum(len(group["rows"]) for group in groups) - differ,
        "chart": {"curves": data["curves"], "jobs": [j["id"] for j in data["jobs"]]},
    })


@require_GET
@project_view()
def job_curves(request: HttpRequest, project: Project, job_id: int) -> JsonResponse:
    job = _job(project, job_id)
    return JsonResponse({"status": job.status, **services.job_page_data(job=job)})


def _act(request: HttpRequest, project: Project, job_id: int, action) -> HttpResponse:
    job = _job(project, job_id)
    try:
        action(job=job, user=request.user)
    except Refused as exc:
        job.refresh_from_db()
        context = _job_context(request, project, job, action_error=str(exc))
        context["settings"] = _settings(project, job, context["decision"])
        return render(request, "training/job.html", context, status=409)
    return redirect(reverse("training_job", args=[project.slug, job.pk]))


@require_POST
@project_view(Role.MAINTAINER)
def job_confirm(request: HttpRequest, project: Project, job_id: int) -> HttpResponse:
    return _act(request, project, job_id, services.job_confirm)


@require_POST
@project_view(Role.MAINTAINER)
def job_cancel(request: HttpRequest, project: Project, job_id: int) -> HttpResponse:
    return _act(request, project, job_id, services.job_cancel)


@require_POST
@project_view(Role.MAINTAINER)
def job_retry(request: HttpRequest, project: Project, job_id: int) -> HttpResponse:
    return _act(request, project, job_id, services.job_retry)


@require_GET
@project_view()
def checkpoint_page(request: HttpRequest, project: Project, job_id: int, step: int) -> HttpResponse:
    from flywheel.training.inspector import checkpoint_view

    job = _job(project, job_id)
    checkpoint = get_object_or_404(job.checkpoints, step=step)
    return render(request, "training/checkpoint.html", {
        "project": project, "job": job, "checkpoint": checkpoint,
        **checkpoint_view(job=job, step=step, folder=services.job_dir(job)),
    })
