"""The eval-suite endpoints of the JSON API (the operations task sets share, built by
flywheel.api.collections) and verifier calibration. `read` for GET and calibration, `review` for the writes."""

from __future__ import annotations

import json
from typing import Any

from django.http import HttpRequest
from ninja import Field, Router, Schema, Status

from flywheel.api import ObjectIn, api
from flywheel.api.auth import read_auth
from flywheel.api.collections import export_response, register
from flywheel.api.errors import ErrorOut, ValidationErrorOut
from flywheel.evals.models import EvalSuite

__all__ = ["export_response", "router"]  # export_response: the suite's page serves the same file


router = register(model=EvalSuite, prefix="eval-suites", tag="eval-suites", id_name="suite_id")


# --- verifier calibration ---------------------------------------------------------------------------------

calibration_router = Router(tags=["calibration"])


class CalibrationIn(ObjectIn):
    verifier: dict[str, Any] | None = Field(default=None, description="a verifier spec; wins over source")
    source: str = Field(default="", description="case:ID or task:ID: that row's verifier")
    agent: str = Field(default="", description="only trajectories of this agent")


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


class CalibrationErrorOut(Schema):
    detail: str
    errors: dict[str, str]


@calibration_router.post(
    "/verifier-calibrations", auth=read_auth,
    response={200: CalibrationOut, 400: ErrorOut, 401: ErrorOut, 403: ErrorOut, 422: CalibrationErrorOut | ValidationErrorOut,
              429: ErrorOut, 503: ErrorOut},
    summary="Calibrate a verifier against reviewed outcomes",
    description="Scores the project's trajectories whose outcome a reviewer labeled and compares with the labels. "
                "Each is scored at one turn through the row's environment: a case's or task's own turn and "
                "environment when `source` names it, else the turn promotion would start from. Reads only: "
                "the `read` scope.",
)
def verifier_calibration(request: HttpRequest, body: CalibrationIn) -> Any:
    from flywheel.evals import calibration

    project = request.auth.project
    errors: dict[str, str] = {}
    text = json.dumps(body.verifier) if body.verifier is not None else ""
    spec = calibration.verifier_from_source(project=project, source=body.source, text=text, errors=errors)
    if spec is None and not errors:
        errors["verifier"] = "give a verifier spec, or a source (case:ID or task:ID)"
    result = None if errors else calibration.verifier_calibrate(project=project, verifier=spec, agent=body.agent,
                                                                source=body.source)
    if result is not None and result.spec_errors:
        errors["verifier"] = "; ".join(result.spec_errors)
    if errors:
        return Status(422, {"detail": "Not calibrated: " + "; ".join(f"{k}: {v}" for k, v in errors.items()),
                            "errors": errors})
    return Status(200, {"n": result.n, "matrix": result.matrix, "precision": result.precision, "recall": result.recall,
                        "kappa": result.kappa, "accuracy": result.accuracy, "too_few": result.too_few,
                        "disagreements": [vars(d) for d in result.disagreements]})


api.add_router("", calibration_router)
