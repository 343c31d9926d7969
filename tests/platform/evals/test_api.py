"""The API a team scripts its promotions with: scopes and projects checked, promotion with both checks,
field errors as 422 (never 500), bulk promotion of a failure mode, versions and the JSONL export."""

from __future__ import annotations

import hashlib
import json

import pytest

pytestmark = pytest.mark.django_db


@pytest.fixture
def keys(make_api_key, project, make_project):
    return {"read": make_api_key(project, scopes=["read"]), "review": make_api_key(project, scopes=["review"]),
            "ingest": make_api_key(project, scopes=["ingest"]),
            "other": make_api_key(make_project("elsewhere"), scopes=["read", "review"])}


@pytest.mark.parametrize("prefix", ["eval-suites", "task-sets"])
def test_scopes_and_projects_are_checked(api_client, keys, prefix, suite, task_set, trajectory):
    pk = suite.pk if prefix == "eval-suites" else task_set.pk
    base = f"/api/v1/{prefix}"
    assert api_client.get(base, key=None).status_code == 401
    assert api_client.get(base, key=keys["ingest"]).status_code == 403  # read needs `read`
    listed = api_client.get(base, key=keys["read"])
    assert listed.status_code == 200 and [c["id"] for c in listed.json()] == [pk]
    assert api_client.get(base, key=keys["other"]).json() == []  # another project's key sees its own
    assert api_client.get(f"{base}/{pk}", key=keys["other"]).status_code == 404
    body = {"trajectory_id": trajectory.pk, "dry_run": True}
    # Writes need `review`: neither `read` nor `ingest` promotes.
    for key in (keys["read"], keys["ingest"]):
        assert api_client.post(f"{base}/{pk}/promotions", body, key=key).status_code == 403
    assert api_client.post(f"{base}/{pk}/promotions", body, key=keys["other"]).status_code == 404
    assert api_client.post(f"{base}/{pk}/promotions", body, key=keys["review"]).status_code == 200


def test_promote_dry_run_then_save_then_export(api_client, keys, suite, trajectory, corrected, user):
    keys["review"].api_key.created_by = user
    keys["review"].api_key.save()
    url = f"/api/v1/eval-suites/{suite.pk}/promotions"
    # Unset fields start from the prefill: the agent's own call, which the verifier passes: refused.
    refused = api_client.post(url, {"trajectory_id": trajectory.pk, "message_index": 4}, key=keys["review"])
    assert refused.status_code == 422
    assert refused.json()["checks"]["original"]["passed"] is True and refused.json()["checks"]["warnings"]
    dry = api_client.post(url, {"trajectory_id": trajectory.pk, **corrected, "dry_run": True}, key=keys["review"])
    assert dry.status_code == 200 and dry.json()["saved"] is False
    checks = dry.json()["checks"]
    assert checks["original"]["passed"] is False and checks["original"]["failure"] == "wrong_arguments"
    assert checks["reference"]["passed"] is True and "calls" in checks["reference"]["checks"]
    saved = api_client.post(url, {"trajectory_id": trajectory.pk, **corrected}, key=keys["review"])
    assert saved.status_code == 201, saved.json()
    out = saved.json()
    assert out["item"]["id"] == out["row"]["id"] and out["version"]["number"] == 1
    assert suite.cases.get().created_by == user  # recorded as the key's maker

    versions = api_client.get(f"/api/v1/eval-suites/{suite.pk}/versions", key=keys["read"]).json()
    assert [v["number"] for v in versions] == [1]
    export = api_client.get(versions[0]["export_url"], key=keys["read"])
    assert export.status_code == 200 and export["Content-Type"].startswith("application/x-ndjson")
    assert hashlib.sha256(export.content).hexdigest() == versions[0]["content_hash"]
    rows = [json.loads(line) for line in export.content.decode().splitlines()]
    assert rows == [out["row"]]
    assert api_client.get(versions[0]["export_url"], key=keys["ingest"]).status_code == 403
    assert api_client.get(f"/api/v1/eval-suites/{suite.pk}/versions/9.jsonl", key=keys["read"]).status_code == 404
    detail = api_client.get(f"/api/v1/eval-suites/{suite.pk}", key=keys["read"]).json()
    assert detail["size"] == 1 and detail["items"][0]["trajectory_id"] == trajectory.pk


