"""The trajectory endpoints of the JSON API: ingest (REST and OTLP/HTTP), list and read.

Keys, scopes and error shapes are the API's shared ones (flywheel.api). Handlers stay thin: parsing lives
here, the writes in `ingest.ingest_trajectories`."""

from __future__ import annotations

import io
import json
import zlib
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from django.conf import settings
from django.http import HttpRequest, HttpResponse, UnreadablePostError
from ninja import Field, Query, Router, Schema
from ninja.errors import HttpError
from pydantic import field_validator

from flywheel.api.auth import ingest_auth, read_auth
from flywheel.api.errors import ErrorOut, ValidationErrorOut, error_format, json_response
from flywheel.api.ids import Id
from flywheel.api.pagination import MAX_LIMIT, cursor_value
from flywheel.api.text import NulFree, Text
from flywheel.trajectories import otlp, selectors
from flywheel.trajectories.ingest import ingest_trajectories, json_error_text, jsonl_records, sender_of_key
from flywheel.trajectories.models import SignalKind, Trajectory

NDJSON_TYPES = frozenset(
    {"application/x-ndjson", "application/ndjson", "application/jsonl", "application/x-jsonlines"}
)
LIST_MAX_LIMIT = MAX_LIMIT


# --- request bodies --------------------------------------------------------------------------------------


def _too_large(size: int | str) -> HttpError:
    limit = settings.FLYWHEEL_MAX_REQUEST_BYTES
    return HttpError(
        413, f"The request body is {size} bytes; the limit is {limit} bytes (FLYWHEEL_MAX_REQUEST_BYTES)."
    )


def read_body(request: HttpRequest) -> bytes:
    """The request body, decompressed, refused with 413 over FLYWHEEL_MAX_REQUEST_BYTES: by its declared
    Content-Length before reading anything, then by its real size (after decompression too)."""
    limit = settings.FLYWHEEL_MAX_REQUEST_BYTES
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError as exc:
        raise HttpError(400, "Content-Length is not a number.") from exc
    if declared > limit:
        raise _too_large(declared)
    try:
        body = request.read(limit + 1)
    except UnreadablePostError as exc:  # the client reset the connection mid-body: its error, not ours
        raise HttpError(400, f"The request body could not be read to its end: {exc}") from exc
    if len(body) > limit:
        raise _too_large(f"more than {limit}")
    if len(body) < declared:
        # The client went away mid-body. Parse nothing of it: an NDJSON prefix is valid and would be
        # stored although the client, never answered, will send it again.
        raise HttpError(400, f"The request body ended after {len(body)} of the {declared} bytes it declared.")
    encoding = (request.headers.get("Content-Encoding") or "identity").strip().lower()
    if encoding in ("gzip", "deflate"):
        # Decompress at most limit + 1 bytes: a small gzip bomb must not fill the memory.
        wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
        try:
            decompressor = zlib.decompressobj(wbits)
            body = decompressor.decompress(body, limit + 1)
        except zlib.error as exc:
            raise HttpError(400, f"The body is not valid {encoding}: {exc}") from exc
        if len(body) > limit or decompressor.unconsumed_tail:
            raise _too_large(f"more than {limit} (decompressed)")
    elif encoding != "identity":
        raise HttpError(415, f"Content-Encoding {encoding!r} is not supported; send gzip, deflate or none.")
    return body


def media_type(request: HttpRequest) -> str:
    return (request.content_type or "").split(";")[0].strip().lower()


def parse_records(body: bytes, content_type: str) -> tuple[list[int], list[Any]]:
    """(indexes, records) of one object, a JSON array, or NDJSON (one object a line; a line that is not JSON
    is rejected alone). An index is the record's position in the array, or its line (from 0) in NDJSON."""
    if content_type in NDJSON_TYPES:
        numbered = list(jsonl_records(io.BytesIO(body)))
        return [index for index, _ in numbered], [record for _, record in numbered]
    try:
        payload = json.loads(body)
    except UnicodeDecodeError as exc:
        raise HttpError(400, f"The body is not UTF-8: {exc}") from exc
    except RecursionError as exc:
        raise HttpError(400, "The body is nested too deeply to be a trajectory.") from exc
    except json.JSONDecodeError as exc:
        hint = " (for one object a line, send Content-Type: application/x-ndjson)" if b"}\n{" in body else ""
        raise HttpError(400, f"The body is not valid JSON: {exc}{hint}") from exc
    except ValueError as exc:  # an integer of more digits than Python reads (4300)
        raise HttpError(400, f"The body is not valid JSON: {json_error_text(exc)}") from exc
    if isinstance(payload, dict):
        return [0], [payload]
    if isinstance(payload, list):
        return list(range(len(payload))), payload
    raise HttpError(400, "The body must be a trajectory object or an array of them.")


