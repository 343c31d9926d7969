"""OTLP/HTTP ingestion: real ExportTraceServiceRequest payloads (built with the opentelemetry-proto classes, as
an exporter sends them) and OTLP/JSON, in the OpenInference and the OTel GenAI conventions."""

from __future__ import annotations

import base64
import gzip
import json
import os
from typing import Any

import pytest
from google.protobuf.json_format import MessageToDict, ParseDict
from google.rpc.status_pb2 import Status as RpcStatus
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    InstrumentationScope,
    KeyValue,
    KeyValueList,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from flywheel.trajectories.models import Trajectory

URL = "/api/v1/otlp/v1/traces"
T0 = 1_764_000_000_000_000_000  # ns
MS = 1_000_000


def any_value(value: Any) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, list):
        return AnyValue(array_value=ArrayValue(values=[any_value(v) for v in value]))
    if isinstance(value, dict):
        return AnyValue(
            kvlist_value=KeyValueList(values=[KeyValue(key=k, value=any_value(v)) for k, v in value.items()])
        )
    return AnyValue(string_value=str(value))


def span(
    trace: bytes,
    sid: int,
    name: str,
    start_ms: int,
    end_ms: int,
    attrs: dict[str, Any],
    *,
    parent: int | None = 1,
    error: bool = False,
) -> Span:
    return Span(
        trace_id=trace,
        span_id=sid.to_bytes(8, "big"),
        parent_span_id=parent.to_bytes(8, "big") if parent else b"",
        name=name,
        kind=Span.SPAN_KIND_INTERNAL,
        start_time_unix_nano=T0 + start_ms * MS,
        end_time_unix_nano=T0 + end_ms * MS,
        attributes=[KeyValue(key=k, value=any_value(v)) for k, v in attrs.items()],
        status=Status(
            code=Status.STATUS_CODE_ERROR if error else Status.STATUS_CODE_UNSET,
            message="boom" if error else "",
        ),
    )


def export(spans: list[Span], service: str = "support-bot") -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                resource=Resource(attributes=[KeyValue(key="service.name", value=any_value(service))]),
                scope_spans=[ScopeSpans(scope=InstrumentationScope(name="test"), spans=spans)],
            )
        ]
    )


def as_otlp_json(request: ExportTraceServiceRequest) -> str:
    """OTLP/JSON: protobuf's JSON mapping, but ids in hex and enums as integers (the OTLP spec's rules)."""
    payload = MessageToDict(request, use_integers_for_enums=True)
    for rs in payload["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for s in ss["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in s:
                        s[key] = base64.b64decode(s[key]).hex()
    return json.dumps(payload)


TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "get_order",
        "description": "Look an order up.",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
    },
}


def oi_message(prefix: str, i: int, role: str, content: str | None = None, **extra: Any) -> dict[str, Any]:
    attrs: dict[str, Any] = {f"{prefix}.{i}.message.role": role}
    if content is not None:
        attrs[f"{prefix}.{i}.message.content"] = content
    for j, call in enumerate(extra.get("tool_calls", [])):
        base = f"{prefix}.{i}.message.tool_calls.{j}.tool_call"
        attrs[f"{base}.id"] = call["id"]
        attrs[f"{base}.function.name"] = call["name"]
        attrs[f"{base}.function.arguments"] = call["arguments"]
    if "tool_call_id" in extra:
        attrs[f"{prefix}.{i}.message.tool_call_id"] = extra["tool_call_id"]
    return attrs


CALL = {"id": "call_1", "name": "get_order", "arguments": '{"order_id": "1234"}'}


