"""The failure-mode API: keys, scopes and projects; modes; assignment by ids and by the list's filter; the
review queue from a script."""

from __future__ import annotations

import pytest

from flywheel.accounts.services import api_key_create
from flywheel.failures import services
from flywheel.failures.models import FailureModeAssignment, ReviewChange


@pytest.fixture
def review_key(project, user):
    """A key with the review scope, made by `user` (the person its writes and claims are recorded as)."""
    return api_key_create(project=project, name="script", scopes=["read", "review"], created_by=user).raw_key


def test_modes_are_listed_with_read_and_created_with_review(api_client, project, user, review_key, make_api_key):
    read_only = make_api_key(project, scopes=["read"])
    services.failure_mode_create(project=project, name="Loops", category_key="bad_planning", user=user)
    listed = api_client.get("/api/v1/failure-modes", key=read_only)
    assert listed.status_code == 200
    assert [(m["name"], m["category"], m["trajectory_count"]) for m in listed.json()] == [("Loops", "bad_planning", 0)]
    refused = api_client.post("/api/v1/failure-modes", {"name": "X"}, key=read_only)
    assert refused.status_code == 403 and "review" in refused.json()["detail"]
    created = api_client.post("/api/v1/failure-modes", {"name": "Bad ids", "category": "wrong_arguments"}, key=review_key)
    assert created.status_code == 201 and created.json()["category"] == "wrong_arguments"
    twice = api_client.post("/api/v1/failure-modes", {"name": "Bad ids"}, key=review_key)
    assert twice.status_code == 422 and twice.json()["detail"][0]["loc"] == ["body", "name"]
    unknown = api_client.post("/api/v1/failure-modes", {"name": "Y", "category": "nope"}, key=review_key)
    assert unknown.status_code == 422 and unknown.json()["detail"][0]["loc"] == ["body", "category"]


def test_assign_by_ids_or_filter_counts_only_new_and_stays_in_the_keys_project(
    api_client, project, user, review_key, make_trajectories, make_project
):
    eu = make_trajectories(project, 3, prefix="eu", agent="eu-bot")
    make_trajectories(project, 2, prefix="us", agent="us-bot")
    foreign = make_trajectories(make_project("other"), 1, prefix="x")[0]
    mode = services.failure_mode_create(project=project, name="EU", category_key="other", user=user)
    url = f"/api/v1/failure-modes/{mode.pk}/assign"
    by_ids = api_client.post(url, {"trajectory_ids": [eu[0].pk, foreign.pk], "message_index": 1}, key=review_key)
    assert by_ids.status_code == 200 and by_ids.json() == {"count": 1}
    by_filter = api_client.post(url, {"filter": {"agent": "eu-bot"}}, key=review_key)
    assert by_filter.json() == {"count": 2}
    assert FailureModeAssignment.objects.filter(failure_mode=mode).count() == 3
    assert ReviewChange.objects.filter(trajectory=eu[1], user=user, field="modes").exists()
    both = api_client.post(url, {"trajectory_ids": [eu[0].pk], "filter": {"agent": "eu-bot"}}, key=review_key)
    assert both.status_code == 422 and both.json()["detail"][0]["loc"] == ["body", "trajectory_ids"]
    bad_filter = api_client.post(url, {"filter": {"signal": "nonsense"}}, key=review_key)
    problem = bad_filter.json()["detail"][0]
    assert bad_filter.status_code == 422 and problem["loc"] == ["body", "filter"] and "signal" in problem["msg"]
    removed = api_client.post(f"/api/v1/failure-modes/{mode.pk}/unassign", {"trajectory_ids": [eu[0].pk]}, key=review_key)
    assert removed.json() == {"count": 1}
    other_key = api_key_create(project=foreign.project, name="k", scopes=["review"], created_by=user).raw_key
    assert api_client.post(url, {"trajectory_ids": [eu[0].pk]}, key=other_key).status_code == 404


def test_the_queue_from_a_script_claims_and_completes(api_client, project, user, review_key, make_trajectories, make_api_key):
    first, second = make_trajectories(project, 2)
    claim = api_client.post("/api/v1/queue/claim", {}, key=review_key)
    assert claim.status_code == 200 and claim.json()["trajectory_id"] == second.pk and claim.json()["expires_at"]
    done = api_client.post(f"/api/v1/queue/{second.pk}/complete", {"outcome": "failure"}, key=review_key)
    assert done.json() == {"trajectory_id": second.pk, "reviewed_outcome": "failure"}
    assert api_client.post("/api/v1/queue/claim", {}, key=review_key).json()["trajectory_id"] == first.pk
    # Another person's key cannot complete what this one holds.
    from flywheel.accounts.services import membership_set

    def person_key(name):
        from django.contrib.auth import get_user_model

        person = get_user_model().objects.create(username=name)
        membership_set(project=project, user=person, role="reviewer")
        return api_key_create(project=project, name=name, scopes=["review"], created_by=person).raw_key

    assert api_client.post(f"/api/v1/queue/{first.pk}/complete", {}, key=person_key("eve")).status_code == 409
    # A key nobody made cannot hold items.
    ownerless = make_api_key(project, scopes=["review"])
    assert api_client.post("/api/v1/queue/claim", {}, key=ownerless).status_code == 409
    assert api_client.post("/api/v1/queue/claim", {}, key=make_api_key(project, scopes=["read"])).status_code == 403


@pytest.mark.parametrize("action", ["assign", "unassign"])
def test_an_empty_selection_changes_nothing_and_says_so(api_client, project, user, review_key, make_trajectories, action):
    """`trajectory_ids: []` reached an `id IN ()` Django cannot write (EmptyResultSet, a 500): it is a
    selection of nothing, answered as a filter that matches nothing is, count 0."""
    trajectory = make_trajectories(project, 1)[0]
    mode = services.failure_mode_create(project=project, name="Empty", category_key="other", user=user)
    services.failure_mode_assign(failure_mode=mode, trajectories=[trajectory], user=user)
    changes = ReviewChange.objects.count()
    answer = api_client.post(f"/api/v1/failure-modes/{mode.pk}/{action}",
                             {"trajectory_ids": [], "filter": None, "message_index": 0, "note": ""}, key=review_key)
    assert answer.status_code == 200, answer.content
    assert answer.json() == {"count": 0}
    assert list(FailureModeAssignment.objects.filter(failure_mode=mode).values_list("trajectory_id", flat=True)) == [
        trajectory.pk]
    assert ReviewChange.objects.count() == changes


@pytest.mark.parametrize("action", ["assign", "unassign"])
def test_a_trajectory_id_outside_the_id_range_is_a_422_naming_it(api_client, project, user, review_key, action):
    mode = services.failure_mode_create(project=project, name="Far", category_key="other", user=user)
    answer = api_client.post(f"/api/v1/failure-modes/{mode.pk}/{action}", {"trajectory_ids": [1, 2**64]},
                             key=review_key)
    assert answer.status_code == 422, answer.content
    assert [problem["loc"] for problem in answer.json()["detail"]] == [["body", "trajectory_ids", 1]]
