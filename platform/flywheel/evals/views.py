"""Pages of eval suites and task sets (one set of views, `model` says which), the promotion form, bulk
promotion and verifier calibration.

Views stay thin: reads from `selectors`, writes through `services`, `promotion` and
`flywheel.environments.variants`. Every view is wrapped in `access.project_view`: members read, reviewers
promote and create, maintainers freeze versions.
"""

from __future__ import annotations

import json
from typing import Any

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from flywheel.accounts.access import project_view
from flywheel.accounts.models import Project, Role
from flywheel.evals import calibration, leakage, promotion, selectors, services
from flywheel.evals.api import export_response
from flywheel.evals.models import EvalSuite, SuiteKind
from flywheel.trajectories.models import Trajectory

# Per collection model: the URL names and words its pages use.
KINDS: dict[str, dict[str, Any]] = {
    "suite": {"label": "eval suite", "plural": "Eval suites", "item": "case", "url": "suite"},
    "taskset": {"label": "task set", "plural": "Task sets", "item": "task", "url": "taskset"},
}


def _model(kind: str) -> type:
    if kind == "suite":
        return EvalSuite
    from flywheel.environments.models import TaskSet

    return TaskSet


def _kind_of(collection: Any) -> str:
    return "suite" if isinstance(collection, EvalSuite) else "taskset"


def _collection_or_404(project: Project, kind: str, pk: int) -> Any:
    collection = selectors.collection_get(project=project, model=_model(kind), pk=pk)
    if collection is None:
        raise Http404(f"No such {KINDS[kind]['label']} in this project.")
    return collection


def _role(request: HttpRequest) -> dict[str, bool]:
    return {"can_review": request.membership.grants(Role.REVIEWER),
            "can_freeze": request.membership.grants(Role.MAINTAINER)}


def _first_errors(exc: ValidationError) -> dict[str, str]:
    return {name: "; ".join(msgs) for name, msgs in exc.message_dict.items()}


# --- suites and task sets -------------------------------------------------------------------------------


def _list_context(request: HttpRequest, project: Project, kind: str, **extra: Any) -> dict[str, Any]:
    return {"project": project, "kind": kind, "words": KINDS[kind],
            "collections": selectors.collection_list(project=project, model=_model(kind)),
            "suite_kinds": SuiteKind.choices, "errors": {}, "posted": {}, **_role(request), **extra}


@require_GET
@project_view()
def collection_list(request: HttpRequest, project: Project, kind: str) -> HttpResponse:
    return render(request, "evals/collection_list.html", _list_context(request, project, kind))


@require_POST
@project_view(Role.REVIEWER)
def collection_create(request: HttpRequest, project: Project, kind: str) -> HttpResponse:
    try:
        if kind == "suite":
            created = services.suite_create(project=project, name=request.POST.get("name", ""),
                                            kind=request.POST.get("kind", SuiteKind.REGRESSION),
                                            description=request.POST.get("description", ""), user=request.user)
        else:
            from flywheel.environments.services import task_set_create

            created = task_set_create(project=project, name=request.POST.get("name", ""),
                                      description=request.POST.get("description", ""), user=request.user)
    except ValidationError as exc:
        context = _list_context(request, project, kind, errors=_first_errors(exc), posted=request.POST)
        return render(request, "evals/collection_list.html", context, status=422)
    return redirect(reverse(f"{kind}_detail", args=[project.slug, created.pk]))


@require_GET
@project_view()
def collection_detail(request: HttpRequest, project: Project, kind: str, collection_id: int) -> HttpResponse:
    collection = _collection_or_404(project, kind, collection_id)
    context = {"project": project, "kind": kind, "words": KINDS[kind], "collection": collection,
               "items": list(selectors.collection_items(collection=collection)),
               "versions": list(selectors.collection_versions(collection=collection)), **_role(request)}
    return render(request, "evals/collection_detail.html", context)


def _version_or_404(project: Project, kind: str, collection_id: int, number: int) -> tuple[Any, Any]:
    collection = _collection_or_404(project, kind, collection_id)
    version = selectors.version_get(collection=collection, number=number)
    if version is None:
        raise Http404("No such version.")
    return collection, version


