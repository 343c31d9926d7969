"""JSONL upload in the UI (inline and on a real Celery worker, failure and retry) and `manage.py ingest`."""

from __future__ import annotations

import io
import json
from datetime import timedelta

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import CommandError, call_command
from django.urls import reverse
from django.utils import timezone

from flywheel.supervise import Refused
from flywheel.trajectories import upload as upload_module
from flywheel.trajectories.models import Trajectory, Upload, UploadStatus


def jsonl(records, *, broken_line: int | None = None) -> bytes:
    lines = [json.dumps(r) for r in records]
    if broken_line is not None:
        lines.insert(broken_line - 1, "{broken")
    return ("\n".join(lines) + "\n").encode()


@pytest.fixture
def reviewer(make_user, make_membership, project):
    user = make_user()
    make_membership(user, project, "reviewer")
    return user


def post_file(client, project, content: bytes, name: str = "runs.jsonl"):
    return client.post(reverse("upload", args=[project.slug]), {"file": SimpleUploadedFile(name, content)})


@pytest.mark.django_db
def test_the_page_needs_the_reviewer_role(client_for, project, make_user, make_membership, reviewer):
    url = reverse("upload", args=[project.slug])
    assert client_for(None).get(url).status_code == 302  # to the login page
    assert client_for(make_user()).get(url).status_code == 404  # not a member
    viewer = make_user()
    make_membership(viewer, project, "viewer")
    assert client_for(viewer).get(url).status_code == 403
    assert client_for(viewer).post(url, {"file": SimpleUploadedFile("a.jsonl", b"{}")}).status_code == 403
    assert client_for(reviewer).get(url).status_code == 200


@pytest.fixture
def failed_upload(project):
    return Upload.objects.create(
        project=project, filename="a.jsonl", content=b"{}\n", size_bytes=3, status=UploadStatus.FAILED, error="boom"
    )


@pytest.mark.django_db
@pytest.mark.parametrize(("method", "name"), [("get", "upload_detail"), ("post", "upload_retry")])
def test_an_upload_needs_the_reviewer_role(client_for, project, make_user, make_membership, failed_upload, method, name):
    url = reverse(name, args=[project.slug, failed_upload.pk])

    anonymous = getattr(client_for(None), method)(url)
    assert anonymous.status_code == 302
    assert anonymous["Location"].startswith(reverse("login") + "?next=")
    assert getattr(client_for(make_user()), method)(url).status_code == 404  # not a member
    viewer = make_user()
    make_membership(viewer, project, "viewer")
    denied = getattr(client_for(viewer), method)(url)
    assert denied.status_code == 403
    assert "reviewer role" in denied.content.decode()
    failed_upload.refresh_from_db()
    assert (failed_upload.status, failed_upload.attempt) == (UploadStatus.FAILED, 0)  # no retry ran


@pytest.mark.django_db
def test_an_upload_of_another_project_is_404(client_for, project, make_project, reviewer, failed_upload):
    other = make_project(owner=reviewer)
    client = client_for(reviewer)
    assert client.get(reverse("upload_detail", args=[other.slug, failed_upload.pk])).status_code == 404
    assert client.post(reverse("upload_retry", args=[other.slug, failed_upload.pk])).status_code == 404
    failed_upload.refresh_from_db()
    assert failed_upload.status == UploadStatus.FAILED


@pytest.mark.django_db
def test_a_small_file_is_ingested_at_once_with_per_line_errors(client_for, project, reviewer, make_record):
    bad = make_record("t-bad")
    bad["messages"][1]["role"] = "robot"
    content = jsonl([make_record("t-1"), bad, make_record("t-2")], broken_line=3)
    response = post_file(client_for(reviewer), project, content)
    assert response.status_code == 302
    upload = Upload.objects.get(project=project)
    assert upload.status == UploadStatus.DONE
    assert (upload.lines_total, upload.lines_done, upload.accepted, upload.rejected_count) == (4, 4, 2, 2)
    assert upload.uploaded_by == reviewer
    assert [(r["line"], r["external_id"]) for r in upload.rejected] == [(2, "t-bad"), (3, None)]
    assert upload.rejected[0]["errors"][0]["field"] == "messages[1].role"
    assert set(
        Trajectory.objects.filter(project=project, source="upload").values_list("external_id", flat=True)
    ) == {"t-1", "t-2"}

    page = client_for(reviewer).get(response["Location"])
    text = page.content.decode()
    assert "messages[1].role" in text and "not valid JSON" in text
    assert "2</strong> accepted" in text


