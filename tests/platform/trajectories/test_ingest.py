"""The ingest service: per-record fates, field paths in errors, upserts, derived fields, and concurrency."""

from __future__ import annotations

import json
import threading

import pytest
from django.db import connection

from flywheel.trajectories import selectors
from flywheel.trajectories.ingest import SEARCH_TEXT_MAX, ingest_trajectories, jsonl_records
from flywheel.trajectories.models import Comment, Tag, Trajectory
from flywheel.trajectories.schemas import MAX_ERRORS_PER_RECORD, MAX_JSON_DEPTH, UnparsableRecord


@pytest.mark.django_db
def test_valid_records_are_stored_and_invalid_ones_named(project, make_record):
    bad = make_record("t-bad")
    bad["messages"][2]["tool_calls"][0]["function"]["name"] = ""
    records = [make_record("t-1"), bad, make_record("t-2")]

    result = ingest_trajectories(project=project, records=records)

    assert (result.accepted, result.created, result.updated) == (2, 2, 0)
    assert len(result.rejected) == 1
    rejected = result.rejected[0]
    assert rejected["index"] == 1
    assert rejected["external_id"] == "t-bad"
    assert rejected["errors"][0]["field"] == "messages[2].tool_calls[0].function.name"
    assert set(Trajectory.objects.filter(project=project).values_list("external_id", flat=True)) == {
        "t-1",
        "t-2",
    }


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda r: r.pop("external_id"), "external_id"),
        (lambda r: r.update(outcome="great"), "outcome"),
        (lambda r: r.update(messages=[]), "messages"),
        (lambda r: r["messages"][1].update(role="robot"), "messages[1].role"),
        (lambda r: r["messages"][1].update(content=42), "messages[1].content"),
        (lambda r: r["messages"][3].pop("tool_call_id"), "messages[3].tool_call_id"),
        (
            lambda r: r["messages"][1].update(tool_calls=[{"function": {"name": "x"}}]),
            "messages[1].tool_calls",
        ),
        (lambda r: r["tools"][0]["function"].pop("name"), "tools[0].function.name"),
        (lambda r: r.update(latency_ms=-1), "latency_ms"),
        (lambda r: r.update(started_at="yesterday"), "started_at"),
        (lambda r: r.update(outcom="success"), "outcom"),
        (lambda r: r.update(external_id="x" * 256), "external_id"),
    ],
)
def test_errors_name_the_field_path(project, change, field, make_record):
    record = make_record("t-1")
    change(record)
    result = ingest_trajectories(project=project, records=[record])
    assert result.accepted == 0
    fields = [e["field"] for e in result.rejected[0]["errors"]]
    assert field in fields, fields
    assert all(e["message"] for e in result.rejected[0]["errors"])


@pytest.mark.django_db
def test_a_record_that_is_not_an_object_is_rejected_alone(project, make_record):
    result = ingest_trajectories(project=project, records=["nope", make_record("t-1")])
    assert result.accepted == 1
    assert result.rejected == [
        {
            "index": 0,
            "external_id": None,
            "errors": [{"field": "", "message": result.rejected[0]["errors"][0]["message"]}],
        }
    ]


@pytest.mark.django_db
def test_invalid_json_in_tool_arguments_is_kept_not_rejected(project, make_record):
    # A malformed tool call is exactly the failure reviewers need to see.
    record = make_record("t-1")
    record["messages"][2]["tool_calls"][0]["function"]["arguments"] = '{"order_id": '
    result = ingest_trajectories(project=project, records=[record])
    assert result.accepted == 1
    stored = Trajectory.objects.get(project=project, external_id="t-1")
    assert stored.messages[2]["tool_calls"][0]["function"]["arguments"] == '{"order_id": '


