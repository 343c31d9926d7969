"""Live metrics per model version (flywheel.registry.live): which version a `model_version` string names
(adapter names by themselves, the table, the unmapped ones), the rollup against a direct recomputation from
the trajectories after ingest, triage, replay (moving a trajectory to another string and hour), review and a
triage re-run, the windows and series, the sweep, the API (shape, scopes, 400/404) and the pages (series,
names, a hostile model_version escaped)."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from datetime import UTC, timedelta

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse
from django.utils import timezone

from flywheel.failures import review
from flywheel.registry import live
from flywheel.registry.models import Alias, AliasAssignment, LiveRollup, LiveRollupState, VersionName
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.models import Trajectory
from flywheel.trajectories.triage import triage_project, triage_run_process, triage_run_start
from tests.platform.registry.worlds import versions_with_adapters

NOW = timezone.now()


@pytest.fixture
def versions(project, user, tmp_path):
    """v1 in production (the base alone) and v2 with an adapter."""
    return versions_with_adapters(project, user, tmp_path, gated=False)


def record(i, model, *, hours_ago=0.0, outcome="success", unsafe=False, usage=None, latency=None, bad_args=False):
    """One trajectory as an agent sends it: a user turn, a call (an unsafe `delete_account`, or arguments that
    are not JSON), its result and an answer."""
    call = {"id": "c", "type": "function", "function": {
        "name": "delete_account" if unsafe else "lookup",
        "arguments": "{not json" if bad_args else json.dumps({"q": i})}}
    out = {"external_id": f"t-{i}", "model_version": model, "outcome": outcome,
           "started_at": (NOW - timedelta(hours=hours_ago)).isoformat(),
           "tools": [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
                     for n in ("lookup", "delete_account")],
           "messages": [{"role": "user", "content": "help"},
                        {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "c", "content": "ok"},
                        {"role": "assistant", "content": "done"}]}
    if usage is not None:
        out["usage"] = usage
    if latency is not None:
        out["latency_ms"] = latency
    return out


def send(project, records):
    result = ingest_trajectories(project=project, records=records)
    assert not result.rejected, result.rejected
    triage_project(project_id=project.pk)


def recomputed(project) -> dict:
    """What the rollup must hold, computed here from each trajectory in Python (another path than the SQL)."""
    out: dict = defaultdict(lambda: {"trajectories": 0, "failures": 0, "triaged": 0, "signals": defaultdict(int),
                                     "tokens_sum": 0, "tokens_n": 0, "latency_sum": 0, "latency_n": 0,
                                     "tokens_in_sum": 0, "tokens_out_sum": 0, "split_n": 0, "gpu_ms_sum": 0,
                                     "gpu_n": 0})

    def number(x) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool)

    for t in Trajectory.objects.filter(project=project).prefetch_related("signals"):
        at = (t.started_at or t.created_at).astimezone(UTC).replace(minute=0, second=0, microsecond=0)
        row = out[(t.model_version, at)]
        row["trajectories"] += 1
        row["failures"] += t.effective_outcome == "failure"
        if t.triage_version:
            row["triaged"] += 1
            for kind in {s.kind for s in t.signals.all()}:
                row["signals"][kind] += 1
        usage = t.usage or {}
        tokens = usage.get("total_tokens")
        for a, b in (("prompt_tokens", "completion_tokens"), ("input_tokens", "output_tokens")):
            if not number(tokens):
                p, c = usage.get(a), usage.get(b)
                tokens = p + c if number(p) and number(c) else None
        if tokens is not None and 0 <= tokens <= live.TOKENS_MAX:
            row["tokens_sum"] += round(tokens)
            row["tokens_n"] += 1
        if t.latency_ms is not None:
            row["latency_sum"] += t.latency_ms
            row["latency_n"] += 1
        for a, b in (("prompt_tokens", "completion_tokens"), ("input_tokens", "output_tokens")):
            i, o = usage.get(a), usage.get(b)
            if number(i) and number(o) and 0 <= i <= live.TOKENS_MAX and 0 <= o <= live.TOKENS_MAX:
                row["tokens_in_sum"] += round(i)
                row["tokens_out_sum"] += round(o)
                row["split_n"] += 1
                break
        gpu = usage.get("gpu_seconds")
        if number(gpu) and 0 <= gpu <= live.GPU_SECONDS_MAX:
            row["gpu_ms_sum"] += round(gpu * 1000)
            row["gpu_n"] += 1
    return {k: {**v, "signals": dict(v["signals"])} for k, v in out.items()}


def stored(project) -> dict:
    return {(r.model_version, r.hour): {"trajectories": r.trajectories, "failures": r.failures, "triaged": r.triaged,
                                        "signals": r.signals, "tokens_sum": r.tokens_sum, "tokens_n": r.tokens_n,
                                        "latency_sum": r.latency_sum, "latency_n": r.latency_n,
                                        "tokens_in_sum": r.tokens_in_sum, "tokens_out_sum": r.tokens_out_sum,
                                        "split_n": r.split_n, "gpu_ms_sum": r.gpu_ms_sum, "gpu_n": r.gpu_n}
            for r in LiveRollup.objects.filter(project=project)}


# --- which version answered ---------------------------------------------------------------------------------


def test_adapter_names_map_by_themselves_and_other_strings_through_the_table(project, versions, user, make_project):
    v1, v2 = versions
    assert live.version_of(project=project, name=f"{project.slug}-v2") == v2
    assert live.version_of(project=project, name=f"{project.slug}-v9") is None  # no such version
    assert live.version_of(project=project, name="qwen-ft-2") is None
    other = make_project("other-project")
    assert live.version_of(project=other, name=f"{project.slug}-v2") is None  # another project's slug

    live.version_name_set(project=project, name="qwen-ft-2", version_number="2", user=user)
    assert live.version_of(project=project, name="qwen-ft-2") == v2
    assert live.names_of(project=project, version=v2) == sorted([f"{project.slug}-v2", "qwen-ft-2"])
    live.version_name_set(project=project, name="qwen-ft-2", version_number="v1", user=user)  # moved, not doubled
    assert VersionName.objects.get(project=project, name="qwen-ft-2").version == v1
    assert live.version_name_remove(project=project, name="qwen-ft-2")
    assert not live.version_name_remove(project=project, name="qwen-ft-2")
    assert live.version_of(project=project, name="qwen-ft-2") is None


@pytest.mark.parametrize(("name", "number", "field"), [
    ("", "1", "name"), ("x" * 201, "1", "name"), ("a\x00b", "1", "name"),
    ("{slug}-v1", "2", "name"),  # an adapter name maps by itself
    ("qwen", "7", "version"), ("qwen", "two", "version"), ("qwen", None, "version"),
])
def test_a_wrong_mapping_names_its_field(project, versions, name, number, field):
    with pytest.raises(ValidationError) as caught:
        live.version_name_set(project=project, name=name.replace("{slug}", project.slug), version_number=number)
    assert field in caught.value.message_dict
    assert not VersionName.objects.filter(project=project).exists()


def test_unmapped_strings_are_listed_with_their_counts_until_mapped(project, versions, user):
    v1, v2 = versions
    send(project, [record(i, f"{project.slug}-v1") for i in range(3)]
         + [record(10 + i, "mystery-model") for i in range(4)] + [record(20, "")])
    live.rollup_refresh()
    summary = live.live_summary(project=project)
    assert summary["unmapped"] == [{"name": "mystery-model", "trajectories": 4}, {"name": "", "trajectories": 1}]
    assert [(r["number"], r["alias"], r["metrics"]["trajectories"]) for r in summary["rows"]] == [(1, "production", 3)]

    live.version_name_set(project=project, name="mystery-model", version_number=2, user=user)
    summary = live.live_summary(project=project)  # the mapping applies when read: no refresh needed
    assert summary["unmapped"] == [{"name": "", "trajectories": 1}]
    assert [(r["number"], r["metrics"]["trajectories"]) for r in summary["rows"]] == [(1, 3), (2, 4)]


# --- the rollup ---------------------------------------------------------------------------------------------


@pytest.fixture(params=["sql", "python"])
def rollup_path(request, monkeypatch):
    """Each way the refresh can do its work: one SQL statement (PostgreSQL) and Python a chunk at a time (SQLite,
    and PostgreSQL with IN_SQL off), held to the same recomputation."""
    from django.db import connection

    if request.param == "sql" and connection.vendor != "postgresql":
        pytest.skip("the refresh runs in SQL on PostgreSQL only")
    monkeypatch.setattr(live, "IN_SQL", request.param == "sql")
    return request.param


def test_the_rollup_equals_a_recomputation_after_ingest_replay_review_and_triage(project, versions, user,
                                                                                 rollup_path, monkeypatch):
    slug = project.slug
    records = [record(i, f"{slug}-v1", hours_ago=i % 3, outcome="failure" if i % 4 == 0 else "success",
                      unsafe=i % 5 == 0, bad_args=i % 7 == 0, latency=100 + i,
                      usage={"prompt_tokens": 10, "completion_tokens": i, "gpu_seconds": 0.25 * i} if i % 2
                      else {"total_tokens": 50, **({"input_tokens": 40, "output_tokens": 10} if i % 4 else {})})
               for i in range(30)]
    records += [record(100 + i, f"{slug}-v2", hours_ago=0.2,
                       usage={"total_tokens": "many", "input_tokens": 7, "output_tokens": -1, "gpu_seconds": 1e9})
                for i in range(5)]
    send(project, records)
    work = live.rollup_refresh()
    assert work.trajectories == 35 and work.buckets == 4 and not work.skipped
    assert stored(project) == recomputed(project)
    v2_now = stored(project)[(f"{slug}-v2", live._hour(NOW - timedelta(hours=0.2)))]
    assert v2_now["tokens_n"] == 5 and v2_now["tokens_sum"] == 30  # "many": input + output (7 - 1)
    assert v2_now["split_n"] == v2_now["gpu_n"] == 0  # -1 output tokens price nothing, 1e9 GPU-seconds is garbage
    assert sum(r["split_n"] for r in stored(project).values()) == 15 + 7  # odd i, and even i not divisible by 4
    assert sum(r["gpu_n"] for r in stored(project).values()) == 15

    # A replay moves t-3 to v2 and two hours back, and makes it fail: both its buckets are recomputed.
    moved = record(3, f"{slug}-v2", hours_ago=5, outcome="failure")
    ingest_trajectories(project=project, records=[moved])
    live.rollup_refresh()  # before its triage: counted in its new bucket, its signals not yet
    assert stored(project) == recomputed(project)
    triage_project(project_id=project.pk)
    live.rollup_refresh()
    assert stored(project) == recomputed(project)
    assert stored(project)[(f"{slug}-v2", live._hour(NOW - timedelta(hours=5)))]["failures"] == 1

    # A reviewer's outcome wins over the agent's, and clearing it counts the agent's again.
    t1 = Trajectory.objects.get(project=project, external_id="t-1")
    review.trajectory_outcome_set(trajectory=t1, outcome="failure", user=user)
    live.rollup_refresh()
    assert stored(project) == recomputed(project)
    review.trajectory_outcome_set(trajectory=t1, outcome="", user=user)
    live.rollup_refresh()
    assert stored(project) == recomputed(project)

    # A re-run of triage under a new policy (no unsafe rules): the unsafe signals go.
    from flywheel.trajectories.triage_policy import policy_for
    policy = policy_for(project_id=project.pk)
    policy.unsafe = []
    policy.save()
    before = sum(r.signals.get("unsafe_action", 0) for r in LiveRollup.objects.filter(project=project))
    run = triage_run_start(project=project)
    triage_run_process(run_id=run.pk)
    live.rollup_refresh()
    assert stored(project) == recomputed(project)
    after = sum(r.signals.get("unsafe_action", 0) for r in LiveRollup.objects.filter(project=project))
    assert before > 0 and after < before

    # A rebuild reads every trajectory again, a range of ids at a time (SQL), to the same counts.
    monkeypatch.setattr(live, "REBUILD_IDS", 4)
    work = live.rollup_refresh(full=True)
    assert work.trajectories == 35 and stored(project) == recomputed(project)


def test_a_bucket_left_empty_is_deleted_and_nothing_changed_is_no_work(project, versions, rollup_path):
    send(project, [record(1, "alpha", hours_ago=3)])
    live.rollup_refresh()
    assert list(LiveRollup.objects.filter(project=project).values_list("model_version", flat=True)) == ["alpha"]
    ingest_trajectories(project=project, records=[record(1, "beta", hours_ago=1)])
    triage_project(project_id=project.pk)
    live.rollup_refresh()
    assert list(LiveRollup.objects.filter(project=project).values_list("model_version", flat=True)) == ["beta"]
    assert stored(project) == recomputed(project)
    # Nothing changed since: the refresh finds only what its overlap re-reads, and changes nothing.
    LiveRollupState.objects.update(watermark=timezone.now() + live.OVERLAP)
    work = live.rollup_refresh()
    assert (work.trajectories, work.buckets, work.written) == (0, 0, 0)


def test_the_sweep_hands_the_refresh_to_a_worker_only_when_something_changed(celery_worker, make_project):
    project = make_project("sweep")
    send(project, [record(1, f"{project.slug}-v1"), record(2, "alpha")])
    assert live.rollup_sweep() == 1
    celery_worker.wait_for(lambda: LiveRollup.objects.filter(project=project).count() == 2)
    assert stored(project) == recomputed(project)
    celery_worker.wait_for(lambda: LiveRollupState.objects.filter(watermark__isnull=False).exists())
    LiveRollupState.objects.update(watermark=timezone.now())
    assert live.rollup_sweep() == 0  # nothing past the watermark
    send(project, [record(3, "alpha")])
    assert live.rollup_sweep() == 1


def test_the_watermark_waits_for_a_transaction_still_open(project, transactional_db, needs_postgres):
    """A writer that stamped its rows before a refresh ran and commits after it: the next refresh still reads
    them, because the watermark stopped at the start of the transaction that was open."""
    import threading

    from django.db import connection, transaction

    stamped, release = threading.Event(), threading.Event()

    def slow_writer():
        with transaction.atomic():
            ingest_trajectories(project=project, records=[record(7, "late")])  # stamped now
            stamped.set()
            release.wait(10)
        connection.close()

    thread = threading.Thread(target=slow_writer)
    thread.start()
    stamped.wait(10)
    time.sleep(live.CLOCK_SKEW.total_seconds() + 1)  # its stamp is now older than the skew allows for
    try:
        live.rollup_refresh()  # the late row is not visible yet
        assert not LiveRollup.objects.filter(project=project, model_version="late").exists()
    finally:
        release.set()
        thread.join()
    live.rollup_refresh()
    assert LiveRollup.objects.get(project=project, model_version="late").trajectories == 1


def test_a_second_refresh_at_once_skips(project, versions, transactional_db, needs_postgres):
    """The watermark's row is locked by the refresh that runs; another one returns at once (SKIP LOCKED: PostgreSQL)."""
    import threading

    from django.db import connection, transaction

    live.rollup_refresh()
    held = threading.Event()
    release = threading.Event()

    def hold():
        with transaction.atomic():
            LiveRollupState.objects.select_for_update().first()
            held.set()
            release.wait(10)
        connection.close()

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(10)
    try:
        assert live.rollup_refresh().skipped
    finally:
        release.set()
        thread.join()


