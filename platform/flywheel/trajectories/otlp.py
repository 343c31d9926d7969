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
rather than refused; what was dropped or replaced is said in the answer's partial_success."""

from __future__ import annotations

import base64
import binascii
import functools
import json
import logging
import math
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import JSONField
from django.db.models.expressions import RawSQL
from django.utils import timezone
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.message import DecodeError
from google.rpc import status_pb2 as rpc_status
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from flywheel.accounts.models import Project
from flywheel.trajectories.ingest import content_text, derive, ingest_trajectories
from flywheel.trajectories.models import Trajectory
from flywheel.trajectories.schemas import validate_record
from flywheel.trajectories.triage import triage_request

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
    # Why this span could not be decoded: it is rejected alone, and the rest of the export goes on.
    error: str = ""
    replaced: int = 0  # values made storable (see `storable`)


# --- values PostgreSQL can store -------------------------------------------------------------------------

_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


def storable(value: Any, fixes: list[int]) -> Any:
    """`value` with what jsonb cannot hold made storable, counting each change in `fixes[0]`: a non-finite
    double becomes the string the protobuf JSON mapping spells it with ("NaN", "Infinity", "-Infinity"), a
    lone surrogate U+FFFD, as OpenTelemetry's rule for invalid Unicode asks. Telemetry is kept rather than
    refused: an exporter cannot correct and resend it, and a span with one odd attribute is still worth
    its conversation."""
    if isinstance(value, str):
        if "\x00" in value:  # valid Unicode that PostgreSQL refuses: replaced as ingestion does, not counted
            value = value.replace("\x00", "\ufffd")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            fixes[0] += 1
            # Through UTF-16: a pair of surrogates split over two escapes joins into its character.
            return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        fixes[0] += 1
        return _NON_FINITE.get(value, "NaN")
    if isinstance(value, list):
        return [storable(v, fixes) for v in value]
    if isinstance(value, dict):
        return {storable(str(k), fixes): storable(v, fixes) for k, v in value.items()}
    return value


def _storable_span(span: Span) -> Span:
    fixes = [span.replaced]
    span.attributes = storable(span.attributes, fixes)
    span.name, span.status_message = storable(span.name, fixes), storable(span.status_message, fixes)
    span.replaced = fixes[0]
    return span


def _storable_resource(resource: dict[str, Any]) -> tuple[dict[str, Any], int]:
    fixes = [0]
    return storable(resource, fixes), fixes[0]


# --- decoding --------------------------------------------------------------------------------------------


def _text(value: str | bytes) -> str:
    """A string field; read as bytes (`_lenient_request`), invalid UTF-8 comes back as lone surrogates, which
    `storable` then replaces (and counts) like those of OTLP/JSON."""
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value


def _any_value_pb(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_any_value_pb(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {_text(kv.key): _any_value_pb(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value).decode()
    if kind == "string_value":
        return _text(value.string_value)
    return getattr(value, kind)


@functools.cache
def _lenient_request() -> type:
    """ExportTraceServiceRequest with every string field declared bytes (the wire format is the same).
    Protobuf refuses a whole message for one string of invalid UTF-8 (a lone surrogate an SDK let through,
    say); read this way, only that string is changed, to U+FFFD, and the rest of the export is kept."""
    pool = descriptor_pool.DescriptorPool()

    def as_bytes(messages: Iterable[descriptor_pb2.DescriptorProto]) -> None:
        for message in messages:
            for f in message.field:
                if f.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
                    f.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
            as_bytes(message.nested_type)

    for module in (common_pb2, resource_pb2, trace_pb2, trace_service_pb2):  # dependencies first
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        as_bytes(proto.message_type)
        pool.Add(proto)
    name = ExportTraceServiceRequest.DESCRIPTOR.full_name
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(name))


def spans_from_protobuf(body: bytes) -> list[Span]:
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as exc:
        if "UTF-8" not in str(exc):
            raise OtlpError(f"The body is not a protobuf ExportTraceServiceRequest: {exc}") from exc
        request = _lenient_request()()
        try:
            request.ParseFromString(body)
        except DecodeError as again:
            raise OtlpError(f"The body is not a protobuf ExportTraceServiceRequest: {again}") from again
    spans = []
    for resource_spans in request.resource_spans:
        resource, replaced = _storable_resource(
            {_text(kv.key): _any_value_pb(kv.value) for kv in resource_spans.resource.attributes}
        )
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    _storable_span(
                        Span(
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            name=_text(span.name),
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={_text(kv.key): _any_value_pb(kv.value) for kv in span.attributes},
                            resource=resource,
                            status_code=span.status.code,
                            status_message=_text(span.status.message),
                            replaced=replaced,  # what the resource needed, counted once, on its first span
                        )
                    )
                )
                replaced = 0
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
    attributes = {}
    for kv in items:
        if isinstance(kv, dict) and "key" in kv:
            if not isinstance(kv["key"], str):
                raise ValueError(f"attribute key {kv['key']!r} is not a string")
            attributes[kv["key"]] = _any_value_json(kv.get("value"))
    return attributes


def _hex_id(value: Any, name: str = "id") -> str:
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
        raise OtlpError(f"{name} {value!r} is neither hex nor base64") from exc


_STATUS_NAMES = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}


