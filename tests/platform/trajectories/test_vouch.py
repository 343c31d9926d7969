"""Live evidence at ingestion (flywheel.trajectories.vouch): the router's token checked at every door (the REST
API, a JSONL upload, OTLP), the verdict and its reason stored on the trajectory with its sender, a replay of a
token for another trajectory refused, a late update by the same sender kept, the key rotated with SECRET_KEY,
and the endpoint the router reads its key from."""

from __future__ import annotations

import base64
import json
import os
import time

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

from flywheel.registry.models import VersionName
from flywheel.router import evidence_parse
from flywheel.trajectories.models import Trajectory
from flywheel.trajectories.vouch import evidence_keys
from tests.platform.registry.worlds import evidence_token, versions_with_adapters
from tests.platform.trajectories.test_otlp import any_value, export, openinference_agent, post_protobuf


@pytest.fixture
def versions(project, user, tmp_path):
    return versions_with_adapters(project, user, tmp_path)


def record(external_id, model_version, token=None, outcome="failure"):
    return {"external_id": external_id, "model_version": model_version, "outcome": outcome,
            "messages": [{"role": "user", "content": "refund order 7"}],
            "metadata": {} if token is None else {"flywheel_evidence": token}}


def vouches(project):
    return {t.external_id: t.vouch for t in Trajectory.objects.filter(project=project)}


def test_each_token_is_judged_and_the_verdict_stored_with_why(project, versions, api_client, make_api_key,
                                                              make_project):
    key = make_api_key(project, scopes=["ingest"])
    v2 = f"{project.slug}-v2"
    good = evidence_token(project, 2)
    tampered = good.replace("fw1.2.", "fw1.1.", 1)
    other_project = make_project("elsewhere")
    records = [
        record("ok", v2, good),
        record("none", v2),
        record("other-version", v2, evidence_token(project, 1)),
        record("old", v2, evidence_token(project, 2, at=time.time() - 25 * 3600)),
        record("ahead", v2, evidence_token(project, 2, at=time.time() + 3600)),
        record("forged", v2, evidence_token(project, 2, key=os.urandom(32))),
        record("tampered", f"{project.slug}-v1", tampered),
        record("other-project", v2, evidence_token(other_project, 2)),
        record("garbage", v2, "fw1.2.not-a-token"),
        record("number", v2, 42),
    ]
    answer = api_client.post("/api/v1/trajectories", records, key=key)
    assert answer.status_code == 200 and answer.json()["accepted"] == len(records)  # stored, every one
    assert vouches(project) == {
        "ok": "vouched", "none": "", "other-version": "other_version", "old": "expired", "ahead": "future",
        "forged": "bad_mac", "tampered": "bad_mac", "other-project": "bad_mac", "garbage": "malformed",
        "number": "malformed"}
    stored = Trajectory.objects.get(project=project, external_id="ok")
    assert stored.vouch_request == evidence_parse(good).request_id
    assert stored.ingested_by == f"key:{key.api_key.pk}" and stored.get_vouch_display() == "Vouched for"
    assert Trajectory.objects.get(project=project, external_id="forged").vouch_request == ""
    reader = make_api_key(project, scopes=["read"])
    assert api_client.get(f"/api/v1/trajectories/{stored.pk}", key=reader).json()["vouch"] == "vouched"
    # The same token for another trajectory, later or in one batch: a replay.
    again = api_client.post("/api/v1/trajectories", [record("copy", v2, good), record("copy-2", v2, good)], key=key)
    assert again.json()["accepted"] == 2
    assert (vouches(project)["copy"], vouches(project)["copy-2"], vouches(project)["ok"]) == (
        "replayed", "replayed", "vouched")


