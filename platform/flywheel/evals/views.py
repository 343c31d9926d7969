"""Pages of eval suites and task sets (one set of views, `model` says which), the promotion form, bulk
promotion and verifier calibration.

Views stay thin: reads from `selectors`, writes through `services`, `promotion` and
`flywheel.environments.variants`. Every view is wrapped in `access.project_view`: members read, reviewers
promote and create, maintainers freeze versions.
"""

from __future__ import annotations

import functools
import json
from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from flywheel.accounts.access import project_view
from flywheel.accounts.models import Project, Role
from flywheel.demo_status import demo_status_of
from flywheel.evals import calibration, leakage, promotion, selectors, services
from flywheel.evals.api import export_response
from flywheel.evals.calibration_models import VerifierCalibration
from flywheel.evals.kinds import train_side
from flywheel.evals.models import EvalSuite, SuiteKind
from flywheel.supervise import Refused
from flywheel.trajectories.models import Trajectory

# Per collection model: the URL names and words its pages use.
KINDS: dict[str, dict[str, Any]] = {
    "suite": {"label": "eval suite", "plural": "Eval suites", "item": "case", "url": "suite"},
    "taskset": {"label": "task set", "plural": "Task sets", "item": "task", "url": "taskset"},
}


def for_kind(view: Any, kind: str) -> Any:
    """The shared view for one kind of collection. Each kind's URLs name their own ids (suite_id and case_id,
    task_set_id and task_id), so that an id of one kind is never taken for the other's."""
    id_name, item_name = ("suite_id", "case_id") if kind == "suite" else ("task_set_id", "task_id")

    @functools.wraps(view)
    def wrapped(request: HttpRequest, project_slug: str, **kwargs: Any) -> HttpResponse:
        if id_name in kwargs:
            kwargs["collection_id"] = kwargs.pop(id_name)
        if item_name in kwargs:
            kwargs["item_id"] = kwargs.pop(item_name)
        return view(request, project_slug, kind=kind, **kwargs)

    return wrapped


