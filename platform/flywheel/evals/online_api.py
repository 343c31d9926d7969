"""Online evaluation's endpoints: its settings (`read` to read, `promote` to change: they decide what live
traffic is sent to a judge and what reaches the review queue) and the scores per model version (`read`)."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any

from django.http import HttpRequest
from django.utils import timezone
from ninja import Field, Query, Router, Schema
from pydantic import StrictBool

from flywheel.accounts.models import Scope
from flywheel.api.auth import promote_auth, read_auth
from flywheel.api.errors import ERRORS
from flywheel.api.ids import Id
from flywheel.api.text import NulFree, Text
from flywheel.evals import online

router = Router(tags=["online-eval"])


class OnlineEvalIn(Schema):
    model_config = {"extra": "forbid"}

    enabled: StrictBool = Field(description="Score a sample of the trajectories that arrive from now on")
    sample_rate: float = Field(0.1, description="The share of new trajectories scored, from 0 to 1 (by a hash of "
                                                "the external id: the same trajectory is always taken or left)")
    max_per_hour: int = Field(200, description="At most this many trajectories scored per clock hour")
    task_set: Id | None = Field(None, description="A task set's id: a trajectory is scored by the verifier of "
                                                   "its task whose declared tool names equal the trajectory's")
    judge_enabled: StrictBool = Field(False, description="Also score with an llm_judge on the endpoint below")
    judge_url: Text = Field("", description="The judge's OpenAI-compatible base URL (the operator's outbound "
                                            "allowlist must allow it)")
    judge_model: Text = ""
    judge_api_key: Text | None = Field(None, description="Write-only; null keeps the stored key, \"\" clears it. The "
                                                          "key is bound to judge_url's origin: a judge_url on another "
                                                          "origin needs the key given again (or \"\")")
    judge_rubric: Text = Field("", description="What a good answer does")
    threshold: float = Field(0.5, description="A reward below it puts the trajectory in the review queue")


class OnlineEvalOut(Schema):
    enabled: bool
    enabled_at: dt.datetime | None
    sample_rate: float
    max_per_hour: int
    task_set: int | None
    judge_enabled: bool
    judge_url: str | None = Field(description="Shown to keys with the `promote` scope (who may change it), as "
                                              "the page shows it to maintainers only; null to other keys")
    judge_model: str
    judge_api_key_set: bool = Field(description="Whether a key is stored (the key itself is never shown)")
    judge_rubric: str
    threshold: float


def _settings_out(request: HttpRequest) -> dict[str, Any]:
    config = online.settings_of(project=request.auth.project)
    # Where live traffic is sent is the maintainers' business, on the page and here alike.
    judge_url = config.judge_url if Scope.PROMOTE in (request.auth.scopes or []) else None
    return {"enabled": config.enabled, "enabled_at": config.enabled_at, "sample_rate": config.sample_rate,
            "max_per_hour": config.max_per_hour, "task_set": config.task_set_id,
            "judge_enabled": config.judge_enabled, "judge_url": judge_url, "judge_model": config.judge_model,
            "judge_api_key_set": bool(config.judge_api_key), "judge_rubric": config.judge_rubric,
            "threshold": config.threshold}


@router.get("/online-eval", auth=read_auth, response={200: OnlineEvalOut, **ERRORS},
            summary="Online evaluation's settings",
            description="Whether a sample of the project's live trajectories is scored, how many, by which "
                        "verifiers, and the threshold under which a scored trajectory goes to review.")
def online_eval_get(request: HttpRequest) -> dict[str, Any]:
    return _settings_out(request)


@router.put("/online-eval", auth=promote_auth, response={200: OnlineEvalOut, **ERRORS},
            summary="Set online evaluation's settings",
            description="Replaces the settings. Each wrong field is a 422 naming it; nothing changes then. "
                        "Turning it on starts with the trajectories that arrive from then on.")
def online_eval_set(request: HttpRequest, body: OnlineEvalIn) -> dict[str, Any]:
    online.online_settings_set(project=request.auth.project, data=body.model_dump(), user=request.auth.created_by)
    return _settings_out(request)


# PostgreSQL's text holds no NUL (its driver refuses the query), and a model_version is at most 200 characters.
_VersionName = Annotated[str, Field(max_length=200), NulFree]


class ScoresQuery(Schema):
    model_version: list[_VersionName] | None = Field(None, description="Only these model_version strings "
                                                                        "(repeatable)")
    hours: int = Field(24 * 7, ge=1, le=24 * 366, description="The window: scores of the last this many hours")


class VersionScoresOut(Schema):
    model_version: str
    n: int = Field(description="Scores (one per verifier per trajectory)")
    trajectories: int
    mean_reward: float | None
    pass_rate: float | None
    pass_rate_ci: list[float] | None = Field(description="95% Wilson interval of the pass rate")
    below_share: float | None = Field(description="The share under the threshold: sent to review")


@router.get("/online-eval/scores", auth=read_auth, response={200: list[VersionScoresOut], **ERRORS},
            summary="Online evaluation's scores per model version",
            description="Per model_version string the trajectories report: how many were scored in the window, "
                        "the mean reward, the pass rate with its 95% interval, and the share below the threshold.")
def online_eval_scores(request: HttpRequest, query: Query[ScoresQuery]) -> list[dict[str, Any]]:
    since = timezone.now() - dt.timedelta(hours=query.hours)
    rows = online.scores_by_version(project=request.auth.project, model_versions=query.model_version, since=since)
    return [{"model_version": name, **{k: v for k, v in row.items() if k in VersionScoresOut.model_fields}}
            for name, row in rows.items()]
