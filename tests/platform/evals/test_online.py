"""Online evaluation of live traffic: deterministic sampling with a known rate and an hourly cap, a task's
verifier matched by tool set, a judge only where configured and allowed, low scores to the review queue,
scores per version with an interval whose coverage is simulated, the API's scopes and an escaped page."""

from __future__ import annotations

import datetime as dt
import json
import math
import random
import re

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse
from django.utils import timezone

from flywheel.evals import online, promotion
from flywheel.evals.models import OnlineScore
from flywheel.trajectories.models import Trajectory
from tests.platform.evals.conftest import TOOLS, refund_record
from tests.standin import StandIn, serving

pytestmark = pytest.mark.django_db

REFUND_50 = [{"name": "refund", "arguments": {"order_id": {"any": True}, "amount": {"range": [49.99, 50.01]}}}]
BASE = {"enabled": True, "sample_rate": 1.0, "max_per_hour": 200, "threshold": 0.5}


@pytest.fixture
def refund_task(ingest, task_set, user):
    """A task of the set whose tools are lookup_order and refund, expecting a refund of 50 at message 4."""
    source = ingest(refund_record("task-source", amount=500.0))
    task, _ = promotion.trajectory_promote(trajectory=source, target=task_set, user=user, data={
        "message_index": 4, "expect": "calls", "expected_calls": REFUND_50})
    return task


def _enable(project, **data):
    return online.online_settings_set(project=project, data={**BASE, **data})


# --- sampling ----------------------------------------------------------------------------------------------


def test_the_sample_is_a_pure_function_of_project_and_external_id():
    assert online.sample_point(7, "abc") == online.sample_point(7, "abc")
    assert online.sample_point(7, "abc") != online.sample_point(8, "abc")
    assert 0 <= online.sample_point(1, "") < 1


def test_the_sampled_share_is_within_its_binomial_bound():
    """20,000 distinct ids at rate 0.1: the share sampled is within 5 standard errors (0.0106) of 0.1. The hash
    is fixed, so this is no random test: it checks that the hash is uniform enough, for every rate below."""
    ids = [f"traj-{i}" for i in range(20_000)]
    for rate in (0.01, 0.1, 0.5):
        share = sum(online.sampled(3, i, rate) for i in ids) / len(ids)
        assert abs(share - rate) < 5 * math.sqrt(rate * (1 - rate) / len(ids)), (rate, share)


def test_only_what_arrives_after_it_is_turned_on_is_sampled_each_once(ingest, project, refund_task):
    before = ingest(refund_record("before", amount=50.0))
    _enable(project, task_set=refund_task.task_set_id)
    after = ingest(refund_record("after", amount=50.0))
    assert online.online_eval_process(project_id=project.pk) == 1
    assert list(OnlineScore.objects.values_list("trajectory_id", flat=True)) == [after.pk]
    # Again: the watermark has passed it, and a second store of the same score is refused by the constraint.
    assert online.online_eval_process(project_id=project.pk) == 0
    assert not OnlineScore.objects.filter(trajectory=before).exists()


def test_the_rate_and_the_hourly_cap(ingest, project, refund_task):
    _enable(project, task_set=refund_task.task_set_id, sample_rate=0.25, max_per_hour=15)
    records = [refund_record(f"live-{i}", amount=50.0) for i in range(120)]
    ingest(*records)
    by_id = Trajectory.objects.filter(external_id__startswith="live-").order_by("id").values_list("external_id", flat=True)
    expected = [external_id for external_id in by_id if online.sampled(project.pk, external_id, 0.25)]
    assert 15 < len(expected) < 60  # 30 expected: the cap binds
    now = timezone.now().replace(minute=5)
    assert online.online_eval_process(project_id=project.pk, now=now) == 15
    scored = list(OnlineScore.objects.order_by("trajectory_id").values_list("trajectory__external_id", flat=True))
    assert scored == expected[:15]  # the hour's first sampled ones, by id: nothing outside the sample
    assert online.cap_reached(online.settings_of(project=project), now)
    # The same hour: new trajectories are considered but none is scored; the next hour scores again.
    ingest(*[refund_record(f"later-{i}", amount=50.0) for i in range(40)])
    assert online.online_eval_process(project_id=project.pk, now=now + dt.timedelta(minutes=10)) == 0
    ingest(*[refund_record(f"next-{i}", amount=50.0) for i in range(40)])
    next_sampled = sum(online.sampled(project.pk, f"next-{i}", 0.25) for i in range(40))
    assert online.online_eval_process(project_id=project.pk, now=now + dt.timedelta(hours=1)) == min(15, next_sampled)