def _uint64(value: Any, name: str) -> int:
    """A fixed64 field of OTLP/JSON (a decimal string or a number), refused outside uint64 as protobuf would."""
    if isinstance(value, bool) or not isinstance(value, int | str | float):
        raise ValueError(f"{name} must be an integer (nanoseconds), not {type(value).__name__}")
    number = int(value) if not isinstance(value, float) or value.is_integer() else -1
    if not 0 <= number < 2**64:
        raise ValueError(f"{name} {value!r} is not an unsigned 64-bit integer")
    return number


def _span_json(span: Any, resource: dict[str, Any]) -> Span:
    if not isinstance(span, dict):
        raise ValueError(f"a span must be an object, not {type(span).__name__}")
    status = span.get("status") or {}
    if not isinstance(status, dict):
        raise ValueError("status must be an object")
    code = status.get("code", 0)
    name, message = span.get("name", ""), status.get("message", "")
    if not isinstance(name, str) or not isinstance(message, str):
        raise ValueError("name and status.message must be strings")
    return Span(
        trace_id=_hex_id(_get(span, "traceId"), "traceId"),
        span_id=_hex_id(_get(span, "spanId"), "spanId"),
        parent_span_id=_hex_id(_get(span, "parentSpanId"), "parentSpanId"),
        name=name,
        start_ns=_uint64(_get(span, "startTimeUnixNano", 0) or 0, "startTimeUnixNano"),
        end_ns=_uint64(_get(span, "endTimeUnixNano", 0) or 0, "endTimeUnixNano"),
        attributes=_attributes_json(span.get("attributes")),
        resource=resource,
        status_code=_STATUS_NAMES.get(code, 0) if isinstance(code, str) else int(code),
        status_message=message,
    )


def _bad_span(span: Any, where: str, exc: BaseException) -> Span:
    """A span that could not be decoded, kept only to be counted and named in the answer (with its trace, when
    its traceId at least is readable)."""
    try:
        trace_id = _hex_id(_get(span, "traceId")) if isinstance(span, dict) else ""
    except (OtlpError, TypeError, ValueError):
        trace_id = ""
    reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
    prefix = f"trace {trace_id}: " if trace_id else ""
    return Span(trace_id, "", "", "", 0, 0, {}, {}, error=f"{prefix}{where}: {reason}")