@pytest.mark.parametrize(("change", "field"), [
    ({"expected_calls": [{"name": "refund", "arguments": {"amount": {"regex": "a++"}}}]}, "expected_calls"),
    ({"expected_calls": "not json ["}, "expected_calls"),
    ({"expected_calls": {"name": "refund"}}, "expected_calls"),
    ({"expect": "telepathy"}, "expect"),
    ({"message_index": 99}, "message_index"),
    ({"max_turns": 0, "env_type": "replay"}, "max_turns"),
    ({"expect": "answer", "answer_match": "json_schema", "expected_answer": {"type": 5}}, "expected_answer"),
])
def test_bad_fields_are_422_naming_the_field(api_client, keys, suite, trajectory, corrected, change, field):
    response = api_client.post(f"/api/v1/eval-suites/{suite.pk}/promotions",
                               {"trajectory_id": trajectory.pk, **corrected, **change}, key=keys["review"])
    assert response.status_code == 422, response.content
    assert field in response.json()["errors"], response.json()
    assert suite.cases.count() == 0


@pytest.mark.parametrize(("schema", "said"), [
    ({"type": "object", "properties": {"amount": {"$ref": "#/$defs/missing"}}},
     '$ref "#/$defs/missing" points to nothing inside the schema'),
    ({"type": "object", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
      "properties": {"amount": {"$ref": "#/$defs/a"}}}, "loops back to where it started"),
    # Past the check: a loop through anyOf that an object never leaves, found when validating.
    ({"anyOf": [{"type": "string"}, {"$ref": "#"}]}, "could not be applied: validation never ended"),
])
def test_a_turn_whose_tool_schema_cannot_be_applied_is_promoted_with_the_schema_check_skipped(
        api_client, keys, suite, ingest, refund_record, corrected, schema, said):
    """The sender's tool schema broke the verifier at this turn: the promotion answered 500."""
    from tests.platform.evals.conftest import TOOLS

    record = refund_record("bad-schema")
    record["tools"] = [TOOLS[0], {"type": "function", "function": {**TOOLS[1]["function"], "parameters": schema}}]
    trajectory = ingest(record)
    url = f"/api/v1/eval-suites/{suite.pk}/promotions"
    dry = api_client.post(url, {"trajectory_id": trajectory.pk, **corrected, "dry_run": True}, key=keys["review"])
    assert dry.status_code == 200, dry.content
    checks = dry.json()["checks"]
    # Judged on the arguments it states (500 where 50 was asked), the schema check skipped and saying why.
    assert checks["original"]["passed"] is False and checks["original"]["failure"] == "wrong_arguments"
    assert checks["reference"]["passed"] is True
    assert said in checks["reference"]["checks"]["schema"]["skipped"][0]
    assert api_client.post(url, {"trajectory_id": trajectory.pk, **corrected}, key=keys["review"]).status_code == 201


def test_leakage_conflicts_come_back_listed(api_client, keys, suite, task_set, trajectory, corrected):
    assert api_client.post(f"/api/v1/eval-suites/{suite.pk}/promotions", {"trajectory_id": trajectory.pk, **corrected},
                           key=keys["review"]).status_code == 201
    response = api_client.post(f"/api/v1/task-sets/{task_set.pk}/promotions",
                               {"trajectory_id": trajectory.pk, **corrected}, key=keys["review"])
    assert response.status_code == 422
    assert {c["rule"] for c in response.json()["conflicts"]} == {"trajectory", "prompt"}


def test_create_and_bulk_promote_a_failure_mode(api_client, keys, project, ingest, refund_record, user, monkeypatch):
    from flywheel.failures.services import failure_mode_assign, failure_mode_create

    created = api_client.post("/api/v1/task-sets", {"name": "Scripted"}, key=keys["review"])
    assert created.status_code == 201 and created.json()["kind"] is None
    assert api_client.post("/api/v1/task-sets", {"name": "Scripted"}, key=keys["review"]).status_code == 422
    pk = created.json()["id"]
    ts = [ingest(refund_record(f"api-{i}", order=f"K-{i}", request=f"Refund 50.00 for K-{i}")) for i in range(2)]
    mode = failure_mode_create(project=project, name="Wrong refund", category_key="wrong_arguments", user=user)
    failure_mode_assign(failure_mode=mode, trajectories=ts, user=user, message_index=4)
    body = {"failure_mode_id": mode.pk, "expected_calls": [{"name": "refund", "arguments": {
        "order_id": {"regex": "^K-"}, "amount": {"one_of": [50, 50.0]}}}]}
    result = api_client.post(f"/api/v1/task-sets/{pk}/promotions/bulk", body, key=keys["review"])
    assert result.status_code == 200, result.content
    out = result.json()
    assert sorted(i["trajectory_id"] for i in out["saved"]) == sorted(t.pk for t in ts)
    assert out["skipped"] == [] and out["version"]["size"] == 2
    again = api_client.post(f"/api/v1/task-sets/{pk}/promotions/bulk", body, key=keys["review"]).json()
    assert again["saved"] == [] and all("already" in r["reasons"][0] for r in again["skipped"])
    missing = api_client.post(f"/api/v1/task-sets/{pk}/promotions/bulk", {"trajectory_ids": [10**9]}, key=keys["review"])
    assert missing.status_code == 404
    from flywheel.evals import promotion

    monkeypatch.setattr(promotion, "BULK_MAX", 1)  # past the limit: refused whole, nothing half done
    too_many = api_client.post(f"/api/v1/task-sets/{pk}/promotions/bulk", body, key=keys["review"])
    assert too_many.status_code == 422 and "at most 1" in too_many.json()["detail"]


