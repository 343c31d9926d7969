"""Training jobs: the config checked field by field, the leakage guard, the advice, and the whole life of a
job through a real Celery worker and the real trainer on the tiny model (measure production, confirm,
train, candidate, gate), cancel killing the trainer's process group, retry resuming from the checkpoint,
a trainer failure shown with its step, and the reaper for a vanished worker."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse
from django.utils import timezone

from flywheel.environments.models import TaskSet, TaskSetVersion
from flywheel.evals.leakage import LeakageError
from flywheel.evals.models import EvalSuite, EvalSuiteVersion
from flywheel.registry import services as registry
from flywheel.registry.models import GateDecision
from flywheel.supervise import Refused
from flywheel.training import services
from flywheel.training.models import Checkpoint, JobEvent, JobStatus, TrainingJob
from tests.platform.training.worlds import frozen_version
from trainer import jobdir
from trainer.config import GRPOConfig

# A job small enough for two busy cores: 2 prompts x 4 samples a step, an eval and a checkpoint every step.
SMALL = {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "max_new_tokens": 40, "max_steps": 2,
         "eval_interval": 1, "eval_samples_per_prompt": 2, "regression_samples_per_prompt": 3, "learning_rate": 1e-3,
         "r": 4, "alpha": 8, "num_threads": 1}


def _rows(tasks, prefix, trajectory_ids=None):
    rows = []
    for i, task in enumerate(tasks):
        call = next(m for m in task["solution"] if m.get("tool_calls"))["tool_calls"][0]["function"]
        rows.append({
            "id": f"{prefix}-{i}", "messages": task["messages"], "tools": task["tools"],
            "verifier": {"type": "tool_call", "expected_calls": [
                {"name": call["name"], "arguments": json.loads(call["arguments"])}]},
            "origin": {"trajectory_id": trajectory_ids[i] if trajectory_ids else None},
        })
    return rows


@pytest.fixture(scope="module")
def workplace():
    from trainer.envs.workplace import generate_tasks

    return {"train": generate_tasks(24, seed=0, split="train", difficulty="single"),
            "holdout": generate_tasks(12, seed=1, split="holdout", difficulty="single")}


@pytest.fixture
def world(project, user, tiny_model, workplace):
    production = registry.base_model_register(project=project, name="tiny", path=str(tiny_model), user=user)
    return {
        "project": project, "user": user, "production": production,
        "train": frozen_version(TaskSetVersion, TaskSet, _rows(workplace["train"], "task"), project=project, name="refunds"),
        "holdout": frozen_version(EvalSuiteVersion, EvalSuite, _rows(workplace["holdout"][:4], "case"), project=project,
                            name="holdout", kind="holdout"),
        "regression": frozen_version(EvalSuiteVersion, EvalSuite, _rows(workplace["holdout"][4:6], "reg"),
                               project=project, name="regressions", kind="regression"),
    }


def test_config_errors_name_the_field(world):
    with pytest.raises(ValidationError) as exc:
        services.job_create(project=world["project"], task_set_version=world["train"],
                            config={"learning_rate": -1.0, "loss_type": "ppo"})
    assert set(exc.value.message_dict) & {"config.learning_rate", "config.loss_type"}
    with pytest.raises(ValidationError) as exc:
        services.job_create(project=world["project"], task_set_version=world["train"], config={"lr": 1e-4})
    assert exc.value.message_dict["config.lr"] == ["config.lr is not a GRPOConfig field"]
    assert not TrainingJob.objects.exists()


def test_rows_the_platform_must_not_run_are_refused(world):
    rows = [dict(world["train"].rows[0], id="srv", env={"type": "http", "url": "http://169.254.169.254/"}),
            dict(world["train"].rows[1], id="code", env={"type": "python", "entry_point": "os:system"})]
    version = frozen_version(TaskSetVersion, TaskSet, rows, project=world["project"], name="sneaky")
    with pytest.raises(ValidationError) as exc:
        services.job_create(project=world["project"], task_set_version=version)
    problems = exc.value.message_dict["task_set_version"]
    # An http row runs only on a server the operator lists (flywheel.environments: registered servers).
    assert any("'srv'" in p and "FLYWHEEL_ENV_URL_ALLOWLIST" in p for p in problems)
    assert any("'code'" in p for p in problems)


def test_a_job_needs_a_production_model(make_project, world):
    other = make_project()
    version = frozen_version(TaskSetVersion, TaskSet, world["train"].rows, project=other, name="t")
    with pytest.raises(ValidationError) as exc:
        services.job_create(project=other, task_set_version=version)
    assert "Register a base model" in exc.value.message_dict["model"][0]


def test_the_leakage_guard_refuses_a_task_set_that_shares_a_trajectory_or_a_request(world, workplace):
    shared = _rows(workplace["holdout"][:2], "leak", trajectory_ids=[101, 102])
    holdout = frozen_version(EvalSuiteVersion, EvalSuite, _rows(workplace["holdout"][:1], "h", trajectory_ids=[101]),
                       project=world["project"], name="h2", kind="holdout")
    train = frozen_version(TaskSetVersion, TaskSet, shared, project=world["project"], name="leaky")
    with pytest.raises(LeakageError) as exc:
        services.job_create(project=world["project"], task_set_version=train, holdout_version=holdout)
    details = [str(c) for c in exc.value.conflicts]
    assert any("trajectory #101" in d for d in details)
    # The second task asks what no holdout case asks: it is not listed.
    assert not any("leak-1" in d for d in details)
    assert not TrainingJob.objects.exists()


def test_advice_follows_production_on_the_holdout():
    assert services.advise({"success_rate": 0.0, "n": 20, "failures": {"invalid_format": 18, "wrong_tool": 2}})[
        "recommendation"] == "sft_grpo"
    assert services.advise({"success_rate": 0.4, "n": 20, "failures": {"wrong_tool": 12}})["recommendation"] == "grpo"
    assert services.advise({"success_rate": 0.97, "n": 20, "failures": {}})["recommendation"] == "none"
    # One recommendation: where GRPO has a signal, preference pairs do not add a second one in the same breath.
    assert "DPO" not in services.advise({"success_rate": 0.4, "n": 20, "failures": {}}, pairs=5)["reason"]
    # Where it has none and the failures are not about format, the pairs are the signal.
    nothing = services.advise({"success_rate": 0.02, "n": 20, "failures": {"wrong_tool": 19}}, pairs=5)
    assert nothing["recommendation"] == "dpo" and "GRPO" not in nothing["reason"]
    assert services.advise({"success_rate": 0.02, "n": 20, "failures": {"wrong_tool": 19}})["recommendation"] == "sft_grpo"


def test_a_job_measures_production_trains_and_its_candidate_goes_through_the_gate(world, celery_worker):
    job = services.job_create(project=world["project"], task_set_version=world["train"],
                              holdout_version=world["holdout"], regression_version=world["regression"],
                              config=SMALL, user=world["user"])
    assert world["train"].__class__.objects.get(pk=world["train"].pk).frozen  # frozen when the job starts
    ready = celery_worker.wait_for(lambda: TrainingJob.objects.filter(pk=job.pk, status=JobStatus.READY).first(),
                                   timeout=240)
    assert ready.advice["metrics"]["n"] == 4 * SMALL["eval_samples_per_prompt"]
    assert ready.advice["recommendation"] in {"sft_grpo", "grpo", "none"}
    services.job_confirm(job=ready, user=world["user"])
    done = celery_worker.wait_for(
        lambda: TrainingJob.objects.filter(pk=job.pk).exclude(status__in=(JobStatus.QUEUED, JobStatus.RUNNING))
        .first(), timeout=400)
    assert done.status == JobStatus.SUCCEEDED, (done.error, celery_worker.log_tail())
    assert done.step == 2 and done.result["best_step"] in (1, 2)
    assert JobEvent.objects.filter(job=job, kind="step").count() == 2
    assert list(Checkpoint.objects.filter(job=job).values_list("step", flat=True)) == [1, 2]
    assert Checkpoint.objects.filter(job=job, best=True).count() == 1
    candidate = done.candidate_version
    assert candidate is not None and len(candidate.adapter_sha256) == 64
    assert candidate.lineage["job"] == job.pk
    from flywheel.registry.selectors import aliases_of

    assert aliases_of(project=world["project"])["candidate"] == candidate
    decision = GateDecision.objects.get(job=job)
    assert decision.error == "" and decision.report["cases"] == 4
    names = [rule["name"] for rule in decision.report["rules"]]
    assert names[0] == "holdout success" and "regression cases" in names
    # Production's side of the gate is what was measured before training.
    assert decision.report["rules"][0]["production"] == pytest.approx(
        ready.advice["metrics"]["success_rate"], abs=0.5)
    # The best of two evaluated checkpoints is judged on fresh samples, not on the scores that picked it.
    best = done.result["best_step"]
    assert decision.report["measurement"] == {"step": best, "looks": [1, 2], "fresh": True,
                                              "seed": jobdir.FRESH_SEED}
    measured = {e.data["split"]: e for e in JobEvent.objects.filter(job=job, kind="measured")}
    assert set(measured) == {"holdout", "regression"} and measured["holdout"].step == best
    folder = services.job_dir(done)
    fresh = jobdir.read_cases(folder / "gate" / "holdout.jsonl")
    assert [c["id"] for c in fresh] == [row["id"] for row in world["holdout"].rows]
    fresh_success = sum(c["pass_rate"] for c in fresh) / len(fresh)  # each case's passes over its samples
    assert decision.report["rules"][0]["candidate"] == pytest.approx(fresh_success, abs=1e-4)
    assert measured["holdout"].data["metrics"]["n"] == 4 * SMALL["eval_samples_per_prompt"]
    # The regression suite is sampled more, on both sides, and the report says what its rule can see there.
    assert measured["regression"].data["metrics"]["n"] == 2 * SMALL["regression_samples_per_prompt"]
    regression = next(rule for rule in decision.report["rules"] if rule["name"] == "regression cases")
    assert {case["production_samples"] for case in regression["cases"]} == {SMALL["regression_samples_per_prompt"]}
    assert decision.report["regression_power"]["sentence"].startswith("With 2 regression cases of 3 samples")
    # Both models timed case by case in one process (the holdout's 4 cases, under the rules' 20): the latency
    # rule judges them.
    latency = next(rule for rule in decision.report["rules"] if rule["name"] == "time per token")
    assert latency["production"] > 0 and latency["candidate"] > 0, latency
    assert latency["detail"].startswith("4 cases timed on both models"), latency
    timed = jobdir.read_cases(folder / "gate" / "latency.jsonl")
    assert sorted(row["id"] for row in timed) == sorted(row["id"] for row in world["holdout"].rows)
    probe = JobEvent.objects.get(job=job, kind="latency")
    assert probe.data["measured"] and probe.data["cases"] == 4
    print(f"\nlatency probe: {probe.data['seconds']} s for 4 cases; {latency['detail']}")
    if not decision.passed:
        with pytest.raises(registry.RegistryError, match="did not pass the gate"):
            registry.model_promote(project=world["project"], version=candidate)


def test_a_failed_latency_probe_leaves_the_rule_unmeasured_and_says_why(world):
    from flywheel.registry.gate_runs import read_latency

    job = services.job_create(project=world["project"], task_set_version=world["train"],
                              holdout_version=world["holdout"], config=SMALL, user=world["user"])
    folder = services._prepare_dir(job)
    (folder / "gate").mkdir(exist_ok=True)
    cancelled = services._measure_latency(job, folder, str(folder / "no-such-adapter"), best=1)
    assert cancelled is False  # a failure is not the job's: it goes on to the gate
    rows, why = read_latency(folder)
    assert rows == [] and why.startswith("the latency probe failed: latency failed: "), why
    assert JobEvent.objects.get(job=job, kind="latency").data == {"measured": False, "why": why}
    # A vLLM job is not timed with transformers: the rule says so.
    job.config = {**SMALL, "rollout_engine": "vllm"}
    assert services._measure_latency(job, folder, str(folder / "no-such-adapter"), best=1) is False
    assert "vLLM's per-request metrics would serve" in read_latency(folder)[1]


def test_cancel_kills_the_trainer_and_retry_resumes_from_the_checkpoint(world, celery_worker):
    job = services.job_create(project=world["project"], task_set_version=world["train"],
                              config={**SMALL, "max_steps": 400, "eval_on_start": False}, user=world["user"])
    ready = celery_worker.wait_for(lambda: TrainingJob.objects.filter(pk=job.pk, status=JobStatus.READY).first(),
                                   timeout=60)
    assert ready.advice["metrics"] is None  # no holdout: nothing to measure
    services.job_confirm(job=ready)
    running = celery_worker.wait_for(lambda: Checkpoint.objects.filter(job=job).exists()
                                     and TrainingJob.objects.get(pk=job.pk), timeout=300)
    pid = running.pid
    assert pid and os.getpgid(pid) == pid  # the trainer leads its own process group
    services.job_cancel(job=running)
    cancelled = celery_worker.wait_for(
        lambda: TrainingJob.objects.filter(pk=job.pk, status=JobStatus.CANCELLED).first(), timeout=60)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone, not an orphan
    step_at_cancel = Checkpoint.objects.filter(job=job).order_by("-step").first().step
    services.job_retry(job=cancelled)
    resumed = celery_worker.wait_for(
        lambda: JobEvent.objects.filter(job=job, attempt=2, kind="step").first(), timeout=300)
    assert resumed.step > step_at_cancel  # it went on from the checkpoint, not from step 1
    services.job_cancel(job=TrainingJob.objects.get(pk=job.pk))
    celery_worker.wait_for(lambda: TrainingJob.objects.filter(pk=job.pk, status=JobStatus.CANCELLED).first(),
                           timeout=60)


def test_a_trainer_failure_is_shown_with_its_step(world, celery_worker, client_for, tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    production = registry.base_model_register(project=world["project"], name="broken", path=str(broken))
    GateDecision.objects.create(project=world["project"], candidate=production, production=world["production"],
                                passed=True)
    registry.model_promote(project=world["project"], version=production)
    job = services.job_create(project=world["project"], task_set_version=world["train"], config=SMALL)
    ready = celery_worker.wait_for(lambda: TrainingJob.objects.filter(pk=job.pk, status=JobStatus.READY).first())
    services.job_confirm(job=ready)
    failed = celery_worker.wait_for(lambda: TrainingJob.objects.filter(pk=job.pk, status=JobStatus.FAILED).first(),
                                    timeout=120)
    assert failed.failed_step == 0 and "failed before training started" in failed.error and "tokenizer" in failed.error
    page = client_for(world["user"]).get(reverse("training_job", args=[world["project"].slug, job.pk]))
    html = page.content.decode()
    assert "Failed at step 0" in html and 'id="retry-job"' in html


def test_the_reaper_fails_a_job_whose_worker_vanished(world):
    job = TrainingJob.objects.create(
        project=world["project"], task_set_version=world["train"], base_version=world["production"],
        status=JobStatus.RUNNING, step=7, max_steps=20, worker="gpu-host:4242", advice={"recommendation": "grpo"},
        heartbeat_at=timezone.now() - timedelta(hours=1),
    )
    fresh = TrainingJob.objects.create(
        project=world["project"], task_set_version=world["train"], base_version=world["production"],
        status=JobStatus.RUNNING, heartbeat_at=timezone.now(),
    )
    assert services.job_reap() == 1
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED and job.failed_step == 7
    assert "gpu-host:4242" in job.error and "Retry resumes" in job.error
    assert TrainingJob.objects.get(pk=fresh.pk).status == JobStatus.RUNNING
    assert services.job_retry(job=job).status == JobStatus.QUEUED


def test_a_job_stopped_at_its_time_limit_fails_saying_so_and_retry_resumes(world, monkeypatch, settings):
    """Celery raises SoftTimeLimitExceeded where the worker is, supervising the trainer (whose process group
    supervise kills on the way out): the job fails with the reason, not as a worker that vanished."""
    from celery.exceptions import SoftTimeLimitExceeded

    job = TrainingJob.objects.create(
        project=world["project"], task_set_version=world["train"], base_version=world["production"],
        status=JobStatus.QUEUED, step=3, max_steps=20, advice={"recommendation": "grpo"}, queued_at=timezone.now(),
    )

    def limit(*args, **kwargs):
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(services, "_run_subprocess", limit)
    settings.FLYWHEEL_WORKER_GPUS = 2
    job = services.job_run(job_id=job.pk)
    assert job.status == JobStatus.FAILED and job.failed_step == 3 and job.heartbeat_at is None
    assert "ran past its time limit" in job.error and "Retry resumes from the last checkpoint" in job.error
    # The attempt held its device until it stopped: recorded on the job (a worker that sees 2 GPUs, a job of 1).
    assert (job.device, job.devices) == ("gpu", 1) and job.wall_seconds > 0
    assert job.device_seconds == job.wall_seconds and job.gpu_hours == job.wall_seconds / 3600
    assert services.job_retry(job=job).status == JobStatus.QUEUED


def test_a_refused_action_is_a_409_with_its_reason_on_the_job_page(world, client_for):
    """The job's state refuses it (flywheel.supervise.Refused), as an eval run's page does: 409, the reason
    shown on the job's own page, nothing changed."""
    job = TrainingJob.objects.create(project=world["project"], task_set_version=world["train"],
                                     base_version=world["production"], status=JobStatus.SUCCEEDED)
    slug = world["project"].slug
    for name, reason in (("training_job_retry", "only a failed or cancelled job"),
                         ("training_job_cancel", "nothing to cancel"), ("training_job_confirm", "nothing to confirm")):
        response = client_for(world["user"]).post(reverse(name, args=[slug, job.pk]))
        assert response.status_code == 409 and reason in response.content.decode(), name
        assert 'role="alert"' in response.content.decode()
    assert TrainingJob.objects.get(pk=job.pk).status == JobStatus.SUCCEEDED
    with pytest.raises(Refused, match="The job is succeeded: only a failed or cancelled job"):
        services.job_retry(job=job)