# --- verifiers ---------------------------------------------------------------------------------------------


def test_without_a_judge_only_trajectories_a_task_can_score_use_the_cap(ingest, project, refund_task):
    _enable(project, task_set=refund_task.task_set_id, max_per_hour=3)
    ingest(*[{**refund_record(f"lookup-{i}"), "tools": TOOLS[:1]} for i in range(5)])
    ingest(*[refund_record(f"refund-{i}", amount=50.0) for i in range(5)])
    assert online.online_eval_process(project_id=project.pk) == 3
    assert set(OnlineScore.objects.values_list("trajectory__external_id", flat=True)) <= {f"refund-{i}" for i in range(5)}


def test_a_task_verifier_scores_trajectories_with_its_tool_set_only(ingest, project, refund_task):
    _enable(project, task_set=refund_task.task_set_id)
    right = ingest({**refund_record("right", amount=50.0), "model_version": "bot-v2"})
    wrong = ingest({**refund_record("wrong", amount=500.0), "model_version": "bot-v1"})
    other_tools = ingest({**refund_record("other", amount=500.0), "tools": TOOLS[:1]})
    online.online_eval_process(project_id=project.pk)
    scores = {s.trajectory_id: s for s in OnlineScore.objects.all()}
    assert set(scores) == {right.pk, wrong.pk}  # the lookup-only trajectory matches no task
    assert scores[right.pk].passed and scores[right.pk].reward == 1.0 and not scores[right.pk].below_threshold
    assert not scores[wrong.pk].passed and scores[wrong.pk].below_threshold
    assert scores[wrong.pk].failure == "wrong_arguments" and scores[wrong.pk].source == refund_task.row_id
    assert scores[wrong.pk].verifier == f"task_set:{refund_task.task_set_id}"
    assert scores[right.pk].model_version == "bot-v2"
    assert other_tools.pk not in scores


def test_a_run_stopped_at_its_time_limit_keeps_what_it_scored_and_says_where_it_stopped(
    ingest, project, refund_task, monkeypatch
):
    """Celery raises SoftTimeLimitExceeded in whatever code runs when the limit passes: here, the third score."""
    from celery.exceptions import SoftTimeLimitExceeded

    _enable(project, task_set=refund_task.task_set_id)
    ingest(*[refund_record(f"live-{i}", amount=50.0) for i in range(4)])
    real, calls = online.task_score, []

    def score(task, trajectory):
        calls.append(trajectory.pk)
        if len(calls) == 3:
            raise SoftTimeLimitExceeded()
        return real(task, trajectory)

    monkeypatch.setattr(online, "task_score", score)
    assert online.online_eval_process(project_id=project.pk) == 2
    config = online.settings_of(project=project)
    assert config.last_error.startswith("It ran past its time limit") and "2 of the 4 sampled" in config.last_error
    assert OnlineScore.objects.count() == 2


class Judge(StandIn):
    """An OpenAI-compatible judge: counts requests, grades 0.2 when the answer says "sorry", else 0.9."""

    def do_POST(self) -> None:
        body = json.loads(self.body())
        self.server.requests.append((self.path, self.headers.get("Authorization"), body))
        prompt = body["messages"][0]["content"]
        score = 0.2 if "sorry" in prompt.split("Answer:")[1].split("Tool calls:")[0] else 0.9
        self.answer(200, {"choices": [{"message": {"content": json.dumps({"score": score, "reason": "ok"})}}],
                          "usage": {"prompt_tokens": 120, "completion_tokens": 15, "total_tokens": 135}})


