"""Triage on a real Celery worker: after a real API ingest, after a replay, after a lost message (the sweep),
and a maintainer's re-run with its progress."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from flywheel.trajectories.models import Trajectory, TriageRun, TriageRunStatus, TriageSignal
from tests.standin import StandIn, serving


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


class Recorder(StandIn):
    """Where a fetched `$ref` would go: answers a schema, and remembers that it was asked."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.requests.append(self.path)
        self.answer(200, {"type": "string", "enum": ["from-the-server"]})


SECRET = "s3cr3t-admin-password"


def hostile(external_id, parameters, arguments):
    """One call to a tool whose parameters schema the sender wrote, as an ingest key can send it."""
    tools = [{"type": "function", "function": {"name": "get_order", "parameters": parameters}}]
    return {**record(external_id), "tools": tools, "messages": [
        {"role": "user", "content": "Where is my order?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_order", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"status": "shipped"}'},
        {"role": "assistant", "content": "It shipped."},
    ]}


def test_a_hostile_tool_schema_is_triaged_without_a_fetch_a_file_read_or_backtracking(
    celery_worker, api_client, api_key, project, user, client_for, tmp_path
):
    """Issue 22: a `$ref` to a server, a `file:` `$ref` to a file holding a secret, and `^(a+)+$` as a
    patternProperties key against 30 a's and a "!" (minutes for Python's re), ingested through the API and
    triaged by the worker."""
    secret = tmp_path / "local-login.json"
    secret.write_text(json.dumps({"type": "string", "enum": [SECRET]}))
    redos = {"type": "object", "patternProperties": {"^(a+)+$": {"type": "string"}}, "additionalProperties": False}
    with serving(Recorder, requests=[]) as server:
        records = [
            hostile("http-ref", {"type": "object", "properties": {"order_id": {"$ref": f"{server.url}/x.json"}}},
                    {"order_id": "1"}),
            hostile("file-ref", {"type": "object", "properties": {"order_id": {"$ref": secret.as_uri()}}},
                    {"order_id": "1"}),
            hostile("redos", redos, {"a" * 30 + "!": "x"}),
        ]
        assert api_client.post("/api/v1/trajectories", records, key=api_key).status_code == 200
        # A generous bound: triage takes well under a second; before RE2 the last one alone took minutes.
        celery_worker.wait_for(lambda: not Trajectory.objects.filter(project=project, triage_version=0).exists(),
                               timeout=20)
        assert server.requests == []  # nothing fetched
    # The schemas that point outside are the tools' problem, never the model's: no schema signal, no values.
    assert "schema_violation" not in kinds(project, "http-ref") | kinds(project, "file-ref")
    # The hostile key was matched on RE2, with an answer: it fits no pattern, and no other key is allowed.
    (violation,) = TriageSignal.objects.filter(trajectory__external_id="redos", kind="schema_violation")
    assert "does not match any of the regexes" in violation.detail["errors"][0]
    stored = json.dumps(list(TriageSignal.objects.filter(project=project).values_list("detail", flat=True)))
    assert SECRET not in stored and "from-the-server" not in stored
    page = client_for(user).get(reverse("trajectory_detail", args=[project.slug,
                                                                   Trajectory.objects.get(external_id="file-ref").pk]))
    assert page.status_code == 200 and SECRET not in page.content.decode()
    # The page says why no argument of that tool was checked, rather than leaving silence to read as "they fit".
    problems = page.context["tool_problems"]
    assert [name for name, _ in problems] == ["get_order"] and "outside the schema" in problems[0][1], problems
    assert "Arguments not checked for <code>get_order</code>: its parameters schema cannot be used" in page.content.decode()
    assert "<li><code>get_order</code>: " in page.content.decode()


def drop_call(external_id, parameters):
    """A call of a tool whose schema the sender wrote, that the default policy calls unsafe (`drop_*`)."""
    tools = [{"type": "function", "function": {"name": "drop_orders", "parameters": parameters}}]
    return {**hostile(external_id, parameters, {"table": "orders"}), "tools": tools, "messages": [
        {"role": "user", "content": "Where is my order?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "drop_orders", "arguments": json.dumps({"table": "orders"})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"ok": true}'},
        {"role": "assistant", "content": "Done."},
    ]}


def test_a_tool_schema_whose_local_ref_points_nowhere_or_loops_hides_no_unsafe_call(
    celery_worker, api_client, api_key, project
):
    """One bad tool schema, sent with an ingest key, used to make triage raise, and the trajectory was stored
    with no signal at all: the unsafe call it made went unseen."""
    from trainer.verifiers.schemas import tool_index

    schemas = {
        "dangling": {"type": "object", "properties": {"table": {"$ref": "#/$defs/missing"}}},
        "nowhere": {"type": "object", "properties": {"table": {"$ref": "#/nope"}}},
        "loop": {"type": "object", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                 "properties": {"table": {"$ref": "#/$defs/a"}}},
        "root-loop": {"type": "object", "properties": {"table": {"$ref": "#"}}, "allOf": [{"$ref": "#"}]},
        # Past the check (a string ends the loop), but an object never does: found when validating.
        "any-of-loop": {"anyOf": [{"type": "string"}, {"$ref": "#"}]},
    }
    records = [drop_call(name, schema) for name, schema in schemas.items()]
    assert api_client.post("/api/v1/trajectories", records, key=api_key).status_code == 200
    celery_worker.wait_for(lambda: not Trajectory.objects.filter(project=project, triage_version=0).exists(),
                           timeout=20)
    for name in schemas:
        # The schema is the tool's problem, never the model's; the call is still unsafe.
        assert kinds(project, name) == {"unsafe_action"}, name
        (unsafe,) = TriageSignal.objects.filter(trajectory__external_id=name, kind="unsafe_action")
        assert unsafe.detail == {"calls": [{"tool": "drop_orders", "rule": "drop_*"}]}
    problems = {name: tool_index(Trajectory.objects.get(external_id=name).tools)["drop_orders"].schema_problem
                for name in schemas}
    assert '$ref "#/$defs/missing" points to nothing inside the schema' in problems["dangling"]
    assert '$ref "#/nope" points to nothing inside the schema' in problems["nowhere"]
    assert "loops back to where it started" in problems["loop"] and "loops back" in problems["root-loop"]
    assert problems["any-of-loop"] is None  # reported per call instead (tests/trainer/test_jsonschemas.py)
