"""The registry: registering a base model by its path (field errors for a wrong one), versions with a content
hash, promotion and rollback with their history, the MLflow mirror (real MLflow on the session's store,
an outage retried without losing the move), the signed webhook (a real HTTP server), the page and the API."""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse
from django.utils import timezone

from flywheel.registry import mlflow_bridge, selectors, services
from flywheel.registry.models import AliasEvent, GateDecision, ModelVersion, RegistrySettings, SyncState


def _gate_passed(*versions, against=None):
    """A passing gate decision for each version against `against` (default v1) (the gate itself is tested in
    test_gate.py)."""
    for version in versions:
        production = against or ModelVersion.objects.filter(project=version.project).order_by("number").first()
        GateDecision.objects.create(project=version.project, candidate=version, production=production, passed=True)


@pytest.fixture
def model_dirs(tmp_path):
    """A base model folder and two adapter folders (files only: the registry never loads weights)."""
    base = tmp_path / "tiny"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "llama"}')
    adapters = []
    for i in (1, 2):
        adapter = tmp_path / f"adapter-{i}"
        (adapter / "nested").mkdir(parents=True)
        (adapter / "adapter_config.json").write_text('{"r": 8}')
        (adapter / "adapter_model.safetensors").write_bytes(bytes([i]) * 1000)
        (adapter / "nested" / "extra.txt").write_text("x")
        adapters.append(adapter)
    return base, adapters


@pytest.fixture
def registered(project, user, model_dirs):
    base_dir, adapters = model_dirs
    v1 = services.base_model_register(project=project, name="tiny", path=str(base_dir), user=user)
    v2 = services.model_version_create(project=project, base=v1.base, adapter_path=str(adapters[0]), user=user,
                                       lineage={"job": 7})
    v3 = services.model_version_create(project=project, base=v1.base, adapter_path=str(adapters[1]), user=user)
    _gate_passed(v2, v3)
    return v1, v2, v3


def test_a_wrong_path_is_a_field_error(project, tmp_path):
    with pytest.raises(ValidationError) as exc:
        services.base_model_register(project=project, name="m", path="models/tiny")
    assert "absolute path" in exc.value.message_dict["path"][0]
    with pytest.raises(ValidationError) as exc:
        services.base_model_register(project=project, name="m", path=str(tmp_path / "absent"))
    assert "not a folder" in exc.value.message_dict["path"][0]
    with pytest.raises(ValidationError) as exc:
        services.base_model_register(project=project, name="m", path=str(tmp_path))
    assert "config.json" in exc.value.message_dict["path"][0]
    assert not ModelVersion.objects.exists()


def test_the_first_model_goes_to_production_and_versions_count_up(project, registered, model_dirs):
    v1, v2, v3 = registered
    assert [v1.number, v2.number, v3.number] == [1, 2, 3]
    assert v1.adapter_path == "" and v1.adapter_sha256 == ""
    event = AliasEvent.objects.get(project=project)
    assert (event.alias, event.kind, event.from_version, event.to_version) == ("production", "set", None, v1)
    with pytest.raises(ValidationError) as exc:
        services.base_model_register(project=project, name="tiny", path=str(model_dirs[0]))
    assert "already has" in exc.value.message_dict["name"][0]


def test_the_adapter_hash_follows_content_not_location(registered, model_dirs, tmp_path):
    _, v2, v3 = registered
    assert len(v2.adapter_sha256) == 64 and v2.adapter_sha256 != v3.adapter_sha256
    copy = tmp_path / "copy"
    shutil.copytree(model_dirs[1][0], copy)
    assert services.adapter_sha256(copy) == v2.adapter_sha256
    (copy / "nested" / "extra.txt").write_text("y")
    assert services.adapter_sha256(copy) != v2.adapter_sha256
    # A file renamed with the same bytes is another adapter too.
    (copy / "nested" / "extra.txt").write_text("x")
    (copy / "nested" / "extra.txt").rename(copy / "nested" / "other.txt")
    assert services.adapter_sha256(copy) != v2.adapter_sha256


