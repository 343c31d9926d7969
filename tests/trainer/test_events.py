"""The stdout contract between the trainer and the platform (trainer/events.py): what the trainer writes the
platform reads back unchanged, and anything else is refused with a reason, never a crash."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest

from trainer import events
from trainer.tracking import EventLog


@pytest.mark.parametrize("kind, fields", [
    ("step", {"step": 3, "loss": 0.25, "reward_mean": 0.5}),
    ("eval", {"step": 4, "split": "holdout", "metrics": {"pass_rate": 0.75}}),
    ("eval", {"case": {"id": "c1", "passed": True}}),
    ("checkpoint", {"step": 5, "path": "/tmp/x", "best": True}),
    ("stage", {"stage": "grpo", "first_step": 3, "last_step": 9}),
    ("latency", {"case": {"id": "c2", "a_s": 0.1}}),
    ("done", {"best_step": 5, "adapter": "/tmp/a", "metrics": {"pass_rate": 1.0}}),
    ("error", {"step": 0, "message": "train failed: boom"}),
])
def test_round_trip(kind, fields):
    event = events.parse_line(events.encode(kind, **fields))
    assert event.kind == kind
    assert event.step == fields.get("step")
    assert event.data == {k: v for k, v in fields.items() if k != "step"}
    assert event.record() == {"event": kind, **fields}


def test_event_log_writes_the_contract_and_parses_back_from_bytes():
    stream = io.StringIO()
    log = EventLog(stream)
    log.emit("eval", step=2, split="holdout", metrics={"pass_rate": math.nan}, path=Path("/a/b"))
    (line,) = stream.getvalue().splitlines()
    event = events.parse_line(line.encode())
    assert (event.kind, event.step) == ("eval", 2)
    assert event.data == {"split": "holdout", "metrics": {"pass_rate": None}, "path": "/a/b"}  # NaN is not JSON
    assert log.events == [json.loads(line)]


def test_the_trainer_cannot_emit_an_unknown_kind():
    with pytest.raises(events.EventRefused, match="unknown event kind 'progress'"):
        EventLog(io.StringIO()).emit("progress", step=1)


@pytest.mark.parametrize("line, reason", [
    (b"Loading checkpoint shards: 100%", "not JSON"),
    (b'{"event": "step", "step": 1', "not JSON"),
    (b"[1, 2]", "not a JSON object but a list"),
    (b'"done"', "not a JSON object but a str"),
    (b'{"step": 1, "loss": 0.5}', 'no "event" kind'),
    (b'{"event": 7}', 'no "event" kind'),
    (b'{"event": "listening", "url": "http://127.0.0.1:1"}', "unknown event kind 'listening'"),
    (b'\xff\xfe{"event"', "not JSON"),
])
def test_malformed_and_unknown_lines_are_refused_with_a_reason(line, reason):
    with pytest.raises(events.EventRefused, match=reason):
        events.parse_line(line)


def test_blank_lines_are_no_event():
    assert events.parse_line(b"") is None
    assert events.parse_line("  \r") is None


def test_a_step_that_is_not_an_int_is_not_the_event_step():
    """A bool or a float is not a step; it stays in the data as it came, the event has none."""
    assert events.parse_line('{"event": "step", "step": true}').step is None
    event = events.parse_line('{"event": "error", "step": 2.5, "message": "x"}')
    assert (event.step, event.data["step"], event.message) == (None, 2.5, "x")
    assert events.parse_line('{"event": "error", "step": null}').record() == {"event": "error"}


def test_outcome_keeps_the_done_record_and_the_error_message():
    outcome = events.Outcome()
    for line in ('{"event": "eval", "case": {"id": "c"}}', '{"event": "error", "step": 0}'):
        outcome.on_event(events.parse_line(line))
    assert (outcome.finished, outcome.error, outcome.done) == (False, "", {})
    outcome.on_event(events.parse_line('{"event": "done", "metrics": {"pass_rate": 0.5}, "cases": 3}'))
    assert outcome.finished
    assert outcome.done == {"metrics": {"pass_rate": 0.5}, "cases": 3}