def spans_from_json(body: bytes) -> list[Span]:
    """The spans of an OTLP/JSON export. A body that is not one is refused whole (OtlpError); a span that does
    not decode (a wrong type, an id that is neither hex nor base64) comes back with `error` set, so that it is
    rejected alone, as one bad record must not cost the others."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:  # ValueError: also bad UTF-8, an int of over 4300 digits
        raise OtlpError(f"The body is not valid JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise OtlpError("The body must be an OTLP ExportTraceServiceRequest object with resourceSpans.")
    spans = []
    try:
        for r, resource_spans in enumerate(_get(payload, "resourceSpans", []) or []):
            try:
                resource, replaced = _storable_resource(
                    _attributes_json((resource_spans.get("resource") or {}).get("attributes"))
                )
                resource_error = None
            except (AttributeError, TypeError, ValueError, OverflowError, RecursionError) as exc:
                resource, replaced, resource_error = {}, 0, exc
            for c, scope_spans in enumerate(_get(resource_spans, "scopeSpans", []) or []):
                for i, span in enumerate(scope_spans.get("spans", []) or []):
                    where = f"resourceSpans[{r}].scopeSpans[{c}].spans[{i}]"
                    if resource_error is not None:
                        spans.append(_bad_span(span, f"resourceSpans[{r}].resource", resource_error))
                        continue
                    try:
                        spans.append(_storable_span(_span_json(span, resource)))
                        spans[-1].replaced += replaced  # the resource's, counted once, on its first span
                        replaced = 0
                    except (
                        OtlpError,
                        AttributeError,
                        TypeError,
                        ValueError,
                        OverflowError,
                        RecursionError,
                    ) as exc:
                        spans.append(_bad_span(span, where, exc))
    except (AttributeError, TypeError) as exc:
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


def _json_or(value: Any, fixes: list[int] | None = None) -> Any:
    """A JSON-encoded attribute decoded (GenAI sends structures as JSON strings), or the value as it is.
    Python's json reads NaN and escaped lone surrogates: what it decodes is made storable (`storable`)."""
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except (ValueError, RecursionError):
            return value
        try:
            return storable(decoded, fixes if fixes is not None else [0])
        except RecursionError:
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


def _genai_parts_messages(items: Any, fixes: list[int]) -> list[dict[str, Any]]:
    """`gen_ai.input.messages` / `gen_ai.output.messages`: [{role, parts: [{type: text|tool_call|
    tool_call_response, ...}]}] into OpenAI chat messages (one tool message per tool_call_response)."""
    items = _json_or(items, fixes)
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


def _system_instructions(value: Any, fixes: list[int]) -> list[dict[str, Any]]:
    value = _json_or(value, fixes)
    if isinstance(value, str):
        return [{"role": "system", "content": value}]
    if isinstance(value, list):
        texts = [p.get("content") for p in value if isinstance(p, dict) and isinstance(p.get("content"), str)]
        if texts:
            return [{"role": "system", "content": "\n".join(texts)}]
    return []


def _tool_schema(value: Any, fixes: list[int] | None = None) -> dict[str, Any] | None:
    value = _json_or(value, fixes)
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("function"), dict) and value["function"].get("name"):
        return {"type": "function", "function": value["function"]}
    if value.get("name"):  # the flat form GenAI uses: {type, name, description, parameters}
        function = {k: value[k] for k in ("name", "description", "parameters") if k in value}
        if isinstance(function.get("parameters"), str):
            function["parameters"] = _json_or(function["parameters"], fixes)
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
    replaced: int = 0  # values of JSON-encoded attributes made storable


