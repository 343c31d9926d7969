"""Spans written as trajectories, one per trace, under a per-trace lock (`otlp_ingest`), appending what an
export adds to a stored trace (`trajectory_append`), and the OTLP/HTTP answers (`export_response`,
`error_status`)."""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import JSONField
from django.db.models.expressions import RawSQL
from django.utils import timezone
from google.protobuf import json_format
from google.rpc import status_pb2 as rpc_status
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceResponse,
)

from flywheel.accounts.models import Project
from flywheel.trajectories.ingest import derive, ingest_trajectories
from flywheel.trajectories.models import Trajectory
from flywheel.trajectories.otlp.decode import Span, storable
from flywheel.trajectories.otlp.merge import TraceMerge, trace_record, unmerged_spans
from flywheel.trajectories.schemas import validate_record
from flywheel.trajectories.triage import triage_request

logger = logging.getLogger(__name__)


@dataclass
class OtlpOutcome:
    traces: int = 0
    created: int = 0
    updated: int = 0
    rejected_spans: int = 0
    skipped_traces: int = 0
    errors: list[str] = field(default_factory=list)

    SHOWN_ERRORS = 20

    @property
    def error_message(self) -> str:
        parts = list(self.errors[: self.SHOWN_ERRORS])
        if len(self.errors) > self.SHOWN_ERRORS:
            parts.append(f"and {len(self.errors) - self.SHOWN_ERRORS} more")
        if self.skipped_traces:
            parts.append(f"{self.skipped_traces} trace(s) had no LLM or tool span and were skipped")
        return storable("; ".join(parts), [0])  # it quotes the input: protobuf takes valid Unicode only


def otlp_ingest(*, project: Project, spans: list[Span], ingested_by: str = "") -> OtlpOutcome:
    """Map spans to one trajectory per trace and ingest them through `ingest_trajectories` (source otlp).
    Spans that could not be decoded (`Span.error`) are rejected alone, and so is a trace that cannot be
    mapped or stored: the answer counts and names them; the rest of the export is stored."""
    outcome = OtlpOutcome()
    by_trace: dict[str, list[Span]] = {}
    for span in spans:
        if span.error or not span.trace_id:
            outcome.rejected_spans += 1
            outcome.errors.append(span.error or f"span {span.span_id or '(no id)'}: it has no traceId")
        else:
            by_trace.setdefault(span.trace_id, []).append(span)
    outcome.traces = len(by_trace)
    if not by_trace:
        return outcome
    max_spans = settings.FLYWHEEL_OTLP_MAX_SPANS_PER_TRACE
    max_messages = settings.FLYWHEEL_OTLP_MAX_MESSAGES_PER_TRACE
    with transaction.atomic():
        trace_ids = sorted(by_trace)
        if connection.vendor == "postgresql":
            # Two exports of one trace at once would each merge into the same stored version and one would
            # lose the other's spans: serialise per trace (sorted, so that two batches never deadlock).
            with connection.cursor() as cursor:
                for trace_id in trace_ids:
                    cursor.execute(
                        "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                        [f"otlp:{project.pk}:{trace_id}"],
                    )
        existing = {
            t.external_id: t
            for t in Trajectory.objects.filter(project=project, external_id__in=trace_ids).only(
                "id",
                "external_id",
                "model_version",
                "outcome",
                "tools",
                "metadata",
                "message_count",
                "has_tool_error",
            )
        }
        # The stored conversation is read only for the traces this export adds spans to: a replay, or an
        # export to a trace at a cap, reads the span index alone.
        extended = [
            t.pk
            for trace_id, t in existing.items()
            if t.message_count < max_messages
            and len(known := (t.metadata or {}).get("otlp", {}).get("spans", {})) < max_spans
            and unmerged_spans(by_trace[trace_id], known)
        ]
        history = dict(Trajectory.objects.filter(pk__in=extended).values_list("pk", "messages"))
        records, merges = [], []
        for trace_id in trace_ids:
            stored = existing.get(trace_id)
            try:
                merge = trace_record(
                    trace_id,
                    by_trace[trace_id],
                    stored,
                    history.get(stored.pk) if stored is not None else None,
                    max_spans=max_spans,
                    max_messages=max_messages,
                )
            except Exception as exc:  # spans are untrusted input: one odd trace must not fail the export
                logger.warning("could not map OTLP trace %s", trace_id, exc_info=True)
                outcome.rejected_spans += len(by_trace[trace_id])
                outcome.errors.append(f"trace {trace_id}: could not be mapped: {type(exc).__name__}: {exc}")
                continue
            outcome.errors.extend(_merge_notes(trace_id, merge, max_spans, max_messages))
            outcome.rejected_spans += merge.dropped_spans
            if merge.skipped:
                outcome.skipped_traces += 1
                continue
            if merge.record is None:
                continue
            if not merge.record["messages"]:
                outcome.rejected_spans += merge.spans
                outcome.errors.append(
                    f"trace {trace_id}: its LLM spans carry no message content; turn content capture on "
                    "(e.g. OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true)"
                )
                continue
            if stored is not None:
                errors = trajectory_append(trajectory=stored, record=merge.record, seeded=merge.seeded)
                if errors:
                    outcome.rejected_spans += merge.spans
                    outcome.errors.append(f"trace {trace_id}: {errors[0]['field']}: {errors[0]['message']}")
                else:
                    outcome.updated += 1
                continue
            records.append(merge.record)
            merges.append((trace_id, merge))
        result = ingest_trajectories(project=project, records=records, source="otlp", ingested_by=ingested_by)
    outcome.created, outcome.updated = result.created, outcome.updated + result.updated
    for item in result.rejected:
        trace_id, merge = merges[item["index"]]
        outcome.rejected_spans += merge.spans
        first = item["errors"][0]
        outcome.errors.append(f"trace {trace_id}: {first['field']}: {first['message']}")
    return outcome