def openinference_agent(
    trace: bytes, *, tool_error: bool = False, resent_without_ids: bool = False
) -> list[Span]:
    """An agent run: root CHAIN span, LLM (asks for a tool), TOOL, LLM (answers, re-sending the history)."""
    history = [("system", "You are a support agent.", {}), ("user", "Where is my order 1234?", {})]
    llm1 = {
        "openinference.span.kind": "LLM",
        "llm.model_name": "qwen-0.5b-v3",
        "llm.token_count.prompt": 100,
        "llm.token_count.completion": 20,
    }
    for i, (role, content, extra) in enumerate(history):
        llm1.update(oi_message("llm.input_messages", i, role, content, **extra))
    llm1.update(oi_message("llm.output_messages", 0, "assistant", None, tool_calls=[CALL]))
    llm1["llm.tools.0.tool.json_schema"] = json.dumps(TOOL_SCHEMA)
    tool = {"openinference.span.kind": "TOOL", "tool.name": "get_order", "input.value": CALL["arguments"]}
    if not tool_error:
        tool["output.value"] = '{"status": "shipped"}'
    llm2 = {
        "openinference.span.kind": "LLM",
        "llm.model_name": "qwen-0.5b-v3",
        "llm.token_count.prompt": 150,
        "llm.token_count.completion": 10,
    }
    history2 = [
        *history,
        ("assistant", None, {"tool_calls": [CALL]}),
        ("tool", '{"status": "shipped"}', {"tool_call_id": "call_1"}),
    ]
    if resent_without_ids:  # some instrumentations drop the ids from the history they re-send
        history2[2] = ("assistant", None, {"tool_calls": [{**CALL, "id": ""}]})
        history2[3] = ("tool", '{"status": "shipped"}', {})
    for i, (role, content, extra) in enumerate(history2):
        llm2.update(oi_message("llm.input_messages", i, role, content, **extra))
    llm2.update(oi_message("llm.output_messages", 0, "assistant", "Your order has shipped."))
    return [
        span(trace, 1, "agent", 0, 400, {"openinference.span.kind": "AGENT"}, parent=None),
        span(trace, 2, "ChatCompletion", 10, 100, llm1),
        span(trace, 3, "get_order", 110, 150, tool, error=tool_error),
        span(trace, 4, "ChatCompletion", 160, 390, llm2),
    ]


def genai_parts(role: str, *parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": role, "parts": list(parts)}


def genai_agent(trace: bytes, *, structured: bool = False) -> list[Span]:
    """The same run in the OTel GenAI convention: chat spans with gen_ai.*.messages and an execute_tool span."""
    encode = (lambda v: v) if structured else json.dumps
    user = genai_parts("user", {"type": "text", "content": "Where is my order 1234?"})
    ask = genai_parts(
        "assistant",
        {"type": "tool_call", "id": "call_1", "name": "get_order", "arguments": {"order_id": "1234"}},
    )
    result = genai_parts(
        "tool", {"type": "tool_call_response", "id": "call_1", "response": '{"status": "shipped"}'}
    )
    answer = genai_parts("assistant", {"type": "text", "content": "Your order has shipped."})
    common = {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "qwen-0.5b-v3",
        "gen_ai.system_instructions": encode([{"type": "text", "content": "You are a support agent."}]),
        "gen_ai.tool.definitions": encode(
            [
                {
                    "type": "function",
                    "name": "get_order",
                    "description": "Look an order up.",
                    "parameters": {"type": "object"},
                }
            ]
        ),
        "gen_ai.agent.name": "support-bot",
    }
    chat1 = {
        **common,
        "gen_ai.input.messages": encode([user]),
        "gen_ai.output.messages": encode([ask]),
        "gen_ai.usage.input_tokens": 100,
        "gen_ai.usage.output_tokens": 20,
    }
    tool = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "get_order",
        "gen_ai.tool.call.id": "call_1",
        "gen_ai.tool.call.arguments": '{"order_id": "1234"}',
        "gen_ai.tool.call.result": '{"status": "shipped"}',
    }
    chat2 = {
        **common,
        "gen_ai.input.messages": encode([user, ask, result]),
        "gen_ai.output.messages": encode([answer]),
        "gen_ai.usage.input_tokens": 150,
        "gen_ai.usage.output_tokens": 10,
    }
    return [
        span(
            trace,
            1,
            "invoke_agent support-bot",
            0,
            400,
            {"gen_ai.operation.name": "invoke_agent"},
            parent=None,
        ),
        span(trace, 2, "chat qwen-0.5b-v3", 10, 100, chat1),
        span(trace, 3, "execute_tool get_order", 110, 150, tool),
        span(trace, 4, "chat qwen-0.5b-v3", 160, 390, chat2),
    ]


