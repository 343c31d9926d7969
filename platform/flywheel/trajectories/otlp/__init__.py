"""OpenTelemetry traces (OTLP/HTTP, protobuf or JSON) mapped onto trajectories: one trajectory per trace.

Understood conventions: OpenInference (`llm.input_messages.N.message.*`, `llm.output_messages.N...tool_calls.M
.tool_call.*`, `llm.tools.N.tool.json_schema`, TOOL spans with `tool.name`/`input.value`/`output.value`),
OTel GenAI (`gen_ai.input.messages` / `gen_ai.output.messages` with `parts[]`, `gen_ai.system_instructions`,
`gen_ai.tool.definitions`, `execute_tool` spans with `gen_ai.tool.call.*`) and the older indexed GenAI form
(`gen_ai.prompt.N.*` / `gen_ai.completion.N.*`) that OpenLLMetry emits.

Every LLM call re-sends the history, so spans are replayed in start order into one conversation and a
message already in it is not added again (counted as a multiset, so a user who really says "yes" twice
keeps both). Spans of a trace that arrive in a later export are merged into the stored trajectory the same
way, under a per-trace lock.

What one trace keeps is capped (FLYWHEEL_OTLP_MAX_SPANS_PER_TRACE, FLYWHEEL_OTLP_MAX_MESSAGES_PER_TRACE): a trace
that lives for days must not grow without bound, and an export costs what it carries, not what the trace has
accumulated. Values PostgreSQL cannot store as sent (non-finite doubles, lone surrogates) are made storable
rather than refused; what was dropped or replaced is said in the answer's partial_success.

The package by concern: `decode` (export bodies into `Span`s, values made storable), `conventions` (an LLM or
tool span's attributes into chat messages), `merge` (one trace's spans into one conversation and trajectory
record) and `ingest` (records written under a per-trace lock, and the OTLP/HTTP answers)."""

from flywheel.trajectories.otlp.conventions import LlmCall, ToolRun, llm_call, tool_run
from flywheel.trajectories.otlp.decode import OtlpError, Span, spans_from_json, spans_from_protobuf, storable
from flywheel.trajectories.otlp.ingest import (
    OtlpOutcome,
    error_status,
    export_response,
    otlp_ingest,
    trajectory_append,
)
from flywheel.trajectories.otlp.merge import Conversation, TraceMerge, trace_record

__all__ = [
    "Conversation",
    "LlmCall",
    "OtlpError",
    "OtlpOutcome",
    "Span",
    "ToolRun",
    "TraceMerge",
    "error_status",
    "export_response",
    "llm_call",
    "otlp_ingest",
    "spans_from_json",
    "spans_from_protobuf",
    "storable",
    "tool_run",
    "trace_record",
    "trajectory_append",
]