def test_only_maintainers_start_jobs_and_form_errors_are_shown(world, make_user, make_membership, client_for):
    viewer = make_user("viewer")
    make_membership(viewer, world["project"], "viewer")
    url = reverse("training_job_new", args=[world["project"].slug])
    assert client_for(viewer).post(url, {"task_set_version": world["train"].pk}).status_code == 403
    response = client_for(world["user"]).post(url, {"task_set_version": world["train"].pk,
                                                    "cfg_max_steps": "ten", "cfg_loss_type": "ppo"})
    html = response.content.decode()
    assert response.status_code == 422 and "config.max_steps must be an integer, got &#x27;ten&#x27;" in html
    page = client_for(viewer).get(reverse("training_jobs", args=[world["project"].slug]))
    assert page.status_code == 200 and 'id="start-job"' not in page.content.decode()
    # Every GRPOConfig field has its input in the maintainer's form.
    from dataclasses import fields

    from trainer.config import GRPOConfig

    form = client_for(world["user"]).get(reverse("training_jobs", args=[world["project"].slug])).content.decode()
    assert all(f'name="cfg_{f.name}"' in form for f in fields(GRPOConfig))


def test_a_project_saves_its_own_recipe_and_new_jobs_start_from_it(world, client_for, api_client, make_api_key):
    from flywheel.training.models import TrainingDefaults

    project, user = world["project"], world["user"]
    url = reverse("training_job_new", args=[project.slug])
    base = {"task_set_version": world["train"].pk, "holdout_version": world["holdout"].pk, "save_defaults": "1"}
    refused = client_for(user).post(url, {**base, "cfg_learning_rate": "-1"})
    assert refused.status_code == 422 and not TrainingDefaults.objects.filter(project=project).exists()

    started = client_for(user).post(url, {**base, "cfg_learning_rate": "0.0005", "cfg_max_steps": "30"})
    assert started.status_code == 302
    first = TrainingJob.objects.filter(project=project).latest("id")
    assert (first.config["learning_rate"], first.config["max_steps"]) == (0.0005, 30)
    assert services.project_defaults(project) == {"learning_rate": 0.0005, "max_steps": 30}

    # The form shows them as the project's, and a job from the API starts from them under its own values.
    page = client_for(user).get(reverse("training_jobs", args=[project.slug])).content.decode()
    assert 'name="cfg_learning_rate" placeholder="0.0005"' in page and "title=\"This project's saved default\"" in page
    assert 'id="defaults-clear"' in page
    key = make_api_key(project, scopes=["train", "read"])
    answer = api_client.post("/api/v1/training-jobs", {**_ref("task_set", world["train"]), "confirm": False,
                                                       "config": {"max_steps": 12}}, key=key)
    assert answer.status_code == 201, answer.json()
    from_api = TrainingJob.objects.get(pk=answer.json()["id"])
    assert (from_api.config["learning_rate"], from_api.config["max_steps"]) == (0.0005, 12)

    # Back to the field's recipe.
    assert client_for(user).post(reverse("training_defaults_clear", args=[project.slug])).status_code == 302
    assert services.project_defaults(project) == {}
    assert services.config_check(algorithm="grpo", config={}, project=project) == GRPOConfig(
        **services.RECIPE).to_dict()


