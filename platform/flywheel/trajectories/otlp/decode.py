"""OTLP trace export bodies (protobuf or OTLP/JSON) decoded into `Span`s, with what PostgreSQL cannot store as
sent made storable. A span that does not decode is kept with its `error`, to be rejected alone."""

from __future__ import annotations

import base64
import binascii
import functools
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

STATUS_ERROR = 2  # a span status of STATUS_CODE_ERROR


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
