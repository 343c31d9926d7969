"""Eval runs: a model version measured on a suite version by the real trainer through a real worker, a run
recorded from a job's files, and two runs compared case by case with a paired test."""

from __future__ import annotations

import json
import os

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse

from flywheel.evals import runs
from flywheel.evals.models import EvalSuite, EvalSuiteVersion
from flywheel.evals.run_models import EvalCaseResult, EvalRun, EvalRunStatus
from flywheel.registry import services as registry
from flywheel.supervise import Refused


def _rows(tasks, mode_ids=None):
    rows = []
    for i, task in enumerate(tasks):
        call = next(m for m in task["solution"] if m.get("tool_calls"))["tool_calls"][0]["function"]
        rows.append({"id": f"case-{i}", "messages": task["messages"], "tools": task["tools"],
                     "verifier": {"type": "tool_call", "expected_calls": [
                         {"name": call["name"], "arguments": json.loads(call["arguments"])}]},
                     "origin": {"trajectory_id": 100 + i, "failure_mode": (mode_ids or {}).get(i)}})
    return rows


@pytest.fixture
def suite_version(project):
    from trainer.envs.workplace import generate_tasks

    rows = _rows(generate_tasks(4, seed=3, split="holdout", difficulty="single"), mode_ids={0: 7, 1: 7})
    suite = EvalSuite.objects.create(project=project, name="holdout", kind="holdout")
    return EvalSuiteVersion.objects.create(suite=suite, number=1, rows=rows, size=len(rows), content_hash="0" * 64)


def _case(case_id, passed, answer="ok"):
    return {"id": case_id, "passed": passed, "pass_rate": 1.0 if passed else 0.0, "mean_reward": float(passed),
            "failures": {} if passed else {"wrong_tool": 2},
            "samples": [{"passed": passed, "messages": [{"role": "assistant", "content": answer}]}]}


def test_a_recorded_run_keeps_each_case_with_its_origin(project, suite_version, tiny_model, user):
    version = registry.base_model_register(project=project, name="tiny", path=str(tiny_model), user=user)
    run = runs.eval_run_record(project=project, model_version=version, suite_version=suite_version,
                               cases=[_case("case-0", True, "<b>hi</b>"), _case("case-1", False)],
                               metrics={"success_rate": 0.5})
    results = {r.case_id: r for r in run.results.all()}
    assert results["case-0"].passed and results["case-0"].failure_mode_id == 7 and results["case-0"].trajectory_id == 100
    assert results["case-1"].failures == {"wrong_tool": 2} and results["case-0"].output == "<b>hi</b>"


def test_two_runs_compare_case_by_case_with_a_paired_test(project, suite_version, tiny_model, user, client_for):
    version = registry.base_model_register(project=project, name="tiny", path=str(tiny_model), user=user)
    a = runs.eval_run_record(project=project, model_version=version, suite_version=suite_version,
                             cases=[_case(f"case-{i}", i == 0) for i in range(4)], metrics={})
    b = runs.eval_run_record(project=project, model_version=version, suite_version=suite_version,
                             cases=[_case(f"case-{i}", i != 3, "<script>x</script>") for i in range(4)], metrics={})
    comparison = runs.eval_compare(a=a, b=b)
    assert (comparison["fixed"], comparison["broken"]) == (2, 0)
    assert comparison["p_b_better"] == pytest.approx(0.25)  # two wins of two discordant cases
    page = client_for(user).get(reverse("eval_run_compare", args=[project.slug]), {"a": a.pk, "b": b.pk})
    html = page.content.decode()
    assert page.status_code == 200 and "&lt;script&gt;x&lt;/script&gt;" in html and "<script>x" not in html
    other_suite = EvalSuite.objects.create(project=project, name="other", kind="regression")
    other = EvalSuiteVersion.objects.create(suite=other_suite, number=1, rows=[], size=0, content_hash="1" * 64)
    c = runs.eval_run_record(project=project, model_version=version, suite_version=other, cases=[], metrics={})
    with pytest.raises(ValidationError):
        runs.eval_compare(a=a, b=c)


def test_a_run_measures_a_version_through_the_worker(project, suite_version, tiny_model, user, celery_worker):
    version = registry.base_model_register(project=project, name="tiny", path=str(tiny_model), user=user)
    with pytest.raises(ValidationError):
        runs.eval_run_create(project=project, model_version=version, suite_version=suite_version, samples=0)
    run = runs.eval_run_create(project=project, model_version=version, suite_version=suite_version, samples=2)
    done = celery_worker.wait_for(
        lambda: EvalRun.objects.filter(pk=run.pk).exclude(status__in=(EvalRunStatus.QUEUED, EvalRunStatus.RUNNING))
        .first(), timeout=240)
    assert done.status == EvalRunStatus.SUCCEEDED, done.error
    assert done.metrics["n"] == 4 * 2
    results = EvalCaseResult.objects.filter(run=run)
    assert results.count() == 4 and {r.case_id for r in results} == {f"case-{i}" for i in range(4)}
    assert sum(r.passed for r in results) / 4 == pytest.approx(
        sum(1 for r in results if r.pass_rate > 0.5) / 4)