# --- windows and metrics ------------------------------------------------------------------------------------


def test_windows_metrics_signals_and_series(project, versions):
    slug = project.slug
    send(project, [record(i, f"{slug}-v1", hours_ago=h, outcome="failure" if i % 2 else "success",
                          unsafe=i % 3 == 0, latency=200, usage={"total_tokens": 1000})
                   for i, h in enumerate([0, 0, 3, 3, 30, 30, 24 * 10, 24 * 10])])  # 0: NOW's own hour
    live.rollup_refresh()
    v1 = versions[0]
    day = live.live_metrics(project=project, version=v1, window="24h", now=NOW)
    assert day["metrics"]["trajectories"] == 4 and day["metrics"]["failures"] == 2
    assert day["metrics"]["failure_rate"] == 0.5
    assert day["metrics"]["tokens_per_trajectory"] == 1000 and day["metrics"]["latency_ms_per_trajectory"] == 200
    unsafe = next(s for s in day["signals"] if s["kind"] == "unsafe_action")
    assert (unsafe["trajectories"], unsafe["rate"]) == (2, 0.5)  # t-0 and t-3 of t-0..t-3
    assert [s["kind"] for s in day["signals"]][:2] == ["invalid_arguments", "undeclared_tool"]
    series = day["series"]
    assert series["step"] == "hour" and len(series["t"]) == 25 and sum(series["trajectories"]) == 4
    assert series["t"] == sorted(series["t"]) and series["t"][1] - series["t"][0] == 3600
    assert series["failure_rate"][-1] == 0.5 and series["failure_rate"][0] is None  # an hour with no traffic

    assert live.live_metrics(project=project, version=v1, window="1h", now=NOW)["metrics"]["trajectories"] == 2
    assert live.live_metrics(project=project, version=v1, window="7d", now=NOW)["metrics"]["trajectories"] == 6
    month = live.live_metrics(project=project, version=v1, window="30d", now=NOW)
    assert month["metrics"]["trajectories"] == 8 and month["series"]["step"] == "day"
    assert month["series"]["t"][1] - month["series"]["t"][0] == 86400 and sum(month["series"]["trajectories"]) == 8
    quiet = live.live_metrics(project=project, version=versions[1], window="24h")["metrics"]
    assert {k: v for k, v in quiet.items() if not k.startswith("online_")} == {  # online_*: evals' hook
        "trajectories": 0, "failures": 0, "failure_rate": None, "triaged": 0, "tokens_per_trajectory": None,
        "tokens_n": 0, "latency_ms_per_trajectory": None, "latency_n": 0, "input_tokens_per_trajectory": None,
        "output_tokens_per_trajectory": None, "split_n": 0, "gpu_seconds_per_trajectory": None, "gpu_n": 0}
    with pytest.raises(live.WindowError):
        live.window_bounds("2w")