EXPECTED_ROLES = ["system", "user", "assistant", "tool", "assistant"]


@pytest.fixture
def client(api_client, api_key):
    return api_client.with_key(api_key)


def post_protobuf(client, request: ExportTraceServiceRequest, **kwargs: Any):
    return client.post(URL, body=request.SerializeToString(), content_type="application/x-protobuf", **kwargs)


def test_openinference_protobuf_multi_step_agent(client, project):
    trace = os.urandom(16)
    response = post_protobuf(client, export(openinference_agent(trace)))
    assert response.status_code == 200, response.content
    assert response["Content-Type"] == "application/x-protobuf"
    parsed = ExportTraceServiceResponse.FromString(response.content)
    assert parsed.partial_success.rejected_spans == 0

    t = Trajectory.objects.get(project=project)
    assert t.external_id == trace.hex()
    assert t.source == "otlp"
    assert [m["role"] for m in t.messages] == EXPECTED_ROLES
    assert t.messages[2]["tool_calls"][0]["function"] == {
        "name": "get_order",
        "arguments": '{"order_id": "1234"}',
    }
    assert t.messages[3]["tool_call_id"] == "call_1"
    assert t.messages[3]["content"] == '{"status": "shipped"}'
    assert t.messages[4]["content"] == "Your order has shipped."
    assert t.tools == [TOOL_SCHEMA]
    assert t.agent == "support-bot"
    assert t.model_version == "qwen-0.5b-v3"
    assert t.usage == {"prompt_tokens": 250, "completion_tokens": 30, "total_tokens": 280}
    assert t.latency_ms == 400
    assert t.tool_call_count == 1 and t.has_tool_error is False
    assert t.title == "Where is my order 1234?"


@pytest.mark.parametrize("structured", [False, True])
def test_genai_json_multi_step_agent(client, project, structured):
    trace = os.urandom(16)
    body = as_otlp_json(export(genai_agent(trace, structured=structured), service="svc"))
    response = client.post(URL, body=body, content_type="application/json")
    assert response.status_code == 200, response.content
    assert response.json() == {}

    t = Trajectory.objects.get(project=project, external_id=trace.hex())
    assert [m["role"] for m in t.messages] == EXPECTED_ROLES
    assert t.messages[0]["content"] == "You are a support agent."
    call = t.messages[2]["tool_calls"][0]
    assert call["id"] == "call_1" and call["function"]["name"] == "get_order"
    assert json.loads(call["function"]["arguments"]) == {"order_id": "1234"}
    assert t.messages[3] == {
        "role": "tool",
        "tool_call_id": "call_1",
        "name": "get_order",
        "content": '{"status": "shipped"}',
    }
    assert t.tools[0]["function"]["name"] == "get_order"
    assert t.agent == "support-bot"  # gen_ai.agent.name wins over service.name
    assert t.usage["prompt_tokens"] == 250


def test_gzip_protobuf_as_exporters_compress_it(client, project):
    body = gzip.compress(export(openinference_agent(os.urandom(16))).SerializeToString())
    response = client.post(
        URL, body=body, content_type="application/x-protobuf", headers={"Content-Encoding": "gzip"}
    )
    assert response.status_code == 200
    assert Trajectory.objects.get(project=project).message_count == 5


def test_genai_protobuf_too(client, project):
    trace = os.urandom(16)
    assert post_protobuf(client, export(genai_agent(trace))).status_code == 200
    assert [m["role"] for m in Trajectory.objects.get(project=project).messages] == EXPECTED_ROLES


def test_history_resent_without_ids_is_not_repeated(client, project):
    post_protobuf(client, export(openinference_agent(os.urandom(16), resent_without_ids=True)))
    assert [m["role"] for m in Trajectory.objects.get(project=project).messages] == EXPECTED_ROLES


