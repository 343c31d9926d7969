"""Triage on a real Celery worker: after a real API ingest, after a replay, after a lost message (the sweep),
and a maintainer's re-run with its progress."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from flywheel.trajectories.models import Trajectory, TriageRun, TriageRunStatus, TriageSignal


@pytest.fixture(autouse=True)
def _triage_on(settings):
    """Automatic triage is what these tests are about (tests/conftest.py turns it off elsewhere)."""
    settings.FLYWHEEL_TRIAGE = True


TOOLS = [{"type": "function", "function": {"name": "get_order", "parameters": {"type": "object"}}}]


def record(external_id, name="get_order", **extra):
    call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps({"order_id": "1"})}}
    return {
        "external_id": external_id,
        "messages": [
            {"role": "user", "content": "Where is my order?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"status": "shipped"}'},
            {"role": "assistant", "content": "It shipped."},
        ],
        "tools": TOOLS,
        **extra,
    }


def kinds(project, external_id):
    return set(
        TriageSignal.objects.filter(trajectory__project=project, trajectory__external_id=external_id).values_list(
            "kind", flat=True
        )
    )


def test_signals_appear_after_an_api_ingest_and_a_replay_is_triaged_again(celery_worker, api_client, api_key, project):
    response = api_client.post(
        "/api/v1/trajectories", [record("ok"), record("made-up", name="cancel_order")], key=api_key
    )
    assert response.status_code == 200, response.content
    celery_worker.wait_for(lambda: not Trajectory.objects.filter(project=project, triage_version=0).exists())
    assert kinds(project, "ok") == set()
    assert kinds(project, "made-up") == {"undeclared_tool"}
    assert Trajectory.objects.get(external_id="made-up").suggested_category == "hallucinated_api"

    replay = record("made-up", feedback={"thumbs": "down"})
    assert api_client.post("/api/v1/trajectories", [replay], key=api_key).json()["updated"] == 1
    celery_worker.wait_for(lambda: kinds(project, "made-up") == {"negative_feedback"})
    assert Trajectory.objects.get(external_id="made-up").suggested_category == "other"


def test_the_sweep_picks_up_a_project_whose_message_was_lost(celery_worker, settings, api_client, api_key, project):
    from flywheel import outbox

    settings.FLYWHEEL_TRIAGE = False  # the ingest sends no message, as if it were lost
    api_client.post("/api/v1/trajectories", [record("lost", name="wipe_disk")], key=api_key)
    Trajectory.objects.filter(project=project).update(updated_at=timezone.now() - timedelta(hours=1))
    assert not TriageSignal.objects.exists()
    # What Celery beat has a worker run every FLYWHEEL_SWEEP_INTERVAL_S (the beat side is tested with uploads in
    # tests/platform/test_faults.py); here in this process, where triage is on again, so that the session's
    # worker, which runs with automatic triage off (tests/conftest.py), only does the triage the sweep sends.
    settings.FLYWHEEL_TRIAGE = True
    sent = outbox.outbox_sweep()
    assert sent["flywheel.trajectories.triage.triage_sweep"] == 1
    celery_worker.wait_for(lambda: kinds(project, "lost") == {"undeclared_tool"})


def test_a_rerun_from_the_page_triages_the_whole_project_with_progress(
    celery_worker, settings, client_for, user, project
):
    from flywheel.trajectories.ingest import ingest_trajectories
    from flywheel.trajectories.triage_policy import policy_set

    settings.FLYWHEEL_TRIAGE = False
    ingest_trajectories(project=project, records=[record(f"t-{i}", name="wipe_disk") for i in range(1100)])
    policy_set(project_id=project.pk, text='[{"name": "wipe_*"}]')
    client = client_for(user)
    assert client.post(reverse("triage_run_start", args=[project.slug])).status_code == 302
    run = TriageRun.objects.get(project=project)
    done = celery_worker.wait_for(
        lambda: TriageRun.objects.filter(pk=run.pk, status=TriageRunStatus.DONE).first(), timeout=120
    )
    assert (done.total, done.done, done.percent) == (1100, 1100, 100)
    assert done.started_at and done.finished_at and not done.error
    assert TriageSignal.objects.filter(kind="unsafe_action").count() == 1100
    assert set(Trajectory.objects.values_list("triage_version", flat=True)) == {done.version}
    fragment = client.get(reverse("triage_run_status", args=[project.slug, run.pk])).content.decode()
    assert "1100 of 1100" in fragment and "Done" in fragment


def test_a_failed_rerun_is_retried_from_the_page_by_a_maintainer(
    celery_worker, settings, client_for, user, project, make_user, make_membership
):
    from flywheel.trajectories.ingest import ingest_trajectories

    settings.FLYWHEEL_TRIAGE = False
    ingest_trajectories(project=project, records=[record(f"t-{i}") for i in range(3)])
    run = TriageRun.objects.create(project=project, version=1, status=TriageRunStatus.FAILED,
                                   error="The worker running this triage re-run (w:1) stopped answering.")
    client = client_for(user)
    page = client.get(reverse("triage_page", args=[project.slug])).content.decode()
    assert "stopped answering" in page and reverse("triage_run_retry", args=[project.slug, run.pk]) in page

    viewer = make_user("viewer-of-triage")
    make_membership(viewer, project, "viewer")
    viewing = client_for(viewer)
    assert reverse("triage_run_retry", args=[project.slug, run.pk]) not in viewing.get(
        reverse("triage_page", args=[project.slug])).content.decode()
    assert viewing.post(reverse("triage_run_retry", args=[project.slug, run.pk])).status_code == 403

    assert client.post(reverse("triage_run_retry", args=[project.slug, run.pk])).status_code == 302
    done = celery_worker.wait_for(
        lambda: TriageRun.objects.filter(pk=run.pk, status=TriageRunStatus.DONE).first(), timeout=120
    )
    assert done.done == done.total == 3 and not done.error and done.attempt == 1
    # A run that is done is not retried again: the page refuses with the reason.
    refused = client.post(reverse("triage_run_retry", args=[project.slug, run.pk]))
    assert refused.status_code == 409 and "only a failed triage re-run is retried" in refused.content.decode()
