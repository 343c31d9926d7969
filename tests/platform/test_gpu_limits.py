"""Bounds on GPU work: a project's eval runs and training jobs waiting or running (409 naming the limit, which
the operator sets), the GPUs a job may ask for (what the GPU workers reported), a job's steps and a
measurement's cases × samples (field errors naming the field). A `train` key once queued 100 eval runs at 64
samples in 8 s, and a job with num_gpus=64, max_steps=100000 was accepted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from django.urls import reverse

from flywheel.accounts.models import WorkerHeartbeat
from flywheel.accounts.services import gpus_visible
from flywheel.accounts.tasks import worker_started
from flywheel.evals.run_models import EvalRun
from tests.platform.training.worlds import tickets_world

RUNS = "/api/v1/eval-runs"
JOBS = "/api/v1/training-jobs"


@pytest.fixture
def world(project, user, tmp_path):
    return tickets_world(project, user, tmp_path / "model", holdout_cases=5)


@pytest.fixture
def key(world, make_api_key):
    return make_api_key(world["project"], scopes=["read", "train"])


def _run(world, samples=1):
    holdout = world["holdout"]
    return {"model_version": world["production"].number, "suite": holdout.suite_id,
            "suite_version": holdout.number, "samples": samples}


def _job(world, **fields):
    train = world["train"]
    return {"task_set": train.task_set_id, "task_set_version": train.number, "config": {"max_steps": 2}, **fields}


def test_a_project_queues_eval_runs_up_to_its_limit(world, key, api_client, settings, make_project, user, tmp_path,
                                                    make_api_key, client_for):
    settings.FLYWHEEL_MAX_EVAL_RUNS_PER_PROJECT = 3
    made = [api_client.post(RUNS, _run(world), key=key) for _ in range(3)]
    assert [answer.status_code for answer in made] == [201, 201, 201]
    refused = api_client.post(RUNS, _run(world), key=key)
    assert refused.status_code == 409
    assert refused.json() == {"detail": "This project has 3 runs waiting or running, its limit "
                                        "(FLYWHEEL_MAX_EVAL_RUNS_PER_PROJECT=3): wait for one to end, or cancel one."}
    assert EvalRun.objects.filter(project=world["project"]).count() == 3

    # The limit is the project's: another project's key still queues.
    other = tickets_world(make_project("other"), user, tmp_path / "other", holdout_cases=2)
    other_key = make_api_key(other["project"], scopes=["train"])
    assert api_client.post(RUNS, _run(other), key=other_key).status_code == 201

    # A cancelled run gives its place back; retrying it takes one again, refused while none is free.
    first = made[0].json()["id"]
    assert api_client.post(f"{RUNS}/{first}/cancel", {}, key=key).json()["status"] == "cancelled"
    assert api_client.post(RUNS, _run(world), key=key).status_code == 201
    retried = api_client.post(f"{RUNS}/{first}/retry", {}, key=key)
    assert retried.status_code == 409 and "FLYWHEEL_MAX_EVAL_RUNS_PER_PROJECT=3" in retried.json()["detail"]

    # The page says the same to a maintainer.
    response = client_for(user).post(reverse("eval_run_start", args=[world["project"].slug]),
                         {"model_version": world["production"].pk, "suite_version": world["holdout"].pk, "samples": 1})
    assert response.status_code == 409 and "FLYWHEEL_MAX_EVAL_RUNS_PER_PROJECT=3" in response.content.decode()


def test_a_measurement_over_the_generations_limit_names_its_samples(world, key, api_client, settings):
    settings.FLYWHEEL_MAX_EVAL_GENERATIONS = 100  # the holdout has 5 cases
    refused = api_client.post(RUNS, _run(world, samples=64), key=key)
    assert refused.status_code == 422
    (detail,) = refused.json()["detail"]
    assert detail["loc"] == ["body", "samples"]
    assert detail["msg"] == ("5 cases × 64 samples a case is 320 generations, over the limit of 100 "
                             "(FLYWHEEL_MAX_EVAL_GENERATIONS): take at most 20 samples a case.")
    assert api_client.post(RUNS, _run(world, samples=20), key=key).status_code == 201

    holdout = world["holdout"]
    job = api_client.post(JOBS, _job(world, holdout=holdout.suite_id, holdout_version=holdout.number,
                                     config={"max_steps": 2, "eval_samples_per_prompt": 64}), key=key)
    assert job.status_code == 422
    (detail,) = job.json()["detail"]
    assert detail["loc"] == ["body", "config", "eval_samples_per_prompt"] and "320 generations" in detail["msg"]


def test_a_job_asks_for_no_more_steps_than_the_operator_allows(world, key, api_client, settings):
    settings.FLYWHEEL_MAX_STEPS = 5000
    refused = api_client.post(JOBS, _job(world, config={"max_steps": 100000}), key=key)
    assert refused.status_code == 422
    (detail,) = refused.json()["detail"]
    assert detail == {**detail, "loc": ["body", "config", "max_steps"],
                      "msg": "At most 5000 steps a job (FLYWHEEL_MAX_STEPS), not 100000."}
    recipe = api_client.put("/api/v1/training-recipe", {"config": {"max_steps": 100000}}, key=key)
    assert recipe.status_code == 422 and recipe.json()["detail"][0]["loc"] == ["body", "config", "max_steps"]
    assert api_client.post(JOBS, _job(world, config={"max_steps": 5000}), key=key).status_code == 201


def test_a_job_asks_for_no_more_gpus_than_a_gpu_worker_reported(world, key, api_client):
    refused = api_client.post(JOBS, _job(world, num_gpus=64), key=key)
    assert refused.status_code == 422
    (detail,) = refused.json()["detail"]
    assert detail["loc"] == ["body", "num_gpus"] and "no GPU worker has reported more" in detail["msg"]

    # The workers report when they start (a Celery consumer, as worker_ready hands it over); a CPU worker's
    # GPUs do not count for the `gpu` queue.
    for hostname, queues, gpus in (("gpu@a", ["gpu"], 8), ("gpu@b", ["gpu"], 2), ("default@c", ["default"], 16)):
        consumer = SimpleNamespace(hostname=hostname,
                                   task_consumer=SimpleNamespace(queues=[SimpleNamespace(name=q) for q in queues]))
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus))))
            worker_started(consumer)
    assert sorted(WorkerHeartbeat.objects.values_list("hostname", "gpus")) == [
        ("default@c", 16), ("gpu@a", 8), ("gpu@b", 2)]
    nine = api_client.post(JOBS, _job(world, num_gpus=9), key=key)
    assert nine.status_code == 422 and nine.json()["detail"][0]["msg"] == (
        "Between 1 and 8 GPUs: the most a GPU worker reported having.")
    assert api_client.post(JOBS, _job(world, num_gpus=8), key=key).status_code == 201


def test_a_project_has_at_most_its_limit_of_jobs_not_yet_ended(world, key, api_client, settings, client_for, user):
    settings.FLYWHEEL_MAX_JOBS_PER_PROJECT = 2
    made = [api_client.post(JOBS, _job(world), key=key) for _ in range(2)]
    assert [answer.status_code for answer in made] == [201, 201]
    refused = api_client.post(JOBS, _job(world), key=key)
    assert refused.status_code == 409 and "FLYWHEEL_MAX_JOBS_PER_PROJECT=2" in refused.json()["detail"]
    train = world["train"]
    page = client_for(user).post(reverse("training_job_new", args=[world["project"].slug]),
                                 {"task_set_version": train.pk, "algorithm": "grpo", "num_gpus": "1",
                                  "max_steps": "2"})
    assert page.status_code == 409 and 'id="job-refused"' in page.content.decode()
    api_client.post(f"{JOBS}/{made[0].json()['id']}/cancel", {}, key=key)
    assert api_client.post(JOBS, _job(world), key=key).status_code == 201


@pytest.mark.parametrize("environ, expected", [
    ({"FLYWHEEL_WORKER_GPUS": "4", "CUDA_VISIBLE_DEVICES": "0"}, 4),  # the operator's word first
    ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, 3),
    ({"CUDA_VISIBLE_DEVICES": "GPU-5e8f,GPU-77aa"}, 2),
    ({"CUDA_VISIBLE_DEVICES": "0,-1,2"}, 1),  # CUDA stops at the first entry that names no device
    ({"CUDA_VISIBLE_DEVICES": ""}, 0),
])
def test_a_worker_counts_the_gpus_it_may_use(settings, monkeypatch, environ, expected):
    settings.FLYWHEEL_WORKER_GPUS = int(environ["FLYWHEEL_WORKER_GPUS"]) if "FLYWHEEL_WORKER_GPUS" in environ else None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", environ["CUDA_VISIBLE_DEVICES"])
    assert gpus_visible() == expected
