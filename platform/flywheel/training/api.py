"""API of training jobs: a team scripts its retraining as well as clicking it. Scope `train` to start and
cancel, `read` to follow."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.http import HttpRequest
from ninja import Router, Schema
from ninja.errors import HttpError

from flywheel.accounts.models import Scope
from flywheel.api import api
from flywheel.environments.models import TaskSetVersion
from flywheel.evals.leakage import LeakageError
from flywheel.evals.models import EvalSuiteVersion
from flywheel.training import services
from flywheel.training.models import JobEvent, TrainingJob
from flywheel.trajectories.api import ApiKeyAuth, ErrorOut, ValidationErrorOut, json_response, read_auth

router = Router(tags=["training"])
train_auth = ApiKeyAuth(Scope.TRAIN)
_ERRORS = {400: ErrorOut, 401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 409: ErrorOut, 422: ValidationErrorOut,
           429: ErrorOut, 503: ErrorOut}


class JobIn(Schema):
    task_set_version: int
    holdout_version: int | None = None
    regression_version: int | None = None
    algorithm: str = "grpo"
    config: dict[str, Any] = {}
    num_gpus: int = 1
    confirm: bool = True  # train right after production is measured; false: wait for a person on the page


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


class JobOut(Schema):
    id: int
    status: str
    step: int
    max_steps: int
    progress: float
    advice: dict[str, Any]
    last_metrics: dict[str, Any] | None
    checkpoints: list[CheckpointOut]
    error: str
    failed_step: int | None
    candidate_version: int | None
    gate: GateOut | None
    created_at: datetime
    finished_at: datetime | None


def _version(model, project, pk: int | None, field: str):
    if pk is None:
        return None
    lookup = {"task_set__project": project} if model is TaskSetVersion else {"suite__project": project}
    version = model.objects.filter(pk=pk, **lookup).first()
    if version is None:
        raise ValidationError({field: f"No {field.replace('_', ' ')} {pk} in this project."})
    return version


def _field_errors(exc: ValidationError) -> dict[str, Any]:
    return {"detail": [{"loc": ["body", *key.split(".")], "msg": "; ".join(map(str, messages)),
                        "type": "value_error"} for key, messages in exc.message_dict.items()]}


@router.post("/training-jobs", auth=train_auth, response={201: JobCreated, **_ERRORS}, summary="Start a training job",
             description=(
                 "Measures production on the holdout, then trains (with `confirm`, the default) on the task-set "
                 "version. 422 names each wrong field, including every GRPOConfig field of `config`; 409 lists the "
                 "rows the leakage guard refuses. Ids are those of the versions (`GET /api/v1/task-sets/{id}/versions`)."))
def job_create(request: HttpRequest, body: JobIn):
    project = request.auth.project
    try:
        job = services.job_create(
            project=project,
            task_set_version=_version(TaskSetVersion, project, body.task_set_version, "task_set_version"),
            holdout_version=_version(EvalSuiteVersion, project, body.holdout_version, "holdout_version"),
            regression_version=_version(EvalSuiteVersion, project, body.regression_version, "regression_version"),
            algorithm=body.algorithm, config=body.config, num_gpus=body.num_gpus, confirm=body.confirm,
            user=request.auth.created_by,
        )
    except ValidationError as exc:
        return json_response(_field_errors(exc), status=422)
    except LeakageError as exc:
        raise HttpError(409, "The task set leaks into the evaluation: " + "; ".join(map(str, exc.conflicts))) from None
    return 201, {"id": job.pk, "status": job.status}


def _job(request: HttpRequest, job_id: int) -> TrainingJob:
    job = TrainingJob.objects.filter(project=request.auth.project, pk=job_id).first()
    if job is None:
        raise HttpError(404, "No such training job in this project.")
    return job


@router.get("/training-jobs/{job_id}", auth=read_auth, response={200: JobOut, **_ERRORS}, summary="A training job",
            description="Status, progress, last holdout metrics, checkpoints and, when done, the candidate version "
                        "and the gate's decision.")
def job_get(request: HttpRequest, job_id: int) -> dict[str, Any]:
    job = _job(request, job_id)
    last_eval = JobEvent.objects.filter(job=job, kind="eval").order_by("-id").first()
    decision = job.gate_decisions.first()
    return {
        "id": job.pk, "status": job.status, "step": job.step, "max_steps": job.max_steps,
        "progress": round(job.progress, 4), "advice": job.advice,
        "last_metrics": (last_eval.data.get("metrics") if last_eval else None),
        "checkpoints": [{"step": c.step, "best": c.best, "holdout": c.holdout} for c in job.checkpoints.all()],
        "error": job.error, "failed_step": job.failed_step,
        "candidate_version": job.candidate_version.number if job.candidate_version else None,
        "gate": ({"id": decision.pk, "passed": decision.passed, "rules": decision.report.get("rules", []),
                  "error": decision.error} if decision else None),
        "created_at": job.created_at, "finished_at": job.finished_at,
    }


@router.post("/training-jobs/{job_id}/cancel", auth=train_auth, response={200: JobCreated, **_ERRORS},
             summary="Cancel a training job", description="Stops the trainer (its whole process group); 409 when the "
             "job has finished.")
def job_cancel(request: HttpRequest, job_id: int) -> dict[str, Any]:
    try:
        job = services.job_cancel(job=_job(request, job_id), user=request.auth.created_by)
    except services.JobRefused as exc:
        raise HttpError(409, str(exc)) from None
    return {"id": job.pk, "status": job.status}


api.add_router("", router)