def test_job_dir_is_per_job(world):
    job = TrainingJob(project=world["project"], pk=5)
    assert services.job_dir(job) == Path(services.settings.FLYWHEEL_JOBS_DIR) / world["project"].slug / "job-5"


def _ref(field, version):
    """A version as the API names it: the collection's id and the version's number."""
    owner = version.task_set_id if isinstance(version, TaskSetVersion) else version.suite_id
    return {field: owner, f"{field}_version": version.number}


def test_the_api_starts_a_job_with_field_errors_and_the_leakage_guard(world, api_client, make_api_key, workplace):
    key = make_api_key(world["project"], scopes=["read", "train"])
    bad = api_client.post("/api/v1/training-jobs", {**_ref("task_set", world["train"]),
                                                     "config": {"learning_rate": "fast", "beta": -1}}, key=key)
    assert bad.status_code == 422
    locations = [tuple(d["loc"]) for d in bad.json()["detail"]]
    assert ("body", "config", "learning_rate") in locations or ("body", "config", "beta") in locations
    missing = api_client.post("/api/v1/training-jobs", {"task_set": world["train"].task_set_id,
                                                         "task_set_version": 9}, key=key)
    assert missing.status_code == 422 and missing.json()["detail"][0]["loc"] == ["body", "task_set_version"]
    assert "no version 9 (its newest is 1)" in missing.json()["detail"][0]["msg"]
    no_set = api_client.post("/api/v1/training-jobs", {"task_set": 999999, "task_set_version": 1}, key=key)
    assert no_set.status_code == 422 and no_set.json()["detail"][0]["loc"] == ["body", "task_set"]
    half = api_client.post("/api/v1/training-jobs", {**_ref("task_set", world["train"]),
                                                      "holdout": world["holdout"].suite_id}, key=key)
    assert half.status_code == 422 and half.json()["detail"][0]["loc"] == ["body", "holdout_version"]
    lax = api_client.post("/api/v1/training-jobs", {**_ref("task_set", world["train"]), "confirm": 0}, key=key)
    assert lax.status_code == 422 and lax.json()["detail"][0]["loc"] == ["body", "confirm"]  # 0 is no boolean
    holdout = frozen_version(EvalSuiteVersion, EvalSuite, _rows(workplace["train"][:1], "h"), project=world["project"],
                       name="h2", kind="holdout")
    leaky = api_client.post("/api/v1/training-jobs", {**_ref("task_set", world["train"]),
                                                       **_ref("holdout", holdout)}, key=key)
    assert leaky.status_code == 409 and "task-0" in leaky.json()["detail"]
    started = api_client.post("/api/v1/training-jobs", {**_ref("task_set", world["train"]),
                                                         **_ref("holdout", world["holdout"]),
                                                         "config": SMALL}, key=key)
    assert started.status_code == 201 and started.json()["status"] == "evaluating"
    job_id = started.json()["id"]
    assert TrainingJob.objects.get(pk=job_id).confirmed_in_advance
    body = api_client.get(f"/api/v1/training-jobs/{job_id}", key=key).json()
    assert (body["status"], body["max_steps"], body["gate"]) == ("evaluating", 2, None)
    # The settings it runs with, every version named as it was sent.
    assert {k: body[k] for k in ("task_set", "task_set_version", "holdout", "holdout_version", "regression",
                                 "regression_version", "algorithm", "base_version")} == {
        **_ref("task_set", world["train"]), **_ref("holdout", world["holdout"]), "regression": None,
        "regression_version": None, "algorithm": "grpo", "base_version": world["production"].number}
    assert body["config"]["max_steps"] == 2 and body["config"]["num_generations_per_prompt"] == 4
    assert body["gate_rules"]["test"] == "permutation"
    assert api_client.post(f"/api/v1/training-jobs/{job_id}/cancel", {}, key=key).json()["status"] == "cancelled"
    # Refused as an eval run's cancel is (flywheel.supervise.Refused): 409 with the reason.
    again = api_client.post(f"/api/v1/training-jobs/{job_id}/cancel", {}, key=key)
    assert again.status_code == 409 and again.json() == {"detail": "The job is cancelled: there is nothing to cancel."}
    read_only = make_api_key(world["project"], scopes=["read"])
    assert api_client.post("/api/v1/training-jobs", _ref("task_set", world["train"]),
                           key=read_only).status_code == 403


