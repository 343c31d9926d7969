"""Property-based fuzzing of REST ingestion (hypothesis), through the real endpoint and database.

Batches of generated trajectories, valid ones mixed with ones broken in one place each (wrong types, huge
strings, deep nesting, NaN and Infinity, lone surrogates, NUL and other control characters, unknown or
missing fields, duplicate ids, records that are not objects), are POSTed as a JSON array or object, as
NDJSON (with blank and unparsable lines) and gzipped. The invariant, for every batch: no 5xx; every valid
record is stored exactly once and reads back equal through GET /api/v1/trajectories/{id} (for an id sent
twice, the last record); every broken one is named in `rejected` with its index and the field broken.

A short run is part of the suite. A longer one: FLYWHEEL_FUZZ_EXAMPLES=2000 (examples per test), e.g.
`FLYWHEEL_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest -n 0 tests/platform/trajectories/test_ingest_fuzz.py
--hypothesis-show-statistics`."""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from django.conf import settings as django_settings
from hypothesis import HealthCheck, Phase, assume, event, given, note
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from flywheel.trajectories.models import Trajectory

URL = "/api/v1/trajectories"
MAX_INT32 = 2**31 - 1
EXAMPLES = int(os.environ.get("FLYWHEEL_FUZZ_EXAMPLES") or 50)

# Each example posts one batch and reads back what it stored; the state is reset per example (below), not
# per test, because pytest-django's transaction wraps the whole test, every example included.
FUZZ = hypothesis_settings(
    max_examples=EXAMPLES,
    deadline=None,  # a request on a loaded machine may take long; speed is bench/'s business
    database=None,  # no .hypothesis/ folder in the working tree; a failure prints its example and a blob
    print_blob=True,
    phases=(Phase.explicit, Phase.generate, Phase.shrink),  # no "explain" phase: it reruns the test a lot
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,  # the client and project are shared by the examples, on purpose
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)

# --- valid trajectories ------------------------------------------------------------------------------------

# Characters agents really send and parsers get wrong: NUL (stored as U+FFFD), escapes, line and paragraph
# separators, a BOM, right-to-left override, astral emoji.
SPECIAL_CHARACTERS = ["\x00", "\x1b", "\x7f", "\n", "\r", "\t", "\\", '"', "\u2028", "\u2029", "\ufeff",
                      "\u202e", "\ufffd", "\U0001f600", "é"]  # fmt: skip
# Any valid Unicode: codec="utf-8" leaves out lone surrogates, which are tested as broken records.
texts = st.text(alphabet=st.one_of(st.characters(codec="utf-8"), st.sampled_from(SPECIAL_CHARACTERS)), max_size=30)
names = st.text(min_size=1, max_size=30)
keys = st.text(max_size=12)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),  # beyond 64 bits: jsonb numbers are decimals
    st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**300, -(10**4299)]),  # Python reads at most 4300 digits
    st.floats(allow_nan=False, allow_infinity=False),  # subnormals, -0.0 and 1.8e308 included
    texts,
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=4),
    max_leaves=8,
)
json_objects = st.dictionaries(keys, json_values, max_size=4)
# Huge but cheap to generate: a short text repeated, up to 60k characters.
huge_texts = st.builds(lambda s, n: s * n, st.text(min_size=1, max_size=3), st.integers(1_000, 20_000))
contents = st.one_of(texts, texts, texts, huge_texts)
content_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": contents}), min_size=1, max_size=3)
# Keys the contract leaves to the agent (kept as sent): never one of the message's own fields.
extra_keys = st.dictionaries(st.sampled_from(["x_score", "x_meta", "cache_control"]), json_values, max_size=2)

tool_calls = st.lists(
    st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": names, "arguments": texts | json_objects})},
        optional={"id": texts},
    ),
    min_size=1,
    max_size=2,
)


