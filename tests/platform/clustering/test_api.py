"""The clustering API: start a run over a filter, read its status and clusters, decide on a suggestion;
keys are checked for their project and scope."""

from __future__ import annotations

import pytest

from flywheel.failures.clustering import services
from flywheel.failures.clustering.models import ClusteringRun
from flywheel.failures.models import FailureMode


@pytest.fixture
def keys(make_api_key, project, user):
    review = make_api_key(project, scopes=["read", "review"])
    review.api_key.created_by = user
    review.api_key.save(update_fields=["created_by"])
    return {"review": review, "read": make_api_key(project, scopes=["read"])}


def test_post_starts_a_run_and_get_answers_its_clusters(api_client, embedder, project, keys, labeled_failures):
    labeled_failures(project, 10, ["stock_timeout", "weather_undeclared_tool"])
    created = api_client.post("/api/v1/clusterings", {"days": 30, "signal": "tool_error"}, key=keys["review"])
    assert created.status_code == 201, created.content
    run_id = created.json()["id"]
    queued = api_client.get(f"/api/v1/clusterings/{run_id}", key=keys["read"]).json()
    assert (queued["status"], queued["progress"], queued["clusters"]) == ("queued", 0, [])
    assert queued["filter"]["signal"] == "tool_error"
    services.clustering_run_process(run_id=run_id)  # what the worker does
    body = api_client.get(f"/api/v1/clusterings/{run_id}", key=keys["read"]).json()
    assert body["status"] == "done" and body["progress"] == 100 and body["total"] == 20
    assert sorted(c["size"] for c in body["clusters"]) == [10, 10]
    cluster = body["clusters"][0]
    assert set(cluster) >= {"id", "size", "label", "trajectory_ids", "representative_ids", "signals"}
    assert len(cluster["trajectory_ids"]) == cluster["size"] and len(cluster["representative_ids"]) == 5
    assert "tool_error" in cluster["signals"]

    decided = api_client.post(
        f"/api/v1/clusterings/suggestions/{cluster['id']}/decision", {"action": "accept", "name": "From the API"}, key=keys["review"]
    )
    assert decided.status_code == 200 and decided.json()["decision"] == "accepted"
    mode = FailureMode.objects.get(project=project, name="From the API")
    assert decided.json()["failure_mode_id"] == mode.pk and mode.assignments.count() == 10
    again = api_client.post(f"/api/v1/clusterings/suggestions/{cluster['id']}/decision", {"action": "dismiss"}, key=keys["review"])
    assert again.status_code == 409


def test_scopes_projects_and_bad_filters(api_client, project, keys, make_project, make_api_key, user):
    assert api_client.post("/api/v1/clusterings", {}, key=keys["read"]).status_code == 403  # needs review
    assert api_client.post("/api/v1/clusterings", {}, key=None).status_code == 401
    bad = api_client.post("/api/v1/clusterings", {"days": 0}, key=keys["review"])
    assert bad.status_code == 422 and "days" in bad.content.decode()
    bad_signal = api_client.post("/api/v1/clusterings", {"signal": "nope"}, key=keys["review"])
    problem = bad_signal.json()["detail"][0]
    assert bad_signal.status_code == 422 and problem["loc"] == ["body", "signal"]
    assert "signal must be one of" in problem["msg"]
    run = services.clustering_run_start(project=project, user=user)
    other = make_api_key(make_project(), scopes=["read", "review"])
    assert api_client.get(f"/api/v1/clusterings/{run.pk}", key=other).status_code == 404
    assert api_client.get(f"/api/v1/clusterings/{run.pk}", key=keys["read"]).status_code == 200
    busy = api_client.post("/api/v1/clusterings", {}, key=keys["review"])
    assert busy.status_code == 409 and ClusteringRun.objects.filter(project=project).count() == 1


@pytest.mark.parametrize("body, loc", [
    ([None, None], ["body"]), ("failure", ["body"]), ({"unassigned": 0}, ["body", "unassigned"]),
    ({"unassigned": "false"}, ["body", "unassigned"]),
])
def test_a_body_that_is_no_object_or_a_lax_boolean_starts_nothing(api_client, project, keys, body, loc):
    """Every field has a default, so an array body used to start a run over the default filter."""
    answer = api_client.post("/api/v1/clusterings", body, key=keys["review"])
    assert answer.status_code == 422, answer.content
    assert answer.json()["detail"][0]["loc"] == loc
    assert not ClusteringRun.objects.filter(project=project).exists()