@pytest.mark.django_db
def test_derived_fields(project, make_record):
    record = make_record("t-1")
    record["messages"][1]["content"] = "  Where   is my ORDER 1234?  " + "x" * 300
    record["messages"][3]["content"] = "Error: order service timed out"
    ingest_trajectories(project=project, records=[record])
    t = Trajectory.objects.get(project=project, external_id="t-1")
    assert t.message_count == 5
    assert t.tool_call_count == 1
    assert t.has_tool_error is True
    assert t.title.startswith("Where is my ORDER 1234? xxx")
    assert len(t.title) == 200
    assert "where   is my order 1234?" in t.search_text
    assert "get_order" in t.search_text
    assert t.search_text == t.search_text.lower()
    assert t.started_at.isoformat() == "2026-12-01T10:00:00+00:00"
    assert t.source == "api"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("tool_message", "metadata", "expected"),
    [
        ({"content": '{"status": "shipped"}'}, {}, False),
        ({"content": '{"error": "not found"}'}, {}, True),
        ({"content": "Traceback (most recent call last): ..."}, {}, True),
        ({"content": "All good", "is_error": True}, {}, True),
        ({"content": [{"type": "text", "text": "ERROR 500"}]}, {}, True),
        ({"content": "ok"}, {"has_tool_error": True}, True),
    ],
)
def test_tool_error_detection(project, tool_message, metadata, expected, make_record):
    record = make_record("t-1", metadata=metadata)
    record["messages"][3] = {"role": "tool", "tool_call_id": "call_1", **tool_message}
    ingest_trajectories(project=project, records=[record])
    assert Trajectory.objects.get(external_id="t-1").has_tool_error is expected


@pytest.mark.django_db
def test_search_text_is_capped(project, make_record):
    record = make_record("t-1")
    record["messages"][1]["content"] = "a" * 100_000
    ingest_trajectories(project=project, records=[record])
    assert len(Trajectory.objects.get(external_id="t-1").search_text) == SEARCH_TEXT_MAX


@pytest.mark.django_db
def test_the_conversation_after_a_huge_tool_result_stays_searchable(project, make_record):
    record = make_record("t-1")
    record["messages"][3]["content"] = "row " * 50_000  # a tool dumped a whole table
    record["messages"][4]["content"] = "Your order has SHIPPED via the Zephyr courier."
    ingest_trajectories(project=project, records=[record])

    text = Trajectory.objects.get(external_id="t-1").search_text
    assert len(text) == SEARCH_TEXT_MAX
    assert "where is my order 1234?" in text
    assert 'get_order {"order_id": "1234"}' in text
    assert "shipped via the zephyr courier" in text
    assert "row row row" in text  # the tool result fills what room is left
    found = selectors.trajectory_queryset(project=project, filters=selectors.TrajectoryFilters(q="Zephyr courier"))
    assert list(found.values_list("external_id", flat=True)) == ["t-1"]


@pytest.mark.django_db
def test_nul_characters_do_not_break_the_batch(project, make_record):
    record = make_record("t-1")
    record["messages"][1]["content"] = "bad \x00 byte"
    record["metadata"] = {"note": "also \x00 here"}
    result = ingest_trajectories(project=project, records=[record, make_record("t-2")])
    assert result.accepted == 2
    t = Trajectory.objects.get(external_id="t-1")
    assert "\x00" not in t.messages[1]["content"]
    assert "bad" in t.messages[1]["content"]


@pytest.mark.django_db
def test_replay_updates_and_keeps_the_review(project, user, make_record):
    ingest_trajectories(project=project, records=[make_record("t-1", outcome="unknown")])
    t = Trajectory.objects.get(project=project, external_id="t-1")
    t.reviewed_outcome = "failure"
    t.reviewed_by = user
    t.save()
    tag = Tag.objects.create(project=project, name="wrong-tool")
    t.tags.add(tag)
    Comment.objects.create(trajectory=t, message_index=2, author=user, body="wrong tool")

    replay = make_record("t-1", outcome="success", agent="support-bot-2")
    result = ingest_trajectories(project=project, records=[replay])

    assert (result.accepted, result.created, result.updated) == (1, 0, 1)
    assert Trajectory.objects.filter(project=project).count() == 1
    t.refresh_from_db()
    assert t.agent == "support-bot-2"
    assert t.outcome == "success"
    assert t.reviewed_outcome == "failure"
    assert t.reviewed_by == user
    assert list(t.tags.values_list("name", flat=True)) == ["wrong-tool"]
    assert t.comments.count() == 1