def _job_with_passed_candidate(world) -> TrainingJob:
    """A finished job whose candidate passed the gate against the world's production."""
    candidate = registry.model_version_create(project=world["project"], base=world["production"].base)
    GateDecision.objects.create(project=world["project"], candidate=candidate, production=world["production"],
                                passed=True)
    return TrainingJob.objects.create(project=world["project"], task_set_version=world["train"],
                                      base_version=world["production"], candidate_version=candidate,
                                      status=JobStatus.SUCCEEDED)


def test_a_passing_candidate_is_promoted_at_once_only_where_the_project_opted_in(world):
    from flywheel.registry.models import AliasEvent, RegistrySettings
    from flywheel.registry.selectors import production_of

    job = _job_with_passed_candidate(world)
    candidate = job.candidate_version
    services._auto_promote(job=job)
    assert production_of(project=world["project"]) == world["production"]  # not opted in: a person clicks
    registry.gate_rules_set(project=world["project"], data={}, auto_promote=True)
    assert RegistrySettings.objects.get(project=world["project"]).auto_promote
    services._auto_promote(job=job)
    assert production_of(project=world["project"]) == candidate
    assert JobEvent.objects.filter(job=job, kind="promoted").exists()
    assert AliasEvent.objects.filter(project=world["project"], alias="production").first().actor == "gate"


