"""OpenTelemetry traces (OTLP/HTTP, protobuf or JSON) mapped onto trajectories: one trajectory per trace.

Understood conventions: OpenInference (`llm.input_messages.N.message.*`, `llm.output_messages.N...tool_calls.M
.tool_call.*`, `llm.tools.N.tool.json_schema`, TOOL spans with `tool.name`/`input.value`/`output.value`),
OTel GenAI (`gen_ai.input.messages` / `gen_ai.output.messages` with `parts[]`, `gen_ai.system_instructions`,
`gen_ai.tool.definitions`, `execute_tool` spans with `gen_ai.tool.call.*`) and the older indexed GenAI form
(`gen_ai.prompt.N.*` / `gen_ai.completion.N.*`) that OpenLLMetry emits.

Every LLM call re-sends the history, so spans are replayed in start order into one conversation and a
message already in it is not added again (counted as a multiset, so a user who really says "yes" twice
keeps both). Spans of a trace that arrive in a later export are merged into the stored trajectory the same
way, under a per-trace lock."""

from __future__ import annotations

import base64
import binascii
import json
import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.db import connection, transaction
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from google.rpc import status_pb2 as rpc_status
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from flywheel.accounts.models import Project
from flywheel.trajectories.ingest import content_text, ingest_trajectories
from flywheel.trajectories.models import Trajectory

logger = logging.getLogger(__name__)

STATUS_ERROR = 2
LLM_OPERATIONS = frozenset({"chat", "text_completion", "generate_content", "completion"})


class OtlpError(ValueError):
    """The body is not an OTLP trace export."""


@dataclass
class Span:
    trace_id: str  # hex
    span_id: str
    parent_span_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status_code: int = 0
    status_message: str = ""


# --- decoding --------------------------------------------------------------------------------------------