def test_the_same_answer_twice_is_kept_twice(client, project):
    trace = os.urandom(16)
    first = {
        "openinference.span.kind": "LLM",
        **oi_message("llm.input_messages", 0, "user", "yes"),
        **oi_message("llm.output_messages", 0, "assistant", "Refund it?"),
    }
    second = {"openinference.span.kind": "LLM"}
    for i, (role, content) in enumerate([("user", "yes"), ("assistant", "Refund it?"), ("user", "yes")]):
        second.update(oi_message("llm.input_messages", i, role, content))
    second.update(oi_message("llm.output_messages", 0, "assistant", "Done."))
    spans = [
        span(trace, 2, "llm", 0, 10, first, parent=None),
        span(trace, 3, "llm", 20, 30, second, parent=None),
    ]
    post_protobuf(client, export(spans))
    contents = [m["content"] for m in Trajectory.objects.get(project=project).messages]
    assert contents == ["yes", "Refund it?", "yes", "Done."]


def test_a_failed_tool_span_is_a_tool_error(client, project):
    trace = os.urandom(16)
    post_protobuf(client, export(openinference_agent(trace, tool_error=True)))
    t = Trajectory.objects.get(project=project)
    assert t.has_tool_error is True
    tool = next(m for m in t.messages if m["role"] == "tool")
    assert tool["is_error"] is True


def test_one_trajectory_per_trace(client, project):
    a, b = os.urandom(16), os.urandom(16)
    post_protobuf(client, export(openinference_agent(a) + genai_agent(b)))
    assert set(Trajectory.objects.filter(project=project).values_list("external_id", flat=True)) == {
        a.hex(),
        b.hex(),
    }


def test_a_trace_split_over_exports_is_merged_and_a_replay_changes_nothing(client, project):
    trace = os.urandom(16)
    spans = openinference_agent(trace)
    post_protobuf(client, export(spans[1:3]))  # first LLM call and the tool, as a batch processor sends them
    first = Trajectory.objects.get(project=project)
    assert [m["role"] for m in first.messages] == ["system", "user", "assistant", "tool"]
    post_protobuf(client, export([spans[3], spans[0]]))  # the second LLM call, then the root ending last
    post_protobuf(client, export(spans))  # a replay of the whole trace
    t = Trajectory.objects.get(project=project)
    assert [m["role"] for m in t.messages] == EXPECTED_ROLES
    assert t.usage["prompt_tokens"] == 250  # counted once per span, whatever the replays
    assert t.latency_ms == 400


def post_as(client, request: ExportTraceServiceRequest, encoding: str) -> dict[str, Any]:
    """Post in `encoding` ("protobuf" or "json"); the ExportTraceServiceResponse as OTLP/JSON would spell it."""
    if encoding == "json":
        response = client.post(URL, body=as_otlp_json(request), content_type="application/json")
        assert response["Content-Type"] == "application/json"
        return {"status": response.status_code, **response.json()}
    response = post_protobuf(client, request)
    assert response["Content-Type"] == "application/x-protobuf"
    return {
        "status": response.status_code,
        **MessageToDict(ExportTraceServiceResponse.FromString(response.content)),
    }


@pytest.mark.parametrize("encoding", ["protobuf", "json"])
def test_a_trace_without_llm_spans_is_skipped_with_a_message(client, project, encoding):
    trace = os.urandom(16)
    answer = post_as(
        client, export([span(trace, 1, "GET /health", 0, 5, {"http.method": "GET"}, parent=None)]), encoding
    )
    assert answer == {
        "status": 200,
        "partialSuccess": {"errorMessage": "1 trace(s) had no LLM or tool span and were skipped"},
    }
    assert not Trajectory.objects.exists()


@pytest.mark.parametrize("encoding", ["protobuf", "json"])
def test_llm_spans_without_content_are_rejected_with_the_reason(client, project, encoding):
    trace = os.urandom(16)
    attrs = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m", "gen_ai.usage.input_tokens": 3}
    answer = post_as(client, export([span(trace, 1, "chat m", 0, 5, attrs, parent=None)]), encoding)
    assert answer["status"] == 200
    assert answer["partialSuccess"]["rejectedSpans"] == "1"
    assert "content capture" in answer["partialSuccess"]["errorMessage"]
    assert not Trajectory.objects.exists()