def extra_source(*, project, version, start, end):
    """Another live measure of a version (as online evaluation adds its verifier scores)."""
    return {"verifier_pass_rate": 0.75, "hours": (end - start) / timedelta(hours=1), "of": version.number}


def test_other_sources_add_their_metrics_beside_the_rollups(project, versions, monkeypatch, api_client,
                                                            make_api_key):
    monkeypatch.setattr(live, "METRIC_SOURCES", [extra_source])
    day = live.live_metrics(project=project, version=versions[1], window="24h", now=NOW)
    assert day["metrics"]["verifier_pass_rate"] == 0.75 and day["metrics"]["of"] == 2
    assert day["metrics"]["hours"] == 25  # the hours that overlap the window
    answer = api_client.get("/api/v1/model-versions/2/live", key=make_api_key(project, scopes=["read"]))
    assert answer.json()["metrics"]["verifier_pass_rate"] == 0.75  # the API passes them through


def test_the_summary_puts_production_then_the_canary_first(project, versions, user):
    v1, v2 = versions
    send(project, [record(i, f"{project.slug}-v{1 + i % 2}") for i in range(6)])
    live.rollup_refresh()
    assert [r["number"] for r in live.live_summary(project=project)["rows"]] == [1, 2]
    AliasAssignment.objects.filter(project=project, alias=Alias.PRODUCTION).update(version=v2)
    AliasAssignment.objects.create(project=project, alias=Alias.CANARY, version=v1, weight=0.1)
    rows = live.live_summary(project=project)["rows"]
    assert [(r["number"], r["alias"]) for r in rows] == [(2, "production"), (1, "canary")]