def test_the_judge_is_called_only_when_configured_and_allowed(ingest, project, settings, refund_task):
    with serving(Judge, requests=[]) as judge:
        # Not configured: a task set alone sends nothing anywhere.
        _enable(project, task_set=refund_task.task_set_id)
        ingest(refund_record("quiet", amount=50.0))
        online.online_eval_process(project_id=project.pk)
        assert judge.requests == []
        judge_fields = {"judge_enabled": True, "judge_url": judge.url + "/v1", "judge_model": "grader",
                        "judge_rubric": "Polite and correct.", "judge_api_key": "sk-test"}
        # Configured on a loopback address the operator did not allow: refused at save, naming the field.
        settings.FLYWHEEL_OUTBOUND_ALLOWLIST = []
        with pytest.raises(ValidationError) as refused:
            _enable(project, **judge_fields)
        assert "judge_url" in refused.value.message_dict
        settings.FLYWHEEL_OUTBOUND_ALLOWLIST = ["127.0.0.1"]
        _enable(project, **judge_fields)
        ingest(refund_record("polite", amount=50.0), refund_record("rude", amount=50.0, answer="sorry, no"))
        assert online.online_eval_process(project_id=project.pk) == 2  # the judge's two; no task set now
        path, auth, body = judge.requests[0]
        assert path == "/v1/chat/completions" and auth == "Bearer sk-test" and body["model"] == "grader"
        rewards = dict(OnlineScore.objects.filter(verifier="llm_judge").values_list("trajectory__external_id", "reward"))
        assert rewards == {"polite": 0.9, "rude": 0.2}
        # What the judge spent, from its answers' usage: the dashboard's judge spend.
        assert online.judge_spend(project=project) == {"input_tokens": 240, "output_tokens": 30, "scores": 2}
        assert online.settings_of(project=project).last_error == ""
        # The allowlist withdrawn after the save: refused at send time, nothing stored, nothing sent; the
        # first refusal stops the judge for the run and is shown on the page.
        settings.FLYWHEEL_OUTBOUND_ALLOWLIST = []
        ingest(refund_record("late", amount=50.0), refund_record("later", amount=50.0))
        assert online.online_eval_process(project_id=project.pk) == 0
        assert len(judge.requests) == 2
        assert "OutboundRefused" in online.settings_of(project=project).last_error


def test_a_judge_whose_key_no_key_of_the_server_opens_is_not_called(ingest, project, settings):
    """SECRET_KEY rotated without SECRET_KEY_FALLBACKS: the sealed key is set but unreadable, so the judge is
    not called at all (never without its key, as if none were set), and the page says why."""
    settings.SECRET_KEY = "old-key-" + "x" * 40
    with serving(Judge, requests=[]) as judge:
        _enable(project, judge_enabled=True, judge_url=judge.url + "/v1", judge_model="grader",
                judge_rubric="Correct.", judge_api_key="sk-judge")
        settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = "new-key-" + "y" * 40, []
        ingest(refund_record("after-rotation", amount=50.0))
        assert online.online_eval_process(project_id=project.pk) == 0
        assert judge.requests == []
    error = online.settings_of(project=project).last_error
    assert "Unreadable" in error and "SECRET_KEY_FALLBACKS" in error


