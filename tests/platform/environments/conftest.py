"""Fixtures of the task-set tests: a project whose agent booked meetings for several people, a task
promoted from one of them, and more bookings on demand."""

from __future__ import annotations

import json
from typing import Any

import pytest

TOOLS = [{"type": "function", "function": {"name": "book_meeting", "parameters": {
    "type": "object", "properties": {"person": {"type": "string"}, "day": {"type": "string"}},
    "required": ["person", "day"]}}}]


def booking(external_id: str, person: str, day: str, request: str) -> dict[str, Any]:
    return {"external_id": external_id, "outcome": "failure", "tools": TOOLS, "messages": [
        {"role": "user", "content": request},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "book_meeting", "arguments": json.dumps({"person": person, "day": day})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "booked"},
        {"role": "assistant", "content": "Booked."}]}


@pytest.fixture
def book(project):
    """`book(external_id, person, day, request) -> Trajectory`: one more booking, ingested."""
    from flywheel.trajectories.ingest import ingest_trajectories
    from flywheel.trajectories.models import Trajectory

    def make(external_id: str, person: str, day: str, request: str) -> Any:
        assert ingest_trajectories(project=project, records=[booking(external_id, person, day, request)]).accepted == 1
        return Trajectory.objects.get(project=project, external_id=external_id)

    return make


@pytest.fixture
def bookings(project):
    """Trajectories booking alice, bob and carol; the first asked for alice on Tuesday but got Monday."""
    from flywheel.trajectories.ingest import ingest_trajectories
    from flywheel.trajectories.models import Trajectory

    records = [booking("b-1", "alice", "monday", "Book a meeting with alice on tuesday."),
               booking("b-2", "bob", "friday", "Meet bob friday"),
               booking("b-3", "carol", "friday", "Set up time with carol friday")]
    assert ingest_trajectories(project=project, records=records).accepted == 3
    return {t.external_id: t for t in Trajectory.objects.filter(project=project)}


@pytest.fixture
def task(bookings, project, user):
    from flywheel.environments.services import task_set_create
    from flywheel.evals.promotion import trajectory_promote

    task_set = task_set_create(project=project, name="Meetings", user=user)
    data = {"message_index": 1, "expect": "calls",
            "expected_calls": [{"name": "book_meeting", "arguments": {"person": "alice", "day": "tuesday"}}]}
    made, _ = trajectory_promote(trajectory=bookings["b-1"], data=data, target=task_set, user=user)
    return made