# --- response shapes (for the OpenAPI schema) ------------------------------------------------------------


class FieldError(Schema):
    field: str = Field(description="Path of the field, e.g. messages[2].tool_calls[0].function.name")
    message: str


class Rejection(Schema):
    index: int = Field(
        description="Position of the record in the array; for NDJSON its line, from 0, blank lines counted"
    )
    external_id: str | int | None
    errors: list[FieldError]


class Accepted(Schema):
    index: int = Field(description="Position of the record in the array; for NDJSON its line, from 0")
    external_id: str | None = Field(description="The record's external_id, as stored")
    id: int = Field(description="The trajectory's id (`GET /api/v1/trajectories/{id}`); a replay names the same one")


class IngestOut(Schema):
    accepted: int
    created: int
    updated: int
    rejected: list[Rejection]
    records: list[Accepted] = Field(description="Every accepted record, in the order sent, with its trajectory's id")


class RpcStatusOut(Schema):
    """google.rpc.Status, the OTLP/HTTP error body (protobuf, or this JSON for OTLP/JSON requests)."""

    code: int = Field(description="gRPC status code, e.g. 3 INVALID_ARGUMENT, 16 UNAUTHENTICATED")
    message: str


class TrajectorySummary(Schema):
    id: int
    external_id: str
    agent: str
    model_version: str
    outcome: str
    reviewed_outcome: str
    source: str
    title: str
    message_count: int
    tool_call_count: int
    has_tool_error: bool
    latency_ms: int | None
    usage: dict[str, Any] | None
    started_at: datetime | None
    created_at: datetime
    updated_at: datetime


class CommentOut(Schema):
    id: int
    message_index: int | None
    author: str | None
    body: str
    created_at: datetime


class TrajectoryDetail(TrajectorySummary):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    feedback: Any
    human_intervention: Any
    metadata: dict[str, Any]
    vouch: str = Field(description="`vouched` when the router's evidence token (`metadata.flywheel_evidence`) vouched "
                                   "for the version it names, else why not (`malformed`, `bad_mac`, `other_version`, "
                                   "`replayed`, `expired`, `future`), or empty without a token: only vouched "
                                   "trajectories can move the canary or the watch by themselves")
    tags: list[str]
    comments: list[CommentOut]


class TrajectoryPage(Schema):
    items: list[TrajectorySummary]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page")


class TrajectoryQuery(Schema):
    """The query parameters of `GET /api/v1/trajectories`: validated here (422 naming the parameter), then
    turned into the one `selectors.TrajectoryFilters` the pages filter with (`filters`)."""

    outcome: Literal["success", "failure", "unknown"] | None = Field(
        None, description="The agent's own outcome"
    )
    reviewed_outcome: Literal["success", "failure", "unknown", "none"] | None = Field(
        None, description="The reviewer's outcome; `none`: not reviewed yet"
    )
    # PostgreSQL's text holds no NUL, so a filter with one could match nothing; its driver refuses the query.
    agent: Text | None = None
    model_version: Text | None = None
    source: Text | None = Field(None, description="api, upload, otlp, cli or demo")
    external_id: Text | None = None
    has_tool_error: bool | None = None
    signal: SignalKind | None = Field(None, description="Trajectories with at least one triage signal of this kind")
    failure_mode: Id | None = Field(None, description="Trajectories assigned to this failure mode (its id)")
    q: Annotated[str, Field(max_length=selectors.MAX_SEARCH_CHARS), NulFree] | None = Field(
        None,
        description=(
            f"Text the messages contain (case-insensitive), at most {selectors.MAX_SEARCH_CHARS} characters "
            "(422 beyond)"
        ),
    )
    started_after: datetime | None = Field(None, description="Inclusive; a time without an offset is UTC")
    started_before: datetime | None = Field(None, description="Exclusive; a time without an offset is UTC")
    cursor: Text | None = Field(
        None, description="From `next_cursor` of the previous page", json_schema_extra={"pattern": "^[0-9]*$"}
    )
    limit: int = Field(50, ge=1, le=LIST_MAX_LIMIT)

    @field_validator("started_after", "started_before", mode="before")
    @classmethod
    def _not_a_number(cls, value: Any) -> Any:
        # pydantic would take "1700000000" or "0.5" as Unix time; the documented format is ISO 8601.
        if isinstance(value, str):
            try:
                float(value)
            except ValueError:
                return value
            raise ValueError("must be an ISO 8601 date-time such as 2026-12-01T10:00:00Z, not a number")
        return value

    @field_validator("started_after", "started_before")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        """In UTC, clamped to what a datetime holds there: SQLite's driver converts a bound to UTC, and
        9999-12-31T23:00-05:00 would overflow into year 10000 (such a bound excludes nothing anyway)."""
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        try:
            return value.astimezone(UTC)
        except OverflowError:
            return (datetime.max if value.year > 1 else datetime.min).replace(tzinfo=UTC)

    def filters(self) -> selectors.TrajectoryFilters:
        return selectors.TrajectoryFilters(
            agent_outcome=self.outcome,
            reviewed_outcome="" if self.reviewed_outcome == "none" else self.reviewed_outcome,
            agent=self.agent,
            model_version=self.model_version,
            source=self.source,
            external_id=self.external_id,
            tool_error=self.has_tool_error,
            signal=self.signal.value if self.signal else "",
            mode=self.failure_mode,
            q=self.q or "",
            started_after=self.started_after,
            started_before=self.started_before,
        )