def test_the_judge_key_stays_with_the_origin_it_was_given_for(api_client, make_api_key, project, ingest):
    promote = make_api_key(project, scopes=["read", "promote"])
    with serving(Judge, requests=[]) as first, serving(Judge, requests=[]) as second:
        body = {**BASE, "judge_enabled": True, "judge_url": first.url + "/v1", "judge_model": "grader",
                "judge_rubric": "Correct.", "judge_api_key": "sk-first"}
        assert api_client.put("/api/v1/online-eval", body, key=promote).status_code == 200
        body.pop("judge_api_key")  # null: keep the stored key
        # Another path on the same origin keeps it.
        assert api_client.put("/api/v1/online-eval", {**body, "judge_url": first.url + "/v2"},
                              key=promote).status_code == 200
        # Another origin (another port) without the key given again: refused on the key, nothing changed.
        moved = api_client.put("/api/v1/online-eval", {**body, "judge_url": second.url + "/v1"}, key=promote)
        assert moved.status_code == 422 and moved.json()["detail"][0]["loc"] == ["body", "judge_api_key"]
        assert "give it again for the new address" in moved.json()["detail"][0]["msg"]
        assert online.settings_of(project=project).judge_url == first.url + "/v2"
        # Emptying the URL first does not carry the key over either.
        emptied = {**body, "enabled": False, "judge_enabled": False, "judge_url": ""}
        assert api_client.put("/api/v1/online-eval", emptied, key=promote).status_code == 200
        again = api_client.put("/api/v1/online-eval", {**body, "judge_url": second.url + "/v1"}, key=promote)
        assert again.status_code == 422
        ingest(refund_record("scored", amount=50.0))
        online.online_eval_process(project_id=project.pk)
        assert second.requests == []  # the second host never saw the first one's key
        # Given again (or cleared), it moves.
        ok = api_client.put("/api/v1/online-eval", {**body, "judge_url": second.url + "/v1",
                                                    "judge_api_key": "sk-second"}, key=promote)
        assert ok.status_code == 200 and ok.json()["judge_api_key_set"]
        ingest(refund_record("scored-2", amount=50.0))
        online.online_eval_process(project_id=project.pk)
        assert [auth for _, auth, _ in second.requests] == ["Bearer sk-second"]
        cleared = api_client.put("/api/v1/online-eval", {**body, "judge_url": first.url + "/v1",
                                                         "judge_api_key": ""}, key=promote)
        assert cleared.status_code == 200 and not cleared.json()["judge_api_key_set"]


def test_the_page_asks_for_the_key_again_when_the_judge_moves(client_for, user, project):
    client = client_for(user)
    save = f"/p/{project.slug}/online-eval/settings"
    form = {"sample_rate": "0.3", "max_per_hour": "10", "threshold": "0.5", "judge_url": "http://127.0.0.1:9001/v1",
            "judge_model": "grader", "judge_rubric": "Correct."}
    assert client.post(save, {**form, "judge_api_key": "sk-a"}).status_code == 302
    moved = client.post(save, {**form, "judge_url": "http://127.0.0.1:9002/v1"})
    assert moved.status_code == 422 and 'data-field="judge_api_key"' in moved.content.decode()
    assert "give it again for the new address" in moved.content.decode()
    assert client.post(save, {**form, "judge_url": "http://127.0.0.1:9002/v1",
                              "judge_api_key_clear": "on"}).status_code == 302
    assert online.settings_of(project=project).judge_api_key == ""


def test_where_the_judge_is_and_why_it_failed_show_to_maintainers_only(api_client, make_api_key, project, user,
                                                                      make_user, make_membership, client_for):
    _enable(project, judge_enabled=True, judge_url="http://127.0.0.1:9001/v1", judge_model="grader",
            judge_rubric="Correct.")
    online.OnlineEvalSettings.objects.filter(project=project).update(
        last_error="the judge could not score trajectory 7 (OSError: http://127.0.0.1:9001/v1 down)",
        last_error_at=timezone.now())
    read = make_api_key(project, scopes=["read"])
    promote = make_api_key(project, scopes=["read", "promote"])
    assert api_client.get("/api/v1/online-eval", key=read).json()["judge_url"] is None
    assert api_client.get("/api/v1/online-eval", key=promote).json()["judge_url"] == "http://127.0.0.1:9001/v1"
    viewer = make_user("viewer-1")
    make_membership(viewer, project, "viewer")
    seen = client_for(viewer).get(f"/p/{project.slug}/online-eval/").content.decode()
    assert 'id="last-error"' in seen and "127.0.0.1:9001" not in seen
    assert "127.0.0.1:9001" in client_for(user).get(f"/p/{project.slug}/online-eval/").content.decode()