def test_odd_attribute_shapes_do_not_fail_the_export(client, project):
    odd, good = os.urandom(16), os.urandom(16)
    attrs = {
        "openinference.span.kind": "LLM",
        "llm.input_messages.0": "not an object",
        "llm.input_messages.1.message.role": "user",
        "llm.input_messages.1.message.content": "hi",
        "llm.tools.0": 7,
        "gen_ai.prompt": 3,
    }
    body = export([span(odd, 1, "llm", 0, 5, attrs, parent=None), *openinference_agent(good)])
    assert post_protobuf(client, body).status_code == 200
    assert Trajectory.objects.get(external_id=odd.hex()).messages == [{"role": "user", "content": "hi"}]
    assert Trajectory.objects.filter(external_id=good.hex()).exists()


def test_a_root_span_error_is_a_failure(client, project):
    trace = os.urandom(16)
    spans = openinference_agent(trace)
    spans[0].status.code = Status.STATUS_CODE_ERROR
    post_protobuf(client, export(spans))
    assert Trajectory.objects.get(project=project).outcome == "failure"


def rpc_status(response) -> RpcStatus:
    """The error body OTLP/HTTP asks for: a google.rpc.Status in the request's encoding."""
    if response["Content-Type"] == "application/x-protobuf":
        return RpcStatus.FromString(response.content)
    assert response["Content-Type"] == "application/json"
    return ParseDict(response.json(), RpcStatus())


def test_bad_payloads(client):
    response = client.post(URL, body=b"\xff\xff\xff", content_type="application/x-protobuf")
    assert response.status_code == 400
    status = rpc_status(response)
    assert response["Content-Type"] == "application/x-protobuf" and status.code == 3 and status.message
    response = client.post(URL, body="{nope", content_type="application/json")
    assert response.status_code == 400 and response["Content-Type"] == "application/json"
    assert rpc_status(response).code == 3 and "JSON" in rpc_status(response).message
    response = client.post(URL, body="x", content_type="text/plain")
    assert response.status_code == 415 and "application/x-protobuf" in rpc_status(response).message


def test_auth(api_client, project, make_api_key):
    body = export(openinference_agent(os.urandom(16))).SerializeToString()
    response = api_client.post(URL, body=body, content_type="application/x-protobuf")
    assert response.status_code == 401
    assert rpc_status(response).code == 16 and "Bearer" in rpc_status(response).message  # UNAUTHENTICATED
    read_only = make_api_key(project, scopes=["read"])
    response = api_client.post(URL, body=body, content_type="application/x-protobuf", key=read_only)
    assert response.status_code == 403 and rpc_status(response).code == 7  # PERMISSION_DENIED
    assert "scope" in rpc_status(response).message
    assert not Trajectory.objects.exists()


def test_errors_elsewhere_in_the_api_stay_json_detail(api_client):
    response = api_client.post("/api/v1/trajectories", body=b"{}", content_type="application/json")
    assert response.status_code == 401 and "detail" in response.json()


# --- values PostgreSQL cannot store as sent; caps; limits (issue 10) -----------------------------------------


def post_json(client, payload: dict[str, Any] | str):
    body = payload if isinstance(payload, str) else json.dumps(payload)
    response = client.post(URL, body=body, content_type="application/json")
    assert response["Content-Type"] == "application/json"
    return response


def unstorable_trace_json(trace: bytes) -> dict[str, Any]:
    """An OTLP/JSON export whose LLM span carries a lone surrogate in a message, non-finite doubles (as the
    protobuf JSON mapping spells them, and as bare JSON constants) and NaN inside a JSON-encoded tool schema."""
    payload = json.loads(as_otlp_json(export(openinference_agent(trace))))
    llm = payload["resourceSpans"][0]["scopeSpans"][0]["spans"][1]
    for kv in llm["attributes"]:
        if kv["key"] == "llm.input_messages.1.message.content":
            kv["value"] = {"stringValue": "Where is my order \ud800 1234?"}
        if kv["key"] == "llm.tools.0.tool.json_schema":
            schema = json.loads(kv["value"]["stringValue"])
            schema["function"]["parameters"]["minimum"] = float("nan")
            kv["value"] = {"stringValue": json.dumps(schema)}  # json.dumps writes NaN, as Python agents do
    llm["attributes"] += [
        {"key": "session.id", "value": {"doubleValue": "NaN"}},
        {"key": "gen_ai.conversation.id", "value": {"doubleValue": float("inf")}},
    ]
    return payload


