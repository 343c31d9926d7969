"""Property-based fuzzing of OTLP/JSON ingestion (hypothesis) through the real endpoint on PostgreSQL.

Generated exports mix spans of every convention the endpoint understands (OpenInference LLM and TOOL spans,
OTel GenAI `gen_ai.*.messages` and `execute_tool`, the indexed `gen_ai.prompt.N.*` form, plain spans) with
broken ones: wrong types, ids that are neither hex nor base64, times out of range, huge strings, deep
nesting, NaN and infinities (bare JSON constants and protobuf's "NaN" strings), lone surrogates, NUL and
other control characters. Invariant: never a 5xx; a 400 stores nothing; otherwise every trace is either
stored once and readable back through the API, or counted in partial_success; an export without broken
parts has nothing refused; replaying the export changes nothing.

The number of examples is FLYWHEEL_FUZZ_EXAMPLES (default 60, a few seconds); for a longer run:
    FLYWHEEL_FUZZ_EXAMPLES=2000 DATABASE_URL=postgres://... pytest -n 0 tests/platform/trajectories/test_otlp_fuzz.py \
        --hypothesis-show-statistics
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from flywheel.env import get_env
from flywheel.trajectories.models import Trajectory

URL = "/api/v1/otlp/v1/traces"
EXAMPLES = get_env("FLYWHEEL_FUZZ_EXAMPLES", 60, cast=int)
T0 = 1_764_000_000_000_000_000

NASTY = [
    "\ud800",  # a lone high surrogate
    "\udfff",
    "ok \ud83d",  # half of an emoji
    "\x00",
    "a\x00b",
    "\x1b[31mred\x1b[0m",
    "\u202eRTL override",
    "\ufeffBOM",
    "NaN",
    "<script>alert(1)</script>",
    "Error: the tool failed",
    '{"error": "boom"}',
    "",
    "   ",
]
texts = st.one_of(
    st.text(max_size=30),
    st.sampled_from(NASTY),
    st.builds(lambda a, b, c: a + b + c, st.text(max_size=8), st.sampled_from(NASTY), st.text(max_size=8)),
    st.integers(5_000, 120_000).map(lambda n: "y" * n),  # huge strings
)
floats = st.floats(allow_nan=True, allow_infinity=True)


def string(value: str) -> dict[str, Any]:
    return {"stringValue": value}


scalar_values = st.one_of(
    texts.map(string),
    st.integers(-(2**70), 2**70).map(lambda i: {"intValue": str(i)}),
    st.integers(-(2**63), 2**63 - 1).map(lambda i: {"intValue": i}),
    floats.map(lambda f: {"doubleValue": f}),  # json.dumps writes NaN and Infinity as bare constants
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999"]).map(lambda f: {"doubleValue": f}),
    st.booleans().map(lambda b: {"boolValue": b}),
    st.binary(max_size=16).map(lambda b: {"bytesValue": base64.b64encode(b).decode()}),
)
broken_values = st.sampled_from(
    [
        {"intValue": "not a number"},
        {"intValue": [1]},
        {"doubleValue": {"x": 1}},
        {"stringValue": 5},
        {"boolValue": "maybe"},
        {"kvlistValue": "not a list"},
        {"arrayValue": {"values": "abc"}},
        {"arrayValue": 7},
        "a bare string",
        None,
        [1, 2],
        {},
    ]
)


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = string("bottom")
    for _ in range(depth):
        value = {"arrayValue": {"values": [value]}}
    return value


def values_of(scalars: st.SearchStrategy) -> st.SearchStrategy:
    return st.recursive(
        scalars,
        lambda children: st.one_of(
            st.lists(children, max_size=3).map(lambda vs: {"arrayValue": {"values": vs}}),
            st.lists(st.tuples(texts, children), max_size=3).map(
                lambda kvs: {"kvlistValue": {"values": [{"key": k, "value": v} for k, v in kvs]}}
            ),
        ),
        max_leaves=6,
    )


good_values = values_of(scalar_values)
# One draw in five broken: a wrong type somewhere inside, or nesting deep enough to refuse the whole body.
bad_values = st.one_of(
    good_values, good_values, good_values, values_of(broken_values), st.integers(1, 400).map(nested)
)
good_roles = st.sampled_from(["system", "user", "assistant", "model", "human", "ai"])
bad_roles = st.sampled_from(["system", "user", "assistant", "tool", "function", "", "x", "ROBOT"])
tool_names = st.sampled_from(["get_order", "refund", "search"])
bad_tool_names = st.sampled_from(["get_order", "refund", "", "x" * 300])


class Kit:
    """The strategies one export draws from: all valid (`broken=False`: values PostgreSQL cannot store as
    sent, lone surrogates and NaN included, are still valid OTLP), or with broken parts mixed in."""

    def __init__(self, broken: bool) -> None:
        self.broken = broken
        self.values = bad_values if broken else good_values
        self.roles = bad_roles if broken else good_roles
        self.tool_names = bad_tool_names if broken else tool_names
        self.texts = st.one_of(texts.map(string), self.values) if broken else texts.map(string)
        good_times = st.integers(0, 10**12).map(lambda d: str(T0 + d)) | st.integers(0, 10**12).map(
            lambda d: T0 + d
        )
        self.times = (
            st.one_of(
                good_times, good_times, good_times, st.sampled_from(["-5", "abc", str(2**64), 1.5, [1]])
            )
            if broken
            else good_times
        )


@st.composite
def openinference_llm(draw: st.DrawFn, kit: Kit) -> dict[str, Any]:
    attrs: dict[str, Any] = {"openinference.span.kind": string("LLM")}
    for direction in ("input", "output"):
        for i in range(draw(st.integers(0 if kit.broken else 1, 4))):
            base = f"llm.{direction}_messages.{i}.message"
            role = draw(kit.roles)
            attrs[f"{base}.role"] = string(role)
            attrs[f"{base}.content"] = draw(kit.texts)
            if draw(st.booleans()) and (kit.broken or role in ("assistant", "model", "ai")):
                call = f"{base}.tool_calls.0.tool_call"
                attrs[f"{call}.id"] = string(draw(st.sampled_from(["call_1", "call_2", ""])))
                attrs[f"{call}.function.name"] = string(draw(kit.tool_names))
                attrs[f"{call}.function.arguments"] = draw(kit.texts)
            if kit.broken and draw(st.booleans()):
                attrs[f"{base}.tool_call_id"] = draw(st.one_of(st.just(string("call_1")), kit.values))
    if draw(st.booleans()):
        schema = {
            "type": "function",
            "function": {"name": draw(kit.tool_names), "parameters": {"m": draw(floats)}},
        }
        attrs["llm.tools.0.tool.json_schema"] = string(json.dumps(schema))  # NaN: json.dumps writes it
    attrs["llm.model_name"] = draw(kit.texts)
    attrs["llm.token_count.prompt"] = draw(kit.values)
    return attrs


@st.composite
def genai_llm(draw: st.DrawFn, kit: Kit) -> dict[str, Any]:
    def parts(role: str) -> list[dict[str, Any]]:
        kinds = ["text", "tool_call_response"]
        if kit.broken or role in ("assistant", "model", "ai"):  # the convention: only the model calls tools
            kinds.append("tool_call")
        kind = draw(st.sampled_from([*kinds, "weird"] if kit.broken else kinds))
        part: dict[str, Any] = {
            "type": kind,
            "content": draw(st.one_of(texts, floats) if kit.broken else texts),
        }
        if kind != "text":
            ids = ["call_1", "call_2", None] if kit.broken else ["call_1", "call_2"]
            part.update(id=draw(st.sampled_from(ids)), name=draw(kit.tool_names))
            part["arguments" if kind == "tool_call" else "response"] = {"v": draw(floats), "s": draw(texts)}
        return [part]

    messages = []
    for _ in range(draw(st.integers(0, 3))):
        role = draw(kit.roles)
        messages.append({"role": role, "parts": parts(role)})
    answer = [{"role": "assistant", "parts": parts("assistant")}]
    output = string(json.dumps(answer))
    return {
        "gen_ai.operation.name": string("chat"),
        "gen_ai.input.messages": string(json.dumps(messages)),  # may carry NaN: json.dumps writes it
        "gen_ai.output.messages": draw(st.one_of(st.just(output), kit.values)) if kit.broken else output,
        "gen_ai.system_instructions": draw(kit.texts),
        "gen_ai.usage.input_tokens": draw(kit.values),
        "gen_ai.agent.name": draw(kit.texts),
        "session.id": draw(kit.values),
    }


@st.composite
def indexed_genai_llm(draw: st.DrawFn, kit: Kit) -> dict[str, Any]:
    return {
        "gen_ai.prompt.0.role": string(draw(kit.roles)),
        "gen_ai.prompt.0.content": draw(kit.texts),
        "gen_ai.completion.0.role": string("assistant"),
        "gen_ai.completion.0.content": draw(kit.texts),
        "gen_ai.completion.0.tool_calls.0.name": string(draw(kit.tool_names)),
    }


@st.composite
def tool_span(draw: st.DrawFn, kit: Kit) -> dict[str, Any]:
    if draw(st.booleans()):
        return {
            "gen_ai.operation.name": string("execute_tool"),
            "gen_ai.tool.name": string(draw(kit.tool_names)),
            "gen_ai.tool.call.id": draw(st.sampled_from(["call_1", "call_2"]).map(string)),
            "gen_ai.tool.call.arguments": draw(kit.values),
            "gen_ai.tool.call.result": draw(kit.texts),
        }
    return {
        "openinference.span.kind": string("TOOL"),
        "tool.name": string(draw(kit.tool_names)),
        "input.value": draw(kit.values),
        "output.value": draw(kit.texts),
    }


def span_attributes(kit: Kit) -> st.SearchStrategy:
    return st.one_of(
        openinference_llm(kit),
        genai_llm(kit),
        indexed_genai_llm(kit),
        tool_span(kit),
        st.just({"http.method": string("GET")}),  # not an LLM or tool span
        st.dictionaries(texts, kit.values, max_size=4),  # anything
    )


@st.composite
def spans(draw: st.DrawFn, trace_id: str, kit: Kit) -> dict[str, Any]:
    attrs = draw(span_attributes(kit))
    span: dict[str, Any] = {
        "traceId": trace_id,
        "spanId": draw(st.binary(min_size=8, max_size=8)).hex(),
        "name": draw(st.one_of(texts, st.integers()) if kit.broken else texts),
        "startTimeUnixNano": draw(kit.times),
        "endTimeUnixNano": draw(kit.times),
        "attributes": [{"key": k, "value": v} for k, v in attrs.items()],
    }
    if draw(st.booleans()):
        span["parentSpanId"] = draw(st.binary(min_size=8, max_size=8)).hex()
    if draw(st.booleans()):
        statuses = [{"code": 2, "message": "boom"}, {"code": "STATUS_CODE_ERROR"}, {"code": 1}]
        span["status"] = draw(st.sampled_from(statuses + ([{"code": "x"}, "x"] if kit.broken else [])))
    if kit.broken and draw(st.integers(0, 4)) == 0:  # now and then an id that is neither hex nor base64
        span[draw(st.sampled_from(["traceId", "spanId"]))] = draw(st.sampled_from(["not hex!", 5, "zz"]))
    return span


@st.composite
def exports(draw: st.DrawFn) -> tuple[dict[str, Any], list[str], bool]:
    kit = Kit(broken=draw(st.booleans()))
    event("broken parts" if kit.broken else "valid OTLP (NaN and lone surrogates included)")
    trace_ids = draw(
        st.lists(st.binary(min_size=16, max_size=16).map(bytes.hex), min_size=1, max_size=3, unique=True)
    )
    all_spans = [draw(spans(trace_id, kit)) for trace_id in trace_ids for _ in range(draw(st.integers(1, 3)))]
    all_spans = draw(st.permutations(all_spans))
    trace_ids = [t for t in trace_ids if any(s["traceId"] == t for s in all_spans)]  # some ids were broken
    resource = [{"key": "service.name", "value": draw(kit.texts)}]
    payload = {
        "resourceSpans": [{"resource": {"attributes": resource}, "scopeSpans": [{"spans": all_spans}]}]
    }
    return payload, trace_ids, kit.broken


@pytest.fixture
def fuzz_client(api_client, api_key, needs_postgres, settings):
    settings.FLYWHEEL_API_RATE_PER_S = 0  # per-key rate limiting off: the fuzzer sends many requests
    return api_client.with_key(api_key)


def post(client: Any, body: str) -> Any:
    response = client.post(URL, body=body, content_type="application/json")
    assert response.status_code < 500, response.content[:2000]
    assert response["Content-Type"] == "application/json"
    return response


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(export=exports())
def test_otlp_json_never_5xx_and_every_trace_is_stored_once_or_counted(fuzz_client, project, export):
    payload, trace_ids, broken = export
    Trajectory.objects.all().delete()  # each example on its own: one test transaction holds them all
    body = json.dumps(
        payload
    )  # allow_nan: NaN and Infinity as bare constants, as Python exporters write them
    response = post(fuzz_client, body)
    event(f"answer {response.status_code}")  # the distribution shows in --hypothesis-show-statistics
    if response.status_code != 200:
        assert response.status_code == 400, response.content[:2000]
        status = response.json()
        assert status["code"] == 3 and status["message"]
        assert not Trajectory.objects.exists()  # the export was refused whole
        return
    answer = response.json().get("partialSuccess", {})
    message = answer.get("errorMessage", "")
    skipped = int(m.group(1)) if (m := re.search(r"(\d+) trace\(s\) had no LLM or tool span", message)) else 0
    more = re.search(r"and \d+ more", message) is not None
    stored = {}
    unaccounted = 0
    for trace_id in trace_ids:
        listing = fuzz_client.get("/api/v1/trajectories", {"external_id": trace_id})
        assert listing.status_code == 200
        items = listing.json()["items"]
        assert len(items) <= 1
        if items:
            detail = fuzz_client.get(f"/api/v1/trajectories/{items[0]['id']}")
            assert detail.status_code == 200, detail.content[:2000]
            assert detail.json()["source"] == "otlp" and detail.json()["messages"]
            stored[trace_id] = detail.json()["messages"]
            event("a trace stored")
        elif f"trace {trace_id}" not in message:
            unaccounted += 1
            event("a trace skipped (no LLM or tool span)")
        else:
            event("a trace refused, named in partial_success")
    if answer.get("rejectedSpans"):
        event("spans rejected")
        assert broken, message  # valid OTLP is stored (made storable where it must be), never refused
    assert unaccounted <= skipped or more, (message, trace_ids)
    assert Trajectory.objects.count() == len(stored)

    # A replay of the same export stores nothing twice and changes no conversation.
    replay = post(fuzz_client, body)
    assert replay.status_code == 200
    assert Trajectory.objects.count() == len(stored)
    for trace_id, messages in stored.items():
        assert Trajectory.objects.get(external_id=trace_id).messages == messages