def test_a_low_score_puts_the_trajectory_in_the_review_queue(ingest, project, refund_task, user):
    from flywheel.failures.queue import queue_queryset
    from flywheel.failures.review import trajectory_outcome_set

    _enable(project, task_set=refund_task.task_set_id, threshold=0.5)
    low = ingest({**refund_record("low", amount=500.0), "outcome": "success"})
    high = ingest({**refund_record("high", amount=50.0), "outcome": "success"})
    queued = set(queue_queryset(project=project).values_list("id", flat=True))
    assert low.pk not in queued and high.pk not in queued  # the agent said success, triage found nothing
    online.online_eval_process(project_id=project.pk)
    queued = set(queue_queryset(project=project).values_list("id", flat=True))
    assert low.pk in queued and high.pk not in queued
    trajectory_outcome_set(trajectory=low, outcome="failure", user=user)
    assert low.pk not in set(queue_queryset(project=project).values_list("id", flat=True))


# --- what the scores say -------------------------------------------------------------------------------------


def test_scores_by_version_over_a_window(project, ingest):
    a, b, c = ingest(refund_record("a"), refund_record("b"), refund_record("c"))
    now = timezone.now()

    def score(t, version, reward, *, ago=0, verifier="task_set:1"):
        OnlineScore.objects.create(project=project, trajectory=t, model_version=version, verifier=verifier,
                                   reward=reward, passed=reward >= 0.5, below_threshold=reward < 0.5,
                                   scored_at=now - dt.timedelta(hours=ago))

    score(a, "bot-v1", 1.0)
    score(a, "bot-v1", 0.0, verifier="llm_judge")
    score(b, "bot-v2", 0.25)
    score(c, "bot-v2", 1.0, ago=48)
    result = online.scores_by_version(project=project, since=now - dt.timedelta(hours=24))
    assert set(result) == {"bot-v1", "bot-v2"}
    assert result["bot-v1"]["n"] == 2 and result["bot-v1"]["trajectories"] == 1
    assert result["bot-v1"]["mean_reward"] == 0.5 and result["bot-v1"]["pass_rate"] == 0.5
    assert result["bot-v2"]["below_share"] == 1.0 and result["bot-v2"]["n"] == 1
    both = online.version_scores(project=project, model_versions=["bot-v1", "bot-v2"])
    assert both["n"] == 4 and both["mean_reward"] == pytest.approx(2.25 / 4) and both["pass_rate"] == 0.5
    assert online.scores_by_version(project=project, model_versions=["none"]) == {}


def test_the_pass_rate_interval_covers_the_true_rate_95_percent_of_the_time():
    """Coverage of the 95% Wilson interval, simulated: 4,000 samples each at small n and rates near the edge,
    where a normal interval falls well short. Coverage must be within [0.93, 0.975] (the simulation's own
    standard error is about 0.0035, so a correct interval fails this far less than once in a million)."""
    rng = random.Random(16)
    for n, p in ((20, 0.5), (30, 0.1), (50, 0.9), (200, 0.03)):
        covered = 0
        for _ in range(4000):
            k = sum(rng.random() < p for _ in range(n))
            low, high = online.wilson(k, n)
            covered += low <= p <= high
        assert 0.93 <= covered / 4000 <= 0.975, (n, p, covered / 4000)
    assert online.wilson(0, 0) is None


# --- settings, API and page ------------------------------------------------------------------------------------