def test_nan_and_lone_surrogates_in_otlp_json_are_stored_made_storable(client, project):
    """Before: json.dumps(allow_nan=False) or the UTF-8 encoder raised inside the batch's transaction, the
    export answered 500 and the good trace beside it was lost too."""
    bad, good = os.urandom(16), os.urandom(16)
    payload = unstorable_trace_json(bad)
    payload["resourceSpans"] += json.loads(as_otlp_json(export(genai_agent(good))))["resourceSpans"]
    response = post_json(client, json.dumps(payload))  # json.dumps keeps NaN / Infinity as bare constants
    assert response.status_code == 200, response.content
    answer = response.json()["partialSuccess"]
    assert "rejectedSpans" not in answer  # a warning: nothing was lost
    assert f"trace {bad.hex()}: 4 value(s)" in answer["errorMessage"]
    stored = Trajectory.objects.get(external_id=bad.hex())
    assert stored.messages[1]["content"] == "Where is my order \ufffd 1234?"
    assert stored.tools[0]["function"]["parameters"]["minimum"] == "NaN"
    assert stored.metadata["session.id"] == "NaN" and stored.metadata["gen_ai.conversation.id"] == "Infinity"
    assert [m["role"] for m in Trajectory.objects.get(external_id=good.hex()).messages] == EXPECTED_ROLES


def test_nan_in_otlp_protobuf_is_stored_as_a_string(client, project):
    trace = os.urandom(16)
    spans = openinference_agent(trace)
    spans[1].attributes.append(KeyValue(key="session.id", value=AnyValue(double_value=float("-inf"))))
    tool_schema = {"type": "function", "function": {"name": "refund", "parameters": {"max": float("nan")}}}
    spans[1].attributes.append(KeyValue(key="llm.tools.1.tool.json_schema", value=any_value(tool_schema)))
    response = post_protobuf(client, export(spans))
    assert response.status_code == 200, response.content
    warning = ExportTraceServiceResponse.FromString(response.content).partial_success
    assert warning.rejected_spans == 0 and "2 value(s)" in warning.error_message
    stored = Trajectory.objects.get(project=project)
    assert stored.metadata["session.id"] == "-Infinity"
    assert stored.tools[1]["function"]["parameters"] == {"max": "NaN"}


def tool_spans(trace: bytes, first: int, count: int) -> list[Span]:
    """`count` execute_tool spans (ids first, first + 1, ...) that carry only their own call: two messages each."""
    return [
        span(
            trace,
            sid,
            "execute_tool get_order",
            sid,
            sid + 1,
            {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "get_order",
                "gen_ai.tool.call.id": f"call_{sid}",
                "gen_ai.tool.call.arguments": '{"order_id": "1234"}',
                "gen_ai.tool.call.result": '{"status": "shipped"}',
            },
        )
        for sid in range(first, first + count)
    ]


def test_the_same_tool_result_for_two_calls_is_kept_for_each(client, project):
    """Before: the second call and its result (the same text, other ids) were taken for a re-send and lost."""
    trace = os.urandom(16)
    post_protobuf(client, export(tool_spans(trace, 2, 2)))
    t = Trajectory.objects.get(project=project)
    assert [(m["role"], m.get("tool_call_id")) for m in t.messages] == [
        ("assistant", None),
        ("tool", "call_2"),
        ("assistant", None),
        ("tool", "call_3"),
    ]
    assert [m["tool_calls"][0]["id"] for m in t.messages if m["role"] == "assistant"] == ["call_2", "call_3"]