def _message(fixed: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(lambda m, extra: {**extra, **m}, st.fixed_dictionaries(fixed), extra_keys)


messages = st.one_of(
    _message({"role": st.sampled_from(["system", "developer", "user"]), "content": contents | content_parts}),
    _message({"role": st.just("assistant"), "content": contents}),
    _message({"role": st.just("assistant"), "content": st.none() | texts, "tool_calls": tool_calls}),
    _message({"role": st.just("tool"), "tool_call_id": names, "content": contents}),
)
tools = st.lists(
    st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries(
            {"name": names}, optional={"description": texts, "parameters": json_objects})}
    ),
    max_size=2,
)  # fmt: skip
offsets = st.sampled_from([UTC, timezone(timedelta(hours=5, minutes=30)), timezone(timedelta(hours=-8)), None])
started_ats = st.builds(
    lambda moment, tz: (moment.replace(tzinfo=tz) if tz else moment).isoformat(),
    st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30)),
    offsets,
)
OPTIONAL_FIELDS = {
    "agent": texts,
    "model_version": texts,
    "tools": tools,
    "outcome": st.sampled_from(["success", "failure", "unknown"]),
    "feedback": json_values,
    "human_intervention": json_values,
    "latency_ms": st.none() | st.integers(0, MAX_INT32),
    "usage": st.none() | json_objects,
    "metadata": json_objects,
    "started_at": st.none() | started_ats,
}


def valid_records(ids: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {"external_id": ids, "messages": st.lists(messages, min_size=1, max_size=5)}, optional=OPTIONAL_FIELDS
    )


# External ids come from a small pool per batch, so that an id often appears twice (the last one wins).
# NUL is the one character an id may not hold (tested as a broken record).
id_pools = st.lists(
    st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=20)
    | st.integers(0, 10**12),  # a number is taken as its decimal string
    min_size=1,
    max_size=4,
    unique_by=str,
)

# --- broken trajectories: a valid one broken in one place, and the field the answer must name -------------

BAD_NUMBERS = st.sampled_from([float("nan"), float("inf"), float("-inf")])
SURROGATES = st.characters(categories=["Cs"])


def _surrogate_path(key: str) -> str:
    """How a field path shows a key with lone surrogates: escaped, as JSON would write them."""
    return "".join(f"\\u{ord(c):04x}" if 0xD800 <= ord(c) <= 0xDFFF else c for c in key)


def _nested(depth: int, leaf: Any) -> Any:
    value = leaf
    for _ in range(depth):
        value = {"a": value}
    return value


