"""The eval-suite endpoints of the JSON API (the operations task sets share, built by
flywheel.api.collections) and verifier calibration (started here, run by a worker). `read` for GET and
calibration, `review` for the writes."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal

from django.http import HttpRequest
from ninja import Field, Router, Schema, Status
from ninja.errors import HttpError

from flywheel.api import ObjectIn
from flywheel.api.auth import read_auth
from flywheel.api.collections import collection_router, export_response
from flywheel.api.errors import ERRORS, ErrorOut, ValidationErrorOut
from flywheel.api.ids import Id
from flywheel.api.text import NulFreeJson, Text
from flywheel.evals.calibration_models import CalibrationStatus, VerifierCalibration
from flywheel.evals.models import EvalSuite

__all__ = ["export_response", "router"]  # export_response: the suite's page serves the same file


router = collection_router(model=EvalSuite, prefix="eval-suites", tag="eval-suites", id_name="suite_id")


# --- verifier calibration ---------------------------------------------------------------------------------

calibration_router = Router(tags=["calibration"])


class CalibrationIn(ObjectIn):
    verifier: Annotated[dict[str, Any], NulFreeJson] | None = Field(default=None,
                                                                    description="a verifier spec; wins over source")
    source: Text = Field(default="", description="case:ID or task:ID: that row's verifier")
    agent: Text = Field(default="", description="only trajectories of this agent")


class DisagreementOut(Schema):
    trajectory_id: int
    label: str = Field(description="the reviewer's outcome")
    passed: bool = Field(description="the verifier's verdict")
    failure: str | None
    turn: int | None


class CalibrationOut(Schema):
    n: int
    matrix: dict[str, dict[str, int]] = Field(description="label (success|failure) -> verdict (pass|fail) -> count")
    precision: float
    recall: float
    kappa: float = Field(description="Cohen's kappa of verdicts against labels")
    accuracy: float
    too_few: bool = Field(description="under 50 labeled trajectories: not to be trusted yet")
    disagreements: list[DisagreementOut]


class CalibrationRunOut(Schema):
    id: int
    status: Literal["queued", "running", "done", "failed"]
    done: int = Field(description="labeled trajectories scored so far")
    total: int = Field(description="labeled trajectories to score (known once it runs)")
    error: str = Field(description="why it failed: a verifier the trainer refused on a row, its time limit")
    created_at: datetime
    finished_at: datetime | None
    result: CalibrationOut | None = Field(description="the figures, once done")


class CalibrationErrorOut(Schema):
    detail: str
    errors: dict[str, str]


def _calibration_out(run: VerifierCalibration) -> dict[str, Any]:
    return {"id": run.pk, "status": run.status, "done": run.done, "total": run.total, "error": run.error,
            "created_at": run.created_at, "finished_at": run.finished_at,
            "result": run.result if run.status == CalibrationStatus.DONE else None}


@calibration_router.post(
    "/verifier-calibrations", auth=read_auth,
    response={202: CalibrationRunOut, 400: ErrorOut, 401: ErrorOut, 403: ErrorOut, 409: ErrorOut,
              422: CalibrationErrorOut | ValidationErrorOut, 429: ErrorOut, 503: ErrorOut},
    summary="Start calibrating a verifier against reviewed outcomes",
    description="Queues a calibration: a worker scores the project's trajectories whose outcome a reviewer "
                "labeled and compares with the labels. Each is scored at one turn through the row's environment: "
                "a case's or task's own turn and environment when `source` names it, else the turn promotion "
                "would start from. Answers 202 with the calibration; read it with GET "
                "/verifier-calibrations/{id} until its status is done (its figures) or failed (why). One at a "
                "time per project: asking for the same one while it runs answers it again, another is 409. "
                "Reads only: the `read` scope.",
)
def verifier_calibration(request: HttpRequest, body: CalibrationIn) -> Any:
    from flywheel.evals import calibration

    errors: dict[str, str] = {}
    text = json.dumps(body.verifier) if body.verifier is not None else ""
    run = calibration.calibration_request(project=request.auth.project, source=body.source, text=text,
                                          agent=body.agent, errors=errors, user=request.auth.created_by)
    if run is None:
        return Status(422, {"detail": "Not calibrated: " + "; ".join(f"{k}: {v}" for k, v in errors.items()),
                            "errors": errors})
    return Status(202, _calibration_out(run))


@calibration_router.get(
    "/verifier-calibrations/{calibration_id}", auth=read_auth, response={200: CalibrationRunOut, **ERRORS},
    summary="A verifier calibration: its progress, then its figures or why it failed",
)
def verifier_calibration_get(request: HttpRequest, calibration_id: Id) -> Any:
    run = VerifierCalibration.objects.filter(project=request.auth.project, pk=calibration_id).first()
    if run is None:
        raise HttpError(404, f"No calibration {calibration_id} in project '{request.auth.project.slug}'.")
    return _calibration_out(run)
