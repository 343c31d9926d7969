"""API of live metrics (flywheel.registry.live): a version's metrics on production traffic over a window, and
the table that maps `model_version` strings to versions, and a version's price per 1M tokens (what its traffic's
cost is figured at). `read` to read, `promote` to change the table or a price."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from django.http import HttpRequest, HttpResponse
from ninja import Field, Query, Router, Schema
from ninja.errors import HttpError

from flywheel.api import ObjectIn
from flywheel.api.auth import promote_auth, read_auth
from flywheel.api.errors import ERRORS
from flywheel.api.ids import VersionNumber
from flywheel.api.text import Text
from flywheel.registry import cost, live, serving
from flywheel.registry.models import PRICE_MAX, ModelVersion

router = Router(tags=["models"])


# A dict rather than a model: other live measures (online evaluation's scores, flywheel.registry.live
# METRIC_SOURCES) join it under their own keys.
METRICS_DESCRIPTION = (
    "`trajectories`; `failures` (effective outcome failure: a reviewer's over the agent's) and `failure_rate` "
    "(null without traffic); `triaged` (the signal rates' denominator); `tokens_per_trajectory` (usage's "
    "total_tokens, else prompt + completion, else input + output) over `tokens_n` trajectories that carried it; "
    "`latency_ms_per_trajectory` over `latency_n`. Other live measures add their own keys."
)


class SignalRateOut(Schema):
    kind: str = Field(description="A triage signal kind (invalid_arguments, undeclared_tool, unsafe_action, …)")
    label: str
    trajectories: int = Field(description="Triaged trajectories carrying it")
    rate: float | None = Field(description="trajectories / triaged; null when none is triaged")


class LiveSeriesOut(Schema):
    step: str = Field(description="hour, or day for the 30d window")
    t: list[int] = Field(description="Each step's start, Unix seconds (UTC)")
    trajectories: list[int]
    failures: list[int]
    failure_rate: list[float | None]


class CostOut(Schema):
    price_input_per_m: float | None = Field(description="Price of 1M input (prompt) tokens: the version's, else "
                                                        "its base model's; null when neither is set")
    price_output_per_m: float | None = Field(description="Price of 1M output (completion) tokens, likewise")
    price_source: str = Field(description="Where the prices came from: version, base, version and base, or "
                                          "empty (none set)")
    input_tokens_per_1k: float | None = Field(description="Input tokens per 1,000 requests (trajectories), over "
                                                          "those that carried input and output tokens apart")
    output_tokens_per_1k: float | None
    token_cost_per_1k: float | None = Field(description="What 1,000 requests' tokens cost at the prices; null "
                                                        "without a price for a side with tokens, or without tokens "
                                                        "carried apart")
    priced_share: float | None = Field(description="The share of the window's trajectories the cost is from")
    gpu_seconds_per_1k: float | None = Field(description="GPU-seconds per 1,000 requests, where serving reported "
                                                         "usage.gpu_seconds")
    gpu_share: float | None = Field(description="The share of trajectories that reported GPU time")


class LiveOut(Schema):
    version: int
    window: str
    from_: datetime = Field(alias="from", description="The first hour read: the window is read in whole hours")
    to: datetime
    names: list[str] = Field(description="The model_version strings counted: the adapter name and mapped names")
    metrics: dict[str, float | int | None] = Field(description=METRICS_DESCRIPTION)
    cost: CostOut = Field(description="Cost per 1,000 requests (flywheel.registry.cost)")
    signals: list[SignalRateOut]
    series: LiveSeriesOut


class LiveQuery(Schema):
    # The schema lists the windows; the handler, not validation, refuses another (400, naming them).
    window: str = Field(live.DEFAULT_WINDOW, description="1h, 24h, 7d or 30d",
                        json_schema_extra={"enum": list(live.WINDOWS)})


def _version(request: HttpRequest, number: int) -> ModelVersion:
    version = ModelVersion.objects.filter(project=request.auth.project, number=number).select_related("base").first()
    if version is None:
        raise HttpError(404, f"No model version {number} in this project.")
    return version


@router.get("/model-versions/{number}/live", auth=read_auth, response={200: LiveOut, **ERRORS},
            by_alias=True, summary="A version's live metrics",
            description="The version's production traffic over `window` (1h, 24h, 7d or 30d; the hours that overlap "
                        "it are read): trajectories, failure rate, each triage signal's rate among triaged "
                        "trajectories, tokens and latency per trajectory where carried, and a series per hour (per "
                        "day for 30d). Counted from the hourly rollup a worker keeps as trajectories are triaged and "
                        "reviewed (seconds behind). 400 for another window, 404 for a version not in the project.")
def version_live(request: HttpRequest, number: VersionNumber,
                 query: Query[LiveQuery]) -> dict[str, Any]:
    version = _version(request, number)
    try:
        return live.live_metrics(project=request.auth.project, version=version, window=query.window)
    except live.WindowError as exc:
        raise HttpError(400, str(exc)) from None


_PRICE = {"ge": 0, "le": PRICE_MAX, "allow_inf_nan": False}


class PriceIn(ObjectIn):
    """A price left out keeps its value; null clears it (a version then uses its base model's)."""

    model_config = {"extra": "forbid"}

    price_input_per_m: float | None = Field(None, description="Price of 1M input (prompt) tokens", **_PRICE)
    price_output_per_m: float | None = Field(None, description="Price of 1M output (completion) tokens", **_PRICE)
    on: Literal["version", "base"] = Field("version", description="version: this version's own price; base: its "
                                           "base model's, which every version of that base without its own uses")


class PriceOut(Schema):
    version: int
    base_model: str
    own: dict[str, float | None] = Field(description="The prices set on the version itself")
    base: dict[str, float | None] = Field(description="The prices set on its base model")
    price_input_per_m: float | None = Field(description="What its traffic is priced at: its own, else the base's")
    price_output_per_m: float | None
    price_source: str


def _price(version: ModelVersion) -> dict[str, Any]:
    price = cost.price_of(version)
    return {"version": version.number, "base_model": version.base.name,
            "own": {f: getattr(version, f) for f in cost.PRICE_FIELDS},
            "base": {f: getattr(version.base, f) for f in cost.PRICE_FIELDS},
            "price_input_per_m": price.input_per_m, "price_output_per_m": price.output_per_m,
            "price_source": price.source}


@router.get("/model-versions/{number}/price", auth=read_auth, response={200: PriceOut, **ERRORS},
            summary="A version's price per 1M tokens",
            description="Its own price, its base model's, and the one its traffic is priced at (its own, else the "
                        "base's). 404 for a version not in the project.")
def version_price_get(request: HttpRequest, number: VersionNumber) -> dict[str, Any]:
    return _price(_version(request, number))


@router.put("/model-versions/{number}/price", auth=promote_auth, response={200: PriceOut, **ERRORS},
            summary="Set a version's (or its base model's) price per 1M tokens",
            description="Live metrics and the gate price 1,000 requests at it. A field left out keeps its value, "
                        "null clears it. 422 naming the field: a price below 0 or above 10,000.")
def version_price_set(request: HttpRequest, number: VersionNumber, body: PriceIn) -> dict[str, Any]:
    version = _version(request, number)
    data = {f: getattr(body, f) for f in cost.PRICE_FIELDS if f in body.model_fields_set}
    cost.price_set(target=version.base if body.on == "base" else version, data=data)
    return _price(version)


class VersionNameOut(Schema):
    name: str
    version: int
    created_at: datetime
    created_by: str | None


class UnmappedOut(Schema):
    name: str = Field(description="A model_version string no version answers to")
    trajectories: int = Field(description="Its trajectories in the last 30 days")


class VersionNamesOut(Schema):
    names: list[VersionNameOut] = Field(description="The strings maintainers mapped")
    unmapped: list[UnmappedOut] = Field(description="Strings of the last 30 days' traffic that name no version")
    adapter_names: str = Field(description="The adapter names the platform gives vLLM: they map by themselves")


class VersionNameIn(Schema):
    name: Text = Field(description="The model_version string the traffic carries", max_length=200)
    version: VersionNumber = Field(description="The version it names (its number)")


def _name(row) -> dict[str, Any]:
    return {"name": row.name, "version": row.version.number, "created_at": row.created_at,
            "created_by": row.created_by.get_username() if row.created_by else None}


@router.get("/version-names", auth=read_auth, response={200: VersionNamesOut, **ERRORS},
            summary="Which strings name which version",
            description="The model_version strings mapped to versions, and the strings of recent traffic that name "
                        "none (with their counts), which live metrics leave out until mapped.")
def version_names_list(request: HttpRequest) -> dict[str, Any]:
    project = request.auth.project
    return {"names": [_name(r) for r in live.version_names(project=project)],
            "unmapped": live.live_summary(project=project, window="30d")["unmapped"],
            "adapter_names": serving.adapter_name(project.slug, 0).removesuffix("0") + "<n>"}


@router.post("/version-names", auth=promote_auth, response={200: VersionNameOut, **ERRORS},
             summary="Map a string to a version",
             description="Live metrics count the traffic carrying `name` for `version`, its past traffic included. A "
                         "name already mapped moves. 422 naming the field: a version not in the project, or a name "
                         "that is an adapter name (those map by themselves).")
def version_name_set(request: HttpRequest, body: VersionNameIn) -> dict[str, Any]:
    row = live.version_name_set(project=request.auth.project, name=body.name, version_number=body.version,
                                user=request.auth.created_by)
    return _name(row)


@router.delete("/version-names", auth=promote_auth, response={204: None, **ERRORS},
               summary="Unmap a string",
               description="Its traffic is unmapped again (live metrics leave it out). 404 when it was not mapped.")
def version_name_remove(request: HttpRequest, name: Annotated[Text, Query(max_length=200)]) -> HttpResponse:
    if not live.version_name_remove(project=request.auth.project, name=name):
        raise HttpError(404, "That name is not mapped in this project.")
    return HttpResponse(status=204)
