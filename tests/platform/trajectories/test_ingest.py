"""The ingest service: per-record fates, field paths in errors, upserts, derived fields, and concurrency."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from flywheel.trajectories import selectors
from flywheel.trajectories.ingest import SEARCH_TEXT_MAX, ingest_trajectories
from flywheel.trajectories.models import Comment, Tag, Trajectory


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