@functools.cache
def _lz4_available() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'"
        )
        found = cursor.fetchone()
    return bool(found and found[0])


_MESSAGE_PATH = re.compile(r"^messages\[(\d+)\]")


def trajectory_append(*, trajectory: Trajectory, record: dict[str, Any], seeded: int) -> list[dict[str, str]]:
    """Write what an export added to a stored trace: `record` is the whole trajectory, of which the first
    `seeded` messages are stored already. Only the new messages are validated and sent (appended with jsonb
    `||` on PostgreSQL): the history was validated when it was stored, and an export should cost what it
    carries, not what the trace has accumulated. The rest of the record (tools, usage, metadata, times) is
    small and replaced; the derived columns are computed again over the whole conversation, exactly as
    `ingest_trajectories` computes them. Returns the errors, with field paths into the whole record (none:
    written). Whole records, and new traces, go through `ingest_trajectories`."""
    messages = record["messages"]
    new = messages[seeded:]
    # The contract wants one message at least; with nothing new, the last stored one (valid) stands in.
    parsed, errors = validate_record({**record, "messages": new or messages[-1:]})
    if parsed is None:
        offset = seeded if new else len(messages) - 1
        return [
            {**e, "field": _MESSAGE_PATH.sub(lambda m: f"messages[{int(m[1]) + offset}]", e["field"])}
            for e in errors
        ]
    fields: dict[str, Any] = {
        "agent": parsed.agent,
        "model_version": parsed.model_version,
        "tools": record["tools"],
        "outcome": parsed.outcome,
        "latency_ms": parsed.latency_ms,
        "usage": parsed.usage,
        "metadata": parsed.metadata,
        "updated_at": timezone.now(),
        "triage_version": 0,  # triaged again, with the new messages (flywheel.trajectories.triage)
        # The text columns (title, search_text) over the whole conversation, exactly as ingestion derives
        # them; whether a tool failed is known of the stored part, so only the new messages are looked at for
        # that (told so up front, derive skips parsing every tool result of the history).
        **derive(messages, {**parsed.metadata, "has_tool_error": True}),
        "has_tool_error": trajectory.has_tool_error or derive(new, parsed.metadata)["has_tool_error"],
    }
    if parsed.started_at is not None:
        fields["started_at"] = parsed.started_at
    if new and connection.vendor == "postgresql":
        text = json.dumps(new, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        fields["messages"] = RawSQL('"messages" || %s::jsonb', [text], output_field=JSONField())
        if _lz4_available():
            # The whole document is compressed again; lz4 does it several times faster than pglz (as ingest).
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL default_toast_compression = lz4")
    elif new:
        fields["messages"] = messages
    Trajectory.objects.filter(pk=trajectory.pk).update(**fields)
    triage_request(project_id=trajectory.project_id)
    return []


def _merge_notes(trace_id: str, merge: TraceMerge, max_spans: int, max_messages: int) -> list[str]:
    notes = []
    if merge.full == "spans":
        notes.append(
            f"trace {trace_id}: it holds the limit of {max_spans} spans (FLYWHEEL_OTLP_MAX_SPANS_PER_TRACE); "
            f"{merge.dropped_spans} span(s) dropped"
        )
    elif merge.full == "messages":
        notes.append(
            f"trace {trace_id}: it holds the limit of {max_messages} messages "
            f"(FLYWHEEL_OTLP_MAX_MESSAGES_PER_TRACE); {merge.dropped_spans} span(s) dropped"
        )
    if merge.dropped_messages:
        notes.append(
            f"trace {trace_id}: it holds the limit of {max_messages} messages "
            f"(FLYWHEEL_OTLP_MAX_MESSAGES_PER_TRACE); {merge.dropped_messages} message(s) dropped"
        )
    if merge.replaced:
        notes.append(
            f"trace {trace_id}: {merge.replaced} value(s) that cannot be stored as sent were replaced "
            '(non-finite numbers by "NaN", "Infinity" or "-Infinity", invalid Unicode by U+FFFD)'
        )
    return notes


# gRPC status codes (google.rpc.Code) for the HTTP errors the endpoint answers with.
_GRPC_CODES = {400: 3, 401: 16, 403: 7, 404: 5, 413: 8, 415: 3, 429: 8}


def error_status(http_status: int, message: str, *, as_json: bool) -> bytes:
    """An error answer as OTLP/HTTP wants it: a google.rpc.Status in the request's encoding."""
    status = rpc_status.Status(code=_GRPC_CODES.get(http_status, 2), message=storable(message, [0]))
    if as_json:
        return json.dumps(json_format.MessageToDict(status), separators=(",", ":")).encode()
    return status.SerializeToString()


def export_response(outcome: OtlpOutcome, *, as_json: bool) -> bytes:
    """The ExportTraceServiceResponse, in the request's encoding. Rejected spans, and traces skipped (a
    warning: rejected_spans 0 with a message, as the OTLP spec allows), fill partial_success in both."""
    response = ExportTraceServiceResponse()
    if outcome.rejected_spans or outcome.error_message:
        response.partial_success.CopyFrom(
            ExportTracePartialSuccess(
                rejected_spans=outcome.rejected_spans, error_message=outcome.error_message
            )
        )
    if as_json:
        # The protobuf JSON mapping OTLP/JSON uses: camelCase names, int64 as a string, zero values left out.
        return json.dumps(json_format.MessageToDict(response), separators=(",", ":")).encode()
    return response.SerializeToString()