SPY = """
import json, os
with open(os.path.join({folder!r}, "env-%d.json" % os.getpid()), "w") as out:
    json.dump(dict(os.environ), out)
"""


def test_the_trainer_runs_with_none_of_the_workers_secrets_in_its_environment(project, suite_version, tiny_model,
                                                                              user, tmp_path, monkeypatch):
    """The worker's side run here, so that the trainer is this process's child: a sitecustomize on the
    trainer's PYTHONPATH writes down the environment it started with."""
    spy = tmp_path / "spy"
    spy.mkdir()
    (spy / "sitecustomize.py").write_text(SPY.format(folder=str(tmp_path)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(spy), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("SECRET_KEY", "worker-secret-key-not-for-the-trainer")
    monkeypatch.setenv("EMAIL_HOST_PASSWORD", "mail-password")
    if "DATABASE_URL" not in os.environ:
        monkeypatch.setenv("DATABASE_URL", "postgres://flywheel:db-password@db:5432/flywheel")
    version = registry.base_model_register(project=project, name="tiny", path=str(tiny_model), user=user)
    run = runs.eval_run_create(project=project, model_version=version, suite_version=suite_version, samples=1)
    done = runs.eval_run_process(run_id=run.pk)
    assert done.status == EvalRunStatus.SUCCEEDED, done.error  # it still runs end to end
    # Its device time is recorded: the trainer's run, on whatever this worker has (1 device either way).
    assert done.device in ("cpu", "gpu") and done.devices == 1 and done.wall_seconds > 0
    assert done.device_seconds == done.wall_seconds and done.usage()["wall_seconds"] > 0
    seen = [json.loads(path.read_text()) for path in tmp_path.glob("env-*.json")]
    assert seen, "the trainer did not start"
    for env in seen:
        assert not {"SECRET_KEY", "EMAIL_HOST_PASSWORD", "DATABASE_URL"} & set(env)
        assert env["FLYWHEEL_ENV_ENTRY_POINTS"] == "0" and env["PATH"] == os.environ["PATH"]


def test_a_failing_run_says_why(project, suite_version, user, tmp_path, celery_worker):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    version = registry.base_model_register(project=project, name="broken", path=str(broken), user=user)
    run = runs.eval_run_create(project=project, model_version=version, suite_version=suite_version, samples=1)
    failed = celery_worker.wait_for(lambda: EvalRun.objects.filter(pk=run.pk, status=EvalRunStatus.FAILED).first(),
                                    timeout=120)
    assert "tokenizer" in failed.error


def test_a_running_evaluation_is_cancelled_with_its_trainer_and_a_retry_completes_it(
    project, suite_version, tiny_model, user, celery_worker,
):
    import os

    from trainer.envs.workplace import generate_tasks

    version = registry.base_model_register(project=project, name="tiny", path=str(tiny_model), user=user)
    # 40 cases at the most samples a run takes, so that it cannot finish before the worker's next heartbeat
    # sees the cancel, even on an idle machine (4 cases at 64 samples took 3 s there, under the 5 s beat).
    rows = _rows(generate_tasks(40, seed=3, split="holdout", difficulty="single"), mode_ids={})
    suite_version = EvalSuiteVersion.objects.create(suite=suite_version.suite, number=2, rows=rows, size=len(rows),
                                                    content_hash="1" * 64)
    run = runs.eval_run_create(project=project, model_version=version, suite_version=suite_version, samples=64)
    running = celery_worker.wait_for(
        lambda: EvalRun.objects.filter(pk=run.pk, status=EvalRunStatus.RUNNING, pid__isnull=False).first(),
        timeout=120)
    pid = running.pid
    assert os.getpgid(pid) == pid and running.worker and running.attempt == 1  # its own process group
    runs.eval_run_cancel(run=running)
    cancelled = celery_worker.wait_for(
        lambda: EvalRun.objects.filter(pk=run.pk, status=EvalRunStatus.CANCELLED).first(), timeout=120)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone, not an orphan
    assert cancelled.pid is None and not cancelled.results.exists()
    with pytest.raises(Refused, match="nothing to cancel"):
        runs.eval_run_cancel(run=cancelled)

    EvalRun.objects.filter(pk=run.pk).update(samples=2)  # the retry need not be long to prove it completes
    runs.eval_run_retry(run=cancelled)
    done = celery_worker.wait_for(
        lambda: EvalRun.objects.filter(pk=run.pk).exclude(status__in=(EvalRunStatus.QUEUED, EvalRunStatus.RUNNING))
        .first(), timeout=240)
    assert done.status == EvalRunStatus.SUCCEEDED, done.error
    assert done.attempt == 2 and done.metrics["n"] == 40 * 2 and done.results.count() == 40
    with pytest.raises(Refused, match="only a failed or cancelled run"):
        runs.eval_run_retry(run=done)


def test_the_sweep_fails_a_run_whose_worker_vanished_and_the_page_offers_a_retry(
    project, suite_version, tiny_model, user, client_for, make_user, make_membership,
):
    from datetime import timedelta

    from django.utils import timezone

    version = registry.base_model_register(project=project, name="tiny", path=str(tiny_model), user=user)
    run = EvalRun.objects.create(project=project, model_version=version, suite_version=suite_version,
                                 status=EvalRunStatus.RUNNING, worker="gpu-7:4242", attempt=1,
                                 heartbeat_at=timezone.now() - timedelta(hours=1))
    fresh = EvalRun.objects.create(project=project, model_version=version, suite_version=suite_version,
                                   status=EvalRunStatus.RUNNING, worker="gpu-8:1", heartbeat_at=timezone.now())
    runs.eval_sweep()
    run.refresh_from_db()
    assert run.status == EvalRunStatus.FAILED and "gpu-7:4242" in run.error and "Retry" in run.error
    assert EvalRun.objects.get(pk=fresh.pk).status == EvalRunStatus.RUNNING  # still beating: left alone

    page = client_for(user).get(reverse("eval_run", args=[project.slug, run.pk]))
    assert b'id="run-retry"' in page.content and b"gpu-7:4242" in page.content
    viewer = make_user("watcher")
    make_membership(viewer, project, "viewer")
    assert b'id="run-retry"' not in client_for(viewer).get(reverse("eval_run", args=[project.slug, run.pk])).content
    response = client_for(user).post(reverse("eval_run_retry", args=[project.slug, run.pk]))
    assert response.status_code == 302
    assert EvalRun.objects.get(pk=run.pk).status == EvalRunStatus.QUEUED

    # The page polls a queued run; once it has ended, the poll reloads the page.
    page = client_for(user).get(reverse("eval_run", args=[project.slug, run.pk]))
    assert b'hx-trigger="every 2s"' in page.content and b'id="run-cancel"' in page.content
    response = client_for(user).post(reverse("eval_run_cancel", args=[project.slug, run.pk]))
    assert response.status_code == 302 and EvalRun.objects.get(pk=run.pk).status == EvalRunStatus.CANCELLED
    poll = client_for(user).get(reverse("eval_run", args=[project.slug, run.pk]), HTTP_HX_REQUEST="true")
    assert poll.status_code == 204 and poll["HX-Refresh"] == "true"
    again = client_for(user).post(reverse("eval_run_cancel", args=[project.slug, run.pk]))
    assert again.status_code == 409 and b"nothing to cancel" in again.content


def test_the_api_starts_follows_cancels_and_retries_a_run(project, suite_version, tiny_model, user, api_client,
                                                          make_api_key, make_project):
    version = registry.base_model_register(project=project, name="tiny", path=str(tiny_model), user=user)
    key = make_api_key(project, scopes=["train", "read"])
    suite = {"suite": suite_version.suite_id, "suite_version": suite_version.number}
    bad = api_client.post("/api/v1/eval-runs", {"model_version": 9, **suite}, key=key)
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "model_version"]
    bad = api_client.post("/api/v1/eval-runs", {"model_version": version.number, **suite, "samples": 0}, key=key)
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "samples"]
    bad = api_client.post("/api/v1/eval-runs", {"model_version": version.number, **suite, "suite_version": 7},
                          key=key)
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "suite_version"]
    started = api_client.post("/api/v1/eval-runs", {"model_version": version.number, **suite, "samples": 2}, key=key)
    assert started.status_code == 201 and started.json()["status"] == "queued"
    run_id = started.json()["id"]
    got = api_client.get(f"/api/v1/eval-runs/{run_id}", key=key).json()
    assert (got["status"], got["model_version"], got["samples"], got["cases"]) == ("queued", version.number, 2, [])
    assert (got["suite"], got["suite_version"]) == (suite["suite"], suite["suite_version"])
    refused = api_client.post(f"/api/v1/eval-runs/{run_id}/retry", key=key)  # still queued
    assert refused.status_code == 409
    assert refused.json() == {"detail": "The run is queued: only a failed or cancelled run is retried."}
    assert api_client.post(f"/api/v1/eval-runs/{run_id}/cancel", key=key).json()["status"] == "cancelled"
    refused = api_client.post(f"/api/v1/eval-runs/{run_id}/cancel", key=key)
    assert refused.status_code == 409 and refused.json() == {"detail": "The run is cancelled: there is nothing to cancel."}
    assert api_client.post(f"/api/v1/eval-runs/{run_id}/retry", key=key).json()["status"] == "queued"
    other = make_api_key(make_project("elsewhere"), scopes=["train", "read"])
    assert api_client.get(f"/api/v1/eval-runs/{run_id}", key=other).status_code == 404
    assert api_client.post(f"/api/v1/eval-runs/{run_id}/cancel", key=other).status_code == 404
    read_only = make_api_key(project, scopes=["read"])
    assert api_client.post(f"/api/v1/eval-runs/{run_id}/cancel", key=read_only).status_code == 403


