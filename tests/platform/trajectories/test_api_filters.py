"""The API list filters by triage signal and by failure mode, like the list page."""

from __future__ import annotations

from flywheel.failures.services import failure_mode_assign, failure_mode_create
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.models import Trajectory, TriageSignal


def test_the_list_filters_by_signal_and_by_failure_mode(project, user, api_client, make_api_key, make_project):
    records = [{"external_id": f"t-{i}", "messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(3)]
    assert ingest_trajectories(project=project, records=records).accepted == 3
    t0, t1, t2 = (Trajectory.objects.get(project=project, external_id=f"t-{i}") for i in range(3))
    TriageSignal.objects.create(project=project, trajectory=t1, kind="undeclared_tool", message_index=0, detail={})
    mode = failure_mode_create(project=project, name="Wrong tool", category_key="wrong_tool", user=user)
    failure_mode_assign(failure_mode=mode, trajectories=[t0, t2], user=user)
    key = make_api_key(project, scopes=["read"])
    by_signal = api_client.get("/api/v1/trajectories", {"signal": "undeclared_tool"}, key=key).json()["items"]
    assert [row["external_id"] for row in by_signal] == ["t-1"]
    by_mode = api_client.get("/api/v1/trajectories", {"failure_mode": mode.pk}, key=key).json()["items"]
    assert [row["external_id"] for row in by_mode] == ["t-2", "t-0"]
    assert api_client.get("/api/v1/trajectories", {"signal": "no_such_kind"}, key=key).status_code == 422
    # Another project's mode id finds nothing here.
    other = failure_mode_create(project=make_project(), name="Elsewhere", category_key="other", user=user)
    assert api_client.get("/api/v1/trajectories", {"failure_mode": other.pk}, key=key).json()["items"] == []


def test_the_api_builds_the_pages_filter_and_an_empty_value_is_still_a_value(project, api_client, make_api_key):
    """One `TrajectoryFilters` for the pages and the API: on the page an empty agent means any agent, while the
    API's `?agent=` asks for trajectories that name none, and `?external_id=` for none at all."""
    from flywheel.trajectories.api import TrajectoryQuery
    from flywheel.trajectories.selectors import TrajectoryFilters

    records = [
        {"external_id": "named", "agent": "billing", "messages": [{"role": "user", "content": "hi"}]},
        {"external_id": "anonymous", "messages": [{"role": "user", "content": "hi"}]},
    ]
    assert ingest_trajectories(project=project, records=records).accepted == 2
    key = make_api_key(project, scopes=["read"])

    def ids(params):
        response = api_client.get("/api/v1/trajectories", params, key=key)
        assert response.status_code == 200, response.content
        return [row["external_id"] for row in response.json()["items"]]

    assert ids({"agent": ""}) == ["anonymous"]
    assert ids({"agent": "billing"}) == ["named"]
    assert ids({"external_id": ""}) == []
    assert sorted(ids({"reviewed_outcome": "none", "outcome": "unknown"})) == ["anonymous", "named"]
    assert TrajectoryFilters.from_params({"agent": ""}) == TrajectoryFilters()
    query = TrajectoryQuery(agent="", reviewed_outcome="none", failure_mode=4, has_tool_error=False)
    assert query.filters() == TrajectoryFilters(agent="", reviewed_outcome="", mode=4, tool_error=False)
