"""Training from a script, past starting a job (tests/platform/training/test_training.py): the project's
recipe, the list of jobs (newest first, by status, page by page), a job's curves and settings, and jobs
compared, each in the key's project only."""

from __future__ import annotations

import pytest

from flywheel.training import services
from flywheel.training.models import JobEvent, TrainingJob


@pytest.fixture
def keys(make_api_key, project, make_project):
    return {"read": make_api_key(project, scopes=["read"]), "train": make_api_key(project, scopes=["train", "read"]),
            "other": make_api_key(make_project("elsewhere"), scopes=["train", "read"])}


@pytest.fixture
def jobs(project):
    """Five jobs (rows only) on task set v2, the holdout v1, from v1; the last two succeeded with v2."""
    from flywheel.environments.models import TaskSet
    from flywheel.evals.models import EvalSuite
    from flywheel.registry.models import BaseModel, GateDecision, ModelVersion

    base = BaseModel.objects.create(project=project, name="tiny", path="/models/tiny")
    v1 = ModelVersion.objects.create(project=project, number=1, base=base)
    v2 = ModelVersion.objects.create(project=project, number=2, base=base)
    task_set = TaskSet.objects.create(project=project, name="t")
    task_set.versions.create(number=1, rows=[], size=0, content_hash="0" * 64)
    train = task_set.versions.create(number=2, rows=[], size=0, content_hash="1" * 64)
    holdout = EvalSuite.objects.create(project=project, name="h", kind="holdout").versions.create(
        number=1, rows=[], size=0, content_hash="2" * 64)
    made = []
    for i, status in enumerate(["failed", "running", "cancelled", "succeeded", "succeeded"]):
        job = TrainingJob.objects.create(
            project=project, task_set_version=train, holdout_version=holdout, base_version=v1, status=status,
            algorithm="grpo", config={"learning_rate": 1e-4 * (i + 1), "max_steps": 10}, max_steps=10, step=i,
            candidate_version=v2 if status == "succeeded" else None)
        made.append(job)
    GateDecision.objects.create(project=project, job=made[-1], candidate=v2, production=v1, passed=True,
                                rules={"confidence": 0.9}, report={"rules": [{"name": "success", "passed": True}]})
    return made


def test_the_recipe_is_read_set_and_cleared(api_client, keys, project):
    url = "/api/v1/training-recipe"
    start = api_client.get(url, key=keys["read"]).json()
    assert start["config"] == {} and start["effective"] == services.config_check(algorithm="grpo", config={})
    recipe = {"config": {"learning_rate": 0.0005, "max_steps": 30}}
    assert api_client.put(url, recipe, key=keys["read"]).status_code == 403
    saved = api_client.put(url, recipe, key=keys["train"])
    assert saved.status_code == 200, saved.content
    assert saved.json()["config"] == recipe["config"] and saved.json()["effective"]["learning_rate"] == 0.0005
    assert services.project_defaults(project) == recipe["config"]  # what the job form's "save as recipe" stores
    assert api_client.get(url, key=keys["other"]).json()["config"] == {}

    for config, field in (({"learning_rate": "fast"}, "learning_rate"), ({"no_such_field": 1}, "no_such_field")):
        bad = api_client.put(url, {"config": config}, key=keys["train"])
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "config", field], bad.content
    assert services.project_defaults(project) == recipe["config"]  # a refused recipe changes nothing

    cleared = api_client.put(url, {"config": {}}, key=keys["train"])
    assert cleared.json()["config"] == {} and services.project_defaults(project) == {}


