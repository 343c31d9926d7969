"""Canary rollout and the watch after a promotion (flywheel.registry.canary): starting a canary and what is
refused, each outcome of the decision on real trajectories (automatic and not), expiry, the watch's rollback
and flag, the alias history with actor and evidence, notifications and webhook bodies (a real HTTP
receiver), the sweep with a real worker, the API with its scopes, and the pages. The rules' error rates are
in test_sequential.py."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse
from django.utils import timezone

from flywheel.registry import canary, mlflow_bridge, notify, selectors, services
from flywheel.registry.models import (
    AliasAssignment,
    AliasEvent,
    GateDecision,
    LiveCheck,
    Notification,
    RegistrySettings,
    VersionName,
)
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.models import Trajectory, TriageSignal
from tests.platform.registry.worlds import evidence_token, versions_with_adapters


@pytest.fixture
def versions(project, user, tmp_path):
    """v1 in production (the base alone), v2 and v3 with adapters, each passed the gate against v1."""
    out = versions_with_adapters(project, user, tmp_path, adapters=2)
    # A tolerance this wide lets the few trajectories here bound a canary's increase (the default 5 points
    # takes about a thousand per arm: test_live_simulation.py).
    RegistrySettings.objects.create(project=project, canary_min_per_arm=50, canary_tolerance=0.5, watch_hours=24)
    return out


_batch = iter(range(10**9))


def traffic(project, version, n, failures=0, unsafe=0, name=None, vouched=True, sender="key:1", token_version=None):
    """`n` trajectories served by `version` (its adapter name, or `name`), the first `failures` failed and the
    first `unsafe` carrying an unsafe-action signal, through ingestion as an agent sends them: each with the
    evidence token the router put on its answer (`vouched`; for `token_version` if given), sent by `sender`."""
    batch = next(_batch)
    model = name or f"{project.slug}-v{version.number}"
    records = [{"external_id": f"b{batch}-{i}", "model_version": model,
                "outcome": "failure" if i < failures else "success",
                "messages": [{"role": "user", "content": "refund order 7"}],
                "metadata": {"flywheel_evidence": evidence_token(project, token_version or version.number)}
                if vouched else {}} for i in range(n)]
    assert ingest_trajectories(project=project, records=records, ingested_by=sender).accepted == n
    ingested = Trajectory.objects.filter(project=project, external_id__startswith=f"b{batch}-")
    ingested.update(triaged_at=timezone.now())  # as triage marks them; the unsafe rate's denominator
    rows = ingested.order_by("id")[:unsafe]
    TriageSignal.objects.bulk_create([TriageSignal(project=project, trajectory=t, kind="unsafe_action",
                                                   detail={"calls": [{"tool": "refund", "rule": "*"}]}) for t in rows])


def settings_set(project, **values):
    RegistrySettings.objects.filter(project=project).update(**values)


def test_a_canary_starts_beside_production_with_its_weight_its_move_and_its_check(project, versions, user):
    v1, v2, _ = versions
    check = canary.canary_start(project=project, version=v2, user=user)
    assignment = AliasAssignment.objects.get(project=project, alias="canary")
    assert (assignment.version, assignment.weight) == (v2, 0.1)
    event = AliasEvent.objects.filter(project=project, alias="canary").get()
    assert (event.kind, event.to_version, event.weight, event.user, event.actor) == ("promote", v2, 0.1, user, "")
    assert (check.kind, check.status, check.subject, check.baseline, check.event) == ("canary", "running", v2, v1, event)
    assert check.ends_at - check.started_at == timedelta(hours=72)
    assert check.rules == {"weight": 0.1, "min_per_arm": 50, "max_hours": 72, "auto": False, "tolerance": 0.5}
    v2.refresh_from_db()
    assert mlflow_bridge.alias_get(project_slug=project.slug, alias="canary") == v2.mlflow_version
    split = selectors.production_of(project=project)
    assert split == v1  # production did not move


def test_what_a_canary_refuses(project, versions, user):
    v1, v2, v3 = versions
    v4 = services.model_version_create(project=project, base=v1.base)
    with pytest.raises(services.RegistryError, match="has not been through the gate"):
        canary.canary_start(project=project, version=v4)
    with pytest.raises(services.RegistryError, match="is production already"):
        GateDecision.objects.create(project=project, candidate=v1, production=v1, passed=True)
        canary.canary_start(project=project, version=v1)
    with pytest.raises(ValidationError) as exc:
        canary.canary_start(project=project, version=v2, weight=1.5)
    assert "between 0 and 1" in exc.value.message_dict["weight"][0]
    canary.canary_start(project=project, version=v2, weight=0.25)
    with pytest.raises(services.RegistryError, match="v2 is the canary now: promote it or roll it back"):
        canary.canary_start(project=project, version=v3)
    # v3 passed against v1; once v2 is production, v3's decision is stale for a canary as for a promotion.
    canary.canary_promote(project=project, user=user)
    with pytest.raises(services.StaleDecision, match="never compared"):
        canary.canary_start(project=project, version=v3)


def test_a_worse_canary_is_rolled_back_by_the_decision_when_the_project_acts_by_itself(project, versions):
    v1, v2, _ = versions
    settings_set(project, canary_auto=True)
    check = canary.canary_start(project=project, version=v2)
    traffic(project, v2, 50, failures=30)
    traffic(project, v1, 60, failures=6)
    traffic(project, v1, 40, failures=40, name="someone-else")  # another string: neither arm
    assert canary.live_check_look(check_id=check.pk) == "rolled_back"
    check.refresh_from_db()
    look = check.evidence["look"]
    assert (look["subject"], look["baseline"]) == ({"n": 50, "known": 50, "failures": 30, "triaged": 50, "unsafe": 0},
                                                   {"n": 60, "known": 60, "failures": 6, "triaged": 60, "unsafe": 0})
    assert look["failure"]["worse"] and look["failure"]["p"] < 0.05 / 3 and check.looks == 1
    end = AliasEvent.objects.filter(project=project, alias="canary").first()
    assert (end.kind, end.to_version, end.actor, end.user) == ("end", v2, "canary", None)
    assert "Rolled back by the canary decision: failure rate 60.0% against 10.0%" in end.reason
    assert end.evidence["look"]["failure"]["p"] == look["failure"]["p"] and "trail" not in end.evidence
    assert check.event == end and not AliasAssignment.objects.filter(project=project, alias="canary").exists()
    assert mlflow_bridge.alias_get(project_slug=project.slug, alias="canary") is None
    assert selectors.production_of(project=project) == v1
    note = Notification.objects.get(project=project)
    assert note.event_type == "canary.rolled_back" and note.payload["evidence"]["verdict"] == "worse"
    assert canary.live_check_look(check_id=check.pk) == "not running"


def test_a_worse_canary_is_flagged_and_a_person_rolls_it_back(project, versions, user, client_for):
    v1, v2, _ = versions
    check = canary.canary_start(project=project, version=v2)
    traffic(project, v2, 50, unsafe=8)
    traffic(project, v1, 200, unsafe=1)
    assert canary.live_check_look(check_id=check.pk) == "flagged"
    check.refresh_from_db()
    assert check.evidence["verdict"] == "worse" and check.evidence["look"]["unsafe"]["worse"]
    assert AliasAssignment.objects.get(project=project, alias="canary").version == v2  # still serving
    assert Notification.objects.get(project=project).event_type == "canary.worse"
    page = client_for(user).get(reverse("registry_page", args=[project.slug])).content.decode()
    assert "Canary decision: v2 against production v1" in page and "does not act by itself" in page
    assert 'id="canary-rollback"' in page
    response = client_for(user).post(reverse("registry_canary_rollback", args=[project.slug]), {"reason": "unsafe"})
    assert response.status_code == 302
    check.refresh_from_db()
    assert (check.status, check.decided_by) == ("rolled_back", user)
    end = AliasEvent.objects.filter(project=project, alias="canary").first()
    assert (end.kind, end.user, end.actor, end.reason) == ("end", user, "", "unsafe")
    assert end.evidence["look"]["unsafe"]["worse"]  # what the person decided on


def test_a_canary_with_enough_traffic_and_no_harm_is_promoted_and_watched(project, versions):
    v1, v2, _ = versions
    settings_set(project, canary_auto=True)
    check = canary.canary_start(project=project, version=v2)
    traffic(project, v2, 30, failures=3)
    assert canary.live_check_look(check_id=check.pk) == "running"  # 30 of 50 in the canary's arm
    traffic(project, v2, 30, failures=3)
    traffic(project, v1, 300, failures=33)
    assert canary.live_check_look(check_id=check.pk) == "promoted"
    check.refresh_from_db()
    assert check.looks == 2 and len(check.evidence["trail"]) == 2
    assert selectors.production_of(project=project) == v2
    moves = list(AliasEvent.objects.filter(project=project).order_by("at", "id"))[-2:]
    assert [(e.alias, e.kind, e.actor, e.to_version.number) for e in moves] == [
        ("production", "promote", "canary", 2), ("canary", "end", "canary", 2)]
    assert moves[0].evidence["look"]["enough"] and check.event == moves[0]
    watch = LiveCheck.objects.get(project=project, kind="watch")
    assert (watch.status, watch.subject, watch.baseline, watch.started_at) == ("running", v2, v1, moves[0].at)
    assert watch.started_at - watch.baseline_from == timedelta(hours=24) == watch.ends_at - watch.started_at
    assert Notification.objects.get(project=project).event_type == "canary.promoted"


def test_a_ready_canary_waits_for_a_person_who_promotes_it_through_the_api(project, versions, api_client,
                                                                           make_api_key):
    v1, v2, _ = versions
    check = canary.canary_start(project=project, version=v2)
    traffic(project, v2, 50, failures=5)
    traffic(project, v1, 50, failures=5)
    assert canary.live_check_look(check_id=check.pk) == "flagged"
    check.refresh_from_db()
    assert check.evidence["verdict"] == "ready"
    assert Notification.objects.get(project=project).event_type == "canary.ready"
    key = make_api_key(project, scopes=["read", "promote"])
    moved = api_client.post("/api/v1/canary/promote", {"reason": "looks fine"}, key=key)
    assert moved.status_code == 200, moved.content
    assert (moved.json()["alias"], moved.json()["to_version"], moved.json()["reason"]) == ("production", 2, "looks fine")
    check.refresh_from_db()
    assert check.status == "promoted"
    assert api_client.post("/api/v1/canary/promote", {}, key=key).status_code == 409  # no canary any more


def test_a_flagged_canary_is_still_looked_at_and_one_ready_that_turns_worse_is_flagged_again(project, versions):
    v1, v2, _ = versions
    check = canary.canary_start(project=project, version=v2)
    traffic(project, v2, 50, failures=5)
    traffic(project, v1, 50, failures=5)
    assert canary.live_check_look(check_id=check.pk) == "flagged"
    check.refresh_from_db()
    assert check.evidence["verdict"] == "ready" and check.evidence["look"]["subject"]["n"] == 50
    assert canary.live_check_sweep() == 1  # waiting for a person, it is still handed to a worker

    traffic(project, v2, 20)
    assert canary.live_check_look(check_id=check.pk) == "flagged"
    check.refresh_from_db()
    assert check.evidence["verdict"] == "ready" and check.evidence["look"]["subject"]["n"] == 70  # figures move on
    assert Notification.objects.filter(project=project).count() == 1  # told once

    # The canary goes bad while it waits: flagged worse, and told.
    traffic(project, v2, 60, unsafe=15)
    traffic(project, v1, 300)
    assert canary.live_check_look(check_id=check.pk) == "flagged"
    check.refresh_from_db()
    assert check.evidence["verdict"] == "worse" and check.evidence["look"]["unsafe"]["worse"]
    assert list(Notification.objects.filter(project=project).order_by("id").values_list("event_type", flat=True)) == [
        "canary.ready", "canary.worse"]
    traffic(project, v2, 10)
    canary.live_check_look(check_id=check.pk)
    check.refresh_from_db()
    assert check.evidence["verdict"] == "worse" and Notification.objects.filter(project=project).count() == 2
    assert AliasAssignment.objects.get(project=project, alias="canary").version == v2  # a person decides


def test_a_canary_flagged_ready_that_turns_worse_is_rolled_back_when_the_project_acts_by_itself(project, versions):
    v1, v2, _ = versions
    check = canary.canary_start(project=project, version=v2)
    traffic(project, v2, 50, failures=5)
    traffic(project, v1, 50, failures=5)
    assert canary.live_check_look(check_id=check.pk) == "flagged"  # ready; the project then turns auto on
    LiveCheck.objects.filter(pk=check.pk).update(rules={**check.rules, "auto": True})
    traffic(project, v2, 60, unsafe=15)
    traffic(project, v1, 300)
    assert canary.live_check_look(check_id=check.pk) == "rolled_back"
    assert not AliasAssignment.objects.filter(project=project, alias="canary").exists()


def test_a_canary_without_enough_traffic_expires_and_says_why(project, versions):
    v1, v2, _ = versions
    check = canary.canary_start(project=project, version=v2)
    traffic(project, v2, 7)
    traffic(project, v1, 70)
    assert canary.live_check_look(check_id=check.pk, now=timezone.now() + timedelta(hours=71)) == "running"
    assert canary.live_check_look(check_id=check.pk, now=timezone.now() + timedelta(hours=73)) == "expired"
    end = AliasEvent.objects.filter(project=project, alias="canary").first()
    assert end.kind == "end" and end.actor == "canary"
    assert "without enough traffic: 7 known outcomes on v2 and 70 on v1, 50 needed in each" in end.reason
    assert Notification.objects.get(project=project).event_type == "canary.expired"


def test_a_mapped_name_counts_for_its_version(project, versions, user):
    v1, v2, _ = versions
    VersionName.objects.create(project=project, name="support-bot-2024-06", version=v2)
    assert set(canary.names_of(project=project, version=v2)) == {f"{project.slug}-v2", "support-bot-2024-06"}
    check = canary.canary_start(project=project, version=v2)
    traffic(project, v2, 10, failures=1, name="support-bot-2024-06")
    traffic(project, v2, 5)
    canary.live_check_look(check_id=check.pk)
    check.refresh_from_db()
    assert check.evidence["look"]["subject"] == {"n": 15, "known": 15, "failures": 1, "triaged": 15, "unsafe": 0}


def test_a_reviewers_outcome_counts_over_the_agents(project, versions, user):
    from flywheel.failures import review

    v1, v2, _ = versions
    check = canary.canary_start(project=project, version=v2)
    traffic(project, v2, 4, failures=2)
    first = Trajectory.objects.filter(project=project, outcome="failure").first()
    review.trajectory_outcome_set(trajectory=first, outcome="success", user=user)
    canary.live_check_look(check_id=check.pk)
    check.refresh_from_db()
    assert check.evidence["look"]["subject"]["failures"] == 1


def test_the_watch_rolls_a_worse_production_back_as_a_person_would(project, versions, user):
    v1, v2, _ = versions
    settings_set(project, watch_rollback=True)
    traffic(project, v1, 200, failures=20)  # before the move: the baseline
    services.model_promote(project=project, version=v2, user=user, reason="passed the gate")
    watch = LiveCheck.objects.get(project=project, kind="watch", status="running")
    traffic(project, v2, 60, failures=30)
    traffic(project, v1, 50, failures=5)  # the holdback: v1 keeps its share at the same hours
    assert canary.live_check_look(check_id=watch.pk) == "rolled_back"
    watch.refresh_from_db()
    assert watch.rules["holdback"] == 0.05
    assert watch.evidence["look"]["baseline"] == {"n": 50, "known": 50, "failures": 5, "triaged": 50, "unsafe": 0}
    assert watch.evidence["look"]["subject"] == {"n": 60, "known": 60, "failures": 30, "triaged": 60, "unsafe": 0}
    back = AliasEvent.objects.filter(project=project, alias="production").first()
    assert (back.kind, back.from_version, back.to_version, back.actor, back.user) == ("rollback", v2, v1, "watch", None)
    assert back.reason.startswith("Rolled back by the watch: failure rate 50.0% against 10.0%")
    assert back.evidence["look"]["failure"]["worse"] and watch.event == back
    assert selectors.production_of(project=project) == v1
    v1.refresh_from_db()
    assert mlflow_bridge.alias_get(project_slug=project.slug, alias="production") == v1.mlflow_version
    assert Notification.objects.get(project=project).event_type == "watch.rolled_back"
    assert not LiveCheck.objects.filter(project=project, kind="watch", status="running").exists()  # no watch of v1


def test_the_watch_flags_when_the_project_does_not_roll_back_and_the_page_says_so(project, versions, user,
                                                                                  client_for):
    v1, v2, _ = versions
    # No holdback: the watch compares with v1's hours before the move, and may only flag (even when the
    # project rolls back by rule: those hours differ by time of day).
    settings_set(project, watch_holdback=0, watch_rollback=True)
    traffic(project, v1, 200, failures=20)
    services.model_promote(project=project, version=v2, user=user)
    watch = LiveCheck.objects.get(project=project, kind="watch")
    traffic(project, v2, 60, failures=30)
    assert canary.live_check_look(check_id=watch.pk) == "flagged"
    assert selectors.production_of(project=project) == v2
    assert Notification.objects.get(project=project).event_type == "watch.flagged"
    watch.refresh_from_db()
    assert "not at the same hours (no holdback)" in watch.evidence["held"]
    traffic(project, v2, 40)  # while it waits for a person, later looks keep its figures current, quietly
    assert canary.live_check_look(check_id=watch.pk, now=timezone.now() + timedelta(hours=25)) == "flagged"
    watch.refresh_from_db()
    assert (watch.evidence["verdict"], watch.evidence["look"]["subject"]["n"]) == ("worse", 100)
    assert Notification.objects.filter(project=project).count() == 1
    page = client_for(user).get(reverse("registry_page", args=[project.slug])).content.decode()
    assert "Watch: production v2 against v1 before the move" in page and "roll back to v1" in page
    services.model_rollback(project=project, user=user, reason="the watch flagged it")
    watch.refresh_from_db()
    assert (watch.status, watch.decided_by) == ("rolled_back", user)


def test_the_watch_passes_at_its_trajectories_and_a_persons_rollback_ends_it(project, versions, user):
    v1, v2, v3 = versions
    settings_set(project, watch_trajectories=40)
    traffic(project, v1, 100, failures=10)
    services.model_promote(project=project, version=v2, user=user)
    watch = LiveCheck.objects.get(project=project, kind="watch")
    traffic(project, v2, 20, failures=2)
    traffic(project, v1, 10, failures=1)  # the holdback
    assert canary.live_check_look(check_id=watch.pk) == "running"
    traffic(project, v2, 20, failures=2)
    assert canary.live_check_look(check_id=watch.pk) == "passed"
    assert not Notification.objects.filter(project=project).exists()  # nothing was done
    GateDecision.objects.create(project=project, candidate=v3, production=v2, passed=True)
    services.model_promote(project=project, version=v3, user=user)
    second = LiveCheck.objects.get(project=project, kind="watch", status="running")
    services.model_rollback(project=project, user=user, reason="not sure")
    second.refresh_from_db()
    assert (second.status, second.decided_by) == ("ended", user)
    assert second.evidence["moved"]["kind"] == "rollback"


def test_a_promotion_of_another_version_ends_the_canary(project, versions, user):
    v1, v2, v3 = versions
    check = canary.canary_start(project=project, version=v2)
    services.model_promote(project=project, version=v3, user=user)
    check.refresh_from_db()
    assert check.status == "ended"
    end = AliasEvent.objects.filter(project=project, alias="canary").first()
    assert end.kind == "end" and "Production moved to v3" in end.reason
    assert not AliasAssignment.objects.filter(project=project, alias="canary").exists()


class _Receiver(BaseHTTPRequestHandler):
    received: list[tuple[str, dict, bytes]] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Receiver.received.append((self.path, dict(self.headers), body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    _Receiver.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_serving_stack_hears_the_split_and_the_rules_actions_are_notified(project, versions, receiver):
    v1, v2, _ = versions
    settings_set(project, webhook_url=receiver + "/hook", webhook_secret="s", vllm_url=receiver, canary_auto=True)
    services.registry_sync(project_id=project.pk)  # v1's first "set"
    _Receiver.received.clear()
    check = canary.canary_start(project=project, version=v2)
    services.registry_sync(project_id=project.pk)
    (load_path, _, load), (hook_path, headers, body) = _Receiver.received
    assert load_path == "/v1/load_lora_adapter" and json.loads(load)["lora_name"] == f"{project.slug}-v2"
    sent = json.loads(body)
    assert (hook_path, headers["X-Flywheel-Event"], sent["alias"], sent["kind"], sent["weight"]) == (
        "/hook", "alias.moved", "canary", "promote", 0.1)
    assert sent["production"]["adapter"] == f"{project.slug}-v1"
    assert (sent["canary"]["adapter"], sent["canary"]["weight"]) == (f"{project.slug}-v2", 0.1)
    _Receiver.received.clear()
    traffic(project, v2, 50, failures=30)
    traffic(project, v1, 50, failures=5)
    canary.live_check_look(check_id=check.pk)
    services.registry_sync(project_id=project.pk)
    (path, headers, body), = _Receiver.received  # the end loads nothing into vLLM
    ended = json.loads(body)
    assert (ended["alias"], ended["kind"], ended["actor"], ended["canary"]) == ("canary", "end", "canary", None)
    assert ended["evidence"]["look"]["failure"]["worse"]
    note = Notification.objects.get(project=project)
    assert notify.notification_deliver(notification_id=note.pk) == "sent"
    _, headers, body = _Receiver.received[-1]
    assert headers["X-Flywheel-Event"] == "canary.rolled_back"
    sent = json.loads(body)
    assert (sent["event"], sent["subject_version"], sent["baseline_version"]) == ("canary.rolled_back", 2, 1)


def test_the_sweep_hands_running_checks_to_a_worker(celery_worker, make_project, tmp_path):
    project = make_project("sweep")
    base = tmp_path / "m"
    base.mkdir()
    (base / "config.json").write_text("{}")
    v1 = services.base_model_register(project=project, name="m", path=str(base))
    v2 = services.model_version_create(project=project, base=v1.base)
    GateDecision.objects.create(project=project, candidate=v2, production=v1, passed=True)
    check = canary.canary_start(project=project, version=v2)
    assert canary.live_check_sweep() == 1
    looked = celery_worker.wait_for(lambda: LiveCheck.objects.filter(pk=check.pk, looks__gte=1).first())
    assert looked.evidence["verdict"] == "watching"


def test_the_rules_are_set_with_field_errors(project, versions, user, client_for):
    with pytest.raises(ValidationError) as exc:
        canary.live_rules_set(project=project, data={"canary_weight": "1", "canary_min_per_arm": "x",
                                                     "watch_hours": "-1", "canary_auto": "maybe",
                                                     "notify_emails": "ops@example.com\nnot an address"})
    assert set(exc.value.message_dict) == {"canary_weight", "canary_min_per_arm", "watch_hours", "canary_auto",
                                           "notify_emails"}
    assert RegistrySettings.objects.get(project=project).canary_weight == 0.1  # nothing saved
    client = client_for(user)
    response = client.post(reverse("registry_live_rules", args=[project.slug]),
                           {"canary_weight": "0.05", "canary_min_per_arm": "1000", "canary_max_hours": "48",
                            "canary_auto": "on", "watch_hours": "12", "watch_trajectories": "0",
                            "notify_emails": "ops@example.com"})
    assert response.status_code == 302
    config = RegistrySettings.objects.get(project=project)
    assert (config.canary_weight, config.canary_min_per_arm, config.canary_max_hours, config.canary_auto,
            config.watch_hours, config.watch_rollback, config.notify_emails) == (
        0.05, 1000, 48, True, 12, False, "ops@example.com")
    page = client.post(reverse("registry_live_rules", args=[project.slug]), {"canary_max_hours": "0"})
    assert page.status_code == 422 and "A whole number from 1 to 2,160, not 0." in page.content.decode()


def test_the_api_starts_decides_and_lists_with_scopes(project, versions, api_client, make_api_key):
    v1, v2, _ = versions
    read = make_api_key(project, scopes=["read"])
    promote = make_api_key(project, scopes=["read", "promote"])
    assert api_client.post(f"/api/v1/model-versions/{v2.number}/canary", {}, key=read).status_code == 403
    started = api_client.post(f"/api/v1/model-versions/{v2.number}/canary", {"weight": 0.2}, key=promote)
    assert started.status_code == 200, started.content
    body = started.json()
    assert (body["move"]["alias"], body["move"]["weight"], body["check"]["kind"], body["check"]["status"]) == (
        "canary", 0.2, "canary", "running")
    again = api_client.post(f"/api/v1/model-versions/{v2.number}/canary", {}, key=promote)
    assert again.status_code == 409 and "is the canary now" in again.json()["detail"]
    assert api_client.post(f"/api/v1/model-versions/{v2.number}/canary", {"weight": 2}, key=promote).status_code == 422
    traffic(project, v2, 50, failures=30)
    traffic(project, v1, 50, failures=5)
    canary.live_check_look(check_id=body["check"]["id"])
    checks = api_client.get("/api/v1/live-checks", key=read).json()
    assert checks[0]["status"] == "flagged" and checks[0]["evidence"]["look"]["failure"]["worse"]
    assert api_client.post("/api/v1/canary/rollback", {}, key=read).status_code == 403
    back = api_client.post("/api/v1/canary/rollback", {"reason": "worse"}, key=promote).json()
    assert (back["kind"], back["to_version"], back["evidence"]["look"]["failure"]["worse"]) == ("end", 2, True)
    history = api_client.get("/api/v1/models/history", key=read).json()
    assert [(m["alias"], m["kind"]) for m in history[:2]] == [("canary", "end"), ("canary", "promote")]
    assert api_client.post("/api/v1/canary/rollback", {}, key=promote).status_code == 409


def test_the_api_reads_and_sets_the_rules(project, versions, api_client, make_api_key):
    read = make_api_key(project, scopes=["read"])
    promote = make_api_key(project, scopes=["read", "promote"])
    rules = api_client.get("/api/v1/live-rules", key=read).json()
    assert (rules["canary_weight"], rules["canary_min_per_arm"], rules["notify_emails"]) == (0.1, 50, [])
    assert api_client.put("/api/v1/live-rules", {"canary_auto": True}, key=read).status_code == 403
    bad = api_client.put("/api/v1/live-rules", {"canary_weight": 0, "notify_emails": ["x"]}, key=promote)
    assert bad.status_code == 422
    assert {tuple(e["loc"]) for e in bad.json()["detail"]} >= {("body", "canary_weight")}
    bad_mail = api_client.put("/api/v1/live-rules", {"notify_emails": ["nobody"]}, key=promote)
    assert bad_mail.status_code == 422 and bad_mail.json()["detail"][0]["loc"] == ["body", "notify_emails"]
    done = api_client.put("/api/v1/live-rules", {"canary_auto": True, "watch_hours": 0,
                                                 "notify_emails": ["ops@example.com"]}, key=promote).json()
    assert (done["canary_auto"], done["watch_hours"], done["notify_emails"], done["canary_weight"]) == (
        True, 0, ["ops@example.com"], 0.1)


def test_the_pages_show_the_canary_to_members_and_buttons_to_maintainers(project, versions, user, make_user,
                                                                         make_membership, client_for):
    v1, v2, _ = versions
    maintainer = client_for(user)
    page = maintainer.get(reverse("registry_page", args=[project.slug])).content.decode()
    assert 'id="canary-start-2"' in page and "Start as canary" in page
    assert 'name="percent" min="1" max="50" step="1" value="10"' in page  # the project's share, to change
    assert maintainer.post(reverse("registry_version_canary", args=[project.slug, v2.number])).status_code == 302
    check = LiveCheck.objects.get(project=project, kind="canary")
    traffic(project, v2, 20, failures=2)
    traffic(project, v1, 180, failures=20)
    canary.live_check_look(check_id=check.pk)
    viewer = make_user("viewer")
    make_membership(viewer, project, "viewer")
    page = client_for(viewer).get(reverse("registry_page", args=[project.slug])).content.decode()
    assert "canary <strong>v2</strong> takes 10%" in page
    assert "Once each arm has 50 known outcomes (now 20 and 180)" in page
    assert 'id="canary-promote"' not in page and 'id="canary-start-3"' not in page
    assert client_for(viewer).post(reverse("registry_canary_promote", args=[project.slug])).status_code == 403
    detail = client_for(viewer).get(reverse("registry_live_check", args=[project.slug, check.pk]))
    assert detail.status_code == 200 and 'id="looks"' in detail.content.decode()
    assert maintainer.post(reverse("registry_canary_promote", args=[project.slug])).status_code == 302
    assert selectors.production_of(project=project) == v2
    history = maintainer.get(reverse("registry_page", args=[project.slug])).content.decode()
    assert "Ended: v2 no longer serves" in history


def test_a_watch_that_saw_no_traffic_says_so_instead_of_passing(project, versions, user):
    v1, v2, _ = versions
    traffic(project, v1, 30, failures=3)
    services.model_promote(project=project, version=v2, user=user)
    watch = LiveCheck.objects.get(project=project, kind="watch")
    traffic(project, v2, 30, failures=3, name="gpt-agent-prod")  # a name nobody mapped
    assert canary.live_check_look(check_id=watch.pk, now=timezone.now() + timedelta(hours=25)) == "expired"
    watch.refresh_from_db()
    assert f"no trajectory of v2 was counted (names: {project.slug}-v2)" in watch.evidence["why"]


def test_the_sync_removes_a_canary_alias_left_in_mlflow(project, versions):
    v1, v2, _ = versions
    canary.canary_start(project=project, version=v2)
    canary.canary_rollback(project=project, reason="changed my mind")
    v2.refresh_from_db()
    # As if the end's commit had failed after MLflow dropped the alias, or someone set it in MLflow's UI.
    mlflow_bridge.alias_set(project_slug=project.slug, alias="canary", mlflow_version=v2.mlflow_version)
    assert services.registry_sync(project_id=project.pk)["aliases"] >= 1
    assert mlflow_bridge.alias_get(project_slug=project.slug, alias="canary") is None
    assert services.registry_sync(project_id=project.pk)["aliases"] == 0


def test_after_a_rollback_the_newer_version_is_promoted_again_or_started_as_canary_from_the_page(
        project, versions, user, client_for):
    v1, v2, _ = versions
    maintainer = client_for(user)
    services.model_promote(project=project, version=v2, user=user)
    services.model_rollback(project=project, user=user)
    assert selectors.production_of(project=project) == v1
    page = maintainer.get(reverse("registry_page", args=[project.slug])).content.decode()
    row = page.split('id="version-2"')[1].split("</tr>")[0]
    # v2 passed the gate against v1, which serves again: it may be promoted or tried as a canary, not "rolled back to".
    assert 'id="promote-2"' in row and 'id="canary-start-2"' in row and "Roll back to this" not in row

    # Forward through the rollback form too (the API's to_version): a promotion, called one, and watched.
    response = maintainer.post(reverse("registry_rollback", args=[project.slug]), {"to": "2"})
    assert response.status_code == 302 and "done=promoted" in response["Location"]
    event = AliasEvent.objects.filter(project=project, alias="production").first()
    assert (event.kind, event.from_version, event.to_version) == ("promote", v1, v2)
    assert LiveCheck.objects.filter(project=project, kind="watch", status="running", subject=v2).exists()

    # And back: to an older version that served, the row offers the rollback.
    page = maintainer.get(reverse("registry_page", args=[project.slug])).content.decode()
    assert "Roll back to this" in page.split('id="version-1"')[1].split("</tr>")[0]


def test_a_canary_started_from_the_page_takes_the_share_typed_there(project, versions, user, client_for):
    _, v2, _ = versions
    response = client_for(user).post(reverse("registry_version_canary", args=[project.slug, v2.number]),
                                     {"percent": "25"})
    assert response.status_code == 302
    assert AliasAssignment.objects.get(project=project, alias="canary").weight == pytest.approx(0.25)