@pytest.mark.django_db
def test_same_external_id_twice_in_one_batch_keeps_the_last(project, make_record):
    result = ingest_trajectories(
        project=project,
        records=[make_record("t-1", agent="first"), make_record("t-1", agent="second")],
    )
    assert (result.accepted, result.created, result.updated) == (2, 1, 1)
    assert Trajectory.objects.get(project=project, external_id="t-1").agent == "second"


@pytest.mark.django_db
def test_external_ids_are_per_project(project, make_project, make_record):
    other = make_project()
    ingest_trajectories(project=project, records=[make_record("t-1")])
    result = ingest_trajectories(project=other, records=[make_record("t-1")])
    assert result.created == 1
    assert Trajectory.objects.filter(external_id="t-1").count() == 2


@pytest.mark.django_db
def test_large_batch_spans_several_statements(project, make_record):
    records = [make_record(f"t-{i}") for i in range(1_203)]
    assert ingest_trajectories(project=project, records=records).created == 1_203
    again = ingest_trajectories(project=project, records=records)
    assert (again.created, again.updated) == (0, 1_203)
    assert Trajectory.objects.filter(project=project).count() == 1_203


@pytest.mark.django_db(transaction=True)
def test_the_same_batch_twice_at_once_never_duplicates(needs_postgres, project, make_record):
    records = [make_record(f"t-{i}") for i in range(300)]
    barrier = threading.Barrier(2)
    results, errors = [], []

    def post() -> None:
        try:
            barrier.wait()
            results.append(ingest_trajectories(project=project, records=records))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=post) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    assert Trajectory.objects.filter(project=project).count() == 300
    assert sum(r.created for r in results) == 300
    assert sum(r.updated for r in results) == 300


@pytest.mark.django_db
def test_without_started_at_a_trajectory_starts_when_first_received(project, make_record):
    record = make_record("t-1")
    del record["started_at"]
    ingest_trajectories(project=project, records=[record])
    t = Trajectory.objects.get(project=project, external_id="t-1")
    assert t.started_at is not None
    assert abs((t.started_at - t.created_at).total_seconds()) < 1


@pytest.mark.django_db
def test_a_replay_without_started_at_keeps_the_start(project, make_record):
    sent, unsent = make_record("sent"), make_record("unsent")
    del unsent["started_at"]
    ingest_trajectories(project=project, records=[sent, unsent])
    first = dict(Trajectory.objects.filter(project=project).values_list("external_id", "started_at"))

    replays = [make_record("sent", outcome="failure"), make_record("unsent", outcome="failure")]
    for replay in replays:
        del replay["started_at"]
    result = ingest_trajectories(project=project, records=replays)

    assert (result.created, result.updated) == (0, 2)
    after = dict(Trajectory.objects.filter(project=project).values_list("external_id", "started_at"))
    assert after == first
    assert after["sent"].isoformat() == "2026-12-01T10:00:00+00:00"
    assert set(Trajectory.objects.filter(project=project).values_list("outcome", flat=True)) == {"failure"}
    # A replay that does send started_at moves it.
    ingest_trajectories(project=project, records=[make_record("unsent", started_at="2026-10-01T00:00:00Z")])
    moved = Trajectory.objects.get(project=project, external_id="unsent").started_at
    assert moved.isoformat() == "2026-10-01T00:00:00+00:00"


# --- what the database cannot store --------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")