def test_promote_then_roll_back_records_who_when_from_to_and_why(project, registered, make_user):
    v1, v2, v3 = registered
    alice, bob = make_user("alice"), make_user("bob")
    services.model_promote(project=project, version=v2, user=alice, reason="beats v1 on the holdout")
    _gate_passed(v3, against=v2)
    services.model_promote(project=project, version=v3, user=alice, reason="beats v2")
    with pytest.raises(services.RegistryError, match="already points"):
        services.model_promote(project=project, version=v3, user=alice)
    back = services.model_rollback(project=project, user=bob, reason="refunds broke")
    assert (back.kind, back.from_version, back.to_version, back.user, back.reason) == ("rollback", v3, v2, bob,
                                                                                       "refunds broke")
    history = list(AliasEvent.objects.filter(project=project).order_by("at", "id"))
    assert [(e.kind, e.from_version and e.from_version.number, e.to_version.number) for e in history] == [
        ("set", None, 1), ("promote", 1, 2), ("promote", 2, 3), ("rollback", 3, 2),
    ]
    # Rolling back to any version that served before works; one that never served must be promoted.
    services.model_rollback(project=project, user=bob, to_version=v1)
    with pytest.raises(services.RegistryError, match="never served"):
        services.model_rollback(project=project, user=bob, to_version=v3.__class__.objects.create(
            project=project, number=4, base=v1.base))


def test_only_a_version_that_passed_the_gate_is_promoted(project, registered):
    v1, v2, _ = registered
    v4 = services.model_version_create(project=project, base=v1.base)
    with pytest.raises(services.RegistryError, match="has not been through the gate"):
        services.model_promote(project=project, version=v4)
    GateDecision.objects.create(project=project, candidate=v4, production=v1, passed=False)
    with pytest.raises(services.RegistryError, match="did not pass the gate"):
        services.model_promote(project=project, version=v4)
    assert services.model_promote(project=project, version=v2).to_version == v2


def test_a_decision_judged_against_another_production_is_stale(project, registered, client_for, user):
    # v2 and v3 each passed against v1. Once v3 serves, promoting v2 would put a version in production that
    # was never compared with v3.
    v1, v2, v3 = registered
    services.model_promote(project=project, version=v3)
    with pytest.raises(services.StaleDecision, match="passed the gate against v1, but production is now v3"):
        services.model_promote(project=project, version=v2)
    assert selectors.production_of(project=project) == v3
    decision = v2.gate_decisions.first()
    page = client_for(user).get(reverse("registry_gate", args=[project.slug, decision.pk]))
    assert page.status_code == 200
    assert "this decision is stale" in page.content.decode() and 'id="promote"' not in page.content.decode()
    # Judged again against v3, it may go.
    _gate_passed(v2, against=v3)
    assert services.model_promote(project=project, version=v2).to_version == v2


def test_every_move_is_in_mlflow_at_once_and_sync_registers_the_rest(project, registered):
    v1, v2, v3 = registered
    services.model_promote(project=project, version=v2, reason="x")
    v2.refresh_from_db()
    assert mlflow_bridge.alias_get(project_slug=project.slug, alias="production") == v2.mlflow_version
    first = services.registry_sync(project_id=project.pk)
    assert first["versions"] == 1 and first["failed"] == 0  # v3: never moved, registered by the sync
    services.model_rollback(project=project)
    v1.refresh_from_db()
    assert mlflow_bridge.alias_get(project_slug=project.slug, alias="production") == v1.mlflow_version
    again = services.registry_sync(project_id=project.pk)
    assert (again["versions"], again["aliases"], again["failed"]) == (0, 0, 0)
    name = mlflow_bridge.registered_model_name(project.slug)
    assert len(mlflow_bridge.client().search_model_versions(f"name = '{name}'")) == 3  # nothing registered twice


def test_the_sync_puts_back_an_alias_moved_behind_the_registry(project, registered):
    v1, v2, v3 = registered
    services.registry_sync(project_id=project.pk)
    v3.refresh_from_db()
    mlflow_bridge.alias_set(project_slug=project.slug, alias="production", mlflow_version=v3.mlflow_version)
    assert services.registry_sync(project_id=project.pk)["aliases"] == 1
    v1.refresh_from_db()
    assert mlflow_bridge.alias_get(project_slug=project.slug, alias="production") == v1.mlflow_version