def _any_value_pb(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_any_value_pb(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _any_value_pb(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value).decode()
    return getattr(value, kind)


def spans_from_protobuf(body: bytes) -> list[Span]:
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as exc:
        raise OtlpError(f"The body is not a protobuf ExportTraceServiceRequest: {exc}") from exc
    spans = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _any_value_pb(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    Span(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        name=span.name,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes={kv.key: _any_value_pb(kv.value) for kv in span.attributes},
                        resource=resource,
                        status_code=span.status.code,
                        status_message=span.status.message,
                    )
                )
    return spans


def _get(obj: dict[str, Any], camel: str, default: Any = None) -> Any:
    """OTLP/JSON uses lowerCamelCase; protobuf JSON parsers also accept the snake_case names."""
    if camel in obj:
        return obj[camel]
    snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in camel)
    return obj.get(snake, default)


def _any_value_json(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    for key in ("stringValue", "string_value"):
        if key in value:
            return value[key]
    for key in ("boolValue", "bool_value"):
        if key in value:
            return bool(value[key])
    for key in ("intValue", "int_value"):
        if key in value:
            return int(value[key])  # int64 travels as a string in OTLP/JSON
    for key in ("doubleValue", "double_value"):
        if key in value:
            return float(value[key])
    array = _get(value, "arrayValue")
    if array is not None:
        return [_any_value_json(v) for v in array.get("values", [])]
    kvlist = _get(value, "kvlistValue")
    if kvlist is not None:
        return _attributes_json(kvlist.get("values", []))
    return _get(value, "bytesValue")


def _attributes_json(items: Any) -> dict[str, Any]:
    if not isinstance(items, list):
        return {}
    return {
        kv["key"]: _any_value_json(kv.get("value")) for kv in items if isinstance(kv, dict) and "key" in kv
    }


def _hex_id(value: Any) -> str:
    """OTLP/JSON ids are hex; some producers send protobuf JSON's base64 instead. Accept both."""
    if not value:
        return ""
    value = str(value)
    try:
        bytes.fromhex(value)
        return value.lower()
    except ValueError:
        pass
    try:
        return base64.b64decode(value, validate=True).hex()
    except (binascii.Error, ValueError) as exc:
        raise OtlpError(f"span id {value!r} is neither hex nor base64") from exc


_STATUS_NAMES = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}


def spans_from_json(body: bytes) -> list[Span]:
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise OtlpError(f"The body is not valid JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise OtlpError("The body must be an OTLP ExportTraceServiceRequest object with resourceSpans.")
    spans = []
    try:
        for resource_spans in _get(payload, "resourceSpans", []) or []:
            resource = _attributes_json((resource_spans.get("resource") or {}).get("attributes"))
            for scope_spans in _get(resource_spans, "scopeSpans", []) or []:
                for span in scope_spans.get("spans", []) or []:
                    status = span.get("status") or {}
                    code = status.get("code", 0)
                    spans.append(
                        Span(
                            trace_id=_hex_id(_get(span, "traceId")),
                            span_id=_hex_id(_get(span, "spanId")),
                            parent_span_id=_hex_id(_get(span, "parentSpanId")),
                            name=span.get("name", ""),
                            start_ns=int(_get(span, "startTimeUnixNano", 0) or 0),
                            end_ns=int(_get(span, "endTimeUnixNano", 0) or 0),
                            attributes=_attributes_json(span.get("attributes")),
                            resource=resource,
                            status_code=_STATUS_NAMES.get(code, 0) if isinstance(code, str) else int(code),
                            status_message=status.get("message", ""),
                        )
                    )
    except (AttributeError, TypeError, ValueError) as exc:
        raise OtlpError(f"The body is not an OTLP ExportTraceServiceRequest: {exc}") from exc
    return spans


# --- conventions -> chat messages ------------------------------------------------------------------------


def _unflatten(attributes: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """`{prefix}0.message.role` style keys into a list of nested dicts, ordered by index."""
    tree: dict[str, Any] = {}
    for key, value in attributes.items():
        if not key.startswith(prefix):
            continue
        node = tree
        parts = key[len(prefix) :].split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        else:
            node[parts[-1]] = value
    return _as_lists(tree) if tree else []


def _as_lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    if node and all(k.isdigit() for k in node):
        return [_as_lists(node[k]) for k in sorted(node, key=int)]
    return {k: _as_lists(v) for k, v in node.items()}


def _json_or(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _arguments(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value)


_ROLES = {"model": "assistant", "ai": "assistant", "human": "user", "function": "tool", "ipython": "tool"}


def _role(role: Any) -> str:
    """Roles some providers use, in OpenAI's words (Gemini says model, LangChain says human and ai)."""
    role = str(role).lower()
    return _ROLES.get(role, role)


def _openinference_message(node: Any) -> dict[str, Any] | None:
    if not isinstance(node, dict):
        return None
    m = node.get("message") if isinstance(node.get("message"), dict) else node
    role = m.get("role")
    if not role:
        return None
    content = m.get("content")
    if content is None and isinstance(m.get("contents"), list):
        texts = [c.get("message_content", {}).get("text") for c in m["contents"] if isinstance(c, dict)]
        content = "\n".join(t for t in texts if isinstance(t, str)) or None
    message: dict[str, Any] = {"role": _role(role), "content": content if content is None else str(content)}
    calls = []
    for item in m.get("tool_calls") or []:
        call = item.get("tool_call", item) if isinstance(item, dict) else {}
        function = call.get("function") or {}
        if function.get("name"):
            calls.append(
                {
                    "id": call.get("id"),
                    "type": "function",
                    "function": {
                        "name": function["name"],
                        "arguments": _arguments(function.get("arguments")),
                    },
                }
            )
    if calls:
        message["tool_calls"] = calls
    for extra in ("tool_call_id", "name"):
        if m.get(extra):
            message[extra] = m[extra]
    return message


def _indexed_genai_message(node: Any) -> dict[str, Any] | None:
    """OpenLLMetry's `gen_ai.prompt.N.{role,content,tool_calls.M.{id,name,arguments}}`."""
    role = node.get("role") if isinstance(node, dict) else None
    if not role:
        return None
    message: dict[str, Any] = {"role": _role(role), "content": node.get("content")}
    calls = [
        {
            "id": c.get("id"),
            "type": "function",
            "function": {"name": c["name"], "arguments": _arguments(c.get("arguments"))},
        }
        for c in node.get("tool_calls") or []
        if isinstance(c, dict) and c.get("name")
    ]
    if calls:
        message["tool_calls"] = calls
    if node.get("tool_call_id"):
        message["tool_call_id"] = node["tool_call_id"]
    return message


def _genai_parts_messages(items: Any) -> list[dict[str, Any]]:
    """`gen_ai.input.messages` / `gen_ai.output.messages`: [{role, parts: [{type: text|tool_call|
    tool_call_response, ...}]}] into OpenAI chat messages (one tool message per tool_call_response)."""
    items = _json_or(items)
    if not isinstance(items, list):
        return []
    messages: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict) or not item.get("role"):
            continue
        texts, calls = [], []
        for part in item.get("parts") or []:
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind == "text" and isinstance(part.get("content"), str):
                texts.append(part["content"])
            elif kind == "tool_call" and part.get("name"):
                calls.append(
                    {
                        "id": part.get("id"),
                        "type": "function",
                        "function": {"name": part["name"], "arguments": _arguments(part.get("arguments"))},
                    }
                )
            elif kind == "tool_call_response":
                response = part.get("response")
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": part.get("id"),
                        "content": response if isinstance(response, str) else json.dumps(response),
                    }
                )
        role = _role(item["role"])
        if texts or calls:
            message: dict[str, Any] = {"role": role, "content": "\n".join(texts) if texts else None}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
    return messages


def _system_instructions(value: Any) -> list[dict[str, Any]]:
    value = _json_or(value)
    if isinstance(value, str):
        return [{"role": "system", "content": value}]
    if isinstance(value, list):
        texts = [p.get("content") for p in value if isinstance(p, dict) and isinstance(p.get("content"), str)]
        if texts:
            return [{"role": "system", "content": "\n".join(texts)}]
    return []


def _tool_schema(value: Any) -> dict[str, Any] | None:
    value = _json_or(value)
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("function"), dict) and value["function"].get("name"):
        return {"type": "function", "function": value["function"]}
    if value.get("name"):  # the flat form GenAI uses: {type, name, description, parameters}
        function = {k: value[k] for k in ("name", "description", "parameters") if k in value}
        if isinstance(function.get("parameters"), str):
            function["parameters"] = _json_or(function["parameters"])
        return {"type": "function", "function": function}
    return None