def test_settings_name_each_wrong_field(project, make_project, user):
    from flywheel.environments.services import task_set_create

    theirs = task_set_create(project=make_project("other-co", owner=user), name="Theirs", user=user)
    with pytest.raises(ValidationError) as caught:
        online.online_settings_set(project=project, data={"enabled": True, "sample_rate": "1.5", "max_per_hour": "0",
                                                          "threshold": "x", "task_set": theirs.pk})
    assert set(caught.value.message_dict) == {"sample_rate", "max_per_hour", "threshold", "task_set"}
    with pytest.raises(ValidationError) as caught:
        online.online_settings_set(project=project, data={**BASE, "judge_enabled": True})
    assert set(caught.value.message_dict) == {"judge_url", "judge_model", "judge_rubric"}
    with pytest.raises(ValidationError) as caught:
        online.online_settings_set(project=project, data=BASE)
    assert "enabled" in caught.value.message_dict  # on, with nothing to score by
    assert not online.settings_of(project=project).enabled  # nothing changed


def test_api_reads_with_read_and_changes_with_promote(api_client, make_api_key, project, refund_task):
    read = make_api_key(project, scopes=["read"])
    promote = make_api_key(project, scopes=["read", "promote"])
    got = api_client.get("/api/v1/online-eval", key=read)
    assert got.status_code == 200 and got.json()["enabled"] is False and got.json()["sample_rate"] == 0.1
    body = {"enabled": True, "sample_rate": 0.2, "max_per_hour": 50, "task_set": refund_task.task_set_id,
            "threshold": 0.4, "judge_api_key": "sk-secret"}
    assert api_client.put("/api/v1/online-eval", body, key=read).status_code == 403
    put = api_client.put("/api/v1/online-eval", body, key=promote)
    assert put.status_code == 200, put.content
    assert put.json()["enabled"] and put.json()["judge_api_key_set"] and "sk-secret" not in put.content.decode()
    wrong = api_client.put("/api/v1/online-eval", {**body, "sample_rate": 2}, key=promote)
    assert wrong.status_code == 422 and wrong.json()["detail"][0]["loc"] == ["body", "sample_rate"]
    for name, value in (("enabled", 1), ("judge_enabled", "false")):  # a boolean is true or false, nothing else
        lax = api_client.put("/api/v1/online-eval", {**body, name: value}, key=promote)
        assert lax.status_code == 422 and lax.json()["detail"][0]["loc"] == ["body", name], lax.content
    scores = api_client.get("/api/v1/online-eval/scores", {"hours": 24}, key=read)
    assert scores.status_code == 200 and scores.json() == []


def test_the_page_escapes_agent_content(client_for, user, project, ingest, refund_task):
    _enable(project, task_set=refund_task.task_set_id)
    ingest({**refund_record("x", amount=500.0, request="<script>alert(1)</script> refund please"),
            "model_version": "<b>v9</b>"})
    online.online_eval_process(project_id=project.pk)
    page = client_for(user).get(f"/p/{project.slug}/online-eval/")
    html = page.content.decode()
    assert page.status_code == 200
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)" in html
    assert "<b>v9</b>" not in html and "&lt;b&gt;v9&lt;/b&gt;" in html


def test_the_page_saves_for_maintainers_and_shows_field_errors(client_for, user, project, refund_task):
    client = client_for(user)
    bad = client.post(f"/p/{project.slug}/online-eval/settings", {"enabled": "on", "sample_rate": "abc",
                                                                   "max_per_hour": "10", "threshold": "0.5"})
    assert bad.status_code == 422 and 'data-field="sample_rate"' in bad.content.decode()
    ok = client.post(f"/p/{project.slug}/online-eval/settings", {
        "enabled": "on", "sample_rate": "0.3", "max_per_hour": "10", "threshold": "0.5",
        "task_set": str(refund_task.task_set_id)})
    assert ok.status_code == 302
    config = online.settings_of(project=project)
    assert config.enabled and config.sample_rate == 0.3 and config.task_set_id == refund_task.task_set_id