def _model(kind: str) -> type:
    return EvalSuite if kind == "suite" else train_side().collection


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
            "suite_kinds": SuiteKind.choices, "errors": {}, "posted": {}, "demo_status": demo_status_of(project=project),
            **_role(request), **extra}


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
            created = train_side().create(project=project, name=request.POST.get("name", ""),
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
@project_view(Role.MAINTAINER)
def regression_build(request: HttpRequest, project: Project, kind: str, collection_id: int) -> HttpResponse:
    """Measure production on the suite and keep the cases it passes reliably (`evals.regression`)."""
    from flywheel.evals.regression import regression_build_start

    collection = _collection_or_404(project, kind, collection_id)
    try:
        run = regression_build_start(project=project, suite=collection, user=request.user,
                                     samples=int(request.POST.get("samples") or 16),
                                     min_rate=request.POST.get("min_rate") or 0.8)
    except (ValidationError, ValueError, Refused) as exc:
        text = ("; ".join(_first_errors(exc).values()) if isinstance(exc, ValidationError) else
                str(exc) if isinstance(exc, Refused) else "Samples: a number.")
        messages.error(request, f"Not started: {text}")
        return redirect(reverse(f"{kind}_detail", args=[project.slug, collection.pk]))
    messages.success(request, "Production is being measured on these cases; the suite's next version keeps the "
                              "ones it passes reliably.")
    return redirect(reverse("eval_run", args=[project.slug, run.pk]))


@require_POST
@project_view(Role.REVIEWER)
def item_remove(request: HttpRequest, project: Project, kind: str, collection_id: int, item_id: int) -> HttpResponse:
    collection = _collection_or_404(project, kind, collection_id)
    item = collection.items.filter(pk=item_id).first()
    if item is None:  # a second click on Remove: nothing left to do
        messages.info(request, "Already removed.")
    else:
        version = services.item_remove(item=item, user=request.user)
        messages.success(request, f"Removed {item.row_id}; version {version.number} made.")
    return redirect(reverse(f"{kind}_detail", args=[project.slug, collection.pk]))


# --- promotion -----------------------------------------------------------------------------------------


def _as_id(text: str) -> int | None:
    """An id from a form or query field; None for anything else (int() refuses over 4,300 digits)."""
    text = (text or "").strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


def _target(project: Project, value: str) -> Any:
    kind, _, pk = (value or "").partition(":")
    if kind not in KINDS or _as_id(pk) is None:
        return None
    return selectors.collection_get(project=project, model=_model(kind), pk=_as_id(pk))


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


def check_rows(score: Any) -> list[dict[str, Any]]:
    """A score's checks as rows a reviewer reads: name, ok (True/False/None) and one line of detail.
    A tool_call score's `calls` check (one entry per expected call) becomes one row per expected call."""
    rows = []
    for name, detail in (score.checks or {}).items():
        if name == "calls" and isinstance(detail, list):
            for entry in detail:
                args = entry.get("arguments") if isinstance(entry.get("arguments"), dict) else {}
                if entry.get("actual") is None:
                    ok, text = False, "not called"
                else:
                    ok = bool(args.get("ok"))
                    text = "; ".join(map(str, args.get("mismatches") or [])) or "arguments match"
                rows.append({"name": f"call {entry.get('name')}", "ok": ok, "detail": text})
            continue
        if isinstance(detail, dict):
            ok = detail.get("ok") if isinstance(detail.get("ok"), bool) else None
            text = detail.get("reason") or "; ".join(map(str, detail.get("errors") or detail.get("mismatches") or []))
            if not text:
                rest = {k: v for k, v in detail.items() if k != "ok"}
                text = json.dumps(rest, ensure_ascii=False, default=str)[:300] if rest else ""
        else:
            ok, text = None, json.dumps(detail, ensure_ascii=False, default=str)[:300]
        rows.append({"name": name, "ok": ok, "detail": text})
    return rows


EXPECT_CHOICES = (("calls", "Tool calls"), ("answer", "Final answer"), ("state", "Final state (workplace)"))


def _target_groups(project: Project) -> list[tuple[str, list[tuple[str, str]]]]:
    targets = selectors.promotion_targets(project=project)
    groups = [("Eval suites", [(f"suite:{s.pk}", f"{s.name} ({s.kind})") for s in targets["suites"]]),
              ("Task sets", [(f"taskset:{t.pk}", t.name) for t in targets["task_sets"]])]
    return [(label, options) for label, options in groups if options]


# The form's text fields: where one is wrong, the page shows back what was typed, not its parse's default.
_TEXT_FIELDS = ("expected_calls", "reference_calls", "expected_answer", "reference_answer", "expected_state",
                "observations", "initial_state", "max_turns", "leakage_reason")


def _form_context(request: HttpRequest, project: Project, trajectory: Trajectory, values: dict[str, Any],
                  target_value: str, check: promotion.PromotionCheck | None = None,
                  not_saved: list[str] | None = None) -> dict[str, Any]:
    index = values.get("message_index")
    fields = {k: _text(v) for k, v in values.items()}
    if request.method == "POST" and check is not None:
        fields |= {name: request.POST[name] for name in _TEXT_FIELDS if name in check.errors and name in request.POST}
    messages_ = trajectory.messages if isinstance(trajectory.messages, list) else []
    context_messages = messages_[:index] if isinstance(index, int) else []
    return {
        "project": project, "trajectory": trajectory, "check": check,
        "original_rows": check_rows(check.original_score) if check and check.original_score else [],
        "reference_rows": check_rows(check.reference_score) if check and check.reference_score else [],
        "fields": fields,
        "values": values,
        "not_saved": not_saved or [],
        "errors": check.errors if check else {},
        "targets": selectors.promotion_targets(project=project),
        "target_groups": _target_groups(project),
        "expect_choices": EXPECT_CHOICES,
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
        values = promotion.promotion_prefill(trajectory=trajectory, message_index=_as_id(request.GET.get("message", "")))
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
    not_saved: list[str] = []
    if request.POST.get("action") == "save":
        try:
            item, _ = promotion.trajectory_promote(
                trajectory=trajectory, data=data, target=target, user=request.user,
                accept_passing_original=request.POST.get("accept_passing_original") == "on")
        except promotion.PromotionRefused as refused:
            check = refused.check
            not_saved = check.reasons() or ["the checks did not pass"]
        else:
            kind = _kind_of(target)
            messages.success(request, f"Promoted trajectory #{trajectory.pk} into {target.name} as {item.row_id}.")
            return redirect(reverse(f"{kind}_detail", args=[project.slug, target.pk]))
    else:
        check = promotion.promotion_check(trajectory=trajectory, data=data, target=target)
    status = 422 if check.errors or not_saved else 200
    return render(request, "evals/promote.html",
                  _form_context(request, project, trajectory, check.values, target_value, check, not_saved),
                  status=status)


@require_http_methods(["GET", "POST"])
@project_view(Role.REVIEWER)
def bulk_promotion(request: HttpRequest, project: Project) -> HttpResponse:
    """A failure mode (?mode=ID) or a selection (?ids=1,2,3) under one expectation."""
    from flywheel.failures.models import FailureMode

    params = request.POST if request.method == "POST" else request.GET
    mode_id = _as_id(params.get("mode", ""))
    mode = FailureMode.objects.filter(project=project, pk=mode_id).first() if mode_id is not None else None
    ids = [i for i in map(_as_id, (params.get("ids") or "").split(",")) if i is not None][:1000]
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
        else:
            try:
                if mode is not None:
                    result = promotion.failure_mode_promote(failure_mode=mode, data=data, target=target,
                                                            user=request.user)
                else:
                    result = promotion.selection_promote(items=[(t, None) for t in trajectories], data=data,
                                                         target=target, user=request.user)
            except promotion.BulkTooLarge as exc:
                errors["mode"] = str(exc)
    context = {"project": project, "mode": mode, "modes": FailureMode.objects.filter(project=project).order_by("name"),
               "ids": ",".join(map(str, ids)), "trajectories": trajectories, "result": result, "errors": errors,
               "fields": fields, "target_groups": _target_groups(project), "expect_choices": EXPECT_CHOICES,
               "target_value": params.get("target", ""), "answer_matches": promotion.ANSWER_MATCHES,
               "env_types": promotion.ENV_TYPES}
    return render(request, "evals/bulk.html", context, status=422 if errors else 200)


# --- calibration ---------------------------------------------------------------------------------------


@require_GET
@project_view()
def calibration_page(request: HttpRequest, project: Project) -> HttpResponse:
    """The form to calibrate a verifier (?source=case:ID / task:ID preselects one), the calibration ?run=
    names (else the project's newest) with its progress or figures, and triage's detectors, calibrated on every
    view against the labels ?labels= names (reviewers' by default)."""
    run = None
    if request.GET.get("run", "").isdecimal() and len(request.GET["run"]) <= 18:
        run = VerifierCalibration.objects.filter(project=project, pk=int(request.GET["run"])).first()
    if run is None:
        run = VerifierCalibration.objects.filter(project=project).first()
    return _calibration_render(request, project, run=run, source=request.GET.get("source", ""),
                               text=request.GET.get("verifier", ""), agent=request.GET.get("agent", ""),
                               labels=request.GET.get("labels") or "reviewed")


@require_POST
@project_view()
def calibration_start(request: HttpRequest, project: Project) -> HttpResponse:
    """Start a calibration on a worker (every member may: it reads only) and show its progress."""
    source, text, agent = (request.POST.get(k, "") for k in ("source", "verifier", "agent"))
    labels = request.POST.get("labels") or "reviewed"
    errors: dict[str, str] = {}
    try:
        run = calibration.calibration_request(project=project, source=source, text=text, agent=agent, errors=errors,
                                              user=request.user)
    except calibration.CalibrationRefused as exc:
        return _calibration_render(request, project, run=None, source=source, text=text, agent=agent, labels=labels,
                                   errors={"run": str(exc)}, status=409)
    if run is None:
        return _calibration_render(request, project, run=None, source=source, text=text, agent=agent, labels=labels,
                                   errors=errors, status=422)
    query = {"run": run.pk, **({"labels": labels} if labels != "reviewed" else {})}
    return redirect(reverse("calibration", args=[project.slug]) + "?" + urlencode(query) + "#calibration-run")


@require_GET
@project_view()
def calibration_status(request: HttpRequest, project: Project, calibration_id: int) -> HttpResponse:
    """A calibration's progress or figures: the fragment the page polls while it is queued or running."""
    run = get_object_or_404(VerifierCalibration, project=project, pk=calibration_id)
    return render(request, "evals/_calibration_run.html",
                  {"project": project, "run": run, "min_labeled": calibration.MIN_LABELED})


def _calibration_render(request: HttpRequest, project: Project, *, run: VerifierCalibration | None, source: str,
                        text: str, agent: str, labels: str, errors: dict[str, str] | None = None,
                        status: int = 200) -> HttpResponse:
    errors = dict(errors or {})
    if labels not in calibration.DETECTOR_LABELS:
        errors["labels"] = f"labels {labels[:40]!r} is not one of: {', '.join(calibration.DETECTOR_LABELS)}"
        labels = "reviewed"
    detectors = calibration.detector_calibrate(project=project, agent=agent, labels=labels)
    if run is not None and not (source or text or agent):
        source, agent = run.source, run.agent  # the form shows what the calibration shown scored
        text = "" if source else _text(run.verifier)
    context = {"project": project, "source": source, "verifier_text": text, "agent": agent, "errors": errors,
               "run": run, "sources": calibration.verifier_sources(project=project),
               "min_labeled": calibration.MIN_LABELED, "detectors": detectors, "labels": labels,
               "label_choices": calibration.DETECTOR_LABELS}
    return render(request, "evals/calibration.html", context, status=422 if errors and status == 200 else status)