@require_GET
@project_view()
def version_detail(request: HttpRequest, project: Project, kind: str, collection_id: int, number: int) -> HttpResponse:
    collection, version = _version_or_404(project, kind, collection_id, number)
    rows = [{"row": row, "json": json.dumps(row, indent=2, ensure_ascii=False)} for row in version.rows]
    context = {"project": project, "kind": kind, "words": KINDS[kind], "collection": collection,
               "version": version, "rows": rows, "conflicts": [], **_role(request)}
    return render(request, "evals/version_detail.html", context)


@require_GET
@project_view()
def version_export(request: HttpRequest, project: Project, kind: str, collection_id: int, number: int) -> HttpResponse:
    collection, version = _version_or_404(project, kind, collection_id, number)
    return export_response(collection, version)


@require_POST
@project_view(Role.MAINTAINER)
def version_freeze(request: HttpRequest, project: Project, kind: str, collection_id: int, number: int) -> HttpResponse:
    collection, version = _version_or_404(project, kind, collection_id, number)
    try:
        services.version_freeze(version=version, user=request.user)
    except leakage.LeakageError as exc:
        rows = [{"row": row, "json": json.dumps(row, indent=2, ensure_ascii=False)} for row in version.rows]
        context = {"project": project, "kind": kind, "words": KINDS[kind], "collection": collection,
                   "version": version, "rows": rows, "conflicts": exc.conflicts, **_role(request)}
        return render(request, "evals/version_detail.html", context, status=409)
    messages.success(request, f"Version {version.number} is frozen.")
    return redirect(reverse(f"{kind}_version", args=[project.slug, collection.pk, version.number]))


@require_POST
@project_view(Role.REVIEWER)
def item_remove(request: HttpRequest, project: Project, kind: str, collection_id: int, item_id: int) -> HttpResponse:
    collection = _collection_or_404(project, kind, collection_id)
    item = get_object_or_404(collection.items, pk=item_id)
    version = services.item_remove(item=item, user=request.user)
    messages.success(request, f"Removed {item.row_id}; version {version.number} made.")
    return redirect(reverse(f"{kind}_detail", args=[project.slug, collection.pk]))


# --- promotion -----------------------------------------------------------------------------------------


def _target(project: Project, value: str) -> Any:
    kind, _, pk = (value or "").partition(":")
    if kind not in KINDS or not pk.isdigit():
        return None
    return selectors.collection_get(project=project, model=_model(kind), pk=int(pk))