def test_a_holdout_says_what_gain_it_can_show_before_anyone_trains(project, suite_version, tiny_model, user,
                                                                     api_client, make_api_key, client_for):
    from flywheel.registry.gate import GateRules, power_report

    version = registry.base_model_register(project=project, name="tiny", path=str(tiny_model), user=user)
    # Not measured yet: the form says the job will measure it, not that the holdout is too small.
    page = client_for(user).get(reverse("training_jobs", args=[project.slug])).content.decode()
    assert "has not been measured on this holdout yet" in page and "too small for the gains" not in page
    rates = [0.0, 0.25, 0.5, 1.0]
    cases = [{"id": f"case-{i}", "passed": r > 0.5, "pass_rate": r, "mean_reward": r, "failures": {},
              "samples": [{"passed": k < r * 4} for k in range(4)]} for i, r in enumerate(rates)]
    run = runs.eval_run_record(project=project, model_version=version, suite_version=suite_version, cases=cases,
                               metrics={})
    key = make_api_key(project, scopes=["read"])
    url = f"/api/v1/eval-suites/{suite_version.suite.pk}/versions/1/power"
    body = api_client.get(url, key=key).json()
    expected = power_report(rates, cases=4, samples=4, rules=GateRules())
    assert (body["measured_by"], body["production"], body["cases"], body["samples"]) == (run.pk, 1, 4, 4)
    assert body["smallest_gain"] == expected["smallest_gain"] and body["sentence"] == expected["sentence"]
    assert not body["enough"] and body["cases_for_expected_gain"] > 4  # four cases show nothing useful
    more = api_client.get(url, {"samples": 16}, key=key).json()
    assert more["samples"] == 16 and more["cases_for_expected_gain"] <= body["cases_for_expected_gain"]
    assert api_client.get(url, {"samples": 0}, key=key).status_code == 422
    assert api_client.get(f"/api/v1/eval-suites/{suite_version.suite.pk}/versions/9/power", key=key).status_code == 404
    # The new-job form says it for the holdout it preselects, and warns.
    page = client_for(user).get(reverse("training_jobs", args=[project.slug])).content.decode()
    assert 'id="holdout-power"' in page and "too small for the gains a job can expect" in page


def test_a_run_started_without_samples_samples_as_a_training_job_does_on_that_suite(
        project, suite_version, user, client_for, api_client, make_api_key, tmp_path):
    from trainer.config import GRPOConfig

    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')  # registered, never loaded here
    version = registry.base_model_register(project=project, name="tiny", path=str(folder), user=user)
    regression_suite = EvalSuite.objects.create(project=project, name="kept", kind="regression")
    regression = EvalSuiteVersion.objects.create(suite=regression_suite, number=1, rows=suite_version.rows,
                                                 size=suite_version.size, content_hash="2" * 64)
    config = GRPOConfig()
    page = client_for(user).post(reverse("eval_run_start", args=[project.slug]),
                                 {"model_version": version.pk, "suite_version": regression.pk, "samples": ""})
    assert page.status_code == 302
    assert EvalRun.objects.get(suite_version=regression).samples == config.regression_samples_per_prompt
    key = make_api_key(project, scopes=["train", "read"])
    started = api_client.post("/api/v1/eval-runs", {"model_version": version.number, "suite": suite_version.suite_id,
                                                    "suite_version": suite_version.number}, key=key)
    assert started.status_code == 201
    assert EvalRun.objects.get(pk=started.json()["id"]).samples == config.eval_samples_per_prompt