def test_calibration_and_variants_from_the_api(api_client, keys, ingest, refund_record, task_set, user):
    from flywheel.evals.calibration import calibration_run_process
    from flywheel.failures.review import trajectory_outcome_set

    for i, (amount, label) in enumerate([(50.0, "success"), (500.0, "failure"), (55.0, "success")]):
        trajectory_outcome_set(trajectory=ingest(refund_record(f"c-{i}", amount=amount)), outcome=label, user=user)
    spec = {"type": "tool_call", "expected_calls": [{"name": "refund", "arguments": {"order_id": {"any": True}, "amount": 50}}]}
    out = api_client.post("/api/v1/verifier-calibrations", {"verifier": spec}, key=keys["read"])
    assert out.status_code == 202, out.content
    queued = out.json()
    assert queued["status"] == "queued" and queued["result"] is None
    url = f"/api/v1/verifier-calibrations/{queued['id']}"
    # Asking again while it waits answers the same calibration; another verifier waits its turn.
    assert api_client.post("/api/v1/verifier-calibrations", {"verifier": spec}, key=keys["read"]).json()["id"] == queued["id"]
    other = api_client.post("/api/v1/verifier-calibrations", {"verifier": {**spec, "order": "any"}}, key=keys["read"])
    assert other.status_code == 409 and f"#{queued['id']}" in other.json()["detail"]
    calibration_run_process(run_id=queued["id"])  # what the worker does
    body = api_client.get(url, key=keys["read"]).json()
    assert body["status"] == "done" and body["done"] == body["total"] == 3
    body = body["result"]
    assert body["n"] == 3 and body["matrix"] == {"success": {"pass": 1, "fail": 1}, "failure": {"pass": 0, "fail": 1}}
    assert body["precision"] == 1.0 and body["recall"] == 0.5 and body["too_few"] is True
    assert [d["label"] for d in body["disagreements"]] == ["success"]
    assert api_client.get(url, key=keys["ingest"]).status_code == 403
    assert api_client.get("/api/v1/verifier-calibrations/999999", key=keys["read"]).status_code == 404
    bad = api_client.post("/api/v1/verifier-calibrations", {"verifier": {"type": "regex", "pattern": "(?<=a)"}},
                          key=keys["read"])
    assert bad.status_code == 422 and "verifier" in bad.json()["errors"]
    assert api_client.post("/api/v1/verifier-calibrations", {"source": "case:999"}, key=keys["read"]).status_code == 422
    assert api_client.post("/api/v1/verifier-calibrations", {"verifier": spec}, key=keys["ingest"]).status_code == 403

    t = ingest(refund_record("v-1", order="A-1001"))
    ingest(refund_record("v-2", order="Z-9", request="something else"))
    data = {"trajectory_id": t.pk, "message_index": 4,
            "expected_calls": [{"name": "refund", "arguments": {"order_id": "A-1001", "amount": 50}}]}
    task_id = api_client.post(f"/api/v1/task-sets/{task_set.pk}/promotions", data, key=keys["review"]).json()["item"]["id"]
    url = f"/api/v1/task-sets/{task_set.pk}/tasks/{task_id.removeprefix('task-')}/variants"
    assert api_client.post(url, {"kinds": ["argument"]}, key=keys["read"]).status_code == 403
    made = api_client.post(url, {"kinds": ["argument"]}, key=keys["review"])
    assert made.status_code == 200, made.content
    assert [i["row"]["verifier"]["expected_calls"][0]["arguments"]["order_id"] for i in made.json()["saved"]] == ["Z-9"]
    assert made.json()["version"] == 2
    assert api_client.post(f"/api/v1/task-sets/{task_set.pk}/tasks/999999/variants", {}, key=keys["review"]).status_code == 404