def test_a_trajectory_sent_again_by_its_sender_stays_vouched_however_late_and_by_another_is_not(
        project, versions, api_client, make_api_key, settings):
    agent, other = make_api_key(project, scopes=["ingest"]), make_api_key(project, scopes=["ingest", "read"])
    v2 = f"{project.slug}-v2"
    token = evidence_token(project, 2, at=time.time() - 2 * 3600)
    api_client.post("/api/v1/trajectories", [record("t", v2, token, outcome="unknown")], key=agent)
    assert vouches(project) == {"t": "vouched"}
    settings.FLYWHEEL_EVIDENCE_TTL_HOURS = 1  # the outcome is reported after the token's time to live
    api_client.post("/api/v1/trajectories", [record("t", v2, token, outcome="success")], key=agent)
    assert vouches(project) == {"t": "vouched"}
    # A key that read the token (it is in the metadata) cannot rewrite the outcome and keep the vouch.
    api_client.post("/api/v1/trajectories", [record("t", v2, token, outcome="failure")], key=other)
    stored = Trajectory.objects.get(project=project, external_id="t")
    assert (stored.vouch, stored.outcome, stored.ingested_by) == ("replayed", "failure", f"key:{other.api_key.pk}")
    # Nor can a fresh record with an expired token be vouched for.
    api_client.post("/api/v1/trajectories", [record("late", v2, evidence_token(project, 2, at=time.time() - 7200))],
                    key=agent)
    assert vouches(project)["late"] == "expired"


def test_an_upload_and_otlp_are_checked_too(project, versions, user, client_for, api_client, make_api_key):
    v2 = f"{project.slug}-v2"
    content = (json.dumps(record("up-1", v2, evidence_token(project, 2))) + "\n"
               + json.dumps(record("up-2", v2, evidence_token(project, 1))) + "\n").encode()
    response = client_for(user).post(reverse("upload", args=[project.slug]),
                                     {"file": SimpleUploadedFile("runs.jsonl", content)})
    assert response.status_code in (200, 302)
    rows = {t.external_id: (t.vouch, t.ingested_by) for t in Trajectory.objects.filter(project=project)}
    assert rows == {"up-1": ("vouched", f"user:{user.pk}"), "up-2": ("other_version", f"user:{user.pk}")}
    # OTLP: the token as a span attribute; the span's model name is mapped to v2 by a maintainer.
    VersionName.objects.create(project=project, name="qwen-0.5b-v3", version=versions[1])
    trace = os.urandom(16)
    spans = openinference_agent(trace)
    spans[3].attributes.append(KeyValue(key="flywheel.evidence", value=any_value(evidence_token(project, 2))))
    key = make_api_key(project, scopes=["ingest"])
    assert post_protobuf(api_client.with_key(key), export(spans)).status_code == 200
    traced = Trajectory.objects.get(project=project, external_id=trace.hex())
    assert (traced.source, traced.vouch, traced.ingested_by) == ("otlp", "vouched", f"key:{key.api_key.pk}")


def test_a_token_signed_before_secret_key_was_rotated_verifies_while_the_old_key_is_a_fallback(
        project, versions, api_client, make_api_key, settings):
    key = make_api_key(project, scopes=["ingest"])
    before, later = evidence_token(project, 2), evidence_token(project, 2)
    settings.SECRET_KEY_FALLBACKS = [settings.SECRET_KEY]
    settings.SECRET_KEY = "a-new-secret-key-after-rotation"
    assert evidence_keys(project.pk)[0] != evidence_keys(project.pk)[1]  # the router reads a new key
    api_client.post("/api/v1/trajectories", [record("before", f"{project.slug}-v2", before)], key=key)
    settings.SECRET_KEY_FALLBACKS = []
    api_client.post("/api/v1/trajectories", [record("later", f"{project.slug}-v2", later)], key=key)
    assert vouches(project) == {"before": "vouched", "later": "bad_mac"}


def test_the_router_reads_its_key_with_scope_route_alone(project, api_client, make_api_key, make_project):
    url = "/api/v1/serving/evidence-key"
    for scopes in (["read"], ["ingest"], ["read", "ingest", "review", "train", "promote"]):
        assert api_client.get(url, key=make_api_key(project, scopes=scopes)).status_code == 403
    assert api_client.get(url, key=None).status_code == 401
    answer = api_client.get(url, key=make_api_key(project, scopes=["route"]))
    assert answer.status_code == 200
    key = base64.urlsafe_b64decode(answer.json()["key"] + "=")
    assert key == evidence_keys(project.pk)[0] and len(key) == 32 and answer.json()["ttl_s"] == 24 * 3600
    other = make_project("other-project")
    other_key = api_client.get(url, key=make_api_key(other, scopes=["route"])).json()["key"]
    assert other_key != answer.json()["key"]  # one project's router cannot vouch for another's traffic
