"""What may move an alias by itself (flywheel.registry.evidence): the audit's forged flood (an ingest key alone
rolled a canary back, forced a promotion, pushed the watch into a rollback) no longer acts, while the same real
difference on traffic the router vouched for does; one sender's share of an arm capped; a token counted once
however many trajectories carry it; an arm imbalance flagged and held for a person; and the split check's error
rates by simulation (run with `-s` to see the figures; evidence.py's docstring quotes them)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import count

import numpy as np
import pytest
from django.urls import reverse
from scipy.special import gammaln
from scipy.stats import binomtest

from flywheel.registry import canary, evidence, selectors, services
from flywheel.registry.models import (
    AliasAssignment,
    AliasEvent,
    GateDecision,
    LiveCheck,
    Notification,
    RegistrySettings,
)
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.models import Trajectory
from tests.platform.registry.worlds import evidence_token, versions_with_adapters

_batch = count()
_T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)


@pytest.fixture
def versions(project, user, tmp_path):
    out = versions_with_adapters(project, user, tmp_path)
    # A wide tolerance, so that 50 per arm can bound a canary's increase (test_live_simulation.py has the default's).
    RegistrySettings.objects.create(project=project, canary_min_per_arm=50, canary_auto=True, watch_hours=24,
                                    watch_rollback=True, canary_tolerance=0.5)
    return out


def traffic(project, version_number, n, *, failures=0, vouched=True, sender="key:1", started_at=None):
    """`n` trajectories answered by v`version_number`, the first `failures` failed, each with the router's token
    when `vouched`, sent by `sender`."""
    batch = next(_batch)
    records = [{"external_id": f"e{batch}-{i}", "model_version": f"{project.slug}-v{version_number}",
                "outcome": "failure" if i < failures else "success",
                "messages": [{"role": "user", "content": "refund order 7"}],
                **({"started_at": started_at.isoformat()} if started_at else {}),
                "metadata": {"flywheel_evidence": evidence_token(project, version_number)} if vouched else {}}
               for i in range(n)]
    assert ingest_trajectories(project=project, records=records, ingested_by=sender).accepted == n


def flood(api_client, key, records):
    answer = api_client.post("/api/v1/trajectories", records, key=key)
    assert answer.status_code == 200 and answer.json()["accepted"] == len(records)


def forged(project, version_number, n, outcome):
    return [{"external_id": f"forged-{version_number}-{outcome}-{i}", "model_version": f"{project.slug}-v{version_number}",
             "outcome": outcome, "messages": [{"role": "user", "content": "hello"}]} for i in range(n)]


# --- the audit's reproduction -----------------------------------------------------------------------------------


def test_an_ingest_key_flooding_failures_on_the_canary_does_not_roll_it_back(project, versions, api_client,
                                                                            make_api_key, user, client_for):
    """The audit: 60 failures tagged with the canary's version and 60 successes tagged with production's, from an
    ingest key, rolled the canary back at the next look ("failure rate 100.0% against 0.0%"). Now the look flags
    the check for a person, and the canary keeps serving."""
    v1, v2 = versions
    check = canary.canary_start(project=project, version=v2)
    attacker = make_api_key(project, scopes=["ingest"])
    flood(api_client, attacker, forged(project, 2, 60, "failure") + forged(project, 1, 60, "success"))
    assert canary.live_check_look(check_id=check.pk) == "flagged"
    check.refresh_from_db()
    assert check.evidence["verdict"] == "worse" and check.evidence["look"]["failure"]["worse"]
    assert check.evidence["held"].startswith("the traffic the router vouched for does not show it (0 vouched")
    assert AliasAssignment.objects.get(project=project, alias="canary").version == v2
    assert not AliasEvent.objects.filter(project=project, alias="canary", kind="end").exists()
    note = Notification.objects.get(project=project)
    assert note.event_type == "canary.worse" and "not rolled back by itself" in note.text
    page = client_for(user).get(reverse("registry_page", args=[project.slug])).content.decode()
    assert "but it was not rolled back by itself: the traffic the router vouched for does not show it" in page
    assert "counted for an automatic action: 0 of v2&#x27;s trajectories and 0 of v1&#x27;s" in page


def test_the_same_real_difference_on_vouched_traffic_is_acted_on(project, versions):
    v1, v2 = versions
    check = canary.canary_start(project=project, version=v2)
    traffic(project, 2, 60, failures=60)
    traffic(project, 1, 60)
    assert canary.live_check_look(check_id=check.pk) == "rolled_back"
    end = AliasEvent.objects.filter(project=project, alias="canary").first()
    assert (end.kind, end.actor) == ("end", "canary")
    assert "failure rate 100.0% against 0.0%" in end.reason
    assert end.evidence["trusted"]["subject"] == {"n": 60, "known": 60, "failures": 60, "triaged": 0, "unsafe": 0,
                                                  "vouched": 60, "senders": 1}


def test_an_ingest_key_flooding_successes_does_not_promote_the_canary(project, versions, api_client, make_api_key):
    v1, v2 = versions
    check = canary.canary_start(project=project, version=v2)
    attacker = make_api_key(project, scopes=["ingest"])
    flood(api_client, attacker, forged(project, 2, 60, "success") + forged(project, 1, 60, "success"))
    # Nothing at all was vouched for: a person decides.
    assert canary.live_check_look(check_id=check.pk) == "flagged"
    check.refresh_from_db()
    assert check.evidence["verdict"] == "ready" and "too little of the traffic was vouched for" in check.evidence["held"]
    assert selectors.production_of(project=project) == v1
    assert "not promoted by itself" in Notification.objects.get(project=project).text


def test_where_the_router_vouches_a_flood_of_successes_waits_for_vouched_evidence(project, versions, api_client,
                                                                                   make_api_key):
    v1, v2 = versions
    check = canary.canary_start(project=project, version=v2)
    traffic(project, 2, 5)
    traffic(project, 1, 45)
    flood(api_client, make_api_key(project, scopes=["ingest"]),
          forged(project, 2, 60, "success") + forged(project, 1, 60, "success"))
    assert canary.live_check_look(check_id=check.pk) == "running"
    check.refresh_from_db()
    assert check.evidence["verdict"] == "watching" and check.evidence["held"].startswith("too little")
    traffic(project, 2, 50)
    traffic(project, 1, 50)
    assert canary.live_check_look(check_id=check.pk) == "promoted"  # the vouched evidence has its minimum


def test_an_ingest_key_cannot_push_the_watch_into_a_rollback(project, versions, user, api_client, make_api_key):
    v1, v2 = versions
    traffic(project, 1, 200, failures=20)  # before the move, vouched
    services.model_promote(project=project, version=v2, user=user)
    watch = LiveCheck.objects.get(project=project, kind="watch", status="running")
    traffic(project, 2, 40, failures=4)
    traffic(project, 1, 40, failures=4)  # the holdback: v1 keeps its share at the same hours
    flood(api_client, make_api_key(project, scopes=["ingest"]), forged(project, 2, 60, "failure"))
    assert canary.live_check_look(check_id=watch.pk) == "flagged"
    assert selectors.production_of(project=project) == v2
    watch.refresh_from_db()
    assert "does not show it (40 vouched trajectories counted on v2" in watch.evidence["held"]
    # The real thing, vouched for, then rolls back by itself.
    traffic(project, 2, 60, failures=40)
    traffic(project, 1, 20, failures=2)
    assert canary.live_check_look(check_id=watch.pk) == "rolled_back"
    assert selectors.production_of(project=project) == v1


# --- what counts ---------------------------------------------------------------------------------------------


def test_one_senders_share_of_an_arm_is_capped_at_its_first_trajectories(project, versions, settings):
    v1, v2 = versions
    names = [f"{project.slug}-v2"]
    traffic(project, 2, 40, failures=4, sender="key:agent")
    traffic(project, 2, 60, failures=60, sender="key:other")  # real tokens, a second key: at most half the arm
    counted = canary.arm_counts(project=project, names=names, vouched=True)
    assert counted == {"n": 90, "known": 90, "failures": 54, "triaged": 0, "unsafe": 0, "vouched": 100, "senders": 2}
    first = Trajectory.objects.filter(project=project, ingested_by="key:other").order_by("id")[:50]
    assert {t.outcome for t in first} == {"failure"}
    assert canary.arm_counts(project=project, names=names)["n"] == 100  # all traffic, for the figures
    settings.FLYWHEEL_EVIDENCE_KEY_SHARE = 1.0
    assert canary.arm_counts(project=project, names=names, vouched=True)["n"] == 100
    settings.FLYWHEEL_EVIDENCE_KEY_SHARE = 0.5
    # A sender alone is never capped: there is no one to share the arm with.
    alone = [f"{project.slug}-v1"]
    traffic(project, 1, 30, sender="key:agent")
    assert canary.arm_counts(project=project, names=alone, vouched=True)["n"] == 30


def test_a_token_that_two_trajectories_carry_counts_once(project, versions):
    """Two batches racing with one token can both be stored as vouched; the count takes the first."""
    v1, v2 = versions
    traffic(project, 2, 3)
    first, second, _ = Trajectory.objects.filter(project=project).order_by("id")
    Trajectory.objects.filter(pk=second.pk).update(vouch_request=first.vouch_request)
    counted = canary.arm_counts(project=project, names=[f"{project.slug}-v2"], vouched=True)
    assert (counted["n"], counted["vouched"]) == (2, 2)


def test_an_arm_imbalance_is_flagged_and_holds_automatic_actions(project, versions):
    v1, v2 = versions
    check = canary.canary_start(project=project, version=v2)  # a weight of 0.1
    started = check.started_at + timedelta(minutes=5)
    later = started + timedelta(hours=1)
    traffic(project, 2, 100, failures=60, started_at=started)  # half the vouched traffic on a 10% canary
    traffic(project, 1, 100, failures=10, started_at=started)
    assert canary.live_check_look(check_id=check.pk, now=later) == "flagged"
    check.refresh_from_db()
    split = check.evidence["trusted"]["split"]
    assert (split["canary"], split["production"], split["imbalanced"]) == (100, 100, True)
    assert split["p"] <= evidence.SPLIT_ALPHA
    assert check.evidence["held"].startswith("the split of the vouched traffic is far from the weight (50.0% on v2")
    assert AliasAssignment.objects.get(project=project, alias="canary").version == v2
    assert list(Notification.objects.filter(project=project).order_by("id").values_list("event_type", flat=True)) \
        == ["canary.imbalanced", "canary.worse"]


def test_a_split_at_the_weight_acts(project, versions):
    v1, v2 = versions
    check = canary.canary_start(project=project, version=v2)
    started = check.started_at + timedelta(minutes=5)
    traffic(project, 2, 60, failures=40, started_at=started)
    traffic(project, 1, 540, failures=54, started_at=started)
    assert canary.live_check_look(check_id=check.pk, now=started + timedelta(hours=1)) == "rolled_back"
    split = LiveCheck.objects.get(pk=check.pk).evidence["trusted"]["split"]
    assert (split["canary"], split["production"], split["imbalanced"]) == (60, 540, False)


# --- the split check's error rates, by simulation ----------------------------------------------------------------

STREAMS = 4000


def _split_streams(*, weight, share, seed, canary_until=1000, per_look=20, streams=STREAMS):
    """`streams` canaries whose router sends each trajectory to the canary with probability `share` while the
    check expects `weight`: a look every `per_look / weight` trajectories until the canary's expected
    `canary_until`, the always-valid p a running minimum, as `split_check` carries it. Answers the share flagged
    and the median canary trajectories at the flag."""
    rng = np.random.default_rng(seed)
    step = round(per_look / weight)
    looks = round(canary_until / per_look)
    k = step * np.arange(1, looks + 1)  # trajectories at each look
    x = np.cumsum(rng.binomial(step, share, size=(streams, looks)), axis=1)  # canary trajectories at each look
    log_ratio = (gammaln(1 + x) + gammaln(1 + k - x) - gammaln(2 + k)
                 - x * np.log(weight) - (k - x) * np.log1p(-weight))
    flagged = log_ratio >= np.log(1 / evidence.SPLIT_ALPHA)
    hit = flagged.any(axis=1)
    first = np.where(hit, flagged.argmax(axis=1), -1)
    at = x[np.arange(streams)[hit], first[hit]]
    return hit.mean(), (int(np.median(at)) if hit.any() else None), int(hit.sum())


def _interval(hits: int, n: int) -> str:
    ci = binomtest(hits, n).proportion_ci(method="wilson")
    return f"[{ci.low:.2%}, {ci.high:.2%}]"


def test_the_split_check_function_is_the_simulated_one():
    for x, k, w in ((3, 40, 0.1), (100, 200, 0.1), (0, 500, 0.05)):
        simulated = (gammaln(1 + x) + gammaln(1 + k - x) - gammaln(2 + k) - x * np.log(w) - (k - x) * np.log1p(-w))
        assert evidence.split_log_ratio(x, k - x, w) == pytest.approx(simulated)
    assert evidence.split_check([(100, 100, 0.1)])["imbalanced"] and not evidence.split_check([(10, 90, 0.1)])["imbalanced"]
    assert evidence.split_check([(10, 90, 0.1)], previous={"p": 1e-9})["imbalanced"]  # a running minimum


@pytest.mark.parametrize("weight", [0.1, 0.05])
def test_a_correct_split_is_flagged_at_most_alpha_of_the_time(weight):
    rate, _, hits = _split_streams(weight=weight, share=weight, seed=7)
    print(f"\nsplit check, correct routing at {weight:.0%}, a look every 20 canary trajectories to 1,000, {STREAMS} "
          f"streams: flagged {rate:.2%} {_interval(hits, STREAMS)} (alpha {evidence.SPLIT_ALPHA:.1%})")
    assert rate <= evidence.SPLIT_ALPHA * 2  # the bound, with room for the simulation's own error


@pytest.mark.parametrize("share", [0.15, 0.2, 0.05])
def test_a_split_away_from_the_weight_is_caught(share):
    rate, median, hits = _split_streams(weight=0.1, share=share, seed=11)
    print(f"\nsplit check, weight 10%, the router sends {share:.0%}: flagged {rate:.1%} {_interval(hits, STREAMS)}, "
          f"median {median} canary trajectories at the flag")
    assert rate >= 0.9



# --- the split when a third arm is served beside the two compared ---------------------------------------------


@pytest.fixture
def three_versions(project, user, tmp_path):
    out = versions_with_adapters(project, user, tmp_path, adapters=2)
    # A person promotes the canary here: the watch it would end is looked at after it.
    RegistrySettings.objects.create(project=project, canary_min_per_arm=50, watch_hours=24, watch_rollback=True,
                                    canary_tolerance=0.5, watch_holdback=0.3)
    return out


def test_the_split_periods_follow_the_arms_served_beside():
    t0 = canary_started = _T0
    hour = timedelta(hours=1)
    beside = [(t0 + hour, t0 + 3 * hour, 0.25)]  # a holdback of 25% for two hours of the canary's five
    periods = evidence.split_periods(started_at=canary_started, now=t0 + 5 * hour, weight=0.1, others=beside)
    grace, settle = evidence.SPLIT_GRACE, evidence.SPLIT_SETTLE
    assert periods == [(t0 + grace, t0 + hour, 0.1), (t0 + hour + grace, t0 + 3 * hour, pytest.approx(0.1 / 0.75)),
                       (t0 + 3 * hour + grace, t0 + 5 * hour - settle, 0.1)]
    # Nothing beside: one period, the weight itself; a third arm still served: its share to now.
    assert evidence.split_periods(started_at=t0, now=t0 + hour, weight=0.1, others=[]) == [
        (t0 + grace, t0 + hour - settle, 0.1)]
    assert evidence.split_periods(started_at=t0, now=t0 + hour, weight=0.1, others=[(t0 - hour, None, 0.5)]) == [
        (t0 + grace, t0 + hour - settle, 0.2)]


def test_a_canary_beside_a_watchs_holdback_is_judged_on_its_share_of_the_two(project, three_versions, user):
    v1, v2, v3 = three_versions
    services.model_promote(project=project, version=v2, user=user)  # watched, with v1 held back on 30%
    watch = LiveCheck.objects.get(project=project, kind="watch", status="running")
    GateDecision.objects.create(project=project, candidate=v3, production=v2, passed=True)
    check = canary.canary_start(project=project, version=v3, weight=0.2)
    started = check.started_at + timedelta(minutes=5)
    # The router's three arms: canary 20%, holdback 30%, production 50%: the canary has 2/7 of the two compared.
    traffic(project, 3, 300, failures=30, started_at=started)
    traffic(project, 2, 750, failures=75, started_at=started)
    traffic(project, 1, 450, failures=45, started_at=started)
    canary.live_check_look(check_id=check.pk, now=started + timedelta(hours=1))
    split = LiveCheck.objects.get(pk=check.pk).evidence["trusted"]["split"]
    assert (split["canary"], split["production"], split["imbalanced"]) == (300, 750, False), split
    assert split["weight"] == pytest.approx(0.2 / 0.7)
    # Judged against the canary's weight alone, this correct routing read as a wrong split.
    assert evidence.split_check([(300, 750, 0.2)])["imbalanced"]
    # The watch's own holdback: 450 of 1,200 is 3/8, its 30% of the 80% the canary leaves.
    canary.live_check_look(check_id=watch.pk, now=started + timedelta(hours=1))
    split = LiveCheck.objects.get(pk=watch.pk).evidence["trusted"]["split"]
    assert (split["canary"], split["production"], split["imbalanced"], split["on"]) == (450, 750, False, "v1"), split
    assert split["weight"] == pytest.approx(0.3 / 0.8)


def test_a_holdback_away_from_its_weight_holds_the_watchs_rollback(project, three_versions, user):
    v1, v2, _ = three_versions
    services.model_promote(project=project, version=v2, user=user)  # v1 held back on 30%
    watch = LiveCheck.objects.get(project=project, kind="watch", status="running")
    started = watch.started_at + timedelta(minutes=5)
    traffic(project, 2, 100, failures=60, started_at=started)  # worse, on half the traffic where 70% was routed
    traffic(project, 1, 100, failures=10, started_at=started)
    assert canary.live_check_look(check_id=watch.pk, now=started + timedelta(hours=1)) == "flagged"
    watch.refresh_from_db()
    split = watch.evidence["trusted"]["split"]
    assert (split["canary"], split["production"], split["imbalanced"], split["on"]) == (100, 100, True, "v1")
    assert watch.evidence["held"].startswith("the split of the vouched traffic is far from the weight (50.0% on v1")
    assert selectors.production_of(project=project) == v2  # not rolled back by itself
    assert "watch.imbalanced" in Notification.objects.filter(project=project).values_list("event_type", flat=True)


@pytest.mark.parametrize("holdback", [0.05, 0.3])
def test_a_canary_beside_a_holdback_was_flagged_on_its_weight_alone(holdback):
    # The canary's vouched share of the two arms compared is w / (1 - h) beside a holdback h: judged on w, correct
    # routing was flagged; on w / (1 - h), at most alpha of the time.
    share = 0.1 / (1 - holdback)
    before, _, hits_before = _split_streams(weight=0.1, share=share, seed=13, canary_until=3000)
    after, _, hits_after = _split_streams(weight=share, share=share, seed=13, canary_until=3000)
    print(f"\nsplit check, a 10% canary beside a {holdback:.0%} holdback, a look every 20 canary trajectories to "
          f"3,000, {STREAMS} streams: flagged {before:.1%} {_interval(hits_before, STREAMS)} on the weight alone, "
          f"{after:.2%} {_interval(hits_after, STREAMS)} on its share of the two")
    assert after <= evidence.SPLIT_ALPHA * 2
    assert before > after