@pytest.mark.django_db
def test_a_file_over_the_upload_limit_is_refused_naming_it(client_for, project, reviewer, make_record, settings):
    content = jsonl([make_record("t-1")])
    settings.FLYWHEEL_MAX_UPLOAD_BYTES = len(content) - 1
    response = post_file(client_for(reviewer), project, content)
    assert response.status_code == 400
    assert f"the limit is {len(content) - 1}\xa0bytes" in response.content.decode()
    # In the units a person reads: 3 MB, not 3145728 bytes.
    settings.FLYWHEEL_MAX_UPLOAD_BYTES = 3 * 1024 * 1024
    big = b" " * (3 * 1024 * 1024 + 1) + content
    text = post_file(client_for(reviewer), project, big).content.decode()
    assert "The file is 3.0\xa0MB; the limit is 3.0\xa0MB." in text and "bytes" not in text.split("form-errors")[1][:200]
    settings.FLYWHEEL_MAX_UPLOAD_BYTES = len(content) - 1
    with pytest.raises(upload_module.UploadRefused, match="the limit is"):
        upload_module.upload_create(project=project, filename="a.jsonl", content=content)
    assert not Upload.objects.exists()

    settings.FLYWHEEL_MAX_UPLOAD_BYTES = len(content)
    assert post_file(client_for(reviewer), project, content).status_code == 302


@pytest.mark.django_db
def test_empty_and_missing_files_are_refused(client_for, project, reviewer):
    client = client_for(reviewer)
    assert client.post(reverse("upload", args=[project.slug]), {}).status_code == 400
    assert post_file(client, project, b"\n\n").status_code == 400
    assert not Upload.objects.exists()


@pytest.mark.django_db
def test_a_json_array_is_refused_with_a_hint_to_send_jsonl(client_for, project, reviewer, make_record):
    content = json.dumps([make_record("t-1"), make_record("t-2")], indent=2).encode()
    response = post_file(client_for(reviewer), project, content, name="runs.json")
    assert response.status_code == 400
    assert "The file is one JSON array; upload JSONL, one trajectory a line" in response.content.decode()
    assert not Upload.objects.exists()


@pytest.mark.django_db
def test_a_crash_leaves_an_explained_retryable_upload(
    client_for, project, reviewer, make_record, monkeypatch
):
    def broken(**kwargs):
        raise RuntimeError("database went away")

    monkeypatch.setattr(upload_module, "ingest_trajectories", broken)
    post_file(client_for(reviewer), project, jsonl([make_record("t-1")]))
    upload = Upload.objects.get(project=project)
    assert upload.status == UploadStatus.FAILED
    assert "database went away" in upload.error and "line 1" in upload.error
    page = client_for(reviewer).get(reverse("upload_detail", args=[project.slug, upload.pk])).content.decode()
    assert "database went away" in page and "Retry" in page

    monkeypatch.undo()
    response = client_for(reviewer).post(reverse("upload_retry", args=[project.slug, upload.pk]))
    assert response.status_code == 302
    upload.refresh_from_db()
    assert (upload.status, upload.accepted, upload.attempt, upload.error) == (UploadStatus.DONE, 1, 2, "")
    assert Trajectory.objects.filter(project=project).count() == 1