def test_a_sync_running_while_a_move_commits_leaves_mlflow_where_the_database_points(
    transactional_db, needs_service, make_project, make_user, model_dirs, monkeypatch,
):
    """A move writes MLflow's alias, then commits. A sync that read the assignments in between (the promotion
    not yet committed) would set MLflow back to the old version after the move: seen once in the loop test.
    The move pauses after MLflow moved until the sync has finished or 5 s have passed; with the sync taking
    the move's lock it cannot finish in that window, and reads the committed move."""
    from django.db import connection, connections

    needs_service(connection.vendor == "postgresql", f"needs PostgreSQL row locks (DATABASE_URL: {connection.vendor})")
    user = make_user("racer")
    project = make_project("race", owner=user)
    base_dir, adapters = model_dirs
    v1 = services.base_model_register(project=project, name="tiny", path=str(base_dir), user=user)
    v2 = services.model_version_create(project=project, base=v1.base, adapter_path=str(adapters[0]), user=user)
    _gate_passed(v2)
    services.registry_sync(project_id=project.pk)  # both registered in MLflow
    mirrored, synced = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    real_alias_set = mlflow_bridge.alias_set

    def alias_set_then_pause(**kwargs):
        real_alias_set(**kwargs)
        if threading.current_thread() is threading.main_thread() and not mirrored.is_set():
            mirrored.set()
            synced.wait(timeout=5)

    def sync_meanwhile():
        try:
            assert mirrored.wait(timeout=30)
            services.registry_sync(project_id=project.pk)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            synced.set()
            connections.close_all()

    monkeypatch.setattr(mlflow_bridge, "alias_set", alias_set_then_pause)
    racer = threading.Thread(target=sync_meanwhile)
    racer.start()
    services.model_promote(project=project, version=v2, reason="while a sync runs")
    racer.join(timeout=60)
    assert not racer.is_alive() and not errors, errors
    v2.refresh_from_db()
    assert mlflow_bridge.alias_get(project_slug=project.slug, alias="production") == v2.mlflow_version


def test_with_mlflow_down_a_promotion_changes_nothing_and_a_retry_completes_it(project, registered, settings):
    v1, v2, _ = registered
    good_uri = settings.MLFLOW_TRACKING_URI
    settings.MLFLOW_TRACKING_URI = "sqlite:////proc/flywheel-no-such-dir/mlflow.db"  # cannot be opened
    with pytest.raises(services.MlflowUnavailable, match="nothing changed"):
        services.model_promote(project=project, version=v2, reason="during the outage")
    from flywheel.registry.selectors import production_of

    assert production_of(project=project) == v1
    assert AliasEvent.objects.filter(project=project).count() == 1  # only the first "set"
    settings.MLFLOW_TRACKING_URI = good_uri
    v1.refresh_from_db()
    assert mlflow_bridge.alias_get(project_slug=project.slug, alias="production") == v1.mlflow_version
    services.model_promote(project=project, version=v2, reason="again")
    v2.refresh_from_db()
    assert production_of(project=project) == v2
    assert mlflow_bridge.alias_get(project_slug=project.slug, alias="production") == v2.mlflow_version


def test_the_page_says_why_a_promotion_did_not_happen(project, registered, user, client_for, settings):
    _, v2, _ = registered
    settings.MLFLOW_TRACKING_URI = "sqlite:////proc/flywheel-no-such-dir/mlflow.db"
    response = client_for(user).post(reverse("registry_version_promote", args=[project.slug, v2.number]))
    assert response.status_code == 409 and "nothing changed" in response.content.decode()


