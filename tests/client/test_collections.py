"""Task sets and eval suites through the client against the live test server: created, a trajectory promoted
into each by the external_id the agent gave it (a dry run first), their versions read back; a refused
promotion raises with the server's reasons."""

from __future__ import annotations

import json

import pytest
from flywheel_client import ApiError, Flywheel

TOOLS = [{"type": "function", "function": {
    "name": "get_order", "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}}}}]
RIGHT = {"name": "get_order", "arguments": {"order_id": "A1"}}


def failed(external_id: str, request: str) -> dict:
    """The agent looked the wrong order up."""
    return {"external_id": external_id, "agent": "support", "outcome": "failure", "tools": TOOLS, "messages": [
        {"role": "user", "content": request},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_order", "arguments": json.dumps({"order_id": "B9"})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"status\": \"unknown order\"}"},
        {"role": "assistant", "content": "I cannot find it."}]}


def test_promotion_by_external_id_into_a_task_set_and_an_eval_suite(live_server, project, make_api_key):
    key = make_api_key(project, scopes=["ingest", "read", "review"])
    with Flywheel(live_server.url, key) as fw:
        assert fw.ingest([
            failed("conv-1", "Where is my order A1?"),
            # Another request: the leakage guard keeps one request out of both a task set and an eval suite.
            failed("conv-2", "My lamp never came; could you check order A1 for me, the one from last week?")]).accepted == 2
        task_set = fw.create_task_set("order lookups")
        suite = fw.create_eval_suite("order regressions", kind="regression")
        assert [c.name for c in fw.task_sets()] == ["order lookups"]
        assert [(c.name, c.kind) for c in fw.eval_suites()] == [("order regressions", "regression")]
        fix = {"message_index": 1, "expect": "calls", "expected_calls": [RIGHT], "reference_calls": [RIGHT]}

        dry = fw.promote_to_task_set(task_set.id, external_id="conv-1", dry_run=True, **fix)
        assert not dry.saved and dry.checks["original"]["passed"] is False and dry.checks["reference"]["passed"]
        assert fw.task_set_versions(task_set.id) == []

        promoted = fw.promote_to_task_set(task_set.id, external_id="conv-1", **fix)
        assert promoted.saved and promoted.version.number == 1 and promoted.row["origin"]["trajectory_id"]
        case = fw.promote_to_eval_suite(suite.id, external_id="conv-2", **fix)
        assert case.saved and case.version.number == 1
        assert [v.number for v in fw.task_set_versions(task_set.id)] == [1]
        assert [(v.number, v.size) for v in fw.eval_suite_versions(suite.id)] == [(1, 1)]

        # The agent's own call as the expectation: the verifier passes what it did, so it is refused.
        with pytest.raises(ApiError) as refused:
            fw.promote_to_eval_suite(suite.id, external_id="conv-2", message_index=1)
        assert refused.value.status_code == 422 and "Not promoted" in str(refused.value)
        assert refused.value.body["checks"]["original"]["passed"] is True
        with pytest.raises(ApiError, match="answered 4"):
            fw.promote_to_task_set(task_set.id, external_id="no-such-conversation", **fix)
