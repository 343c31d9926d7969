"""Fixtures of the failure-mode tests: trajectories made through the one ingest service, with signals."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.models import Trajectory, TriageSignal


def failing_record(external_id: str, **overrides: Any) -> dict[str, Any]:
    """A small trajectory whose tool call fails: user, call, error result, apology."""
    record: dict[str, Any] = {
        "external_id": external_id,
        "agent": "support-bot",
        "model_version": "v1",
        "messages": [
            {"role": "user", "content": f"Refund order {external_id}"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "refund", "arguments": json.dumps({"id": 1})}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "error: refund failed"},
            {"role": "assistant", "content": "Sorry, I could not do that."},
        ],
        "tools": [{"type": "function", "function": {"name": "refund", "parameters": {"type": "object"}}}],
        "outcome": "failure",
        "started_at": "2026-11-20T10:00:00Z",
    }
    record.update(overrides)
    return record


@pytest.fixture
def make_trajectories(db: None) -> Callable[..., list[Trajectory]]:
    """`make_trajectories(project, n, prefix="t", **overrides) -> [Trajectory]`, oldest first."""

    def make(project: Any, n: int, prefix: str = "t", **overrides: Any) -> list[Trajectory]:
        records = [failing_record(f"{prefix}-{i}", **overrides) for i in range(n)]
        result = ingest_trajectories(project=project, records=records)
        assert not result.rejected, result.rejected
        return list(Trajectory.objects.filter(project=project, external_id__startswith=f"{prefix}-").order_by("id"))

    return make


@pytest.fixture
def add_signal() -> Callable[..., TriageSignal]:
    """`add_signal(trajectory, kind="tool_error", severity=2, message_index=2)`: a triage signal, as triage
    writes it (the trajectory's severity is its signals' highest)."""

    def add(trajectory: Trajectory, kind: str = "tool_error", severity: int = 2, message_index: int | None = 2) -> TriageSignal:
        signal = TriageSignal.objects.create(
            project_id=trajectory.project_id,
            trajectory=trajectory,
            kind=kind,
            severity=severity,
            message_index=message_index,
            detail={"tool": "refund", "excerpt": "refund failed"},
        )
        Trajectory.objects.filter(pk=trajectory.pk, triage_severity__lt=severity).update(triage_severity=severity)
        return signal

    return add