def test_jobs_are_listed_newest_first_by_status_and_page(api_client, keys, jobs):
    url = "/api/v1/training-jobs"
    listed = api_client.get(url, key=keys["read"]).json()
    assert [j["id"] for j in listed["items"]] == [j.pk for j in reversed(jobs)] and listed["next_cursor"] is None
    first = listed["items"][0]
    holdout = jobs[0].holdout_version
    assert {k: first[k] for k in ("task_set", "task_set_version", "holdout", "holdout_version", "base_version",
                                  "candidate_version")} == {
        "task_set": jobs[0].task_set_version.task_set_id, "task_set_version": 2, "holdout": holdout.suite_id,
        "holdout_version": 1, "base_version": 1, "candidate_version": 2}

    assert first["usage"] == {"device": "", "devices": 0, "wall_seconds": 0, "device_hours": 0, "gpu_hours": 0}
    TrainingJob.objects.filter(pk=jobs[4].pk).update(device="gpu", devices=2, wall_seconds=5400,
                                                      device_seconds=10800)
    done = api_client.get(url, {"status": "succeeded"}, key=keys["read"]).json()["items"]
    assert [j["id"] for j in done] == [jobs[4].pk, jobs[3].pk]
    assert done[0]["usage"] == {"device": "gpu", "devices": 2, "wall_seconds": 5400, "device_hours": 3.0,
                                "gpu_hours": 3.0}
    detail = api_client.get(f"{url}/{jobs[4].pk}", key=keys["read"]).json()
    assert detail["usage"]["gpu_hours"] == 3.0
    assert api_client.get(url, {"status": "finished"}, key=keys["read"]).status_code == 422

    seen, cursor = [], None
    while True:
        page = api_client.get(url, {"limit": 2, **({"cursor": cursor} if cursor else {})}, key=keys["read"]).json()
        seen += [j["id"] for j in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [j.pk for j in reversed(jobs)]
    assert api_client.get(url, {"cursor": "x1"}, key=keys["read"]).status_code == 400  # not one it gave out
    assert api_client.get(url, key=keys["other"]).json()["items"] == []


def test_a_jobs_answer_shows_the_settings_it_ran_with(api_client, keys, jobs):
    body = api_client.get(f"/api/v1/training-jobs/{jobs[4].pk}", key=keys["read"]).json()
    assert body["algorithm"] == "grpo" and body["num_gpus"] == 1 and body["stages"] == []
    # Every GRPOConfig field, as the trainer runs it: the job's own values and the defaults of the rest.
    assert body["config"]["learning_rate"] == pytest.approx(5e-4) and body["config"]["max_steps"] == 10
    assert "num_generations_per_prompt" in body["config"] and body["config"]["epsilon_high"] is not None
    assert body["gate_rules"] == {"confidence": 0.9}  # the rules its candidate was judged by
    assert body["gate"]["passed"] is True
    unjudged = api_client.get(f"/api/v1/training-jobs/{jobs[1].pk}", key=keys["read"]).json()
    assert unjudged["gate"] is None and unjudged["gate_rules"]["confidence"] == 0.95  # the project's rules now
    assert api_client.get(f"/api/v1/training-jobs/{jobs[4].pk}", key=keys["other"]).status_code == 404


def test_a_jobs_curves_are_the_charts_points(api_client, keys, jobs):
    job = jobs[1]
    for step, reward in ((1, 0.1), (2, 0.3)):
        JobEvent.objects.create(job=job, kind="step", step=step, data={"reward_mean": reward, "kl": 0.01 * step,
                                                                       "completion_length": 20})
    JobEvent.objects.create(job=job, kind="eval", step=2, data={"split": "holdout", "metrics": {"success_rate": 0.5}})
    JobEvent.objects.create(job=job, kind="eval", step=2, data={"split": "regression", "metrics": {"success_rate": 1}})
    curves = api_client.get(f"/api/v1/training-jobs/{job.pk}/curves", key=keys["read"])
    assert curves.status_code == 200
    assert curves.json() == {"status": "running", **services.job_page_data(job=job)}
    assert curves.json()["train"]["reward"] == [0.1, 0.3]
    assert curves.json()["holdout"] == {"step": [2], "success_rate": [0.5]}
    assert api_client.get(f"/api/v1/training-jobs/{job.pk}/curves", key=keys["other"]).status_code == 404


def test_jobs_compared_side_by_side(api_client, keys, jobs):
    from flywheel.training.comparison import compare_jobs

    url = "/api/v1/training-jobs/compare"
    ids = [jobs[4].pk, jobs[3].pk]
    answer = api_client.get(url, {"ids": ids}, key=keys["read"])
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert [j["id"] for j in body["jobs"]] == ids
    assert body == compare_jobs(project=jobs[0].project, jobs=[jobs[4], jobs[3]])
    learning_rate = next(row for row in body["settings"] if row["name"] == "learning_rate")
    assert learning_rate["differs"] and learning_rate["values"] == pytest.approx([5e-4, 4e-4])
    assert body["gates"][0]["passed"] is True and body["gates"][1] is None

    assert api_client.get(url, {"ids": [jobs[4].pk]}, key=keys["read"]).status_code == 422  # one job
    assert api_client.get(url, {"ids": [jobs[4].pk, jobs[4].pk]}, key=keys["read"]).status_code == 422
    assert api_client.get(url, {"ids": [jobs[4].pk, 10**9]}, key=keys["read"]).status_code == 404
    assert api_client.get(url, {"ids": ids}, key=keys["other"]).status_code == 404


@pytest.mark.parametrize("outside", [2**63, -(2**63) - 1, 0, -4106197646545209942349509624609112064])
def test_a_job_id_outside_the_id_range_is_a_422_naming_it(api_client, keys, jobs, outside):
    """SQLite raised OverflowError on an id past 64 bits in the `IN` of the comparison (a 500)."""
    answer = api_client.get("/api/v1/training-jobs/compare", {"ids": [jobs[4].pk, jobs[3].pk, outside]},
                            key=keys["read"])
    assert answer.status_code == 422, answer.content
    assert [problem["loc"] for problem in answer.json()["detail"]] == [["query", "ids", 2]]


def test_the_schema_says_a_comparison_names_each_job_once():
    """A job named twice is refused (422, above): the schema says so, or a client that follows it (a fuzzer
    did) sends a request the schema allows and gets refused."""
    from flywheel.api_urls import api

    operation = api.get_openapi_schema(path_prefix="")["paths"]["/training-jobs/compare"]["get"]
    ids = next(p for p in operation["parameters"] if p["name"] == "ids")
    assert ids["schema"]["uniqueItems"] is True