# --- routes ----------------------------------------------------------------------------------------------

router = Router(tags=["trajectories"])

_INGEST_BODY = {
    "requestBody": {
        "required": True,
        "description": (
            "One trajectory, a JSON array of them, or NDJSON (Content-Type: application/x-ndjson, one "
            "trajectory a line). Content-Encoding gzip is accepted. At most FLYWHEEL_MAX_REQUEST_BYTES "
            "bytes and FLYWHEEL_MAX_BATCH_RECORDS records."
        ),
        "content": {
            "application/json": {
                "schema": {
                    "oneOf": [
                        {"$ref": "#/components/schemas/TrajectoryIn"},
                        {"type": "array", "items": {"$ref": "#/components/schemas/TrajectoryIn"}},
                    ]
                }
            },
            "application/x-ndjson": {"schema": {"type": "string", "description": "one TrajectoryIn a line"}},
        },
    }
}


@router.post(
    "/trajectories",
    auth=ingest_auth,
    response={200: IngestOut, 400: ErrorOut, 401: ErrorOut, 403: ErrorOut, 413: ErrorOut, 422: IngestOut},
    openapi_extra=_INGEST_BODY,
    summary="Ingest trajectories",
    description=(
        "Stores each valid record in the key's project and names the fate of every record. A replayed "
        "`external_id` updates its trajectory (never a duplicate, also when the same batch arrives twice at "
        "once); the reviewer's outcome, tags and comments are kept. Valid records are stored even when others "
        "are rejected. 200 when at least one record was accepted (or none was sent), 422 when every record "
        "was rejected; both carry the same body."
    ),
)
def trajectories_ingest(request: HttpRequest) -> HttpResponse:
    body = read_body(request)
    indexes, records = parse_records(body, media_type(request))
    limit = settings.FLYWHEEL_MAX_BATCH_RECORDS
    if len(records) > limit:
        raise HttpError(
            413, f"The batch has {len(records)} records; the limit is {limit} (FLYWHEEL_MAX_BATCH_RECORDS)."
        )
    result = ingest_trajectories(project=request.auth.project, records=records, source="api", indexes=indexes,
                                 ingested_by=sender_of_key(request.auth))
    status = 422 if records and not result.accepted else 200
    return json_response(result.to_dict(), status=status)


_SUMMARY_FIELDS = [name for name in TrajectorySummary.model_fields]


@router.get(
    "/trajectories",
    auth=read_auth,
    response={
        200: TrajectoryPage, 400: ErrorOut, 401: ErrorOut, 403: ErrorOut, 422: ValidationErrorOut, 429: ErrorOut,
        503: ErrorOut,
    },
    summary="List trajectories",
    description=(
        "Trajectories of the key's project, newest first, `limit` at a time. Keyset pagination: pass "
        "`next_cursor` back as `cursor`; pages stay consistent while trajectories arrive."
    ),
)
def trajectories_list(request: HttpRequest, query: Query[TrajectoryQuery]) -> dict[str, Any]:
    rows, next_cursor = selectors.trajectory_api_page(
        project=request.auth.project,
        filters=query.filters(),
        fields=_SUMMARY_FIELDS,
        after=cursor_value(query.cursor),
        size=query.limit,
    )
    return {"items": rows, "next_cursor": str(next_cursor) if next_cursor is not None else None}


