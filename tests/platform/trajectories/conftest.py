"""Fixtures of the trajectory tests: `make_record`, a trajectory record as an agent sends it (the contract
in ARCHITECTURE.md)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest


def trajectory_record(external_id: str = "t-1", **overrides: Any) -> dict[str, Any]:
    """A small valid trajectory: system, user, an assistant tool call, its result, the final answer."""
    record: dict[str, Any] = {
        "external_id": external_id,
        "agent": "support-bot",
        "model_version": "qwen-0.5b-v3",
        "messages": [
            {"role": "system", "content": "You are a support agent."},
            {"role": "user", "content": "Where is my order 1234?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_order", "arguments": json.dumps({"order_id": "1234"})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"status": "shipped"})},
            {"role": "assistant", "content": "Your order has shipped."},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_order",
                    "description": "Look an order up.",
                    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
                },
            }
        ],
        "outcome": "success",
        "latency_ms": 812,
        "usage": {"prompt_tokens": 120, "completion_tokens": 30},
        "metadata": {"region": "eu"},
        "started_at": "2026-12-01T10:00:00Z",
    }
    record.update(overrides)
    return record


@pytest.fixture
def make_record() -> Callable[..., dict[str, Any]]:
    """`make_record(external_id="t-1", **overrides) -> dict`: a fresh valid record each call."""
    return trajectory_record