class _Receiver(BaseHTTPRequestHandler):
    received: list[tuple[dict, bytes]] = []
    fail = False

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Receiver.received.append((dict(self.headers), body))
        self.send_response(500 if _Receiver.fail else 204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    _Receiver.received, _Receiver.fail = [], False
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


def test_production_moves_are_announced_in_order_signed_logged_and_once(project, registered, receiver):
    _, v2, v3 = registered
    url = f"http://127.0.0.1:{receiver.server_address[1]}/hook"
    RegistrySettings.objects.create(project=project, webhook_url=url, webhook_secret="s3cret")
    services.registry_sync(project_id=project.pk)  # the first "set" of v1
    _Receiver.received.clear()
    _Receiver.fail = True
    services.model_promote(project=project, version=v2, reason="a")
    _gate_passed(v3, against=v2)
    services.model_promote(project=project, version=v3, reason="b")
    assert services.registry_sync(project_id=project.pk)["failed"] == 1
    assert len(_Receiver.received) == 1  # stopped at the first failure: v3 is not announced before v2
    failed = AliasEvent.objects.get(project=project, to_version=v2)
    assert failed.webhook_state == SyncState.FAILED and failed.next_attempt_at > timezone.now()
    assert [(d.status_code, d.error) for d in failed.deliveries.all()] == [(500, "HTTP 500")]
    _Receiver.fail = False
    _Receiver.received.clear()
    services.registry_sync(project_id=project.pk)
    bodies = [json.loads(body) for _, body in _Receiver.received]
    assert [(b["version"], b["from_version"]) for b in bodies] == [(2, 1), (3, 2)]
    headers, body = _Receiver.received[1]
    timestamp = headers["X-Flywheel-Timestamp"]
    expected = "sha256=" + hmac.new(b"s3cret", timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    assert headers["X-Flywheel-Signature"] == expected
    assert bodies[1]["adapter_sha256"] == v3.adapter_sha256 and bodies[1]["vllm_lora_name"] == f"{project.slug}-v3"
    services.registry_sync(project_id=project.pk)
    assert len(_Receiver.received) == 2  # nothing sent twice
    assert [d.status_code for d in failed.deliveries.order_by("at", "id")] == [500, 204]


def test_the_api_answers_the_production_version(project, registered, api_client, make_api_key, make_project):
    _, v2, _ = registered
    services.model_promote(project=project, version=v2)
    key = make_api_key(project, scopes=["read"])
    body = api_client.get("/api/v1/models/production", key=key).json()
    assert (body["version"], body["adapter_sha256"], body["adapter_path"]) == (2, v2.adapter_sha256, v2.adapter_path)
    other = make_api_key(make_project("elsewhere"), scopes=["read"])
    assert api_client.get("/api/v1/models/production", key=other).status_code == 404


def test_the_page_shows_versions_and_history_escaped_and_only_maintainers_act(
    project, registered, user, make_user, make_membership, client_for
):
    _, v2, _ = registered
    services.model_promote(project=project, version=v2, user=user, reason="<script>alert(1)</script>")
    viewer = make_user("viewer")
    make_membership(viewer, project, "viewer")
    page = client_for(viewer).get(reverse("registry_page", args=[project.slug]))
    html = page.content.decode()
    assert page.status_code == 200 and "v2" in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<script>alert(1)" not in html
    assert 'id="rollback"' not in html  # a viewer gets no buttons...
    assert client_for(viewer).post(reverse("registry_rollback", args=[project.slug])).status_code == 403
    maintainer = client_for(user)
    assert 'id="rollback"' in maintainer.get(reverse("registry_page", args=[project.slug])).content.decode()
    response = maintainer.post(reverse("registry_rollback", args=[project.slug]), {"reason": "broke"})
    assert response.status_code == 302
    assert AliasEvent.objects.filter(project=project).first().kind == "rollback"


def test_bad_settings_and_a_bad_base_path_are_field_errors_on_the_page(project, user, client_for, celery_worker):
    client = client_for(user)  # the worker checks the path (tests/platform/registry/test_base_models.py)
    response = client.post(reverse("registry_settings_save", args=[project.slug]), {"webhook_url": "not a url"})
    assert response.status_code == 422 and "Enter a valid URL" in response.content.decode()
    response = client.post(reverse("registry_base_register", args=[project.slug]), {"name": "m", "path": "/nope"})
    assert response.status_code == 422 and "not a usable model folder under the models directory" in response.content.decode()


def test_the_worker_announces_a_move_after_commit(celery_worker, make_project, model_dirs, receiver):
    from django.db import transaction

    project = make_project()
    RegistrySettings.objects.create(project=project, webhook_url=f"http://127.0.0.1:{receiver.server_address[1]}/")
    with transaction.atomic():
        services.base_model_register(project=project, name="tiny", path=str(model_dirs[0]))
        assert not _Receiver.received  # nothing leaves before the commit
    delivered = celery_worker.wait_for(
        lambda: AliasEvent.objects.filter(project=project, webhook_state=SyncState.DONE).first())
    assert delivered.deliveries.get().status_code == 204
    assert json.loads(_Receiver.received[0][1])["version"] == 1


def test_paths_are_stored_as_given(project, model_dirs):
    version = services.base_model_register(project=project, name="t", path=str(model_dirs[0]))
    assert Path(version.base.path) == model_dirs[0]


def test_the_api_promotes_rolls_back_and_lists_the_history(project, registered, api_client, make_api_key):
    v1, v2, _ = registered
    v4 = services.model_version_create(project=project, base=v1.base)
    GateDecision.objects.create(project=project, candidate=v4, production=v1, passed=False, report={"rules": [
        {"name": "holdout success", "passed": False}, {"name": "unsafe actions", "passed": True}]})
    key = make_api_key(project, scopes=["read", "promote"])
    refused = api_client.post(f"/api/v1/model-versions/{v4.number}/promote", {"reason": "try"}, key=key)
    assert refused.status_code == 409 and "Failing rules: holdout success." in refused.json()["detail"]
    moved = api_client.post(f"/api/v1/model-versions/{v2.number}/promote", {"reason": "better"}, key=key).json()
    assert (moved["kind"], moved["from_version"], moved["to_version"]) == ("promote", 1, 2)
    back = api_client.post("/api/v1/models/production/rollback", {"reason": "bad"}, key=key).json()
    assert (back["kind"], back["to_version"], back["reason"]) == ("rollback", 1, "bad")
    history = api_client.get("/api/v1/models/history", key=key).json()
    assert [(m["kind"], m["to_version"]) for m in history] == [("rollback", 1), ("promote", 2), ("set", 1)]
    version = api_client.get(f"/api/v1/model-versions/{v2.number}", key=key).json()
    assert version["adapter_sha256"] == v2.adapter_sha256 and version["gate"]["passed"] is True
    read_only = make_api_key(project, scopes=["read"])
    assert api_client.post("/api/v1/models/production/rollback", {}, key=read_only).status_code == 403


def test_the_models_page_shows_the_delivery_log(project, registered, receiver, user, client_for):
    _, v2, _ = registered
    RegistrySettings.objects.create(project=project, webhook_url=f"http://127.0.0.1:{receiver.server_address[1]}/x")
    services.model_promote(project=project, version=v2)
    services.registry_sync(project_id=project.pk)
    html = client_for(user).get(reverse("registry_page", args=[project.slug])).content.decode()
    assert 'id="deliveries"' in html and ">204<" in html


def test_gate_rules_are_set_per_project_with_field_errors(project, user, client_for):
    from flywheel.registry.gate_runs import rules_for

    with pytest.raises(ValidationError) as exc:
        services.gate_rules_set(project=project, data={"confidence": "1.5", "test": "coin", "success_margin": "x",
                                                       "tokens_tolerance": "-1", "invalid_tolerance": "2"},
                                auto_promote=False)
    assert set(exc.value.message_dict) == {"confidence", "test", "success_margin", "tokens_tolerance",
                                           "invalid_tolerance"}
    assert rules_for(project).test == "permutation"  # nothing saved
    response = client_for(user).post(reverse("registry_gate_rules", args=[project.slug]),
                                     {"test": "bootstrap", "confidence": "0.9", "auto_promote": "on",
                                      "invalid_tolerance": "0.005", "expected_gain": "0.15"})
    assert response.status_code == 302
    rules = rules_for(project)
    assert (rules.test, rules.confidence, rules.success_margin, rules.invalid_tolerance, rules.expected_gain) == (
        "bootstrap", 0.9, 0.0, 0.005, 0.15)
    assert rules.require_regression is False  # the box was not ticked
    assert RegistrySettings.objects.get(project=project).auto_promote
    # Non-inferiority needs a tolerance above zero: said on the field.
    page = client_for(user).post(reverse("registry_gate_rules", args=[project.slug]),
                                 {"invalid_test": "noninferiority", "invalid_tolerance": "0",
                                  "require_regression": "on"})
    assert page.status_code == 422 and "must be above 0 for a non-inferiority test" in page.content.decode()
    client_for(user).post(reverse("registry_gate_rules", args=[project.slug]),
                          {"invalid_test": "noninferiority", "invalid_tolerance": "0.01", "require_regression": "on"})
    assert (rules_for(project).invalid_test, rules_for(project).require_regression) == ("noninferiority", True)
    assert rules_for(project).unsafe_zero_tolerance is False  # a test by default; the policy only when ticked
    client_for(user).post(reverse("registry_gate_rules", args=[project.slug]), {"unsafe_zero_tolerance": "on"})
    assert rules_for(project).unsafe_zero_tolerance is True
    page = client_for(user).post(reverse("registry_gate_rules", args=[project.slug]), {"confidence": "2"})
    assert page.status_code == 422 and "confidence must be in" in page.content.decode()


def test_the_gate_report_offers_promote_beside_its_verdict_above_the_rules(project, registered, client_for, user):
    _, v2, _ = registered
    decision = v2.gate_decisions.first()
    html = client_for(user).get(reverse("registry_gate", args=[project.slug, decision.pk])).content.decode()
    # Above the rules and the regression rows (twenty rows pushed it below a 900 px screen).
    assert html.index('id="verdict"') < html.index('id="promote"') < html.index('id="gate-rules"')