@dataclass
class LlmCall:
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    model: str
    prompt_tokens: int
    completion_tokens: int


def llm_call(span: Span) -> LlmCall | None:
    """The messages of an LLM span in whichever convention it uses, or None for a span that is not one."""
    a = span.attributes
    operation = a.get("gen_ai.operation.name")
    kind = a.get("openinference.span.kind")
    inputs: list[dict[str, Any]] = []
    outputs: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    if "gen_ai.input.messages" in a or "gen_ai.output.messages" in a:
        inputs = _system_instructions(a.get("gen_ai.system_instructions")) + _genai_parts_messages(
            a.get("gen_ai.input.messages")
        )
        outputs = _genai_parts_messages(a.get("gen_ai.output.messages"))
        definitions = _json_or(a.get("gen_ai.tool.definitions"))
        tools = [t for t in map(_tool_schema, definitions if isinstance(definitions, list) else []) if t]
    elif kind == "LLM" or any(k.startswith(("llm.input_messages.", "llm.output_messages.")) for k in a):
        inputs = [m for m in map(_openinference_message, _unflatten(a, "llm.input_messages.")) if m]
        outputs = [m for m in map(_openinference_message, _unflatten(a, "llm.output_messages.")) if m]
        tools = [
            t
            for t in (
                _tool_schema((n.get("tool") or {}).get("json_schema"))
                for n in _unflatten(a, "llm.tools.")
                if isinstance(n, dict) and isinstance(n.get("tool"), dict)
            )
            if t
        ]
    elif any(k.startswith(("gen_ai.prompt.", "gen_ai.completion.")) for k in a):
        inputs = [m for m in map(_indexed_genai_message, _unflatten(a, "gen_ai.prompt.")) if m]
        outputs = [m for m in map(_indexed_genai_message, _unflatten(a, "gen_ai.completion.")) if m]
        tools = [t for t in map(_tool_schema, _unflatten(a, "llm.request.functions.")) if t]
    elif operation not in LLM_OPERATIONS:
        return None
    model = a.get("gen_ai.response.model") or a.get("gen_ai.request.model") or a.get("llm.model_name") or ""
    prompt = a.get(
        "gen_ai.usage.input_tokens", a.get("gen_ai.usage.prompt_tokens", a.get("llm.token_count.prompt", 0))
    )
    completion = a.get(
        "gen_ai.usage.output_tokens",
        a.get("gen_ai.usage.completion_tokens", a.get("llm.token_count.completion", 0)),
    )
    return LlmCall(inputs, outputs, tools, str(model), _int(prompt), _int(completion))


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