# --- the API ------------------------------------------------------------------------------------------------


@pytest.fixture
def keys(make_api_key, project, make_project):
    return {"read": make_api_key(project, scopes=["read"]), "promote": make_api_key(project, scopes=["promote"]),
            "ingest": make_api_key(project, scopes=["ingest"]),
            "other": make_api_key(make_project("elsewhere"), scopes=["promote", "read"])}


def test_the_live_api_answers_a_versions_metrics(project, versions, api_client, keys):
    send(project, [record(i, f"{project.slug}-v1", outcome="failure" if i < 2 else "success") for i in range(5)])
    live.rollup_refresh()
    url = "/api/v1/model-versions/1/live"
    answer = api_client.get(url, {"window": "24h"}, key=keys["read"])
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert body["version"] == 1 and body["window"] == "24h" and body["names"] == [f"{project.slug}-v1"]
    assert body["metrics"]["trajectories"] == 5 and body["metrics"]["failure_rate"] == 0.4
    assert {s["kind"] for s in body["signals"]} >= {"unsafe_action", "loop", "no_final_answer"}
    assert len(body["series"]["t"]) == 25 and sum(body["series"]["trajectories"]) == 5
    assert api_client.get(url, key=keys["read"]).json()["window"] == "24h"  # the default

    bad = api_client.get(url, {"window": "2w"}, key=keys["read"])
    assert bad.status_code == 400 and "1h, 24h, 7d, 30d" in bad.json()["detail"]
    missing = api_client.get("/api/v1/model-versions/9/live", key=keys["read"])
    assert missing.status_code == 404 and "9" in missing.json()["detail"]
    assert api_client.get(url, key=keys["ingest"]).status_code == 403
    assert api_client.get(url, key=None).status_code == 401
    assert api_client.get(url, key=keys["other"]).status_code == 404  # v1 is not in the other project