def llm_call(span: Span) -> LlmCall | None:
    """The messages of an LLM span in whichever convention it uses, or None for a span that is not one."""
    a = span.attributes
    operation = a.get("gen_ai.operation.name")
    kind = a.get("openinference.span.kind")
    inputs: list[dict[str, Any]] = []
    outputs: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    fixes = [0]  # values of JSON-encoded attributes made storable
    if "gen_ai.input.messages" in a or "gen_ai.output.messages" in a:
        inputs = _system_instructions(a.get("gen_ai.system_instructions"), fixes) + _genai_parts_messages(
            a.get("gen_ai.input.messages"), fixes
        )
        outputs = _genai_parts_messages(a.get("gen_ai.output.messages"), fixes)
        definitions = _json_or(a.get("gen_ai.tool.definitions"), fixes)
        tools = [
            t
            for t in (_tool_schema(d, fixes) for d in (definitions if isinstance(definitions, list) else []))
            if t
        ]
    elif kind == "LLM" or any(k.startswith(("llm.input_messages.", "llm.output_messages.")) for k in a):
        inputs = [m for m in map(_openinference_message, _unflatten(a, "llm.input_messages.")) if m]
        outputs = [m for m in map(_openinference_message, _unflatten(a, "llm.output_messages.")) if m]
        tools = [
            t
            for t in (
                _tool_schema((n.get("tool") or {}).get("json_schema"), fixes)
                for n in _unflatten(a, "llm.tools.")
                if isinstance(n, dict) and isinstance(n.get("tool"), dict)
            )
            if t
        ]
    elif any(k.startswith(("gen_ai.prompt.", "gen_ai.completion.")) for k in a):
        inputs = [m for m in map(_indexed_genai_message, _unflatten(a, "gen_ai.prompt.")) if m]
        outputs = [m for m in map(_indexed_genai_message, _unflatten(a, "gen_ai.completion.")) if m]
        tools = [t for t in (_tool_schema(f, fixes) for f in _unflatten(a, "llm.request.functions.")) if t]
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
    return LlmCall(inputs, outputs, tools, str(model), _int(prompt), _int(completion), fixes[0])


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an infinite double
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
    """The messages of one trace, with what deduplication and tool-call matching need kept as indexes, so
    that adding a span costs what the span carries, not what the conversation holds. New messages past
    `limit` are dropped and counted in `dropped`; the stored history (`seed`) is kept whole."""

    def __init__(self, seed: Iterable[dict[str, Any]] = (), *, limit: int | None = None) -> None:
        self.messages: list[dict[str, Any]] = []
        self.counts: Counter = Counter()  # key -> copies held
        self.idless: Counter = Counter()  # key -> copies held that carry no tool call id
        self.ids: dict[str, set[str]] = {"assistant": set(), "tool": set()}
        self.calls_by_name: dict[str, list[str | None]] = {}  # tool name -> ids of its calls, in order
        # Stored messages with ids are counted by key only once a message without ids asks (a re-sent
        # history): spans that carry ids (tool runs, most LLM outputs) never pay for keying the history.
        self._unkeyed: list[dict[str, Any]] = []
        self.messages = list(seed)
        for message in self.messages:
            ids = _ids(message)
            if ids:
                self._unkeyed.append(message)
            else:
                key = _key(message)
                self.counts[key] += 1
                self.idless[key] += 1
            self._index(message, ids)
        self.seeded = len(self.messages)
        self.limit = limit
        self.dropped = 0

    def _copies(self, key: tuple) -> int:
        if self._unkeyed:
            self.counts.update(_key(m) for m in self._unkeyed)
            self._unkeyed = []
        return self.counts[key]

    def _append(self, message: dict[str, Any], key: tuple, ids: set[str]) -> None:
        self.messages.append(message)
        self.counts[key] += 1
        if not ids:
            self.idless[key] += 1
        self._index(message, ids)

    def _index(self, message: dict[str, Any], ids: set[str]) -> None:
        known = self.ids.get(message.get("role"))
        if known is not None:
            known |= ids
        if message.get("role") == "assistant":
            for call in message.get("tool_calls") or ():
                name = (call.get("function") or {}).get("name") or ""
                self.calls_by_name.setdefault(name, []).append(call.get("id"))

    def extend(self, sequence: list[dict[str, Any]]) -> None:
        """Append what `sequence` adds. A message is already there when it carries a tool call id the
        conversation holds, or else when the conversation holds as many copies of it as `sequence` has up
        to that point (the history an LLM call re-sends; counted, so a repeated "yes" stays twice). A message
        whose ids are all new is new, even when its text repeats (the same tool result for another call),
        unless copies of it were stored without ids (a history re-sent with ids its first report lacked)."""
        seen: Counter = Counter()
        for message in sequence:
            key = _key(message)
            seen[key] += 1
            ids = _ids(message)
            known = self.ids.get(message.get("role"))
            if ids and known is not None:
                if ids & known or seen[key] <= self.idless[key]:
                    continue
            elif seen[key] <= self._copies(key):
                continue
            if self.limit is not None and len(self.messages) >= self.limit:
                self.dropped += 1
                continue
            self._append(message, key, ids)

    def add_tool_run(self, run: ToolRun, span_id: str) -> None:
        call_id = run.call_id
        if call_id is None:  # no id on the span: the latest unanswered call of that tool
            for candidate in reversed(self.calls_by_name.get(run.name, ())):
                if candidate not in self.ids["tool"]:
                    call_id = candidate
                    break
        if call_id is None or call_id not in self.ids["assistant"]:
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