@dataclass
class ToolRun:
    name: str
    call_id: str | None
    arguments: str
    result: str
    error: bool


def tool_run(span: Span) -> ToolRun | None:
    a = span.attributes
    if a.get("gen_ai.operation.name") == "execute_tool":
        name = a.get("gen_ai.tool.name") or span.name.removeprefix("execute_tool ").strip()
        call_id = a.get("gen_ai.tool.call.id")
        arguments = a.get("gen_ai.tool.call.arguments")
        result = a.get("gen_ai.tool.call.result")
    elif a.get("openinference.span.kind") == "TOOL":
        name = a.get("tool.name") or span.name
        call_id = a.get("tool_call.id")
        arguments = a.get("input.value", a.get("tool.parameters"))
        result = a.get("output.value")
    else:
        return None
    error = span.status_code == STATUS_ERROR or bool(a.get("error.type"))
    if result is None:
        result = f"Error: {span.status_message or a.get('error.type') or 'the tool failed'}" if error else ""
    return ToolRun(
        name=str(name),
        call_id=str(call_id) if call_id else None,
        arguments=_arguments(arguments),
        result=result if isinstance(result, str) else json.dumps(result),
        error=error,
    )


# --- one conversation per trace --------------------------------------------------------------------------


def _key(message: dict[str, Any]) -> tuple:
    """What makes two messages the same one, re-sent: role, text and the names of the tools called.
    Ids are left out on purpose: instrumentations often drop them from the history they re-send."""
    names = tuple((c.get("function") or {}).get("name") or "" for c in message.get("tool_calls") or ())
    return (message.get("role"), content_text(message.get("content")).strip(), names)


def _ids(message: dict[str, Any]) -> set[str]:
    """The tool call ids a message carries: those it makes (assistant) or answers (tool)."""
    if message.get("role") == "tool":
        return {message["tool_call_id"]} if message.get("tool_call_id") else set()
    return {c["id"] for c in message.get("tool_calls") or () if c.get("id")}