def test_automatic_promotion_refuses_a_decision_judged_against_a_production_that_moved(world):
    # Production moved while the job trained: its candidate beat the old production, not the new one.
    from flywheel.registry.selectors import production_of

    moved = registry.model_version_create(project=world["project"], base=world["production"].base)
    GateDecision.objects.create(project=world["project"], candidate=moved, production=world["production"],
                                passed=True)
    job = _job_with_passed_candidate(world)
    registry.model_promote(project=world["project"], version=moved)
    registry.gate_rules_set(project=world["project"], data={}, auto_promote=True)
    services._auto_promote(job=job)
    assert production_of(project=world["project"]) == moved
    refused = JobEvent.objects.get(job=job, kind="promotion failed")
    assert f"production is now v{moved.number}" in refused.data["message"]


def test_dpo_trains_on_the_reference_over_the_agents_own_output(world, tmp_path):
    import json
    import subprocess
    import sys

    from flywheel.trajectories.ingest import ingest_trajectories
    from flywheel.trajectories.models import Trajectory

    tools = world["train"].rows[0]["tools"]
    records, rows = [], []
    for i, task in enumerate(world["train"].rows[:6]):
        expected = task["verifier"]["expected_calls"][0]
        bad = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": expected["name"], "arguments": json.dumps({**expected["arguments"], "task_id": "T999"})}}]}
        records.append({"external_id": f"dpo-{i}", "messages": [*task["messages"], bad], "tools": tools,
                        "outcome": "failure"})
    ingest_trajectories(project=world["project"], records=records)
    for i, task in enumerate(world["train"].rows[:6]):
        trajectory = Trajectory.objects.get(project=world["project"], external_id=f"dpo-{i}")
        rows.append({**task, "id": f"pair-{i}", "tools": tools, "origin": {"trajectory_id": trajectory.pk}})
    pairs = services.preference_pairs(rows)
    assert len(pairs) == 6
    assert pairs[0]["rejected"]["tool_calls"][0]["function"]["arguments"].count("T999") == 1
    assert pairs[0]["chosen"][0]["tool_calls"][0]["function"]["name"] == rows[0]["verifier"]["expected_calls"][0]["name"]
    # Without the agent's output (no trajectory) there is no pair, and DPO is refused with the reason.
    with pytest.raises(ValidationError) as exc:
        services.job_create(project=world["project"], task_set_version=world["train"], algorithm="dpo")
    assert "DPO needs pairs" in exc.value.message_dict["algorithm"][0]
    version = frozen_version(TaskSetVersion, TaskSet, rows, project=world["project"], name="pairs")
    job = services.job_create(project=world["project"], task_set_version=version, algorithm="dpo",
                              config={"max_steps": 2, "num_prompts_per_step": 2, "eval_interval": 100,
                                      "eval_on_start": False, "num_threads": 1})
    assert job.config["beta"] == 0.1 and job.config["loss_type"] == "sigmoid"  # DPO's, not the GRPO recipe's
    folder = services._prepare_dir(job)
    written = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    assert len(written) == 6 and all("chosen" in r and "rejected" in r for r in written)
    # The worker's command on that folder: the trainer takes the platform's pairs.
    spec = json.loads((folder / "spec.json").read_text())
    spec["mlflow"] = False
    (folder / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, "-m", "trainer", "train", "--spec", str(folder / "spec.json")],
                          capture_output=True, text=True, timeout=300)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, done.stderr[-2000:]
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2] and events[-1]["event"] == "done"
    assert "margin" in next(e for e in events if e["event"] == "step")
    assert "DPO learns from them without sampling" in services.advise({"success_rate": 0.0, "n": 8}, pairs=6)["reason"]