@dataclass
class TraceMerge:
    """What merging one trace's spans of an export gave: the record to write (None: nothing to write) and
    what the answer must say about it."""

    record: dict[str, Any] | None = None
    spans: int = 0  # spans of this export merged into the trajectory
    skipped: bool = False  # a new trace without any LLM or tool span: not a trajectory
    dropped_spans: int = 0  # spans not merged: the trace holds the most it may (`full`)
    full: str = ""  # which cap made spans go: "spans" or "messages"
    dropped_messages: int = 0  # over FLYWHEEL_OTLP_MAX_MESSAGES_PER_TRACE
    replaced: int = 0  # values made storable
    seeded: int = 0  # messages of record["messages"] already stored: the rest are new


def _unmerged(spans: list[Span], known: Iterable[str]) -> list[Span]:
    """The spans of an export not merged yet (a span sent twice counts once), in start order."""
    seen = set(known)
    fresh = []
    for span in sorted(spans, key=lambda s: (s.start_ns, s.end_ns)):
        if span.span_id not in seen:
            seen.add(span.span_id)
            fresh.append(span)
    return fresh


def trace_record(
    trace_id: str,
    spans: list[Span],
    existing: Trajectory | None,
    history: list[dict[str, Any]] | None = None,
    *,
    max_spans: int,
    max_messages: int,
) -> TraceMerge:
    """The trajectory record for one trace, merged with what is stored of it (`existing`, its messages in
    `history`). Spans merged before are not replayed; nothing new means nothing to write."""
    previous = (existing.metadata or {}).get("otlp", {}) if existing is not None else {}
    span_meta: dict[str, list[int]] = dict(previous.get("spans", {}))
    fresh = _unmerged(spans, span_meta)
    merge = TraceMerge()
    if existing is not None and fresh and existing.message_count >= max_messages:
        # A full conversation takes nothing more, so its spans are not merged either: the trajectory stays
        # as it is, and the export costs no read of the conversation and no write.
        merge.dropped_spans, merge.full = len(fresh), "messages"
        return merge
    room = max(max_spans - len(span_meta), 0)
    if len(fresh) > room:
        merge.dropped_spans, merge.full = len(fresh) - room, "spans"
        fresh = fresh[:room]  # past the cap, the latest spans go: a trajectory keeps its beginning
    if not fresh and existing is not None:
        return merge
    merge.spans = len(fresh)

    conversation = Conversation(history or (), limit=max_messages)
    merge.seeded = conversation.seeded
    tools: dict[str, dict[str, Any]] = {
        t["function"]["name"]: t for t in (existing.tools if existing else []) if _tool_schema(t)
    }
    model = existing.model_version if existing is not None else ""
    found = bool(span_meta)  # spans of an earlier export, already in the stored conversation
    for span in fresh:
        merge.replaced += span.replaced
        call = llm_call(span)
        if call is not None:
            found = True
            merge.replaced += call.replaced
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
    merge.dropped_messages = conversation.dropped
    if not found and existing is None:
        merge.skipped = True
        return merge

    starts = [m[0] for m in span_meta.values() if m[0]]
    ends = [m[1] for m in span_meta.values() if m[1]]
    prompt = sum(m[2] for m in span_meta.values())
    completion = sum(m[3] for m in span_meta.values())
    latency = max(ends) - min(starts) if starts and ends else None
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
    if previous.get("truncated") or merge.dropped_spans or merge.dropped_messages:
        metadata["otlp"]["truncated"] = True  # a cap was reached: the trajectory is not the whole trace
    for key in ("session.id", "gen_ai.conversation.id"):
        if key in attrs:
            metadata[key] = attrs[key]
    if any(m.get("is_error") for m in conversation.messages[conversation.seeded :]):
        metadata["has_tool_error"] = True
    merge.record = {
        "external_id": trace_id,
        "agent": str(agent)[:200],
        "model_version": str(model)[:200],
        "messages": conversation.messages,
        "tools": list(tools.values()),
        "outcome": outcome,
        # None when the spans' clocks disagree (an end before every start): unknown, not negative.
        "latency_ms": min(latency // 1_000_000, 2**31 - 1) if latency is not None and latency >= 0 else None,
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
        "metadata": metadata,
        "started_at": _iso(min(starts)) if starts else None,
    }
    return merge


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


def otlp_ingest(*, project: Project, spans: list[Span]) -> OtlpOutcome:
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
            and _unmerged(by_trace[trace_id], known)
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
        result = ingest_trajectories(project=project, records=records, source="otlp")
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