class Conversation:
    def __init__(self, seed: Iterable[dict[str, Any]] = ()) -> None:
        self.messages: list[dict[str, Any]] = []
        self.counts: Counter = Counter()
        self.ids: dict[str, set[str]] = {"assistant": set(), "tool": set()}
        self.extend(list(seed))

    def extend(self, sequence: list[dict[str, Any]]) -> None:
        """Append what `sequence` adds. A message is already there when it carries a tool call id the
        conversation holds, or else when the conversation holds as many copies of it as `sequence` has up
        to that point (the history an LLM call re-sends; counted, so a repeated "yes" stays twice)."""
        seen: Counter = Counter()
        for message in sequence:
            key = _key(message)
            seen[key] += 1
            ids = _ids(message)
            known = self.ids.get(message.get("role"))
            if ids and known is not None and ids & known:
                continue
            if seen[key] <= self.counts[key]:
                continue
            self.messages.append(message)
            self.counts[key] += 1
            if known is not None:
                known |= ids

    def _calls(self) -> list[dict[str, Any]]:
        return [c for m in self.messages if m.get("role") == "assistant" for c in m.get("tool_calls") or ()]

    def add_tool_run(self, run: ToolRun, span_id: str) -> None:
        answered = {m.get("tool_call_id") for m in self.messages if m.get("role") == "tool"}
        calls = self._calls()
        call_id = run.call_id
        if call_id is None:  # no id on the span: the latest unanswered call of that tool
            for call in reversed(calls):
                if (call.get("function") or {}).get("name") == run.name and call.get("id") not in answered:
                    call_id = call.get("id")
                    break
        if call_id is None or not any(c.get("id") == call_id for c in calls):
            # A tool ran that no recorded LLM call asked for: record the call too, so the result has one.
            call_id = call_id or f"call_{span_id}"
            self.extend(
                [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": call_id,
                                "type": "function",
                                "function": {"name": run.name, "arguments": run.arguments},
                            }
                        ],
                    }
                ]
            )
        message: dict[str, Any] = {
            "role": "tool",
            "tool_call_id": call_id,
            "name": run.name,
            "content": run.result,
        }
        if run.error:
            message["is_error"] = True
        self.extend([message])


def _iso(ns: int) -> str | None:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).isoformat() if ns else None