def _text(value: Any) -> str:
    """A field's value as the form shows it: JSON pretty-printed, text as it is."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, indent=2, ensure_ascii=False)


def _assistant_turns(trajectory: Trajectory) -> list[tuple[int, str]]:
    out = []
    for i, m in enumerate(trajectory.messages if isinstance(trajectory.messages, list) else []):
        if isinstance(m, dict) and m.get("role") == "assistant":
            calls = [((c.get("function") or {}).get("name") or "?") for c in (m.get("tool_calls") or [])
                     if isinstance(c, dict)]
            text = calls and "calls " + ", ".join(map(str, calls)) or str(m.get("content") or "")[:60]
            out.append((i, text))
    return out


def _form_context(request: HttpRequest, project: Project, trajectory: Trajectory, values: dict[str, Any],
                  target_value: str, check: promotion.PromotionCheck | None = None) -> dict[str, Any]:
    index = values.get("message_index")
    messages_ = trajectory.messages if isinstance(trajectory.messages, list) else []
    context_messages = messages_[:index] if isinstance(index, int) else []
    return {
        "project": project, "trajectory": trajectory, "check": check,
        "fields": {k: _text(v) for k, v in values.items()},
        "values": values,
        "errors": check.errors if check else {},
        "targets": selectors.promotion_targets(project=project),
        "target_value": target_value,
        "turns": _assistant_turns(trajectory),
        "context_messages": [{"role": m.get("role"), "text": _text(m.get("content")),
                              "calls": _text(m.get("tool_calls")) if m.get("tool_calls") else ""}
                             for m in context_messages if isinstance(m, dict)],
        "original_json": _text(messages_[index]) if isinstance(index, int) and index < len(messages_) else "",
        "answer_matches": promotion.ANSWER_MATCHES,
        "env_types": promotion.ENV_TYPES,
    }


@require_http_methods(["GET", "POST"])
@project_view(Role.REVIEWER)
def promotion_form(request: HttpRequest, project: Project, trajectory_id: int) -> HttpResponse:
    trajectory = get_object_or_404(Trajectory, project=project, pk=trajectory_id)
    if request.method == "GET":
        message = request.GET.get("message", "")
        values = promotion.promotion_prefill(trajectory=trajectory,
                                             message_index=int(message) if message.isdigit() else None)
        return render(request, "evals/promote.html",
                      _form_context(request, project, trajectory, values, request.GET.get("target", "")))
    target_value = request.POST.get("target", "")
    target = _target(project, target_value)
    data = request.POST.dict()
    if target is None:
        check = promotion.PromotionCheck(trajectory=trajectory, values={})
        promotion._read_fields(check, data)
        check.error("target", "choose the suite or task set to promote into")
        return render(request, "evals/promote.html",
                      _form_context(request, project, trajectory, check.values, target_value, check), status=422)
    if request.POST.get("action") == "save":
        try:
            item, _ = promotion.trajectory_promote(
                trajectory=trajectory, data=data, target=target, user=request.user,
                accept_passing_original=request.POST.get("accept_passing_original") == "on")
        except promotion.PromotionRefused as refused:
            check = refused.check
        else:
            kind = _kind_of(target)
            messages.success(request, f"Promoted trajectory #{trajectory.pk} into {target.name} as {item.row_id}.")
            return redirect(reverse(f"{kind}_detail", args=[project.slug, target.pk]))
    else:
        check = promotion.promotion_check(trajectory=trajectory, data=data, target=target)
    status = 200 if not check.errors else 422
    return render(request, "evals/promote.html",
                  _form_context(request, project, trajectory, check.values, target_value, check), status=status)


@require_http_methods(["GET", "POST"])
@project_view(Role.REVIEWER)
def bulk_promotion(request: HttpRequest, project: Project) -> HttpResponse:
    """A failure mode (?mode=ID) or a selection (?ids=1,2,3) under one expectation."""
    from flywheel.failures.models import FailureMode

    params = request.POST if request.method == "POST" else request.GET
    mode = None
    if (params.get("mode") or "").isdigit():
        mode = FailureMode.objects.filter(project=project, pk=int(params["mode"])).first()
    ids = [int(x) for x in (params.get("ids") or "").split(",") if x.strip().isdigit()][:1000]
    trajectories = list(Trajectory.objects.filter(project=project, pk__in=ids).order_by("pk")) if ids else []
    result, errors = None, {}
    fields = {k: params.get(k, "") for k in promotion.SHARED_FIELDS}
    if request.method == "POST":
        target = _target(project, params.get("target", ""))
        data = {k: v for k, v in fields.items() if v != ""}
        if target is None:
            errors["target"] = "choose the suite or task set to promote into"
        elif mode is None and not trajectories:
            errors["mode"] = "choose a failure mode or a selection of trajectories"
        elif mode is not None:
            result = promotion.failure_mode_promote(failure_mode=mode, data=data, target=target, user=request.user)
        else:
            result = promotion.selection_promote(items=[(t, None) for t in trajectories], data=data, target=target,
                                                 user=request.user)
    context = {"project": project, "mode": mode, "modes": FailureMode.objects.filter(project=project).order_by("name"),
               "ids": ",".join(map(str, ids)), "trajectories": trajectories, "result": result, "errors": errors,
               "fields": fields, "targets": selectors.promotion_targets(project=project),
               "target_value": params.get("target", ""), "answer_matches": promotion.ANSWER_MATCHES,
               "env_types": promotion.ENV_TYPES}
    return render(request, "evals/bulk.html", context, status=422 if errors else 200)


# --- calibration ---------------------------------------------------------------------------------------


@require_GET
@project_view()
def calibration_page(request: HttpRequest, project: Project) -> HttpResponse:
    """Pick a verifier (?source=case:ID / task:ID, or ?verifier=JSON) and the labeled trajectories."""
    source = request.GET.get("source", "")
    text = request.GET.get("verifier", "")
    agent = request.GET.get("agent", "")
    errors: dict[str, str] = {}
    result = None
    spec, tools = calibration.verifier_from_source(project=project, source=source, text=text, errors=errors)
    if spec is not None and not errors:
        result = calibration.verifier_calibrate(project=project, verifier=spec, tools=tools, agent=agent)
        if result.spec_errors:
            errors["verifier"] = "; ".join(result.spec_errors)
            result = None
    context = {"project": project, "source": source, "verifier_text": text or (_text(spec) if spec else ""),
               "agent": agent, "errors": errors, "result": result,
               "sources": calibration.verifier_sources(project=project), "min_labeled": calibration.MIN_LABELED}
    return render(request, "evals/calibration.html", context, status=422 if errors else 200)
