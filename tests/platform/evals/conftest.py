"""Fixtures of the promotion tests: a project with refund trajectories where the agent refunded the wrong
amount (a wrong argument), a suite and a task set to promote into, and members of every role."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

TOOLS = [
    {"type": "function", "function": {
        "name": "lookup_order", "description": "Find an order.",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}},
    {"type": "function", "function": {
        "name": "refund", "description": "Refund an order.",
        "parameters": {"type": "object", "properties": {
            "order_id": {"type": "string"}, "amount": {"type": "number"},
            "reason": {"type": "string"}}, "required": ["order_id", "amount"]}}},
]


def refund_record(external_id: str, *, order: str = "A-1001", amount: float = 500.0, request: str | None = None,
                  answer: str = "Done, refunded.") -> dict[str, Any]:
    """A user asks for a 50.00 refund; the agent looks the order up, then refunds `amount` (500: wrong)."""
    request = request or f"Please refund 50.00 on order {order}, the mug arrived broken."
    return {
        "external_id": external_id,
        "agent": "support-bot",
        "outcome": "failure",
        "messages": [
            {"role": "system", "content": "You are a support agent."},
            {"role": "user", "content": request},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "lookup_order", "arguments": json.dumps({"order_id": order})}}]},
            {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"order_id": order, "total": 80.0})},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c2", "type": "function", "function": {
                "name": "refund", "arguments": json.dumps({"order_id": order, "amount": amount})}}]},
            {"role": "tool", "tool_call_id": "c2", "content": json.dumps({"ok": True, "refunded": amount})},
            {"role": "assistant", "content": answer},
        ],
        "tools": TOOLS,
    }


@pytest.fixture
def ingest(project) -> Callable[..., Any]:
    """`ingest(record, ...) -> Trajectory` (or a list for several records), through the one ingest service."""
    from flywheel.trajectories.ingest import ingest_trajectories
    from flywheel.trajectories.models import Trajectory

    def run(*records: dict[str, Any]) -> Any:
        result = ingest_trajectories(project=project, records=list(records))
        assert result.accepted == len(records), result
        found = [Trajectory.objects.get(project=project, external_id=r["external_id"]) for r in records]
        return found[0] if len(found) == 1 else found

    return run


@pytest.fixture
def trajectory(ingest):
    return ingest(refund_record("r-1"))


@pytest.fixture
def suite(project, user):
    from flywheel.evals.services import suite_create

    return suite_create(project=project, name="Refunds", kind="regression", user=user)


@pytest.fixture
def task_set(project, user):
    from flywheel.environments.services import task_set_create

    return task_set_create(project=project, name="Refund tasks", user=user)


# The correction a reviewer states for the refund turn (message 4): refund 50, any reason, optional.
CORRECTED = {
    "message_index": 4,
    "expect": "calls",
    "expected_calls": [{"name": "refund", "arguments": {
        "order_id": "A-1001", "amount": {"range": [49.99, 50.01]}, "reason": {"any": True, "optional": True}}}],
}


@pytest.fixture
def corrected() -> dict[str, Any]:
    return json.loads(json.dumps(CORRECTED))


@pytest.fixture(name="refund_record")
def refund_record_fixture() -> Callable[..., dict[str, Any]]:
    return refund_record