def _set(path: list, value):
    """A change that puts `value` at `path` (keys and indexes) of a record."""

    def change(record: dict) -> None:
        target = record
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("change", "field"),
    [
        (_set(["metadata", "score"], NAN), "metadata.score"),
        (_set(["feedback"], {"rating": INF}), "feedback.rating"),
        (_set(["usage", "cost"], -INF), "usage.cost"),
        (_set(["human_intervention"], [1, NAN]), "human_intervention[1]"),
        (_set(["messages", 1, "content"], "lone \ud800 surrogate"), "messages[1].content"),
        (_set(["messages", 1, "content"], [{"type": "text", "text": "\udfff"}]), "messages[1].content[0].text"),
        (_set(["messages", 1, "score"], NAN), "messages[1].score"),  # an extra key, kept as sent
        (_set(["messages", 3, "name"], "get\ud800order"), "messages[3].name"),
        (
            _set(["messages", 2, "tool_calls", 0, "function", "arguments"], {"amount": NAN}),
            "messages[2].tool_calls[0].function.arguments.amount",
        ),
        (
            _set(["tools", 0, "function", "parameters", "properties", "order_id", "default"], INF),
            "tools[0].function.parameters.properties.order_id.default",
        ),
        (_set(["metadata"], {"ok": 1, "bad\ud800key": 2}), "metadata.bad\\ud800key"),
        (_set(["external_id"], "t-\ud800"), "external_id"),
        (_set(["agent"], "\udc00"), "agent"),
        (_set(["metadata"], _nested(200)), "metadata" + ".a" * 64),
        (_set(["metadata"], {"x": {1, 2}}), "metadata.x"),  # not JSON at all (a caller's bug)
        # Before the year 1 or after 9999 once in UTC: PostgreSQL would store it, Python cannot read it back.
        (_set(["started_at"], "0001-01-01T00:00:00+01:00"), "started_at"),
        (_set(["started_at"], "9999-12-31T23:00:00-05:00"), "started_at"),
    ],
)
def test_a_record_the_database_cannot_store_is_rejected_alone(project, make_record, change, field):
    bad = make_record("t-bad")
    change(bad)

    result = ingest_trajectories(project=project, records=[make_record("t-1"), bad, make_record("t-2")])

    assert (result.accepted, result.created) == (2, 2)
    [rejected] = result.rejected
    assert rejected["index"] == 1
    fields = [e["field"] for e in rejected["errors"]]
    assert field in fields, fields
    assert all(e["message"] for e in rejected["errors"])
    stored = set(Trajectory.objects.filter(project=project).values_list("external_id", flat=True))
    assert stored == {"t-1", "t-2"}
    # The answer itself is storable and printable: no lone surrogate comes back to the client.
    json.dumps(result.to_dict(), ensure_ascii=False).encode("utf-8")


@pytest.mark.django_db
def test_every_bad_place_of_a_record_is_named(project, make_record):
    bad = make_record("t-bad", metadata={"a": NAN, "b": [INF], "k" * 10_000: NAN}, usage={"c": "\ud800"})
    result = ingest_trajectories(project=project, records=[bad])
    fields = {e["field"] for e in result.rejected[0]["errors"]}
    assert {"metadata.a", "metadata.b[0]", "metadata." + "k" * 80 + "…", "usage.c"} <= fields


@pytest.mark.django_db
def test_the_errors_of_a_record_are_capped(project, make_record):
    bad = make_record("t-bad", metadata={f"k{i}": NAN for i in range(1_000)})
    [rejected] = ingest_trajectories(project=project, records=[bad]).rejected
    assert len(rejected["errors"]) == MAX_ERRORS_PER_RECORD


@pytest.mark.django_db
def test_nesting_is_allowed_up_to_the_limit(project, make_record):
    # metadata is the first level; _nested(n) holds n + 1 objects.
    at_limit = make_record("at-limit", metadata=_nested(MAX_JSON_DEPTH - 1))
    over = make_record("over", metadata=_nested(MAX_JSON_DEPTH))
    result = ingest_trajectories(project=project, records=[at_limit, over])
    assert result.accepted == 1
    assert [e["field"] for e in result.rejected[0]["errors"]] == ["metadata" + ".a" * MAX_JSON_DEPTH]
    assert Trajectory.objects.get(project=project, external_id="at-limit").metadata == at_limit["metadata"]