@router.get(
    "/trajectories/{trajectory_id}",
    auth=read_auth,
    response={
        200: TrajectoryDetail, 401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 422: ValidationErrorOut, 429: ErrorOut,
        503: ErrorOut,
    },
    summary="Read one trajectory",
    description="A trajectory of the key's project, messages included; 404 when the key's project has no such id.",
)
def trajectory_detail(request: HttpRequest, trajectory_id: Id) -> dict[str, Any]:
    trajectory = (
        Trajectory.objects.filter(project=request.auth.project, pk=trajectory_id)
        .prefetch_related("tags", "comments__author")
        .first()
    )
    if trajectory is None:
        raise HttpError(404, f"No trajectory {trajectory_id} in project '{request.auth.project.slug}'.")
    out = {name: getattr(trajectory, name) for name in _SUMMARY_FIELDS}
    out.update(
        messages=trajectory.messages,
        tools=trajectory.tools,
        feedback=trajectory.feedback,
        human_intervention=trajectory.human_intervention,
        metadata=trajectory.metadata,
        vouch=trajectory.vouch,
        tags=[tag.name for tag in trajectory.tags.all()],
        comments=[
            {
                "id": c.id,
                "message_index": c.message_index,
                "author": c.author.get_username() if c.author else None,
                "body": c.body,
                "created_at": c.created_at,
            }
            for c in trajectory.comments.all()
        ],
    )
    return out


# --- OTLP/HTTP -------------------------------------------------------------------------------------------

otlp_router = Router(tags=["otlp"])
OTLP_PATH = "/otlp/v1/traces"
OTLP_PROTOBUF_TYPES = ("application/x-protobuf", "application/protobuf")


@otlp_router.post(
    OTLP_PATH,
    auth=ingest_auth,
    response={200: None, 400: RpcStatusOut, 401: RpcStatusOut, 403: RpcStatusOut, 413: RpcStatusOut,
              415: RpcStatusOut},
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "An OTLP ExportTraceServiceRequest, as application/x-protobuf or application/json.",
            "content": {
                "application/x-protobuf": {"schema": {"type": "string", "format": "binary"}},
                "application/json": {},
            },
        }
    },
    summary="Ingest OpenTelemetry traces (OTLP/HTTP)",
    description=(
        "Point an OTLP exporter here: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=<base>/api/v1/otlp/v1/traces and "
        "OTEL_EXPORTER_OTLP_HEADERS='Authorization=Bearer KEY'. Each trace becomes one trajectory (external_id: "
        "the trace id); LLM spans (OpenInference `llm.*`, OTel GenAI `gen_ai.*`) and tool spans (`execute_tool`, "
        "OpenInference TOOL) become one conversation in time order, without repeating the history each LLM "
        "call re-sends. Spans of a trace sent in a later request are merged into its trajectory. The answer is "
        "an ExportTraceServiceResponse in the request's encoding; traces that could not be stored are counted "
        "in partial_success.rejected_spans, with the reason in error_message, and so are spans that do not "
        "decode and spans past FLYWHEEL_OTLP_MAX_SPANS_PER_TRACE (messages past "
        "FLYWHEEL_OTLP_MAX_MESSAGES_PER_TRACE, and values made storable, are named there too). Errors (400, "
        "401, 403, 413: more traces than FLYWHEEL_MAX_BATCH_RECORDS, 415) are a google.rpc.Status in the "
        "request's encoding, as OTLP/HTTP specifies."
    ),
)
def otlp_traces(request: HttpRequest) -> HttpResponse:
    body = read_body(request)
    kind = media_type(request)
    if kind in OTLP_PROTOBUF_TYPES:
        try:
            spans = otlp.spans_from_protobuf(body)
        except otlp.OtlpError as exc:
            raise HttpError(400, str(exc)) from exc
        as_json = False
    elif kind == "application/json" or not kind:
        try:
            spans = otlp.spans_from_json(body)
        except otlp.OtlpError as exc:
            raise HttpError(400, str(exc)) from exc
        as_json = True
    else:
        raise HttpError(415, f"Content-Type {kind!r}: send application/x-protobuf or application/json.")
    # A trace is one record: the batch limit of the REST endpoint counts traces here.
    traces = len({span.trace_id for span in spans if not span.error})
    limit = settings.FLYWHEEL_MAX_BATCH_RECORDS
    if traces > limit:
        raise HttpError(
            413, f"The export has {traces} traces; the limit is {limit} (FLYWHEEL_MAX_BATCH_RECORDS)."
        )
    outcome = otlp.otlp_ingest(project=request.auth.project, spans=spans, ingested_by=sender_of_key(request.auth))
    return HttpResponse(
        otlp.export_response(outcome, as_json=as_json),
        content_type="application/json" if as_json else "application/x-protobuf",
    )


def _otlp_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    """OTLP/HTTP asks for a google.rpc.Status in the request's encoding (exporters log its message)."""
    as_json = media_type(request) not in OTLP_PROTOBUF_TYPES
    return HttpResponse(
        otlp.error_status(exc.status_code, str(exc), as_json=as_json), status=exc.status_code,
        content_type="application/json" if as_json else "application/x-protobuf",
    )


error_format(lambda request: request.path.endswith(OTLP_PATH), _otlp_error)
