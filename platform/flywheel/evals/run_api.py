"""API of eval runs: measure a model version on a suite version from a script (a release check, a nightly
comparison). Scope `train` to start, cancel and retry (they take GPU time) and to build a regression suite,
`read` to follow, list and compare runs and read the per-case results."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from django.core.exceptions import ValidationError
from django.http import HttpRequest
from ninja import Field, Query, Router, Schema, Status
from ninja.errors import HttpError

from flywheel.api import ObjectIn
from flywheel.api.auth import read_auth, train_auth
from flywheel.api.errors import ERRORS
from flywheel.api.ids import Id, VersionNumber
from flywheel.api.pagination import PageQuery, keyset_page
from flywheel.api.usage import UsageOut
from flywheel.api.versions import version_of
from flywheel.evals import runs
from flywheel.evals.models import EvalSuite
from flywheel.evals.run_models import EvalRun, EvalRunStatus
from flywheel.registry.models import ModelVersion

router = Router(tags=["eval runs"])


class RunIn(Schema):
    model_version: VersionNumber = Field(description="The model version's number (v3 is 3)")
    suite: Id = Field(description="The eval suite's id")
    suite_version: VersionNumber = Field(description="Its version's number (`GET /api/v1/eval-suites/{id}/versions`)")
    samples: int | None = Field(None, description="Samples a case; by default a training job's: GRPOConfig's "
                                "eval_samples_per_prompt (4), regression_samples_per_prompt (16) on a regression suite")


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


class RunSummary(Schema):
    id: int
    status: str
    model_version: int = Field(description="The model version's number")
    suite: int = Field(description="The eval suite's id")
    suite_version: int = Field(description="The suite version's number")
    samples: int
    source: str = Field(description="manual (started by a person or a key) or job (a training job's measurement)")
    job: int | None = Field(description="The training job that recorded it, for a job's measurement")
    metrics: dict[str, Any]
    created_at: datetime
    finished_at: datetime | None
    usage: UsageOut = Field(description="The device time it held: GPU-hours (or CPU-hours) and wall time")


class RunOut(RunSummary):
    error: str
    attempt: int
    cases: list[CaseOut]


class RunPage(Schema):
    items: list[RunSummary]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page")


class RunFilters(PageQuery):
    status: Literal[tuple(EvalRunStatus.values)] | None = None  # type: ignore[valid-type]
    model_version: VersionNumber | None = Field(None, description="Runs of this model version (number)")
    suite: Id | None = Field(None, description="Runs on this eval suite (id)")
    suite_version: VersionNumber | None = Field(None, description="Runs on this version (its number) of `suite`, "
                                                                  "or of any suite")


class CompareRowOut(Schema):
    case_id: str
    a: CaseOut | None
    b: CaseOut | None
    change: Literal["fixed", "broken", ""]


class CompareOut(Schema):
    a: RunSummary
    b: RunSummary
    a_success: float = Field(description="Mean per-case pass rate of a")
    b_success: float
    fixed: int = Field(description="Cases a failed and b passes")
    broken: int = Field(description="Cases a passed and b fails")
    p_b_better: float = Field(description="The paired sign-flip test's p-value that b is better")
    p_a_better: float
    rows: list[CompareRowOut]


class RunCompareQuery(Schema):
    ids: list[Id] = Field(min_length=2, max_length=2, description="The two runs: a, then b")


class RegressionBuildIn(ObjectIn):
    samples: int = 16
    min_rate: float = 0.8


def _case(result: Any) -> dict[str, Any] | None:
    if result is None:
        return None
    return {"case_id": result.case_id, "passed": result.passed, "pass_rate": result.pass_rate,
            "failures": result.failures, "trajectory_id": result.trajectory_id,
            "failure_mode_id": result.failure_mode_id}


def _summary(run: EvalRun) -> dict[str, Any]:
    return {"id": run.pk, "status": run.status, "model_version": run.model_version.number,
            "suite": run.suite_version.suite_id, "suite_version": run.suite_version.number, "samples": run.samples,
            "source": run.source, "job": run.job_id, "metrics": run.metrics, "created_at": run.created_at,
            "finished_at": run.finished_at, "usage": run.usage()}


@router.post("/eval-suites/{suite_id}/regression-builds", auth=train_auth, response={201: RunState, **ERRORS},
             summary="Build a regression suite from production's passes",
             description="Queues production's measurement on the suite's newest version (`samples` a case); when it "
                         "succeeds the suite gets a new version of the cases whose 95% Wilson lower bound of the "
                         "pass rate is at least `min_rate`. The answer is the eval run: follow it at "
                         "`GET /api/v1/eval-runs/{id}`, which shows every case's measured rate. 422 names the "
                         "wrong field.")
def regression_build_create(request: HttpRequest, suite_id: Id, body: RegressionBuildIn) -> Status:
    from flywheel.evals.regression import regression_build_start

    project = request.auth.project
    suite = EvalSuite.objects.filter(project=project, pk=suite_id).first()
    if suite is None:
        raise HttpError(404, f"No eval suite {suite_id} in project '{project.slug}'.")
    run = regression_build_start(project=project, suite=suite, samples=body.samples, min_rate=body.min_rate,
                                 user=request.auth.created_by)
    return Status(201, {"id": run.pk, "status": run.status})


@router.post("/eval-runs", auth=train_auth, response={201: RunState, **ERRORS}, summary="Start an eval run",
             description="Queues a measurement of a model version (its number) on an eval suite's version (the "
                         "suite's id and the version's number) for a GPU worker. 422 names the wrong field (cases "
                         "× `samples` over FLYWHEEL_MAX_EVAL_GENERATIONS too); 409 when the project already has "
                         "FLYWHEEL_MAX_EVAL_RUNS_PER_PROJECT runs waiting or running, naming the limit.")
def run_create(request: HttpRequest, body: RunIn) -> Status:
    project = request.auth.project
    version = ModelVersion.objects.filter(project=project, number=body.model_version).first()
    if version is None:
        raise ValidationError({"model_version": f"No model version v{body.model_version} in this project."})
    suite_version = version_of(project=project, model=EvalSuite, collection=body.suite, number=body.suite_version,
                               field="suite", required=True)
    run = runs.eval_run_create(project=project, model_version=version, suite_version=suite_version,
                               user=request.auth.created_by, samples=body.samples)
    return Status(201, {"id": run.pk, "status": run.status})


def _runs(request: HttpRequest):
    return EvalRun.objects.filter(project=request.auth.project).select_related("model_version", "suite_version")


def _run(request: HttpRequest, eval_run_id: int) -> EvalRun:
    run = _runs(request).filter(pk=eval_run_id).first()
    if run is None:
        raise HttpError(404, f"No eval run {eval_run_id} in project '{request.auth.project.slug}'.")
    return run


@router.get("/eval-runs", auth=read_auth, response={200: RunPage, **ERRORS}, summary="List eval runs",
            description="The project's eval runs, newest first, `limit` at a time (pass `next_cursor` back as "
                        "`cursor`), narrowed by status, model version, suite and suite version.")
def run_list(request: HttpRequest, filters: Query[RunFilters]) -> dict[str, Any]:
    found = _runs(request)
    if filters.status:
        found = found.filter(status=filters.status)
    if filters.model_version is not None:
        found = found.filter(model_version__number=filters.model_version)
    if filters.suite is not None:
        found = found.filter(suite_version__suite_id=filters.suite)
    if filters.suite_version is not None:
        found = found.filter(suite_version__number=filters.suite_version)
    rows, next_cursor = keyset_page(found, cursor=filters.cursor, limit=filters.limit)
    return {"items": [_summary(run) for run in rows], "next_cursor": next_cursor}


# Before /eval-runs/{eval_run_id}: "compare" is not a run's id.
@router.get("/eval-runs/compare", auth=read_auth, response={200: CompareOut, **ERRORS}, summary="Compare two eval runs",
            description="Two runs of one suite version (`?ids=A&ids=B`) case by case, with the gate's paired test "
                        "each way, as the comparison page shows them; 422 when they measured different versions.")
def run_compare(request: HttpRequest, query: Query[RunCompareQuery]) -> dict[str, Any]:
    ids = query.ids
    found = {run.pk: run for run in _runs(request).filter(pk__in=ids)}
    missing = [pk for pk in ids if pk not in found]
    if missing:
        raise HttpError(404, f"No eval run {missing[0]} in project '{request.auth.project.slug}'.")
    a, b = found[ids[0]], found[ids[1]]
    try:
        comparison = runs.eval_compare(a=a, b=b)
    except ValidationError as exc:
        raise ValidationError({"ids": exc.messages}) from None
    return {
        **{k: comparison[k] for k in ("a_success", "b_success", "fixed", "broken", "p_b_better", "p_a_better")},
        "a": _summary(a), "b": _summary(b),
        "rows": [{"case_id": r["case_id"], "a": _case(r["a"]), "b": _case(r["b"]), "change": r["change"]}
                 for r in comparison["rows"]],
    }


@router.get("/eval-runs/{eval_run_id}", auth=read_auth, response={200: RunOut, **ERRORS}, summary="An eval run",
            description="Status, metrics and, once it succeeded, each case's result with where the case came from.")
def run_get(request: HttpRequest, eval_run_id: Id) -> dict[str, Any]:
    run = _run(request, eval_run_id)
    return {**_summary(run), "error": run.error, "attempt": run.attempt,
            "cases": [_case(r) for r in run.results.all()]}


def _act(request: HttpRequest, eval_run_id: int, action) -> dict[str, Any]:
    run = action(run=_run(request, eval_run_id))  # supervise.Refused: 409 with the reason (api.errors)
    return {"id": run.pk, "status": run.status}


@router.post("/eval-runs/{eval_run_id}/cancel", auth=train_auth, response={200: RunState, **ERRORS},
             summary="Cancel an eval run", description="A queued run stops at once, a running one when its worker "
             "next checks (its trainer's whole process group is killed); 409 when it has ended.")
def run_cancel(request: HttpRequest, eval_run_id: Id) -> dict[str, Any]:
    return _act(request, eval_run_id, runs.eval_run_cancel)


@router.post("/eval-runs/{eval_run_id}/retry", auth=train_auth, response={200: RunState, **ERRORS},
             summary="Retry an eval run", description="Queues a failed or cancelled run again; 409 otherwise.")
def run_retry(request: HttpRequest, eval_run_id: Id) -> dict[str, Any]:
    return _act(request, eval_run_id, runs.eval_run_retry)