@pytest.mark.parametrize("encoding", ["protobuf", "json"])
def test_a_trace_is_capped_in_messages_and_the_answer_says_so(client, project, settings, encoding):
    """Before: every export appended to the trace's conversation and to metadata.otlp.spans, without end."""
    settings.FLYWHEEL_OTLP_MAX_MESSAGES_PER_TRACE = 6
    trace = os.urandom(16)
    answer = post_as(client, export(tool_spans(trace, 2, 2)), encoding)  # 2 spans, 4 messages
    assert answer == {"status": 200}
    answer = post_as(client, export(tool_spans(trace, 4, 2)), encoding)  # 4 more messages: 2 fit
    assert "rejectedSpans" not in answer["partialSuccess"]  # a warning: the spans were merged
    assert answer["partialSuccess"]["errorMessage"] == (
        f"trace {trace.hex()}: it holds the limit of 6 messages (FLYWHEEL_OTLP_MAX_MESSAGES_PER_TRACE); "
        "2 message(s) dropped"
    )
    t = Trajectory.objects.get(project=project)
    assert t.message_count == 6 and t.metadata["otlp"]["truncated"] is True
    assert [m.get("tool_call_id") for m in t.messages if m["role"] == "tool"] == [
        "call_2",
        "call_3",
        "call_4",
    ]
    answer = post_as(client, export(tool_spans(trace, 6, 3)), encoding)  # full: nothing more is merged
    assert answer["partialSuccess"]["rejectedSpans"] == "3"
    assert (
        "limit of 6 messages (FLYWHEEL_OTLP_MAX_MESSAGES_PER_TRACE); 3 span(s) dropped"
        in (answer["partialSuccess"]["errorMessage"])
    )
    assert Trajectory.objects.get(project=project).updated_at == t.updated_at  # not even written


@pytest.mark.parametrize("encoding", ["protobuf", "json"])
def test_a_trace_is_capped_in_spans_and_the_answer_says_so(client, project, settings, encoding):
    settings.FLYWHEEL_OTLP_MAX_SPANS_PER_TRACE = 3
    trace = os.urandom(16)
    post_as(client, export(tool_spans(trace, 2, 2)), encoding)
    answer = post_as(client, export(tool_spans(trace, 4, 3)), encoding)  # 1 more span fits, 2 are dropped
    assert answer["partialSuccess"] == {
        "rejectedSpans": "2",
        "errorMessage": f"trace {trace.hex()}: it holds the limit of 3 spans "
        "(FLYWHEEL_OTLP_MAX_SPANS_PER_TRACE); 2 span(s) dropped",
    }
    t = Trajectory.objects.get(project=project)
    assert len(t.metadata["otlp"]["spans"]) == 3 and t.message_count == 6
    assert t.metadata["otlp"]["truncated"] is True


def test_spans_merged_into_a_stored_trace_are_validated_and_refused_alone(client, project):
    """Only the new messages are validated when a trace grows; an error names its index in the whole record,
    and the stored trajectory is left as it was."""
    trace, other = os.urandom(16), os.urandom(16)
    post_protobuf(client, export(tool_spans(trace, 2, 2)))  # 4 messages
    bad = {
        "gen_ai.operation.name": "chat",
        "gen_ai.input.messages": json.dumps([genai_parts("user", {"type": "text", "content": "and now?"})]),
        "gen_ai.output.messages": json.dumps(
            [genai_parts("tool", {"type": "tool_call_response", "response": "x"})]
        ),
    }
    response = post_protobuf(client, export([span(trace, 9, "chat", 10, 11, bad), *genai_agent(other)]))
    warning = ExportTraceServiceResponse.FromString(response.content).partial_success
    assert warning.rejected_spans == 1
    assert warning.error_message.startswith(
        f"trace {trace.hex()}: messages[5].tool_call_id: a tool message needs"
    )
    t = Trajectory.objects.get(external_id=trace.hex())
    assert t.message_count == 4 and "9".zfill(16) not in t.metadata["otlp"]["spans"]
    assert Trajectory.objects.filter(external_id=other.hex()).exists()


