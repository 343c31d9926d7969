"""Verifier calibration through the API on a real Celery worker: the request answers at once, the worker
scores, the client polls. With the tool schema of issue 22 (a patternProperties ReDoS), it finishes."""

from __future__ import annotations

import json

REDOS_TOOL = {"type": "function", "function": {"name": "tag", "parameters": {
    "type": "object", "patternProperties": {"^(a+)+$": {"type": "string"}}, "additionalProperties": False}}}
HOSTILE_KEY = "a" * 30 + "!"  # Python's re takes minutes on it; RE2 answers at once


def labeled(external_id, key, outcome):
    return {"external_id": external_id, "outcome": outcome, "tools": [REDOS_TOOL], "messages": [
        {"role": "user", "content": "Tag it."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "tag", "arguments": json.dumps({key: "x"})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{}"},
        {"role": "assistant", "content": "Tagged."},
    ]}


def test_a_calibration_with_a_redos_tool_schema_answers_at_once_and_the_worker_finishes_it(
    celery_worker, api_client, make_api_key, project, user
):
    from flywheel.failures.review import trajectory_outcome_set
    from flywheel.trajectories.ingest import ingest_trajectories
    from flywheel.trajectories.models import Trajectory

    records = [labeled("hostile-1", HOSTILE_KEY, "failure"), labeled("hostile-2", HOSTILE_KEY, "failure"),
               labeled("fine", "aaa", "success")]
    assert ingest_trajectories(project=project, records=records).accepted == 3
    for t in Trajectory.objects.filter(project=project):
        trajectory_outcome_set(trajectory=t, outcome=t.outcome, user=user)
    key = make_api_key(project, scopes=["read"])
    spec = {"type": "tool_call", "expected_calls": [{"name": "tag", "arguments": {}}], "allow_extra_arguments": True}
    started = api_client.post("/api/v1/verifier-calibrations", {"verifier": spec}, key=key)
    assert started.status_code == 202, started.content
    # The request queues it: nothing is scored in the web process.
    assert started.json()["status"] == "queued" and started.json()["done"] == 0, started.json()
    url = f"/api/v1/verifier-calibrations/{started.json()['id']}"
    # A generous bound: scoring three trajectories takes milliseconds; before RE2, minutes for each hostile one.
    body = celery_worker.wait_for(lambda: (b := api_client.get(url, key=key).json())["status"] in ("done", "failed")
                                  and b, timeout=20)
    assert body["status"] == "done", body
    # The hostile argument names were matched, on RE2: they fit no pattern, so those calls break the schema.
    assert body["result"]["matrix"] == {"success": {"pass": 1, "fail": 0}, "failure": {"pass": 0, "fail": 2}}
    assert body["done"] == body["total"] == 3