@st.composite
def broken_records(draw: st.DrawFn, ids: st.SearchStrategy[Any]) -> tuple[Any, str]:
    record = draw(valid_records(ids))
    n = len(record["messages"])
    i = draw(st.integers(0, n - 1))
    kind = draw(
        st.sampled_from(
            ["nan", "surrogate", "deep", "huge", "wrong_type", "missing", "unknown_field", "contract",
             "started_at_range", "not_object", "nul_in_id"]
        )
    )  # fmt: skip
    event(f"broken record: {kind}")
    key = draw(st.text(alphabet="abcxyz_", min_size=1, max_size=6))
    if kind == "nan":
        bad = draw(BAD_NUMBERS)
        place = draw(st.sampled_from(["metadata", "feedback", "usage", "human_intervention", "message", "arguments"]))
        if place in ("metadata", "usage", "feedback"):
            record[place] = {**(record.get(place) or {}), key: bad} if place != "feedback" else {key: bad}
            return record, f"{place}.{key}"
        if place == "human_intervention":
            record[place] = [1, "two", bad]
            return record, "human_intervention[2]"
        if place == "message":
            record["messages"][i]["x_score"] = bad
            return record, f"messages[{i}].x_score"
        record["messages"][i] = {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": {key: [bad]}}}]}  # fmt: skip
        return record, f"messages[{i}].tool_calls[0].function.arguments.{key}[0]"
    if kind == "surrogate":
        lone = draw(SURROGATES)
        place = draw(st.sampled_from(["content", "part", "external_id", "agent", "key", "tool_call_id"]))
        if place == "content":
            record["messages"][i] = {"role": "user", "content": f"before {lone} after"}
            return record, f"messages[{i}].content"
        if place == "part":
            record["messages"][i] = {"role": "user", "content": [{"type": "text", "text": lone}]}
            return record, f"messages[{i}].content[0].text"
        if place in ("external_id", "agent"):
            record[place] = f"id-{lone}"
            return record, place
        if place == "key":
            record["metadata"] = {key + lone: 1}
            return record, f"metadata.{_surrogate_path(key + lone)}"
        record["messages"][i] = {"role": "tool", "tool_call_id": f"call-{lone}", "content": "ok"}
        return record, f"messages[{i}].tool_call_id"
    if kind == "deep":
        depth = draw(st.integers(65, 400))
        if draw(st.booleans()):
            record["metadata"] = _nested(depth, draw(scalars))
            return record, "metadata"
        record["human_intervention"] = json.loads("[" * depth + "1" + "]" * depth)
        return record, "human_intervention"
    if kind == "huge":
        place = draw(st.sampled_from(["external_id", "agent", "model_version", "tool_name"]))
        size = draw(st.integers(256, 5_000))
        if place == "tool_name":
            record["tools"] = [{"type": "function", "function": {"name": "n" * size}}]
            return record, "tools[0].function.name"
        record[place] = "x" * size
        return record, place
    if kind == "wrong_type":
        field, value = draw(
            st.sampled_from(
                [("external_id", []), ("external_id", {"a": 1}), ("external_id", True), ("messages", "hi"),
                 ("messages", {}), ("messages", []), ("messages", [1]), ("outcome", 3), ("outcome", "great"),
                 ("latency_ms", "slow"), ("latency_ms", -5), ("latency_ms", 2**40), ("latency_ms", 1.5),
                 ("metadata", []), ("metadata", "x"), ("usage", [1]), ("tools", {}), ("tools", [1]),
                 ("started_at", "yesterday"), ("started_at", []), ("agent", []), ("role", "robot"),
                 ("content", 42)]
            )
        )  # fmt: skip
        if field in ("role", "content"):
            record["messages"][i] = {"role": "user", "content": "hi", field: value}
            return record, f"messages[{i}].{field}"
        record[field] = value
        return record, field
    if kind == "missing":
        field = draw(st.sampled_from(["external_id", "messages"]))
        del record[field]
        return record, field
    if kind == "unknown_field":
        record["x_" + key] = 1
        return record, "x_" + key
    if kind == "contract":
        case = draw(st.sampled_from(["tool_without_id", "user_without_content", "user_with_tool_calls"]))
        if case == "tool_without_id":
            record["messages"][i] = {"role": "tool", "content": "ok"}
            return record, f"messages[{i}].tool_call_id"
        if case == "user_without_content":
            record["messages"][i] = {"role": "user", "content": None}
            return record, f"messages[{i}].content"
        record["messages"][i] = {"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "f"}}]}
        return record, f"messages[{i}].tool_calls"
    if kind == "started_at_range":
        # Valid ISO times that fall outside the years 1 to 9999 once in UTC.
        record["started_at"] = draw(st.sampled_from(["0001-01-01T00:00:00+01:00", "9999-12-31T23:30:00-01:00"]))
        return record, "started_at"
    if kind == "not_object":
        return draw(st.sampled_from([None, 7, "a trajectory", [record]])), ""
    record["external_id"] = draw(st.sampled_from(["\x00", "a\x00b"]))  # nul_in_id
    return record, "external_id"


@dataclass
class Item:
    record: Any
    broken_field: str | None  # None: valid; else the field the rejection must name ("" for the record)


@st.composite
def batches(draw: st.DrawFn, max_size: int = 8) -> list[Item]:
    """A mixed batch: valid and broken records, their ids from one small pool so that ids repeat."""
    pool = draw(id_pools)
    ids = st.sampled_from(pool)
    items = []
    for _ in range(draw(st.integers(1, max_size))):
        if draw(st.integers(0, 3)) == 0:
            record, field = draw(broken_records(ids))
            items.append(Item(record, field))
        else:
            items.append(Item(draw(valid_records(ids)), None))
    valid = [str(item.record["external_id"]) for item in items if item.broken_field is None]
    event(f"batch: {'all valid' if len(valid) == len(items) else 'mixed' if valid else 'none valid'}")
    if len(set(valid)) < len(valid):
        event("batch: an id sent twice")
    return items


# --- the invariant -----------------------------------------------------------------------------------------


def _dumps(record: Any, ascii_only: bool) -> str:
    """JSON as a client writes it: Python's writer emits NaN and Infinity literals and escapes a lone
    surrogate as \\ud800 (only ASCII output can carry one)."""
    if not ascii_only:
        try:
            text = json.dumps(record, ensure_ascii=False)
            text.encode("utf-8")
            return text
        except UnicodeEncodeError:
            pass
    return json.dumps(record)


def _nul_replaced(value: Any) -> Any:
    """What the database keeps of a value: U+0000 becomes U+FFFD (PostgreSQL cannot store it)."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, list):
        return [_nul_replaced(v) for v in value]
    if isinstance(value, dict):
        return {_nul_replaced(k): _nul_replaced(v) for k, v in value.items()}
    return value


def _same_json(sent: Any, stored: Any) -> bool:
    """Equal as JSON. jsonb keeps numbers as decimals: 1e23 comes back as the integer 10**23, -0.0 as 0."""
    if isinstance(sent, bool) or isinstance(stored, bool):
        return sent is stored
    if isinstance(sent, int | float) and isinstance(stored, int | float):
        if isinstance(sent, float) or isinstance(stored, float):
            return float(sent) == float(stored)
        return sent == stored
    if isinstance(sent, list) and isinstance(stored, list):
        return len(sent) == len(stored) and all(_same_json(a, b) for a, b in zip(sent, stored, strict=True))
    if isinstance(sent, dict) and isinstance(stored, dict):
        return sent.keys() == stored.keys() and all(_same_json(sent[k], stored[k]) for k in sent)
    return type(sent) is type(stored) and sent == stored


def _expected(record: dict[str, Any]) -> dict[str, Any]:
    """What GET /trajectories/{id} must answer for a valid record: as sent, defaults filled in."""
    started_at = record.get("started_at")
    if started_at is not None:
        started_at = datetime.fromisoformat(started_at)
        started_at = started_at if started_at.tzinfo else started_at.replace(tzinfo=UTC)
    return {
        "external_id": str(record["external_id"]),
        "agent": _nul_replaced(record.get("agent", "")),
        "model_version": _nul_replaced(record.get("model_version", "")),
        "messages": _nul_replaced(record["messages"]),
        "tools": _nul_replaced(record.get("tools") or []),
        "outcome": record.get("outcome", "unknown"),
        "feedback": _nul_replaced(record.get("feedback")),
        "human_intervention": _nul_replaced(record.get("human_intervention")),
        "latency_ms": record.get("latency_ms"),
        "usage": _nul_replaced(record.get("usage")),
        "metadata": _nul_replaced(record.get("metadata") or {}),
        "started_at": started_at,
    }


def check_answer(client: Any, project: Any, items: list[Item], indexes: list[int], response: Any) -> None:
    """The invariant: no 5xx, every broken record rejected naming its field, every valid one stored once
    (the last of an id) and read back equal."""
    assert response.status_code < 500, response.content[:2000]
    answer = response.json()
    valid = [(index, item.record) for index, item in zip(indexes, items, strict=True) if item.broken_field is None]
    assert response.status_code == (422 if not valid else 200), answer

    rejected = {r["index"]: r for r in answer["rejected"]}
    broken = {index: item.broken_field for index, item in zip(indexes, items, strict=True) if item.broken_field is not None}
    assert rejected.keys() == broken.keys(), answer["rejected"]
    for index, field in broken.items():
        fields = [error["field"] for error in rejected[index]["errors"]]
        assert any(f == field or f.startswith((field + ".", field + "[")) for f in fields) or (
            field == "" and fields == [""]
        ), (index, field, rejected[index])
        assert all(error["message"] for error in rejected[index]["errors"])

    last: dict[str, dict[str, Any]] = {}
    for _, record in valid:
        last[str(record["external_id"])] = record  # a later record of the same id replaces it
    assert answer["accepted"] == len(valid)
    assert answer["created"] == len(last)  # each example starts from an empty project
    assert answer["updated"] == len(valid) - len(last)

    stored = dict(Trajectory.objects.filter(project=project).values_list("external_id", "pk"))
    assert stored.keys() == last.keys()
    for external_id, pk in stored.items():
        detail = client.get(f"{URL}/{pk}")
        assert detail.status_code == 200, detail.content[:2000]
        got = detail.json()
        for field, want in _expected(last[external_id]).items():
            if field == "started_at":
                if want is not None:
                    # Django's JSON encoder writes milliseconds; the database keeps microseconds.
                    assert Trajectory.objects.get(pk=pk).started_at == want
                    assert datetime.fromisoformat(got["started_at"]) == want.replace(
                        microsecond=want.microsecond // 1000 * 1000
                    )
            else:
                assert _same_json(want, got[field]), (external_id, field, want, got[field])


# --- the tests ---------------------------------------------------------------------------------------------


@pytest.fixture
def client(api_client, api_key, settings):
    settings.FLYWHEEL_API_RATE_PER_S = 0  # the per-key rate limit is not what this fuzzes
    return api_client.with_key(api_key)


def _fresh(project: Any) -> None:
    # Examples share the test's transaction: start each from an empty project.
    Trajectory.objects.filter(project=project).delete()


@pytest.mark.django_db
@FUZZ
@given(items=batches(), single=st.booleans(), ascii_only=st.booleans())
def test_fuzz_json_bodies(client, project, items, single, ascii_only):
    _fresh(project)
    if single and len(items) == 1 and isinstance(items[0].record, dict):
        event("body: one object")
        body = _dumps(items[0].record, ascii_only)
    else:
        event("body: array")
        body = "[" + ",".join(_dumps(item.record, ascii_only) for item in items) + "]"
    note(body[:5000])
    assume(len(body.encode("utf-8")) <= django_settings.FLYWHEEL_MAX_REQUEST_BYTES)  # 413: test_api's
    response = client.post(URL, body=body.encode("utf-8"), content_type="application/json")
    check_answer(client, project, items, list(range(len(items))), response)


# Lines that are not a trajectory at all: rejected alone, by their line, with the record's field ("").
BAD_LINES = st.sampled_from(
    ["{broken", "[1, 2", '{"a": ' + "1" * 5_000 + "}", "[" * 5_000 + "]" * 5_000, "null", '"text"', "\udcff"]
)


@st.composite
def ndjson_bodies(draw: st.DrawFn) -> tuple[bytes, list[Item], list[int]]:
    """(body, items, line of each item), with blank lines between records and unparsable lines among them."""
    items = draw(batches())
    ascii_only = draw(st.booleans())
    lines: list[str] = []
    placed: list[Item] = []
    indexes: list[int] = []
    for item in items:
        for _ in range(draw(st.integers(0, 1))):
            lines.append(draw(st.sampled_from(["", "   ", "\t"])))
        if draw(st.integers(0, 5)) == 0:
            indexes.append(len(lines))
            placed.append(Item(None, ""))
            line = draw(BAD_LINES)
            event("ndjson: unparsable line")
            lines.append(line)
        indexes.append(len(lines))
        placed.append(item)
        lines.append(_dumps(item.record, ascii_only))
    body = ("\n".join(lines) + draw(st.sampled_from(["", "\n"]))).encode("utf-8", "surrogatepass")
    if draw(st.booleans()):
        body = b"\xef\xbb\xbf" + body  # a byte order mark, as some editors write
    return body, placed, indexes


@pytest.mark.django_db
@FUZZ
@given(data=ndjson_bodies())
def test_fuzz_ndjson_bodies(client, project, data):
    _fresh(project)
    body, items, indexes = data
    note(body[:5000].decode("utf-8", "replace"))
    assume(len(body) <= django_settings.FLYWHEEL_MAX_REQUEST_BYTES)
    response = client.post(URL, body=body, content_type="application/x-ndjson")
    check_answer(client, project, items, indexes, response)


@pytest.mark.django_db
@FUZZ
@given(data=st.data(), ndjson=st.booleans(), level=st.integers(1, 9))
def test_fuzz_gzip_bodies(client, project, data, ndjson, level):
    _fresh(project)
    if ndjson:
        event("body: gzip NDJSON")
        body, items, indexes = data.draw(ndjson_bodies())
        content_type = "application/x-ndjson"
    else:
        event("body: gzip JSON array")
        items = data.draw(batches())
        body = json.dumps([item.record for item in items]).encode()
        indexes = list(range(len(items)))
        content_type = "application/json"
    assume(len(body) <= django_settings.FLYWHEEL_MAX_REQUEST_BYTES)
    response = client.post(
        URL, body=gzip.compress(body, compresslevel=level), content_type=content_type,
        headers={"Content-Encoding": "gzip"},
    )  # fmt: skip
    check_answer(client, project, items, indexes, response)