def test_a_stored_trace_grows_by_what_an_export_adds(client, project):
    """The append path keeps every derived column as a whole ingest would compute it."""
    trace = os.urandom(16)
    spans = openinference_agent(trace, tool_error=True)
    post_protobuf(client, export(spans[:2]))
    post_protobuf(client, export(spans[2:]))
    grown = Trajectory.objects.get(external_id=trace.hex())
    whole = os.urandom(16)
    post_protobuf(client, export(openinference_agent(whole, tool_error=True)))
    once = Trajectory.objects.get(external_id=whole.hex())
    for name in (
        "messages",
        "message_count",
        "tool_call_count",
        "has_tool_error",
        "title",
        "search_text",
        "usage",
        "latency_ms",
        "started_at",
        "model_version",
        "agent",
        "tools",
        "outcome",
    ):
        assert getattr(grown, name) == getattr(once, name), name


@pytest.mark.parametrize("encoding", ["protobuf", "json"])
def test_more_traces_than_the_batch_limit_is_413(client, project, settings, encoding):
    settings.FLYWHEEL_MAX_BATCH_RECORDS = 2
    request = export([*tool_spans(os.urandom(16), 2, 1), *tool_spans(os.urandom(16), 2, 1)])
    assert post_as(client, request, encoding)["status"] == 200
    request = export([s for _ in range(3) for s in tool_spans(os.urandom(16), 2, 1)])
    if encoding == "json":
        response = client.post(URL, body=as_otlp_json(request), content_type="application/json")
    else:
        response = post_protobuf(client, request)
    assert response.status_code == 413
    status = rpc_status(response)
    assert status.code == 8 and "3 traces; the limit is 2 (FLYWHEEL_MAX_BATCH_RECORDS)" in status.message
    assert Trajectory.objects.count() == 2


def test_a_span_that_does_not_decode_is_rejected_alone(client, project):
    """Before: one span with a wrong type or a bad id answered 400 and the whole export was lost."""
    bad, good = os.urandom(16), os.urandom(16)
    payload = json.loads(as_otlp_json(export(openinference_agent(bad) + genai_agent(good))))
    spans = payload["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans[1]["attributes"][0]["value"] = {"intValue": "not a number"}
    spans[2]["startTimeUnixNano"] = "-5"
    spans.append({"traceId": "not hex", "spanId": "zz"})
    response = post_json(client, payload)
    assert response.status_code == 200, response.content
    answer = response.json()["partialSuccess"]
    assert answer["rejectedSpans"] == "3"
    message = answer["errorMessage"]
    assert f"trace {bad.hex()}: resourceSpans[0].scopeSpans[0].spans[1]: invalid literal for int()" in message
    assert "spans[2]: startTimeUnixNano '-5' is not an unsigned 64-bit integer" in message
    assert "resourceSpans[0].scopeSpans[0].spans[8]: traceId 'not hex' is neither hex nor base64" in message
    assert [m["role"] for m in Trajectory.objects.get(external_id=good.hex()).messages] == EXPECTED_ROLES
    kept = Trajectory.objects.get(external_id=bad.hex())  # the rest of its trace: the second LLM call
    assert [m["role"] for m in kept.messages] == EXPECTED_ROLES


def test_invalid_utf8_in_protobuf_costs_that_string_not_the_export(client, project):
    """A lone surrogate travels in protobuf as invalid UTF-8, which protobuf refuses for the whole message.
    Before: 400, every trace of the export lost. Now the string gets U+FFFD and the rest is kept."""
    trace, good = os.urandom(16), os.urandom(16)
    spans = openinference_agent(trace)
    for kv in spans[1].attributes:
        if kv.key == "llm.input_messages.1.message.content":
            kv.value.string_value = "Where is my order MRK?"
    body = export(spans + genai_agent(good)).SerializeToString()
    body = body.replace(b"MRK", b"\xed\xa0\x80")  # as many bytes: the message stays well-formed
    response = client.post(URL, body=body, content_type="application/x-protobuf")
    assert response.status_code == 200, response.content
    warning = ExportTraceServiceResponse.FromString(response.content).partial_success
    assert warning.rejected_spans == 0
    assert warning.error_message.startswith(f"trace {trace.hex()}: 1 value(s) that cannot be stored as sent")
    stored = Trajectory.objects.get(external_id=trace.hex())
    assert stored.messages[1]["content"] == "Where is my order \ufffd\ufffd\ufffd?"
    assert [m["role"] for m in Trajectory.objects.get(external_id=good.hex()).messages] == EXPECTED_ROLES