def trace_record(trace_id: str, spans: list[Span], existing: Trajectory | None) -> dict[str, Any] | None:
    """The trajectory record for one trace (merged with what is stored of it), or None when no span of it
    is an LLM or tool span."""
    spans = sorted(spans, key=lambda s: (s.start_ns, s.end_ns))
    previous = (existing.metadata or {}).get("otlp", {}) if existing is not None else {}
    conversation = Conversation(existing.messages if existing is not None else ())
    tools: dict[str, dict[str, Any]] = {
        t["function"]["name"]: t for t in (existing.tools if existing else []) if _tool_schema(t)
    }
    span_meta: dict[str, list[int]] = dict(previous.get("spans", {}))
    model = existing.model_version if existing is not None else ""
    merged = set(span_meta)  # spans of an earlier export, already in the stored conversation
    found = False
    for span in spans:
        if span.span_id in merged:
            found = True
            continue
        call = llm_call(span)
        if call is not None:
            found = True
            conversation.extend(call.inputs + call.outputs)
            for tool in call.tools:
                tools.setdefault(tool["function"]["name"], tool)
            model = call.model or model
            span_meta[span.span_id] = [span.start_ns, span.end_ns, call.prompt_tokens, call.completion_tokens]
            continue
        run = tool_run(span)
        if run is not None:
            found = True
            conversation.add_tool_run(run, span.span_id)
        span_meta[span.span_id] = [span.start_ns, span.end_ns, 0, 0]
    if not found and existing is None:
        return None

    starts = [m[0] for m in span_meta.values() if m[0]]
    ends = [m[1] for m in span_meta.values() if m[1]]
    prompt = sum(m[2] for m in span_meta.values())
    completion = sum(m[3] for m in span_meta.values())
    ids = {s.span_id for s in spans}
    roots = [s for s in spans if not s.parent_span_id or s.parent_span_id not in ids]
    root = min(roots, key=lambda s: s.start_ns) if roots else spans[0]
    attrs = {
        k: v
        for s in spans
        for k, v in s.attributes.items()
        if k in ("gen_ai.agent.name", "agent.name", "session.id", "gen_ai.conversation.id")
    }
    agent = (
        attrs.get("gen_ai.agent.name") or attrs.get("agent.name") or root.resource.get("service.name") or ""
    )
    outcome = (
        "failure"
        if root.status_code == STATUS_ERROR and not root.parent_span_id
        else (existing.outcome if existing else "unknown")
    )
    metadata = dict(existing.metadata or {}) if existing is not None else {}
    metadata["otlp"] = {
        "trace_id": trace_id,
        "root_span": previous.get("root_span") or (root.name if not root.parent_span_id else ""),
        "service": root.resource.get("service.name", ""),
        "spans": span_meta,
    }
    for key in ("session.id", "gen_ai.conversation.id"):
        if key in attrs:
            metadata[key] = attrs[key]
    if any(m.get("is_error") for m in conversation.messages):
        metadata["has_tool_error"] = True
    return {
        "external_id": trace_id,
        "agent": str(agent)[:200],
        "model_version": str(model)[:200],
        "messages": conversation.messages,
        "tools": list(tools.values()),
        "outcome": outcome,
        "latency_ms": min((max(ends) - min(starts)) // 1_000_000, 2**31 - 1) if starts and ends else None,
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
        "metadata": metadata,
        "started_at": _iso(min(starts)) if starts else None,
    }


@dataclass
class OtlpOutcome:
    traces: int = 0
    created: int = 0
    updated: int = 0
    rejected_spans: int = 0
    skipped_traces: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def error_message(self) -> str:
        parts = list(self.errors[:5])
        if self.skipped_traces:
            parts.append(f"{self.skipped_traces} trace(s) had no LLM or tool span and were skipped")
        return "; ".join(parts)


def otlp_ingest(*, project: Project, spans: list[Span]) -> OtlpOutcome:
    """Map spans to one trajectory per trace and ingest them through `ingest_trajectories` (source otlp)."""
    by_trace: dict[str, list[Span]] = {}
    for span in spans:
        by_trace.setdefault(span.trace_id, []).append(span)
    outcome = OtlpOutcome(traces=len(by_trace))
    if not by_trace:
        return outcome
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
            t.external_id: t for t in Trajectory.objects.filter(project=project, external_id__in=trace_ids)
        }
        records, record_traces = [], []
        for trace_id in trace_ids:
            try:
                record = trace_record(trace_id, by_trace[trace_id], existing.get(trace_id))
            except Exception as exc:  # spans are untrusted input: one odd trace must not fail the export
                logger.warning("could not map OTLP trace %s", trace_id, exc_info=True)
                outcome.rejected_spans += len(by_trace[trace_id])
                outcome.errors.append(f"trace {trace_id}: could not be mapped: {type(exc).__name__}: {exc}")
                continue
            if record is None:
                outcome.skipped_traces += 1
                continue
            if not record["messages"]:
                outcome.rejected_spans += len(by_trace[trace_id])
                outcome.errors.append(
                    f"trace {trace_id}: its LLM spans carry no message content; turn content capture on "
                    "(e.g. OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true)"
                )
                continue
            records.append(record)
            record_traces.append(trace_id)
        result = ingest_trajectories(project=project, records=records, source="otlp")
    outcome.created, outcome.updated = result.created, result.updated
    for item in result.rejected:
        trace_id = record_traces[item["index"]]
        outcome.rejected_spans += len(by_trace[trace_id])
        first = item["errors"][0]
        outcome.errors.append(f"trace {trace_id}: {first['field']}: {first['message']}")
    return outcome


# gRPC status codes (google.rpc.Code) for the HTTP errors the endpoint answers with.
_GRPC_CODES = {400: 3, 401: 16, 403: 7, 404: 5, 413: 8, 415: 3, 429: 8}


def error_status(http_status: int, message: str, *, as_json: bool) -> bytes:
    """An error answer as OTLP/HTTP wants it: a google.rpc.Status in the request's encoding."""
    status = rpc_status.Status(code=_GRPC_CODES.get(http_status, 2), message=message)
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