def test_sft_then_grpo_needs_something_to_imitate_and_takes_the_grpo_recipe(world):
    failures = [{**row, "outcome": "failure"} for row in world["train"].rows[:3]]
    assert not any(map(services.imitable, failures)) and services.imitable(world["train"].rows[0])
    version = frozen_version(TaskSetVersion, TaskSet, failures, project=world["project"], name="failures only")
    with pytest.raises(ValidationError) as exc:
        services.job_create(project=world["project"], task_set_version=version, algorithm="sft_grpo")
    assert "SFT needs something to imitate" in exc.value.message_dict["algorithm"][0]
    with pytest.raises(ValidationError) as exc:
        services.job_create(project=world["project"], task_set_version=world["train"], algorithm="sft_grpo",
                            config={"max_steps": 5, "sft_steps": 5})
    assert "sft_steps" in exc.value.message_dict["config.sft_steps"][0]
    job = services.job_create(project=world["project"], task_set_version=world["train"], algorithm="sft_grpo",
                              config={"max_steps": 6, "sft_steps": 2})
    assert job.algorithm == "sft_grpo" and job.config["num_generations_per_prompt"] == services.RECIPE[
        "num_generations_per_prompt"]
    spec = json.loads((services._prepare_dir(job) / "spec.json").read_text())
    assert spec["algorithm"] == "sft_grpo" and spec["config"]["sft_steps"] == 2
    # The job's settings name its two stages: planned from the config, then as the trainer announces them.
    from flywheel.training.comparison import job_stages

    assert [(s["stage"], s["first_step"], s["last_step"], s["started"]) for s in job_stages(job)] == [
        ("sft", 1, 2, False), ("grpo", 3, 6, False)]
    JobEvent.objects.create(job=job, attempt=job.attempt, kind="stage",
                            data={"stage": "sft", "first_step": 1, "last_step": 2, "examples": 7})
    assert [(s["started"], s["examples"]) for s in job_stages(job)] == [(True, 7), (False, None)]
    assert job_stages(services.job_create(project=world["project"], task_set_version=world["train"])) == []


