"""Failure modes that reopen (flywheel.failures.recurrence, flywheel.evals.recurrence): a fixed mode reopens
when failures like its members come back and not for unrelated ones; the signal-rate rule with its threshold
and its error rates by simulation; a promotion marks fixed the modes whose eval cases it passes, a person's
fix records the version serving; the notification (webhook with its event type, e-mail); the review queue
offers recurrences first; the mode's page shows the recurrence escaped and its rate per version.

Here beside the clustering tests: the similarity rule is the clustering's features, and these fixtures (the
embedder, labeled failures from bench/clustering_fixture.py) are the clustering's."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from django.core import mail
from django.urls import reverse
from django.utils import timezone

from flywheel.evals import recurrence as registry_recurrence
from flywheel.evals.runs import eval_run_record
from flywheel.evals.services import suite_create, version_create
from flywheel.failures import queue
from flywheel.failures import recurrence as failures_recurrence
from flywheel.failures.models import FailureMode, RecurrenceMatch
from flywheel.failures.services import failure_mode_assign, failure_mode_create, failure_mode_update
from flywheel.registry import notify, services
from flywheel.registry.models import LiveRollup, Notification, RegistrySettings
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.models import Trajectory, TriageSignal
from tests.platform.registry.worlds import versions_with_adapters


@pytest.fixture
def versions(project, user, tmp_path):
    """v1 in production (the base alone); v2 with an adapter that passed the gate against v1."""
    return versions_with_adapters(project, user, tmp_path)


@pytest.fixture
def make_trajectories(db):
    """`make_trajectories(project, n, prefix="t", **overrides)`: failing trajectories (a refund that errors),
    ingested, oldest first (the failures tests' fixture; conftest fixtures do not cross folders)."""

    def make(project, n, prefix="t", **overrides):
        records = [{"external_id": f"{prefix}-{i}", "agent": "support-bot", "outcome": "failure",
                    "messages": [{"role": "user", "content": f"Refund order {prefix}-{i}"},
                                 {"role": "assistant", "content": "Sorry, I could not do that."}],
                    **overrides} for i in range(n)]
        assert ingest_trajectories(project=project, records=records).accepted == n
        return list(Trajectory.objects.filter(project=project, external_id__startswith=f"{prefix}-").order_by("id"))

    return make


def _signal(trajectory, severity=3):
    TriageSignal.objects.create(project_id=trajectory.project_id, trajectory=trajectory, kind="tool_error",
                                severity=severity, message_index=1)
    Trajectory.objects.filter(pk=trajectory.pk).update(triage_severity=severity)


def _mode_of(project, user, ids, name="Flight dates in the wrong format"):
    mode = failure_mode_create(project=project, name=name, category_key="wrong_arguments", user=user)
    failure_mode_assign(failure_mode=mode, trajectories=ids, user=user)
    return mode


def _fix(mode):
    failure_mode_update(failure_mode=mode, name=mode.name, category_key=mode.category.key, status="fixed")
    mode.refresh_from_db()
    return mode


class _Hook(BaseHTTPRequestHandler):
    received: list[tuple[dict, bytes]] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Hook.received.append((dict(self.headers), body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def hook():
    _Hook.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    server.shutdown()


# --- the similarity rule ---------------------------------------------------------------------------------


def test_a_fixed_mode_reopens_when_similar_failures_return_not_for_unrelated_ones_and_says_so(
    project, user, embedder, labeled_failures, versions, hook, django_capture_on_commit_callbacks,
):
    RegistrySettings.objects.create(project=project, webhook_url=hook, webhook_secret="s",
                                    notify_emails="ops@example.com")
    before = labeled_failures(project, 8, causes=["flight_date_format", "sql_destructive"], prefix="before")
    mode = _mode_of(project, user, [t for t, c in before.items() if c == "flight_date_format"])
    mode = _fix(mode)
    assert (mode.status, mode.fixed_version_number) == ("fixed", 1) and mode.fixed_at is not None

    # Unrelated failures after the fix: other causes, a sibling cause on another tool included.
    labeled_failures(project, 6, causes=["sql_destructive", "refund_over_total", "ticket_bad_json"], seed=1,
                     prefix="unrelated")
    assert registry_recurrence.recurrence_check(mode_id=mode.pk, embedder=embedder) == "fixed"
    assert not RecurrenceMatch.objects.filter(failure_mode=mode).exists()
    mode.refresh_from_db()
    watched_to = mode.recurrence_watch["after_id"]
    assert watched_to == Trajectory.objects.filter(project=project).order_by("-id").values_list("id", flat=True)[0]

    # The same failure again, on traffic of v1's adapter name.
    back = labeled_failures(project, 4, causes=["flight_date_format"], seed=2, prefix="back")
    Trajectory.objects.filter(pk__in=list(back)).update(model_version=f"{project.slug}-v1")
    with django_capture_on_commit_callbacks(execute=False):
        assert registry_recurrence.recurrence_check(mode_id=mode.pk, embedder=embedder) == "open"
    mode.refresh_from_db()
    assert mode.status == "open" and mode.reopened_at is not None and mode.fixed_version_number == 1
    matched = set(RecurrenceMatch.objects.filter(failure_mode=mode).values_list("trajectory_id", flat=True))
    assert matched <= set(back) and len(matched) >= 3  # nothing from before the fix or of another cause
    assert mode.recurrence["rules"] == ["similarity"]
    assert set(mode.recurrence["trajectory_ids"]) == matched
    assert mode.recurrence["similarity"]["matches"] == len(matched)

    row = Notification.objects.get(project=project, event_type="failure_mode.reopened")
    assert notify.notification_deliver(notification_id=row.pk) == "sent"
    headers, body = _Hook.received[0]
    assert headers["X-Flywheel-Event"] == "failure_mode.reopened"
    data = json.loads(body)
    assert data["event"] == "failure_mode.reopened" and data["failure_mode"]["id"] == mode.pk
    assert data["failure_mode"]["fixed_version_number"] == 1
    assert set(data["recurrence"]["trajectory_ids"]) == matched
    assert len(mail.outbox) == 1 and mail.outbox[0].to == ["ops@example.com"]
    assert mode.name in mail.outbox[0].subject and "reopened" in mail.outbox[0].subject

    # An open mode is not watched: a second check changes nothing.
    assert registry_recurrence.recurrence_check(mode_id=mode.pk, embedder=embedder) == "open"
    assert Notification.objects.filter(event_type="failure_mode.reopened").count() == 1


class _Counting:
    """The embedder, counting the texts it is asked to encode."""

    def __init__(self, embedder):
        self.inner, self.name, self.texts = embedder, embedder.name, 0

    def encode(self, texts):
        self.texts += len(texts)
        return self.inner.encode(texts)


def test_fixed_modes_scanning_the_same_new_failures_embed_them_once_until_one_changes(
    project, user, embedder, labeled_failures,
):
    before = labeled_failures(project, 6, causes=["flight_date_format", "sql_destructive"], prefix="before")
    modes = [_fix(_mode_of(project, user, [t for t, c in before.items() if c == cause], name=cause))
             for cause in ("flight_date_format", "sql_destructive")]
    new = labeled_failures(project, 5, causes=["refund_over_total"], seed=3, prefix="new")
    counting = _Counting(embedder)
    registry_recurrence.recurrence_check(mode_id=modes[0].pk, embedder=counting)
    first = counting.texts
    assert first == 2 * (6 + len(new))  # two texts (request, failing step) for its 6 members and each new failure
    registry_recurrence.recurrence_check(mode_id=modes[1].pk, embedder=counting)
    second = counting.texts - first
    assert second == 2 * 6  # only the second mode's own members: the new failures came from memory

    # A replayed failure is a new state: embedded again, by the next scan that reads it.
    replayed = next(iter(new))
    Trajectory.objects.filter(pk=replayed).update(updated_at=timezone.now())
    kept, _ = failures_recurrence._vectors(list(new), counting)
    assert sorted(kept) == sorted(new) and counting.texts - first - second == 2


def test_the_sweep_hands_fixed_modes_to_a_worker_which_scans_them(celery_worker, make_project, make_trajectories):
    project = make_project("recur-sweep")
    ids = [t.pk for t in make_trajectories(project, 3)]
    fixed = _fix(_mode_of(project, None, ids, name="fixed one"))
    still_open = _mode_of(project, None, ids, name="open one")
    assert registry_recurrence.recurrence_sweep() == 1  # only the fixed one is watched
    scanned = celery_worker.wait_for(
        lambda: FailureMode.objects.filter(pk=fixed.pk, recurrence_watch__has_key="scanned_at").first())
    assert scanned.recurrence_watch["profile"]["members"] == 3 and scanned.status == "fixed"
    still_open.refresh_from_db()
    assert still_open.recurrence_watch == {}


def test_the_threshold_separates_causes_on_the_bench_fixture(fx, embedder):
    """The similarity rule's figures in the module's text: 12 causes, 40 failures each, 15 or 8 members."""
    from flywheel.failures.clustering import engine

    causes = list(fx.CAUSES)
    data = fx.failures(40 * len(causes), seed=1, causes=causes)
    labels = np.array([causes.index(c) for c, _ in data])
    vectors = engine.features([engine.signature(r["messages"], []) for _, r in data], embedder)
    for size, least_caught in ((15, 0.98), (8, 0.95)):
        caught = same = false = others = 0
        for i in range(len(causes)):
            members = vectors[labels == i][:size]
            centre = engine.centroid(members)
            threshold = failures_recurrence.similarity_threshold(members)
            caught += int((vectors[labels == i][size:] @ centre >= threshold).sum())
            same += len(vectors[labels == i][size:])
            false += int((vectors[labels != i] @ centre >= threshold).sum())
            others += int((labels != i).sum())
        print(f"\nsimilarity rule, {size} members: {caught / same:.1%} of a cause's new failures match, "
              f"{false / others:.2%} of other causes' failures do")
        assert caught / same >= least_caught
        assert false / others <= 0.01


# --- the signal rule -------------------------------------------------------------------------------------


def _simulate(p_before, p_after, *, streams=2000, before_n=500, step=100, most=5000, seed=0):
    rng = np.random.default_rng(seed)
    reopened, when = 0, []
    for _ in range(streams):
        before_k = int(rng.binomial(before_n, p_before))
        n = k = 0
        p = 1.0
        while n < most:
            k += int(rng.binomial(step, p_after))
            n += step
            look = failures_recurrence.signal_look(after_n=n, after_k=k, before_n=before_n, before_k=before_k,
                                                   previous_p=p)
            p = look.p
            if look.rose:
                reopened += 1
                when.append(n)
                break
    return reopened / streams, (int(np.median(when)) if when else None)


def test_the_signal_rule_rarely_reopens_a_mode_whose_signal_stays_and_catches_one_that_comes_back():
    """The figures in flywheel.failures.recurrence's text: 2,000 streams, 10% before the fix measured on 500
    trajectories, a look every 100, 5,000 at most."""
    stays, _ = _simulate(0.10, 0.10)
    at_margin, _ = _simulate(0.10, 0.13, streams=1000, seed=1)
    back, median = _simulate(0.10, 0.20, seed=2)
    print(f"\nsignal rule: rate unchanged reopened {stays:.2%}; at p_before + margin {at_margin:.2%}; "
          f"ten points higher reopened {back:.1%} (median {median} trajectories)")
    assert stays <= 0.01
    # At the edge of the null (three points up, exactly the margin) the bound would be 1% with p_before
    # known; estimated from 500 trajectories it is below the truth half the time, so more are reopened.
    assert at_margin <= 0.15
    assert back >= 0.99 and median <= 600


def test_the_signal_rule_states_its_threshold():
    # 10% before on 500 trajectories: p0 = 13%. 30 of 100 is past it; 25 of 100 not yet (p = 0.044 > 1%).
    assert failures_recurrence.signal_look(after_n=100, after_k=30, before_n=500, before_k=50).rose
    look = failures_recurrence.signal_look(after_n=100, after_k=25, before_n=500, before_k=50)
    assert not look.rose and look.p0 == pytest.approx(0.13) and 0.01 < look.p < 0.05
    # Too few signals, or too little traffic before the fix to know the rate, never reopen.
    assert not failures_recurrence.signal_look(after_n=8, after_k=4, before_n=500, before_k=0).rose
    assert failures_recurrence.signal_look(after_n=100, after_k=90, before_n=50, before_k=5).p0 is None


def _traffic(project, n, *, prefix, signal_first=0, failed=True, model="acme-v1"):
    records = [{"external_id": f"{prefix}-{i}", "model_version": model, "outcome": "failure" if failed else "success",
                "messages": [{"role": "user", "content": f"what is the weather in city {i}"}]} for i in range(n)]
    assert ingest_trajectories(project=project, records=records).accepted == n
    rows = list(Trajectory.objects.filter(project=project, external_id__startswith=f"{prefix}-").order_by("id"))
    Trajectory.objects.filter(pk__in=[t.pk for t in rows]).update(triaged_at="2026-01-01T00:00:00Z")
    TriageSignal.objects.bulk_create([TriageSignal(project=project, trajectory=t, kind="tool_error", severity=2)
                                      for t in rows[:signal_first]])
    return rows


def test_a_fixed_mode_reopens_when_its_signal_rate_rises_past_the_threshold(project, user, embedder, labeled_failures):
    members = labeled_failures(project, 6, causes=["stock_timeout"], prefix="members")
    _traffic(project, 200, prefix="before", signal_first=20, failed=False)  # 10% before the fix
    mode = _fix(_mode_of(project, user, list(members), name="Stock service times out"))

    _traffic(project, 200, prefix="same", signal_first=20, failed=False)  # the rate it had: stays fixed
    assert registry_recurrence.recurrence_check(mode_id=mode.pk, embedder=embedder) == "fixed"
    mode.refresh_from_db()
    state = mode.recurrence_watch["profile"]["signal"]
    assert state["kind"] == "tool_error"
    assert (state["before_n"], state["before_k"]) == (206, 26)  # the members carry it too
    assert (state["after_n"], state["after_k"]) == (200, 20)

    risen = _traffic(project, 100, prefix="risen", signal_first=60)  # 80 of 300 since the fix, p0 = 15.6%
    assert registry_recurrence.recurrence_check(mode_id=mode.pk, embedder=embedder) == "open"
    mode.refresh_from_db()
    assert mode.recurrence["rules"] == ["signal"]
    assert mode.recurrence["signal"]["after_k"] == 80 and mode.recurrence["signal"]["rose"]
    signal_matches = set(RecurrenceMatch.objects.filter(failure_mode=mode, rule="signal").values_list(
        "trajectory_id", flat=True))
    assert signal_matches == {t.pk for t in risen[:60]}  # failed and carrying the signal, since the fix


# --- when a mode counts as fixed -------------------------------------------------------------------------


def _suite_with_cases(project, modes_and_trajectories):
    suite = suite_create(project=project, name="holdout")
    cases = [suite.cases.create(trajectory=t, failure_mode=m, messages=t.messages,
                                verifier={"type": "exact", "expected": "ok"}) for m, t in modes_and_trajectories]
    return version_create(collection=suite), cases


def test_a_promotion_marks_fixed_the_modes_whose_eval_cases_it_passes(project, user, versions, make_trajectories):
    v1, v2 = versions
    ts = make_trajectories(project, 3)
    passed = _mode_of(project, user, [ts[0].pk, ts[1].pk], name="passed by v2")
    failed = _mode_of(project, user, [ts[2].pk], name="still failed by v2")
    untested = _mode_of(project, user, [ts[2].pk], name="no eval case")
    suite_version, cases = _suite_with_cases(project, [(passed, ts[0]), (passed, ts[1]), (failed, ts[2])])
    results = [{"id": cases[0].row_id, "passed": True, "pass_rate": 1.0},
               {"id": cases[1].row_id, "passed": True, "pass_rate": 0.75},
               {"id": cases[2].row_id, "passed": False, "pass_rate": 0.25}]
    eval_run_record(project=project, model_version=v2, suite_version=suite_version, cases=results, metrics={})

    services.model_promote(project=project, version=v2, user=user)
    for mode in (passed, failed, untested):
        mode.refresh_from_db()
    assert (passed.status, passed.fixed_version_number) == ("fixed", 2) and passed.fixed_at is not None
    assert passed.recurrence_watch["by"] == "promotion"
    assert passed.recurrence_watch["evidence"]["cases"] == 2
    assert passed.recurrence_watch["evidence"]["pass_rate"] == pytest.approx(0.875)
    assert (failed.status, failed.fixed_at) == ("open", None)
    assert (untested.status, untested.fixed_at) == ("open", None)

    # A rollback fixes nothing (and does not unfix).
    services.model_rollback(project=project, user=user)
    passed.refresh_from_db()
    assert (passed.status, passed.fixed_version_number) == ("fixed", 2)


def test_a_person_marking_a_mode_fixed_records_when_and_the_version_serving(
    project, user, versions, make_trajectories, api_client, api_key,
):
    ts = make_trajectories(project, 2)
    mode = _fix(_mode_of(project, user, [t.pk for t in ts]))
    assert (mode.fixed_version_number, mode.recurrence_watch["by"]) == (1, "person")
    assert mode.recurrence_watch["after_id"] == ts[-1].pk
    listed = api_client.get("/api/v1/failure-modes", key=api_key).json()
    assert [(m["id"], m["status"], m["fixed_version_number"], m["reopened_at"]) for m in listed] == [
        (mode.pk, "fixed", 1, None)]
    fixed_at = mode.fixed_at
    _fix(mode)  # saving it fixed again is no new fix
    mode.refresh_from_db()
    assert mode.fixed_at == fixed_at


def test_without_a_registry_version_a_fix_has_no_version(project, user, make_trajectories):
    mode = _fix(_mode_of(project, user, [t.pk for t in make_trajectories(project, 1)]))
    assert mode.status == "fixed" and mode.fixed_at is not None and mode.fixed_version_number is None


# --- the queue and the page ------------------------------------------------------------------------------


def test_the_queue_offers_a_reopened_modes_matches_first(project, user, make_trajectories):
    ts = make_trajectories(project, 4)
    mode = _mode_of(project, user, [ts[0].pk])
    for t in ts[2:]:
        _signal(t)  # newer and more severe: first in the usual order
    RecurrenceMatch.objects.create(failure_mode=mode, trajectory=ts[1], rule="similarity", similarity=0.9)
    FailureMode.objects.filter(pk=mode.pk).update(status="fixed")
    assert queue.queue_claim_next(project=project, user=user).trajectory == ts[3]  # a fixed mode's match waits
    queue.queue_release(project=project, user=user)
    FailureMode.objects.filter(pk=mode.pk).update(status="open")  # reopened
    assert queue.queue_claim_next(project=project, user=user).trajectory == ts[1]


def test_the_modes_page_shows_its_recurrence_escaped_and_its_rate_per_version(
    project, user, versions, make_trajectories, client_for,
):
    hostile = "<script>alert('x')</script>"
    ts = make_trajectories(project, 3, model_version=f"{project.slug}-v1")
    back = ingest_trajectories(project=project, records=[{
        "external_id": "hostile", "model_version": f"{project.slug}-v2", "outcome": "failure",
        "messages": [{"role": "user", "content": hostile}]}])
    assert back.accepted == 1
    returned = Trajectory.objects.get(project=project, external_id="hostile")
    mode = _fix(_mode_of(project, user, [t.pk for t in ts], name=f"mode {hostile}"))
    RecurrenceMatch.objects.create(failure_mode=mode, trajectory=returned, rule="similarity", similarity=0.91,
                                   model_version=returned.model_version)
    failures_recurrence.failure_mode_reopen(failure_mode=mode, evidence={
        "rules": ["similarity"], "reason": f"back {hostile}", "similarity": {"matches": 3, "min_matches": 3,
                                                                            "threshold": 0.8}})
    LiveRollup.objects.create(project=project, model_version=f"{project.slug}-v1", hour="2026-11-20T10:00:00Z",
                              trajectories=10, failures=4)
    LiveRollup.objects.create(project=project, model_version=f"{project.slug}-v2", hour="2026-11-20T10:00:00Z",
                              trajectories=20, failures=5)

    client = client_for(user)
    page = client.get(reverse("failure_mode_detail", args=[project.slug, mode.pk])).content.decode()
    assert hostile not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert 'id="fm-recurrence"' in page and "Came back after its fix" in page
    assert f'data-trajectory="{returned.pk}"' in page and "by <strong>v1</strong>" in page
    versions_url = reverse("registry_failure_mode_versions", args=[project.slug, mode.pk])
    assert f'hx-get="{versions_url}"' in page

    fragment = client.get(versions_url).content.decode()
    assert hostile not in fragment
    rows = {r.number: r for r in registry_recurrence.mode_version_rates(failure_mode=mode)}
    assert (rows[1].matching, rows[1].failures, rows[1].trajectories) == (3, 4, 10)  # its members
    assert (rows[2].matching, rows[2].failures) == (1, 5)  # the recurrence
    assert rows[1].fixed_here and not rows[2].fixed_here
    assert 'data-version="1"' in fragment and "75%" in fragment and "marked fixed" in fragment
