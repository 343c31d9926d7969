"""API of training jobs: a team scripts its retraining as well as clicking it. Scope `train` to start and
cancel jobs and to set the project's training recipe, `read` to follow them, list them, read their curves
and compare them."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from django.http import HttpRequest
from ninja import Field, Query, Router, Schema, Status
from ninja.errors import HttpError
from pydantic import StrictBool

from flywheel.api.auth import read_auth, train_auth
from flywheel.api.errors import ERRORS
from flywheel.api.ids import Id, VersionNumber
from flywheel.api.pagination import PageQuery, keyset_page
from flywheel.api.text import NulFreeJson, Text
from flywheel.api.usage import UsageOut
from flywheel.api.versions import version_of, version_ref
from flywheel.environments.models import TaskSet
from flywheel.evals.leakage import LeakageError
from flywheel.evals.models import EvalSuite
from flywheel.training import comparison, services
from flywheel.training.models import JobEvent, JobStatus, TrainingJob

router = Router(tags=["training"])


class JobIn(Schema):
    task_set: Id = Field(description="The task set's id")
    task_set_version: VersionNumber = Field(description="Its version's number (`GET /api/v1/task-sets/{id}/versions`)")
    holdout: Id | None = Field(None, description="The holdout suite's id; with holdout_version")
    holdout_version: VersionNumber | None = Field(None, description="Its version's number")
    regression: Id | None = Field(None, description="The regression suite's id; with regression_version")
    regression_version: VersionNumber | None = Field(None, description="Its version's number")
    algorithm: Text = Field("grpo", description=" | ".join(services.ALGORITHMS))
    config: Annotated[dict[str, Any], NulFreeJson] = Field({}, description="GRPOConfig fields, over the project's recipe")
    num_gpus: int = 1
    confirm: StrictBool = Field(True, description="Train right after production is measured; false: wait for a "
                                                  "person on the job's page")


class JobCreated(Schema):
    id: int
    status: str


class CheckpointOut(Schema):
    step: int
    best: bool
    holdout: dict[str, Any]


class GateOut(Schema):
    id: int
    passed: bool
    rules: list[dict[str, Any]]
    error: str


class JobSummary(Schema):
    id: int
    status: str
    algorithm: str
    task_set: int
    task_set_version: int
    holdout: int | None
    holdout_version: int | None
    regression: int | None
    regression_version: int | None
    base_version: int = Field(description="The model version it started from (production when it was made)")
    candidate_version: int | None
    step: int
    max_steps: int
    progress: float
    created_at: datetime
    finished_at: datetime | None
    usage: UsageOut = Field(description="The device time it held: GPU-hours (or CPU-hours) and wall time")


class JobOut(JobSummary):
    config: dict[str, Any] = Field(description="Every GRPOConfig field as it runs: the field's recipe, the "
                                               "project's, the job's own, the algorithm's defaults, and what the "
                                               "trainer works out for a field left unset")
    num_gpus: int
    stages: list[dict[str, Any]] = Field(description="A job of several stages (sft_grpo): each stage's steps, "
                                                     "planned and as the trainer announced them; [] otherwise")
    gate_rules: dict[str, Any] = Field(description="The gate's rules its candidate was judged by; before the "
                                                   "gate, the project's rules now")
    advice: dict[str, Any]
    last_metrics: dict[str, Any] | None
    checkpoints: list[CheckpointOut]
    error: str
    failed_step: int | None
    gate: GateOut | None


class JobPage(Schema):
    items: list[JobSummary]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page")


class JobFilters(PageQuery):
    status: Literal[tuple(JobStatus.values)] | None = Field(None, description="Only jobs in this state")  # type: ignore[valid-type]


class CurvesOut(Schema):
    status: str
    train: dict[str, list[Any]] = Field(description="Per trainer step: step, reward, kl, completion_length")
    holdout: dict[str, list[Any]] = Field(description="Per holdout look: step, success_rate")


class JobCompareQuery(Schema):
    ids: list[Id] = Field(min_length=2, max_length=comparison.MAX_COMPARED, json_schema_extra={"uniqueItems": True},
                          description="The jobs, in the order to show them, each once")


class RecipeIn(Schema):
    config: Annotated[dict[str, Any], NulFreeJson] = Field(
        description="GRPOConfig values new jobs start from; {} clears the recipe")


class RecipeOut(Schema):
    config: dict[str, Any] = Field(description="The project's own recipe (what it saved)")
    effective: dict[str, Any] = Field(description="What a GRPO job with no `config` of its own starts from: the "
                                                  "field's recipe under the project's")


@router.post("/training-jobs", auth=train_auth, response={201: JobCreated, **ERRORS}, summary="Start a training job",
             description=(
                 "Measures production on the holdout, then trains (with `confirm`, the default) on the task set's "
                 "version. Each collection is named by its id and each version by its number within it. 422 names "
                 "each wrong field, including every GRPOConfig field of `config` (`max_steps` over "
                 "FLYWHEEL_MAX_STEPS, `eval_samples_per_prompt` × a suite's cases over FLYWHEEL_MAX_EVAL_GENERATIONS) "
                 "and `num_gpus` over what the GPU workers reported; 409 lists the rows the leakage guard refuses, "
                 "or names the limit when the project has FLYWHEEL_MAX_JOBS_PER_PROJECT jobs not yet ended."))
def job_create(request: HttpRequest, body: JobIn) -> Status:
    project = request.auth.project
    try:
        job = services.job_create(
            project=project,
            task_set_version=version_of(project=project, model=TaskSet, collection=body.task_set,
                                        number=body.task_set_version, field="task_set", required=True),
            holdout_version=version_of(project=project, model=EvalSuite, collection=body.holdout,
                                       number=body.holdout_version, field="holdout"),
            regression_version=version_of(project=project, model=EvalSuite, collection=body.regression,
                                          number=body.regression_version, field="regression"),
            algorithm=body.algorithm, config=body.config, num_gpus=body.num_gpus, confirm=body.confirm,
            user=request.auth.created_by,
        )
    except LeakageError as exc:
        raise HttpError(409, "The task set leaks into the evaluation: " + "; ".join(map(str, exc.conflicts))) from None
    return Status(201, {"id": job.pk, "status": job.status})


def _jobs(request: HttpRequest):
    return TrainingJob.objects.filter(project=request.auth.project).select_related(
        "task_set_version", "holdout_version", "regression_version", "base_version", "candidate_version")


def _job(request: HttpRequest, job_id: int) -> TrainingJob:
    job = _jobs(request).filter(pk=job_id).first()
    if job is None:
        raise HttpError(404, f"No training job {job_id} in project '{request.auth.project.slug}'.")
    return job


def _summary(job: TrainingJob) -> dict[str, Any]:
    task_set, task_set_version = version_ref(job.task_set_version)
    holdout, holdout_version = version_ref(job.holdout_version)
    regression, regression_version = version_ref(job.regression_version)
    return {
        "id": job.pk, "status": job.status, "algorithm": job.algorithm,
        "task_set": task_set, "task_set_version": task_set_version, "holdout": holdout,
        "holdout_version": holdout_version, "regression": regression, "regression_version": regression_version,
        "base_version": job.base_version.number,
        "candidate_version": job.candidate_version.number if job.candidate_version else None,
        "step": job.step, "max_steps": job.max_steps, "progress": round(job.progress, 4),
        "created_at": job.created_at, "finished_at": job.finished_at, "usage": job.usage(),
    }


@router.get("/training-jobs", auth=read_auth, response={200: JobPage, **ERRORS}, summary="List training jobs",
            description="The project's jobs, newest first, `limit` at a time (pass `next_cursor` back as `cursor`); "
                        "`status` keeps the jobs in that state.")
def job_list(request: HttpRequest, filters: Query[JobFilters]) -> dict[str, Any]:
    jobs = _jobs(request)
    if filters.status:
        jobs = jobs.filter(status=filters.status)
    rows, next_cursor = keyset_page(jobs, cursor=filters.cursor, limit=filters.limit)
    return {"items": [_summary(job) for job in rows], "next_cursor": next_cursor}


# Before /training-jobs/{job_id}: "compare" is not a job's id.
@router.get("/training-jobs/compare", auth=read_auth, response={200: dict[str, Any], **ERRORS},
            summary="Compare training jobs",
            description=f"Two to {comparison.MAX_COMPARED} jobs of the project (`?ids=1&ids=2`) side by side: "
                        "their settings (a row per setting, a value per job, `differs` where they are not all the "
                        "same), holdout curves and gate outcomes, as the comparison page shows them. 404 for a job "
                        "the project does not have; 422 for a job named twice.")
def job_compare(request: HttpRequest, query: Query[JobCompareQuery]) -> dict[str, Any]:
    found = {job.pk: job for job in _jobs(request).filter(pk__in=query.ids)}
    missing = [pk for pk in query.ids if pk not in found]
    if missing:
        raise HttpError(404, f"No training job {missing[0]} in project '{request.auth.project.slug}'.")
    return comparison.compare_jobs(project=request.auth.project, jobs=[found[pk] for pk in query.ids])


@router.get("/training-jobs/{job_id}", auth=read_auth, response={200: JobOut, **ERRORS}, summary="A training job",
            description="Status, progress, the settings it runs with (resolved config, algorithm, versions, the "
                        "gate's rules), last holdout metrics, checkpoints and, when done, the candidate version and "
                        "the gate's decision.")
def job_get(request: HttpRequest, job_id: Id) -> dict[str, Any]:
    from flywheel.registry.selectors import gate_rules_of

    job = _job(request, job_id)
    last_eval = JobEvent.objects.filter(job=job, kind="eval").order_by("-id").first()
    decision = job.gate_decisions.first()
    config = comparison.resolved_config(algorithm=job.algorithm, config=job.config)
    return {
        **_summary(job),
        "config": {row["name"]: row.get("resolved", row["value"]) for row in config}, "num_gpus": job.num_gpus,
        "stages": comparison.job_stages(job),
        "gate_rules": decision.rules if decision and decision.rules else gate_rules_of(project=job.project),
        "advice": job.advice,
        "last_metrics": (last_eval.data.get("metrics") if last_eval else None),
        "checkpoints": [{"step": c.step, "best": c.best, "holdout": c.holdout} for c in job.checkpoints.all()],
        "error": job.error, "failed_step": job.failed_step,
        "gate": ({"id": decision.pk, "passed": decision.passed, "rules": decision.report.get("rules", []),
                  "error": decision.error} if decision else None),
    }


@router.get("/training-jobs/{job_id}/curves", auth=read_auth, response={200: CurvesOut, **ERRORS},
            summary="A training job's curves",
            description="Each trainer step's reward, KL and completion length, and each holdout look's success "
                        "rate: the points of the job page's chart.")
def job_curves(request: HttpRequest, job_id: Id) -> dict[str, Any]:
    job = _job(request, job_id)
    return {"status": job.status, **services.job_page_data(job=job)}


@router.post("/training-jobs/{job_id}/cancel", auth=train_auth, response={200: JobCreated, **ERRORS},
             summary="Cancel a training job", description="Stops the trainer (its whole process group); 409 when the "
             "job has finished.")
def job_cancel(request: HttpRequest, job_id: Id) -> dict[str, Any]:
    job = services.job_cancel(job=_job(request, job_id), user=request.auth.created_by)  # Refused: 409
    return {"id": job.pk, "status": job.status}


def _recipe(request: HttpRequest) -> dict[str, Any]:
    project = request.auth.project
    return {"config": services.project_defaults(project),
            "effective": services.config_check(algorithm="grpo", config={}, project=project)}


@router.get("/training-recipe", auth=read_auth, response={200: RecipeOut, **ERRORS},
            summary="The project's training recipe",
            description="The GRPOConfig values the project's new jobs start from (the job form's \"save as "
                        "recipe\"), and what a job with no settings of its own would run with.")
def recipe_get(request: HttpRequest) -> dict[str, Any]:
    return _recipe(request)


@router.put("/training-recipe", auth=train_auth, response={200: RecipeOut, **ERRORS},
            summary="Set the project's training recipe",
            description="Replaces the recipe with `config` (checked as a job's is: 422 names each wrong GRPOConfig "
                        "field); `{}` clears it, and new jobs start from the field's recipe again.")
def recipe_set(request: HttpRequest, body: RecipeIn) -> dict[str, Any]:
    from django.core.exceptions import ValidationError

    try:
        services.defaults_save(project=request.auth.project, config=body.config, user=request.auth.created_by)
    except ValidationError as exc:
        # The service names GRPOConfig fields; in this body they sit under `config`.
        raise ValidationError({f"config.{k}" if k != "config" else k: v for k, v in exc.message_dict.items()}) from None
    return _recipe(request)