@pytest.mark.django_db
def test_what_is_valid_json_and_text_is_stored_as_sent(project, make_record):
    # The limits must not refuse what the database takes: big integers, astral characters, deep-ish schemas.
    record = make_record(
        "t-1",
        metadata={"big": 10**300, "tiny": 5e-324, "emoji": "\U0001f600 \u202e", "deep": _nested(30)},
        usage={"neg": -(2**70)},
    )
    record["messages"][1]["content"] = "caf\u00e9 \U0001f600 \ufffd"
    assert ingest_trajectories(project=project, records=[record]).accepted == 1
    stored = Trajectory.objects.get(project=project, external_id="t-1")
    assert stored.metadata == record["metadata"]
    assert stored.usage == record["usage"]
    assert stored.messages == record["messages"]


@pytest.mark.django_db
def test_a_tool_result_of_absurdly_nested_json_is_kept(project, make_record):
    # The tool-error check parses JSON-looking results; one nested beyond Python's recursion limit is text.
    record = make_record("t-1")
    record["messages"][3]["content"] = '{"error": ' + "[" * 100_000 + "]" * 100_000 + "}"
    result = ingest_trajectories(project=project, records=[record])
    assert result.accepted == 1


def test_a_jsonl_line_with_an_integer_python_cannot_read_is_rejected_alone():
    lines = [b'{"a": 1}\n', b'{"a": ' + b"1" * 5_000 + b"}\n", b'{"a": 2}\n']
    records = list(jsonl_records(lines))
    assert [index for index, _ in records] == [0, 1, 2]
    assert isinstance(records[1][1], UnparsableRecord)
    assert "not valid JSON" in records[1][1].message


@pytest.mark.django_db
def test_the_api_answers_a_batch_with_nan_and_a_lone_surrogate_with_its_valid_records(
    api_client, api_key, project, make_record
):
    """Before: PostgreSQL refused the batch's single statement, the API answered 500 and lost t-1 and t-2."""
    api_client.client.raise_request_exception = False  # see the status a client would see
    nan = make_record("t-nan", metadata={"score": NAN})  # json.dumps writes the NaN literal Python reads
    surrogate = make_record("t-surrogate")
    surrogate["messages"][1]["content"] = "\ud800"  # json.dumps escapes it: "\\ud800"
    batch = [make_record("t-1"), nan, surrogate, make_record("t-2")]

    for body, content_type in [
        (json.dumps(batch), "application/json"),
        ("".join(json.dumps(r) + "\n" for r in batch), "application/x-ndjson"),
    ]:
        Trajectory.objects.filter(project=project).delete()
        response = api_client.post("/api/v1/trajectories", body=body, content_type=content_type, key=api_key)
        assert response.status_code == 200, response.content
        answer = response.json()
        assert answer["accepted"] == 2
        assert [(r["index"], r["external_id"], r["errors"][0]["field"]) for r in answer["rejected"]] == [
            (1, "t-nan", "metadata.score"),
            (2, "t-surrogate", "messages[1].content"),
        ]
        stored = set(Trajectory.objects.filter(project=project).values_list("external_id", flat=True))
        assert stored == {"t-1", "t-2"}


@pytest.mark.django_db
def test_a_json_body_with_an_integer_python_cannot_read_is_400(api_client, api_key):
    api_client.client.raise_request_exception = False
    body = b'[{"external_id": "t-1", "metadata": {"n": ' + b"9" * 5_000 + b"}}]"
    response = api_client.post("/api/v1/trajectories", body=body, key=api_key)
    assert response.status_code == 400, response.content
    assert "not valid JSON" in response.json()["detail"]