def test_a_script_promotes_by_the_external_id_it_sent(api_client, keys, project, suite, task_set, ingest,
                                                      refund_record, corrected, make_api_key):
    """Ingest, then promote by the agent's own id: no search for the database's id in between."""
    ingest_key = make_api_key(project, scopes=["ingest"])
    sent = api_client.post("/api/v1/trajectories", refund_record("order-77"), key=ingest_key).json()
    assert sent["records"][0]["external_id"] == "order-77"
    url = f"/api/v1/eval-suites/{suite.pk}/promotions"
    saved = api_client.post(url, {"external_id": "order-77", **corrected}, key=keys["review"])
    assert saved.status_code == 201, saved.json()
    assert saved.json()["item"]["trajectory_id"] == sent["records"][0]["id"]
    assert (saved.json()["version"]["collection"], saved.json()["version"]["number"]) == (suite.pk, 1)

    both = api_client.post(url, {"external_id": "order-77", "trajectory_id": sent["records"][0]["id"], **corrected},
                           key=keys["review"])
    assert both.status_code == 422 and both.json()["detail"][0]["loc"] == ["body", "trajectory_id"]
    neither = api_client.post(url, corrected, key=keys["review"])
    assert neither.status_code == 422 and neither.json()["detail"][0]["loc"] == ["body", "external_id"]
    unknown = api_client.post(url, {"external_id": "order-78", **corrected}, key=keys["review"])
    assert unknown.status_code == 404 and "'order-78'" in unknown.json()["detail"]
    # Another project's key does not find this project's trajectory by its external_id either.
    other = make_api_key(keys["other"].api_key.project, scopes=["review"])
    theirs = api_client.post("/api/v1/eval-suites", {"name": "Theirs"}, key=other).json()["id"]
    elsewhere = api_client.post(f"/api/v1/eval-suites/{theirs}/promotions", {"external_id": "order-77", **corrected},
                                key=other)
    assert elsewhere.status_code == 404

    # Bulk: a selection by external ids, exactly one way of naming it.
    ingest(refund_record("order-80", order="K-80", request="Refund 50.00 for K-80"))
    body = {"external_ids": ["order-80"], "expected_calls": [{"name": "refund", "arguments": {
        "order_id": "K-80", "amount": 50.0}}]}
    bulk = api_client.post(f"/api/v1/task-sets/{task_set.pk}/promotions/bulk", body, key=keys["review"])
    assert bulk.status_code == 200, bulk.content
    assert [i["trajectory_id"] for i in bulk.json()["saved"]] == [
        project.trajectories.get(external_id="order-80").pk]
    mixed = api_client.post(f"/api/v1/task-sets/{task_set.pk}/promotions/bulk",
                            {**body, "trajectory_ids": [1]}, key=keys["review"])
    assert mixed.status_code == 422 and mixed.json()["detail"][0]["loc"] == ["body", "external_ids"]
    missing = api_client.post(f"/api/v1/task-sets/{task_set.pk}/promotions/bulk",
                              {**body, "external_ids": ["nope"]}, key=keys["review"])
    assert missing.status_code == 404 and "'nope'" in missing.json()["detail"]


def test_a_pair_the_guard_is_unsure_of_is_promoted_only_with_a_reason(api_client, keys, suite, task_set, ingest,
                                                                      refund_record, corrected):
    """The guard's "unsure" pairs come back as `doubts`; `leakage_reason` lets the row in and is kept."""
    loan = ingest(refund_record("u-1", request="Renew my library books."))
    extension = ingest(refund_record("u-2", request="Can you extend the loan on my library books?"))
    assert api_client.post(f"/api/v1/eval-suites/{suite.pk}/promotions", {"trajectory_id": loan.pk, **corrected},
                           key=keys["review"]).status_code == 201
    url = f"/api/v1/task-sets/{task_set.pk}/promotions"
    dry = api_client.post(url, {"trajectory_id": extension.pk, **corrected, "dry_run": True}, key=keys["review"])
    assert dry.status_code == 200 and [(d["rule"], d["confirmable"]) for d in dry.json()["doubts"]] == [("unsure", True)]
    refused = api_client.post(url, {"trajectory_id": extension.pk, **corrected}, key=keys["review"])
    assert refused.status_code == 422 and refused.json()["conflicts"] == []
    assert refused.json()["doubts"][0]["other"].endswith("in eval suite 'Refunds'")
    assert "leakage_reason" in refused.json()["detail"]
    too_short = api_client.post(url, {"trajectory_id": extension.pk, **corrected, "leakage_reason": "fine"},
                                key=keys["review"])
    assert too_short.status_code == 422 and "leakage_reason" in too_short.json()["errors"]
    reason = "Renewing is a different request from asking to extend a loan"
    saved = api_client.post(url, {"trajectory_id": extension.pk, **corrected, "leakage_reason": reason},
                            key=keys["review"])
    assert saved.status_code == 201, saved.json()
    assert saved.json()["item"]["leakage_confirmation"]["reason"] == reason
    assert task_set.tasks.get().leakage_confirmation["pairs"][0]["detail"] == refused.json()["doubts"][0]["detail"]