def test_the_version_names_api_lists_maps_and_unmaps_with_scopes(project, versions, api_client, keys):
    send(project, [record(i, "qwen-prod") for i in range(3)])
    live.rollup_refresh()
    url = "/api/v1/version-names"
    listed = api_client.get(url, key=keys["read"]).json()
    assert listed == {"names": [], "unmapped": [{"name": "qwen-prod", "trajectories": 3}],
                      "adapter_names": f"{project.slug}-v<n>"}
    assert api_client.post(url, {"name": "qwen-prod", "version": 2}, key=keys["read"]).status_code == 403
    made = api_client.post(url, {"name": "qwen-prod", "version": 2}, key=keys["promote"])
    assert made.status_code == 200, made.content
    assert made.json()["name"] == "qwen-prod" and made.json()["version"] == 2
    listed = api_client.get(url, key=keys["read"]).json()
    assert [n["name"] for n in listed["names"]] == ["qwen-prod"] and listed["unmapped"] == []
    assert api_client.get("/api/v1/model-versions/2/live", key=keys["read"]).json()["metrics"]["trajectories"] == 3

    wrong = api_client.post(url, {"name": "qwen-prod", "version": 7}, key=keys["promote"])
    assert wrong.status_code == 422 and wrong.json()["detail"][0]["loc"] == ["body", "version"]
    adapter = api_client.post(url, {"name": f"{project.slug}-v1", "version": 2}, key=keys["promote"])
    assert adapter.status_code == 422 and adapter.json()["detail"][0]["loc"] == ["body", "name"]

    assert api_client.client.delete(f"{url}?name=qwen-prod", headers={"Authorization": f"Bearer {keys['read']}"}
                                    ).status_code == 403
    gone = api_client.client.delete(f"{url}?name=qwen-prod", headers={"Authorization": f"Bearer {keys['promote']}"})
    assert gone.status_code == 204
    again = api_client.client.delete(f"{url}?name=qwen-prod", headers={"Authorization": f"Bearer {keys['promote']}"})
    assert again.status_code == 404
    assert api_client.get(url, key=keys["other"]).json()["unmapped"] == []  # the other project's own