def test_a_succeeded_job_says_the_gates_verdict_in_its_status_and_in_the_list(world, client_for):
    candidate = registry.model_version_create(project=world["project"], base=world["production"].base)
    job = TrainingJob.objects.create(project=world["project"], task_set_version=world["train"],
                                     base_version=world["production"], candidate_version=candidate,
                                     status=JobStatus.SUCCEEDED)
    decision = GateDecision.objects.create(project=world["project"], job=job, candidate=candidate,
                                           production=world["production"], passed=False)
    client = client_for(world["user"])
    page = client.get(reverse("training_job", args=[world["project"].slug, job.pk])).content.decode()
    assert '<span class="badge job-succeeded" id="job-state">Succeeded · gate refused</span>' in page
    listing = client.get(reverse("training_jobs", args=[world["project"].slug])).content.decode()
    row = listing.split(f'id="compare-{job.pk}"')[1].split("</tr>")[0]
    gate = reverse("registry_gate", args=[world["project"].slug, decision.pk])
    assert f'<a href="{gate}" class="badge o-failure">refused</a>' in row


def test_the_status_poll_that_sees_the_job_end_reloads_the_page(world, client_for):
    job = TrainingJob.objects.create(project=world["project"], task_set_version=world["train"],
                                     base_version=world["production"], status=JobStatus.RUNNING)
    client = client_for(world["user"])
    url = reverse("training_job", args=[world["project"].slug, job.pk])
    running = client.get(url, headers={"HX-Request": "true"})
    assert "HX-Refresh" not in running.headers and 'hx-trigger="every 2s"' in running.content.decode()
    TrainingJob.objects.filter(pk=job.pk).update(status=JobStatus.SUCCEEDED)
    ended = client.get(url, headers={"HX-Request": "true"})
    assert ended.headers["HX-Refresh"] == "true"  # the checkpoints and the verdict outside the partial too
