"""API of eval runs: measure a model version on a suite version from a script (a release check, a nightly
comparison). Scope `train` to start, cancel and retry (they take GPU time), `read` to follow and read the
per-case results."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.http import HttpRequest
from ninja import Router, Schema
from ninja.errors import HttpError

from flywheel.api import api
from flywheel.evals import runs
from flywheel.evals.models import EvalSuiteVersion
from flywheel.evals.run_models import EvalRun
from flywheel.registry.models import ModelVersion
from flywheel.training.api import _ERRORS, _field_errors, train_auth
from flywheel.trajectories.api import json_response, read_auth

router = Router(tags=["eval runs"])


class RunIn(Schema):
    model_version: int  # the version's number (v3 → 3)
    suite_version: int  # the suite version's id (`GET /api/v1/eval-suites/{id}/versions`)
    samples: int = 4


class RunState(Schema):
    id: int
    status: str


class CaseOut(Schema):
    case_id: str
    passed: bool
    pass_rate: float
    failures: dict[str, int]
    trajectory_id: int | None
    failure_mode_id: int | None


class RunOut(Schema):
    id: int
    status: str
    model_version: int
    suite_version: int
    samples: int
    metrics: dict[str, Any]
    error: str
    attempt: int
    created_at: datetime
    finished_at: datetime | None
    cases: list[CaseOut]


class RegressionBuildIn(Schema):
    samples: int = 16
    min_rate: float = 0.8


@router.post("/eval-suites/{suite_id}/regression-builds", auth=train_auth, response={201: RunState, **_ERRORS},
             summary="Build a regression suite from production's passes",
             description="Queues production's measurement on the suite's newest version (`samples` a case); when it "
                         "succeeds the suite gets a new version of the cases whose 95% Wilson lower bound of the "
                         "pass rate is at least `min_rate`. The eval run's page and `GET /api/v1/eval-runs/{id}` "
                         "show every case's measured rate. 422 names the wrong field.")
def regression_build_create(request: HttpRequest, suite_id: int, body: RegressionBuildIn):
    from flywheel.evals.models import EvalSuite
    from flywheel.evals.regression import regression_build_start

    project = request.auth.project
    suite = EvalSuite.objects.filter(project=project, pk=suite_id).first()
    if suite is None:
        raise HttpError(404, f"No eval suite {suite_id} in project '{project.slug}'.")
    try:
        run = regression_build_start(project=project, suite=suite, samples=body.samples, min_rate=body.min_rate,
                                     user=request.auth.created_by)
    except ValidationError as exc:
        return json_response(_field_errors(exc), status=422)
    return 201, {"id": run.pk, "status": run.status}


@router.post("/eval-runs", auth=train_auth, response={201: RunState, **_ERRORS}, summary="Start an eval run",
             description="Queues a measurement of a model version on a suite version for a GPU worker. 422 names "
                         "the wrong field.")
def run_create(request: HttpRequest, body: RunIn):
    project = request.auth.project
    version = ModelVersion.objects.filter(project=project, number=body.model_version).first()
    suite_version = EvalSuiteVersion.objects.filter(suite__project=project, pk=body.suite_version).first()
    try:
        if version is None:
            raise ValidationError({"model_version": f"No version v{body.model_version} in this project."})
        if suite_version is None:
            raise ValidationError({"suite_version": f"No suite version {body.suite_version} in this project."})
        run = runs.eval_run_create(project=project, model_version=version, suite_version=suite_version,
                                   user=request.auth.created_by, samples=body.samples)
    except ValidationError as exc:
        return json_response(_field_errors(exc), status=422)
    return 201, {"id": run.pk, "status": run.status}


def _run(request: HttpRequest, eval_run_id: int) -> EvalRun:
    run = EvalRun.objects.select_related("model_version").filter(project=request.auth.project, pk=eval_run_id).first()
    if run is None:
        raise HttpError(404, "No such eval run in this project.")
    return run


@router.get("/eval-runs/{eval_run_id}", auth=read_auth, response={200: RunOut, **_ERRORS}, summary="An eval run",
            description="Status, metrics and, once it succeeded, each case's result with where the case came from.")
def run_get(request: HttpRequest, eval_run_id: int) -> dict[str, Any]:
    run = _run(request, eval_run_id)
    return {
        "id": run.pk, "status": run.status, "model_version": run.model_version.number,
        "suite_version": run.suite_version_id, "samples": run.samples, "metrics": run.metrics, "error": run.error,
        "attempt": run.attempt, "created_at": run.created_at, "finished_at": run.finished_at,
        "cases": [{"case_id": r.case_id, "passed": r.passed, "pass_rate": r.pass_rate, "failures": r.failures,
                   "trajectory_id": r.trajectory_id, "failure_mode_id": r.failure_mode_id}
                  for r in run.results.all()],
    }


def _act(request: HttpRequest, eval_run_id: int, action) -> dict[str, Any]:
    try:
        run = action(run=_run(request, eval_run_id))
    except ValidationError as exc:
        raise HttpError(409, exc.messages[0]) from None
    return {"id": run.pk, "status": run.status}


@router.post("/eval-runs/{eval_run_id}/cancel", auth=train_auth, response={200: RunState, **_ERRORS},
             summary="Cancel an eval run", description="A queued run stops at once, a running one when its worker "
             "next checks (its trainer's whole process group is killed); 409 when it has ended.")
def run_cancel(request: HttpRequest, eval_run_id: int) -> dict[str, Any]:
    return _act(request, eval_run_id, runs.eval_run_cancel)


@router.post("/eval-runs/{eval_run_id}/retry", auth=train_auth, response={200: RunState, **_ERRORS},
             summary="Retry an eval run", description="Queues a failed or cancelled run again; 409 otherwise.")
def run_retry(request: HttpRequest, eval_run_id: int) -> dict[str, Any]:
    return _act(request, eval_run_id, runs.eval_run_retry)


api.add_router("", router)