# --- the pages ----------------------------------------------------------------------------------------------


HOSTILE = '<script>alert("x")</script>'


def test_the_models_page_shows_each_versions_series_and_escapes_strings(project, versions, user, client_for,
                                                                         make_user, make_membership):
    send(project, [record(i, f"{project.slug}-v{1 + i % 2}", hours_ago=i % 4,
                          outcome="failure" if i % 3 == 0 else "success") for i in range(12)]
         + [record(50, HOSTILE)])
    live.rollup_refresh()
    page = client_for(user).get(reverse("registry_page", args=[project.slug]) + "?window=7d")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'id="live-traffic"' in html and "live-series-data" in html and "static/flywheel/live.js" in html
    data = json.loads(html.split('id="live-series-data" type="application/json">')[1].split("</script>")[0])
    assert [row["version"] for row in data["versions"]] == [1, 2]
    assert sum(data["versions"][0]["series"]["trajectories"]) == 6 and data["step"] == "hour"
    assert HOSTILE not in html and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in html
    assert 'aria-current="true">7d<' in html  # the window chooser marks the window shown
    # A week ends on another day than it starts: both ends carry their date.
    first, last, _ = live.window_bounds("7d")
    span = f'({first:%Y-%m-%d %H:%M} to {last + live.HOUR:%Y-%m-%d %H:%M} UTC, whole hours)'
    assert span in html, html.split("whole hours")[0][-120:]
    assert f'action="{reverse("registry_version_name_set", args=[project.slug])}"' in html  # the map form

    viewer = make_user()
    make_membership(viewer, project, "viewer")
    seen = client_for(viewer).get(reverse("registry_page", args=[project.slug])).content.decode()
    assert "live-series-data" in seen and "registry_version_name_set" not in seen
    assert reverse("registry_version_name_set", args=[project.slug]) not in seen  # maintainers map