def test_the_sweep_hands_projects_with_new_trajectories_to_the_task(ingest, project, refund_task):
    """The sweep sends through the real broker (this run's Redis db); the task's body is then run here."""
    from flywheel.evals.tasks import online_eval_task

    _enable(project, task_set=refund_task.task_set_id)
    assert online.online_eval_sweep() == 0  # nothing new yet
    ingest(refund_record("swept", amount=50.0))
    assert online.online_eval_sweep() == 1
    assert online_eval_task(project.pk) == 1
    assert OnlineScore.objects.filter(trajectory__external_id="swept").exists()
    assert online.online_eval_sweep() == 0  # the watermark passed it


def test_live_metrics_entries_of_a_version(project, ingest):
    a, b = ingest(refund_record("a"), refund_record("b"))
    now = timezone.now()
    for t, version, reward in ((a, "acme-v2", 1.0), (b, "support-bot-2", 0.0)):
        OnlineScore.objects.create(project=project, trajectory=t, model_version=version, verifier="llm_judge",
                                   reward=reward, passed=reward >= 0.5, below_threshold=reward < 0.5, scored_at=now)
    extra = online.live_metrics_extra(project=project, names=["acme-v2", "support-bot-2"],
                                      since=now - dt.timedelta(hours=1), until=now + dt.timedelta(seconds=1))
    assert extra["online_scored"] == 2 and extra["online_pass_rate"] == 0.5 and extra["online_below_share"] == 0.5
    empty = online.live_metrics_extra(project=project, names=["acme-v3"], since=now - dt.timedelta(hours=1), until=now)
    assert empty["online_scored"] == 0 and empty["online_pass_rate"] is None and empty["online_pass_rate_ci"] is None


def test_a_versions_live_metrics_carry_its_online_scores(project, ingest, tmp_path, client_for, user):
    """Through the registry's hook: the version's adapter name and the strings mapped to it are counted."""
    from flywheel.registry import live, services

    base = tmp_path / "tiny"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "llama"}')
    v1 = services.base_model_register(project=project, name="tiny", path=str(base))
    live.version_name_set(project=project, name="support-bot-1", version_number=1)
    a, b, c = ingest(refund_record("a"), refund_record("b"), refund_record("c"))
    now = timezone.now()
    for t, version, reward in ((a, f"{project.slug}-v1", 1.0), (b, "support-bot-1", 0.0), (c, "other", 0.0)):
        OnlineScore.objects.create(project=project, trajectory=t, model_version=version, verifier="llm_judge",
                                   reward=reward, passed=reward >= 0.5, below_threshold=reward < 0.5, scored_at=now)
    metrics = live.live_metrics(project=project, version=v1, window="24h")["metrics"]
    assert metrics["online_scored"] == 2 and metrics["online_pass_rate"] == 0.5
    page = client_for(user).get(reverse("registry_version", args=[project.slug, 1])).content.decode()
    assert "Online evaluation pass rate" in page and "2 scored" in page


def test_the_schema_states_what_a_scores_query_refuses(api_client, make_api_key, project):
    """A model_version with a NUL or past 200 characters is refused (422): the schema says so, or a client
    that follows it (a fuzzer did) sends a request the schema allows and gets refused."""
    from flywheel.api_urls import api

    operation = api.get_openapi_schema(path_prefix="")["paths"]["/online-eval/scores"]["get"]
    names = next(p for p in operation["parameters"] if p["name"] == "model_version")["schema"]["anyOf"][0]["items"]
    assert names["maxLength"] == 200 and re.fullmatch(names["pattern"], "v1") and not re.search(names["pattern"], "a\x00")
    key = make_api_key(project, scopes=["read"])
    for name in ("a\x00", "v" * 201):
        refused = api_client.get("/api/v1/online-eval/scores", {"model_version": [name]}, key=key)
        assert refused.status_code == 422 and refused.json()["detail"][0]["loc"][:2] == ["query", "model_version"]
    assert api_client.get("/api/v1/online-eval/scores", {"model_version": ["v" * 200]}, key=key).status_code == 200