@pytest.mark.django_db
def test_only_failed_or_stuck_uploads_are_retried(project, make_record):
    upload = upload_module.upload_create(
        project=project, filename="a.jsonl", content=jsonl([make_record("t-1")])
    )
    with pytest.raises(Refused, match="The upload is done: only a failed, stuck or long-waiting upload"):
        upload_module.upload_retry(upload=upload)
    # Processing, with a lease still good: its run is going, a retry would race it.
    Upload.objects.filter(pk=upload.pk).update(
        status=UploadStatus.PROCESSING, lease_owner="elsewhere", lease_expires_at=timezone.now() + timedelta(minutes=1)
    )
    upload.refresh_from_db()
    assert not upload.stale
    with pytest.raises(Refused, match="The upload is processing: only a failed, stuck"):
        upload_module.upload_retry(upload=upload)
    # The lease expired: the run lost its worker (or is too slow to keep it).
    Upload.objects.filter(pk=upload.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    upload.refresh_from_db()
    assert upload.stale
    assert upload_module.upload_retry(upload=upload).status == UploadStatus.DONE


@pytest.mark.django_db
def test_the_htmx_status_fragment_polls_while_running(client_for, project, reviewer, make_record):
    upload = Upload.objects.create(
        project=project, filename="big.jsonl", content=b"{}", size_bytes=2, lines_total=1
    )
    response = client_for(reviewer).get(
        reverse("upload_detail", args=[project.slug, upload.pk]), headers={"HX-Request": "true"}
    )
    text = response.content.decode()
    assert 'id="upload-status"' in text and 'hx-trigger="every 1s"' in text
    assert "<html" not in text
    assert "HX-Trigger" not in response.headers

    # The last poll tells the page, whose list of recent uploads then draws itself again (it said Queued).
    Upload.objects.filter(pk=upload.pk).update(status=UploadStatus.DONE)
    done = client_for(reviewer).get(reverse("upload_detail", args=[project.slug, upload.pk]), headers={"HX-Request": "true"})
    assert done.headers["HX-Trigger"] == "upload-finished"
    assert 'hx-trigger="every 1s"' not in done.content.decode()
    page = client_for(reviewer).get(reverse("upload_detail", args=[project.slug, upload.pk])).content.decode()
    assert 'id="recent-uploads"' in page and 'hx-trigger="upload-finished from:body"' in page


def test_a_large_file_is_ingested_by_the_worker(
    celery_worker, client_for, make_project, make_user, make_membership, make_record, monkeypatch
):
    user = make_user()
    project = make_project(owner=user)
    monkeypatch.setattr(upload_module, "INLINE_MAX_BYTES", 1_000)
    monkeypatch.setattr(upload_module, "CHUNK_LINES", 7)  # in this process only; the worker uses its own
    content = jsonl([make_record(f"t-{i}") for i in range(40)], broken_line=5)
    response = post_file(client_for(user), project, content)
    assert response.status_code == 302
    upload = Upload.objects.get(project=project)
    assert upload.status in (UploadStatus.QUEUED, UploadStatus.PROCESSING, UploadStatus.DONE)

    done = celery_worker.wait_for(
        lambda: Upload.objects.filter(pk=upload.pk, status=UploadStatus.DONE).first(), timeout=60
    )
    assert (done.accepted, done.created, done.rejected_count, done.lines_done) == (40, 40, 1, 41)
    assert done.rejected[0]["line"] == 5
    assert Trajectory.objects.filter(project=project, source="upload").count() == 40


@pytest.mark.django_db
def test_manage_py_ingest(tmp_path, project, make_record):
    bad = make_record("t-bad", outcome="meh")
    path = tmp_path / "runs.jsonl"
    path.write_bytes(jsonl([make_record("t-1"), bad, make_record("t-2")]))
    out, err = io.StringIO(), io.StringIO()
    call_command("ingest", str(path), project=project.slug, stdout=out, stderr=err)
    assert "2 accepted (2 created, 0 updated), 1 rejected" in out.getvalue()
    assert "line 2 (t-bad): outcome:" in err.getvalue()
    assert set(
        Trajectory.objects.filter(project=project, source="cli").values_list("external_id", flat=True)
    ) == {"t-1", "t-2"}

    call_command("ingest", str(path), project=project.slug, stdout=out, stderr=err)
    assert "2 accepted (0 created, 2 updated)" in out.getvalue()
    with pytest.raises(CommandError, match="1 line"):
        call_command("ingest", str(path), project=project.slug, strict=True, stdout=out, stderr=err)
    with pytest.raises(CommandError, match="No project"):
        call_command("ingest", str(path), project="nope")


@pytest.mark.django_db
@pytest.mark.parametrize("source", ["backfill-from-the-old-system", "made-up", ""])
def test_manage_py_ingest_refuses_an_unknown_source(tmp_path, project, make_record, source):
    path = tmp_path / "runs.jsonl"
    path.write_bytes(jsonl([make_record("t-1")]))
    with pytest.raises(CommandError, match=r"--source .* is not one of: api, upload, otlp, cli, demo"):
        call_command("ingest", str(path), "--project", project.slug, "--source", source, stdout=io.StringIO())
    assert not Trajectory.objects.exists()
    call_command("ingest", str(path), "--project", project.slug, "--source", "demo", stdout=io.StringIO())
    assert Trajectory.objects.get().source == "demo"


@pytest.mark.django_db(transaction=True)
def test_a_broker_that_is_down_leaves_the_upload_queued_for_the_sweep(
    client_for, project, reviewer, make_record, monkeypatch
):
    from flywheel.trajectories import tasks

    def down(*args, **kwargs):
        raise ConnectionError("broker unreachable")

    monkeypatch.setattr(upload_module, "INLINE_MAX_BYTES", 10)
    monkeypatch.setattr(tasks.upload_process_task, "delay", down)
    upload = upload_module.upload_create(
        project=project, filename="a.jsonl", content=jsonl([make_record("t-1")])
    )
    upload.refresh_from_db()
    # The upload committed and says it waits; the broker's failure is not the user's.
    assert (upload.status, upload.error) == (UploadStatus.QUEUED, "")
    page = client_for(reviewer).get(reverse("upload_detail", args=[project.slug, upload.pk])).content.decode()
    assert "Waiting for a worker" in page and "Retry" not in page
    with pytest.raises(Refused, match="The upload is queued: only a failed, stuck"):
        upload_module.upload_retry(upload=upload)  # not yet: its message may still be on its way
    assert upload_module.upload_sweep() == 0

    # Past FLYWHEEL_REQUEUE_AFTER_S: the sweep sends it again (the broker still down: it keeps waiting).
    Upload.objects.filter(pk=upload.pk).update(queued_at=timezone.now() - timedelta(hours=1))
    assert upload_module.upload_sweep() == 0
    upload.refresh_from_db()
    assert upload.status == UploadStatus.QUEUED
    sent = []
    monkeypatch.setattr(tasks.upload_process_task, "delay", lambda upload_id: sent.append(upload_id))
    Upload.objects.filter(pk=upload.pk).update(queued_at=timezone.now() - timedelta(hours=1))
    assert upload_module.upload_sweep() == 1
    assert sent == [upload.pk]
    assert upload_module.upload_sweep() == 0  # sent just now: not again before its time

    # Retry sends it too, once it has waited long enough for the page to offer it.
    Upload.objects.filter(pk=upload.pk).update(queued_at=timezone.now() - timedelta(hours=1))
    page = client_for(reviewer).get(reverse("upload_detail", args=[project.slug, upload.pk])).content.decode()
    assert "Retry" in page
    monkeypatch.setattr(upload_module, "INLINE_MAX_BYTES", 10_000)
    assert upload_module.upload_retry(upload=upload).status == UploadStatus.DONE


@pytest.fixture
def queued_upload(project, make_record, monkeypatch):
    """An upload of three lines, queued for a worker (no message is sent: the test decides who runs it)."""
    monkeypatch.setattr(upload_module, "INLINE_MAX_BYTES", 10)
    upload = upload_module.upload_create(
        project=project, filename="a.jsonl", content=jsonl([make_record(f"t-{i}") for i in range(3)])
    )
    assert upload.status == UploadStatus.QUEUED
    return upload


def _counters(upload_id):
    return Upload.objects.values(
        "status", "attempt", "lease_owner", "lines_done", "accepted", "created", "updated", "rejected_count"
    ).get(pk=upload_id)


@pytest.mark.django_db
def test_a_delivery_while_a_run_holds_the_upload_does_nothing(queued_upload):
    # A run holds the upload (its lease is good): a redelivered message, or a second one, must not start
    # a second run that resets and races its counters.
    owner = upload_module.upload_claim(upload_id=queued_upload.pk)
    held = _counters(queued_upload.pk)
    assert (held["status"], held["attempt"], held["lease_owner"]) == (UploadStatus.PROCESSING, 1, owner)

    assert upload_module.upload_claim(upload_id=queued_upload.pk) is None
    assert upload_module.upload_process(upload_id=queued_upload.pk).status == UploadStatus.PROCESSING
    assert _counters(queued_upload.pk) == held
    assert not Trajectory.objects.exists()

    assert upload_module.upload_run(upload_id=queued_upload.pk, owner=owner).status == UploadStatus.DONE
    assert _counters(queued_upload.pk) == {
        **held, "status": UploadStatus.DONE, "lines_done": 3, "accepted": 3, "created": 3,
    }  # fmt: skip


@pytest.mark.django_db
def test_a_run_that_lost_its_lease_writes_nothing(queued_upload):
    slow = upload_module.upload_claim(upload_id=queued_upload.pk)
    # Its lease runs out (the run is stuck, or only slow): the upload is taken over and finished.
    Upload.objects.filter(pk=queued_upload.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    done = upload_module.upload_process(upload_id=queued_upload.pk)
    assert (done.status, done.attempt, done.accepted, done.created) == (UploadStatus.DONE, 2, 3, 3)
    after_winner = _counters(queued_upload.pk)
    stored = dict(Trajectory.objects.values_list("external_id", "updated_at"))

    # The first run goes on: it finds the lease another's and stops before its first write.
    upload_module.upload_run(upload_id=queued_upload.pk, owner=slow)
    assert _counters(queued_upload.pk) == after_winner
    assert dict(Trajectory.objects.values_list("external_id", "updated_at")) == stored


@pytest.mark.django_db
def test_the_sweep_sends_uploads_that_lost_their_worker_and_gives_up_after_max_attempts(queued_upload, monkeypatch):
    from flywheel.trajectories import tasks

    sent = []
    monkeypatch.setattr(tasks.upload_process_task, "delay", lambda upload_id: sent.append(upload_id))
    expired = timezone.now() - timedelta(seconds=1)
    Upload.objects.filter(pk=queued_upload.pk).update(
        status=UploadStatus.PROCESSING, lease_owner="gone", lease_expires_at=expired, attempt=1
    )
    assert upload_module.upload_sweep() == 1
    assert sent == [queued_upload.pk]
    again = Upload.objects.get(pk=queued_upload.pk)
    assert (again.status, again.lease_owner, again.lease_expires_at) == (UploadStatus.QUEUED, "", None)

    # A file that loses its worker every time (it kills it, say) is not sent forever.
    Upload.objects.filter(pk=queued_upload.pk).update(
        status=UploadStatus.PROCESSING, lease_owner="gone", lease_expires_at=expired,
        attempt=Upload.LOST_WORKER_ATTEMPTS,
    )  # fmt: skip
    assert upload_module.upload_sweep() == 0
    failed = Upload.objects.get(pk=queued_upload.pk)
    assert failed.status == UploadStatus.FAILED
    assert f"lost its worker {Upload.LOST_WORKER_ATTEMPTS} times" in failed.error
    assert sent == [queued_upload.pk]


def _wait_for_task(celery_worker, task_id: str) -> str:
    """The worker's log line for a task that ran."""
    return celery_worker.wait_for(
        lambda: next((line for line in celery_worker.log().splitlines() if f"[{task_id}]" in line and " succeeded " in line), None)
    )


def test_a_stale_upload_taken_over_on_the_worker_is_written_by_one_run(celery_worker, project, make_record, monkeypatch):
    from flywheel.trajectories.tasks import upload_process_task

    monkeypatch.setattr(upload_module, "INLINE_MAX_BYTES", 10)
    upload = Upload.objects.create(
        project=project, filename="a.jsonl", content=jsonl([make_record(f"t-{i}") for i in range(5)]),
        size_bytes=100, lines_total=5, queued_at=timezone.now(),
    )  # fmt: skip
    first = upload_module.upload_claim(upload_id=upload.pk)
    # A second delivery while the first run holds it: the worker takes it and does nothing.
    line = _wait_for_task(celery_worker, upload_process_task.delay(upload.pk).id)
    assert "'processing'" in line
    assert _counters(upload.pk)["lease_owner"] == first

    # The first run's lease expires; Retry hands the upload to the worker, which runs it to the end.
    Upload.objects.filter(pk=upload.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    upload.refresh_from_db()
    assert upload_module.upload_retry(upload=upload).status == UploadStatus.QUEUED
    done = celery_worker.wait_for(lambda: Upload.objects.filter(pk=upload.pk, status=UploadStatus.DONE).first())
    assert (done.attempt, done.accepted, done.created, done.lines_done) == (2, 5, 5, 5)
    assert done.lease_owner != first
    stored = dict(Trajectory.objects.values_list("external_id", "updated_at"))

    # The first run was only slow: it goes on, and writes neither the file nor the counters.
    upload_module.upload_run(upload_id=upload.pk, owner=first)
    assert _counters(upload.pk) == _counters(done.pk) and Upload.objects.get(pk=upload.pk).attempt == 2
    assert dict(Trajectory.objects.values_list("external_id", "updated_at")) == stored


def test_a_queued_upload_whose_message_was_lost_is_picked_up_again(celery_worker, project, make_record):
    from flywheel.celery import outbox_sweep_task

    # Queued an hour ago, and its message never reached a worker (lost, or the broker was down).
    upload = Upload.objects.create(
        project=project, filename="a.jsonl", content=jsonl([make_record(f"t-{i}") for i in range(4)]),
        size_bytes=100, lines_total=4, queued_at=timezone.now() - timedelta(hours=1),
    )  # fmt: skip
    # What Celery beat sends every FLYWHEEL_SWEEP_INTERVAL_S: the worker runs the sweep, which sends the upload.
    outbox_sweep_task.delay()
    done = celery_worker.wait_for(lambda: Upload.objects.filter(pk=upload.pk, status=UploadStatus.DONE).first())
    assert (done.attempt, done.accepted, done.created) == (1, 4, 4)
    assert Trajectory.objects.filter(project=project).count() == 4


@pytest.mark.django_db
def test_the_api_an_upload_and_the_command_report_the_same_lines(
    tmp_path, client_for, api_client, api_key, project, reviewer, make_record
):
    lines = [json.dumps(make_record("t-1")), "", "{broken", json.dumps(make_record("t-bad", outcome="great"))]
    content = ("\n".join(lines) + "\n").encode()

    api = api_client.with_key(api_key).post("/api/v1/trajectories", body=content, content_type="application/x-ndjson")
    assert [r["index"] + 1 for r in api.json()["rejected"]] == [3, 4]  # the API counts lines from 0

    post_file(client_for(reviewer), project, content)
    assert [r["line"] for r in Upload.objects.get(project=project).rejected] == [3, 4]

    path = tmp_path / "runs.jsonl"
    path.write_bytes(content)
    err = io.StringIO()
    with pytest.raises(CommandError):
        call_command("ingest", str(path), "--project", project.slug, "--strict", stdout=io.StringIO(), stderr=err)
    assert [line.split(":")[0] for line in err.getvalue().splitlines()] == ["line 3", "line 4 (t-bad)"]


@pytest.mark.django_db
def test_lines_the_database_cannot_store_are_rejected_and_the_upload_finishes(project, make_record):
    """Before: a NaN or a lone surrogate made PostgreSQL refuse the chunk's statement (and a NUL in a rejected
    line's external_id made it refuse the upload's error list): the upload failed, and failed again on
    every retry, the valid lines of its chunk never stored."""
    nan = make_record("t-nan", metadata={"score": float("nan")})
    surrogate = make_record("t-\ud800")  # json.dumps writes the escape "\ud800", which JSON reads back
    nul = make_record("t-\x00")
    content = jsonl([make_record("t-1"), nan, surrogate, nul, make_record("t-2")])

    upload = upload_module.upload_create(project=project, filename="a.jsonl", content=content)

    upload.refresh_from_db()
    assert (upload.status, upload.error) == (UploadStatus.DONE, "")
    assert (upload.accepted, upload.rejected_count) == (2, 3)
    assert [(r["line"], r["external_id"], r["errors"][0]["field"]) for r in upload.rejected] == [
        (2, "t-nan", "metadata.score"),
        (3, "t-\\ud800", "external_id"),
        (4, "t-\\u0000", "external_id"),
    ]
    assert set(Trajectory.objects.filter(project=project).values_list("external_id", flat=True)) == {"t-1", "t-2"}
