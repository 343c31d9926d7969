"""Online evaluation's page: the project's settings (maintainers change them) and what the scores say, per
model version and the lowest-scored trajectories."""

from __future__ import annotations

import datetime as dt

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from flywheel.accounts.access import project_view
from flywheel.accounts.models import Project, Role
from flywheel.evals import online
from flywheel.evals.kinds import train_side

WINDOWS = {"1": "the last day", "7": "the last 7 days", "30": "the last 30 days"}
FIELDS = ("enabled", "sample_rate", "max_per_hour", "task_set", "judge_enabled", "judge_url", "judge_model",
          "judge_api_key", "judge_rubric", "threshold")


def _page(request: HttpRequest, project: Project, *, errors: dict[str, str] | None = None,
          posted: dict[str, str] | None = None, status: int = 200) -> HttpResponse:
    days = request.GET.get("days", "7")
    days = days if days in WINDOWS else "7"
    since = timezone.now() - dt.timedelta(days=int(days))
    config = online.settings_of(project=project)
    summary = online.scores_by_version(project=project, since=since)
    task_sets = list(train_side().collection.objects.filter(project=project).order_by("name"))
    # A score names its verifier by the task set's id (a name may change): shown by the set's name.
    names = {f"task_set:{ts.pk}": f"task set {ts.name}" for ts in task_sets} | {online.JUDGE: "LLM judge"}
    context = {
        "project": project, "config": config, "errors": errors or {},
        "can_change": request.membership.grants(Role.MAINTAINER), "task_sets": task_sets,
        "summary": sorted(summary.items()),
        "lowest": [(s, names.get(s.verifier, s.verifier)) for s in online.lowest_scored(project=project, since=since)],
        "days": days, "windows": WINDOWS,
        "cap_reached": online.cap_reached(config),
        "values": posted if posted is not None else {
            "enabled": "on" if config.enabled else "", "sample_rate": config.sample_rate,
            "max_per_hour": config.max_per_hour, "task_set": str(config.task_set_id or ""),
            "judge_enabled": "on" if config.judge_enabled else "", "judge_url": config.judge_url,
            "judge_model": config.judge_model, "judge_rubric": config.judge_rubric, "threshold": config.threshold},
    }
    return render(request, "evals/online.html", context, status=status)


@require_GET
@project_view()
def online_eval_page(request: HttpRequest, project: Project) -> HttpResponse:
    return _page(request, project)


@require_POST
@project_view(Role.MAINTAINER)
def online_eval_save(request: HttpRequest, project: Project) -> HttpResponse:
    data = {name: request.POST.get(name) for name in FIELDS}
    if not data["judge_api_key"]:
        data["judge_api_key"] = None  # left blank: keep the stored key
    if request.POST.get("judge_api_key_clear"):
        data["judge_api_key"] = ""
    try:
        online.online_settings_set(project=project, data=data, user=request.user)
    except ValidationError as exc:
        errors = {name: "; ".join(msgs) for name, msgs in exc.message_dict.items()}
        posted = {k: ("" if k == "judge_api_key" else (v or "")) for k, v in data.items()}
        return _page(request, project, errors=errors, posted=posted, status=422)
    messages.success(request, "Online evaluation settings saved.")
    return redirect("online_eval", project_slug=project.slug)