def test_a_maintainer_maps_and_unmaps_a_string_on_the_page(project, versions, user, client_for, make_user,
                                                           make_membership):
    send(project, [record(i, "qwen-prod") for i in range(2)])
    live.rollup_refresh()
    url = reverse("registry_version_name_set", args=[project.slug])
    viewer = make_user()
    make_membership(viewer, project, "reviewer")
    assert client_for(viewer).post(url, {"name": "qwen-prod", "version": "2"}).status_code == 403
    done = client_for(user).post(url, {"name": "qwen-prod", "version": "2"})
    assert done.status_code == 302
    assert VersionName.objects.get(project=project, name="qwen-prod").version.number == 2
    wrong = client_for(user).post(url, {"name": "qwen-prod", "version": "8"})
    assert wrong.status_code == 422 and "no version 8" in wrong.content.decode()
    removed = client_for(user).post(reverse("registry_version_name_remove", args=[project.slug]),
                                    {"name": "qwen-prod"})
    assert removed.status_code == 302 and not VersionName.objects.filter(project=project).exists()


def test_a_versions_page_shows_its_full_live_metrics(project, versions, user, client_for):
    send(project, [record(i, f"{project.slug}-v1", unsafe=i == 0, latency=300, usage={"total_tokens": 900})
                   for i in range(4)])
    live.rollup_refresh()
    url = reverse("registry_version", args=[project.slug, 1])
    page = client_for(user).get(url + "?window=1h")
    assert page.status_code == 200
    html = page.content.decode()
    for label in ("Unsafe action", "Arguments not JSON", "Loop", "No final answer", "Human intervention"):
        assert label in html
    assert "900" in html and "300" in html and "live-version-data" in html
    assert client_for(user).get(url + "?window=2w").status_code == 400
    assert client_for(user).get(reverse("registry_version", args=[project.slug, 9])).status_code == 404


def test_the_schema_lists_the_windows_the_live_api_takes():
    """Any other window is refused (400, above): the schema lists them, or a client that follows it (a fuzzer
    sent `window=`) sends a request the schema allows and gets refused."""
    from flywheel.api_urls import api

    operation = api.get_openapi_schema(path_prefix="")["paths"]["/model-versions/{number}/live"]["get"]
    window = next(p for p in operation["parameters"] if p["name"] == "window")
    assert window["schema"]["enum"] == list(live.WINDOWS) and window["schema"]["default"] == live.DEFAULT_WINDOW
