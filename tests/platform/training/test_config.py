"""A job's config, resolved and checked once: a new job stores every GRPOConfig field as it will run them, an
older job's partial config reads back the same, the page, the API and the trainer give the same field errors,
and every evaluation default is GRPOConfig's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse

from flywheel.evals.models import EvalSuite, EvalSuiteVersion
from flywheel.training import comparison, forms, services
from flywheel.training.models import JobStatus, TrainingJob
from tests.platform.training.worlds import frozen_version, ticket_rows, tickets_world
from trainer.config import GRPOConfig, resolve_config

FIELDS = {f.name for f in dataclasses.fields(GRPOConfig)}


@pytest.fixture
def world(project, user, tmp_path: Path):
    return tickets_world(project, user, tmp_path / "tiny", holdout_cases=4)


def test_a_new_job_stores_every_field_as_it_will_run(world):
    services.defaults_save(project=world["project"], config={"max_steps": 30, "eval_temperature": 0.5})
    job = services.job_create(project=world["project"], task_set_version=world["train"],
                              holdout_version=world["holdout"], config={"learning_rate": 1e-3, "max_turns": 2})
    job.refresh_from_db()
    assert set(job.config) == FIELDS
    # The user's values, over the project's recipe, over the field's recipe, over the dataclass's defaults.
    assert (job.config["learning_rate"], job.config["max_turns"]) == (1e-3, 2)
    assert (job.config["max_steps"], job.config["eval_temperature"], job.max_steps) == (30, 0.5, 30)
    assert job.config["num_generations_per_prompt"] == services.RECIPE["num_generations_per_prompt"]
    assert job.config["eval_samples_per_prompt"] == GRPOConfig().eval_samples_per_prompt
    assert services.job_config(job) == GRPOConfig(**job.config)
    # A later change of the dataclass's defaults cannot change what this job ran with: the values are its own.
    assert services.job_config(job).to_dict() == job.config


def test_an_older_jobs_partial_config_reads_back_the_same(world):
    """Jobs made before the config was stored whole hold only the fields set (plus the recipe): the one
    reader resolves them as the trainer does, so the page, the API and the gate's command line agree."""
    for algorithm, partial in [("grpo", {"learning_rate": 1e-3, "num_generations_per_prompt": 8}),
                               ("dpo", {"max_steps": 20})]:
        jobs = [TrainingJob.objects.create(
            project=world["project"], task_set_version=world["train"], holdout_version=world["holdout"],
            base_version=world["production"], algorithm=algorithm, config=config, status=JobStatus.SUCCEEDED)
            for config in (partial, resolve_config(partial, algorithm).to_dict())]
        old, new = jobs
        assert services.job_config(old) == services.job_config(new)
        assert comparison.resolved_config(algorithm=algorithm, config=old.config) == comparison.resolved_config(
            algorithm=algorithm, config=new.config)
        suite, out = Path("holdout.jsonl"), Path("production-holdout.jsonl")
        assert services._evaluate_command(old, "holdout", suite, out) == services._evaluate_command(
            new, "holdout", suite, out)
    assert services.job_config(old).beta == 0.1  # dpo's own default, not GRPO's


def test_config_errors_come_from_the_trainers_check_named_by_field(world):
    with pytest.raises(ValidationError) as exc:
        services.job_create(project=world["project"], task_set_version=world["train"],
                            config={"learning_rate": "fast", "max_steps": 2.5, "bf16": 1, "lr": 1})
    assert exc.value.message_dict == {"config.lr": ["config.lr is not a GRPOConfig field"]}
    with pytest.raises(ValidationError) as exc:
        services.job_create(project=world["project"], task_set_version=world["train"],
                            config={"learning_rate": "fast", "max_steps": 2.5, "bf16": 1})
    assert exc.value.message_dict == {
        "config.learning_rate": ["config.learning_rate must be a number, got 'fast'"],
        "config.max_steps": ["config.max_steps must be an integer, got 2.5"],
        "config.bf16": ["config.bf16 must be true or false, got 1"],
    }
    with pytest.raises(ValidationError) as exc:
        services.job_create(project=world["project"], task_set_version=world["train"],
                            config={"learning_rate": 0})
    assert exc.value.message_dict == {"config.learning_rate": ["config.learning_rate must be > 0, got 0.0"]}
    assert not TrainingJob.objects.exists()


def test_the_form_reads_text_into_values_and_passes_them_through_the_same_check(world):
    post = {"cfg_learning_rate": "5e-4", "cfg_max_turns": "null", "cfg_bf16": "False", "cfg_loss_type": "dapo",
            "cfg_target_modules": '["q_proj", "v_proj"]', "cfg_epsilon": ".1", "cfg_max_steps": ""}
    values, errors = forms.config_from_post(post)
    assert errors == {}
    assert values == {"learning_rate": 5e-4, "max_turns": None, "bf16": False, "loss_type": "dapo",
                      "target_modules": ["q_proj", "v_proj"], "epsilon": 0.1}
    values, errors = forms.config_from_post({"cfg_max_steps": "ten", "cfg_warmup_ratio": "2", "cfg_bf16": "yes",
                                             "cfg_target_modules": "q_proj"})
    assert errors == {"max_steps": "config.max_steps must be an integer, got 'ten'",
                      "bf16": "config.bf16 must be true or false, got 'yes'",
                      "target_modules": "config.target_modules must be a list of strings, got 'q_proj'"}
    # Ranges too, once the types are right; dpo's own rules with dpo.
    assert forms.config_from_post({"cfg_warmup_ratio": "2"})[1] == {
        "warmup_ratio": "config.warmup_ratio must be in [0, 1], got 2.0"}
    assert forms.config_from_post({"cfg_beta": "0"}, algorithm="dpo")[1] == {
        "beta": "config.beta (the DPO temperature) must be > 0, got 0.0"}


def test_the_page_shows_the_trainers_message_beside_the_field(world, client_for):
    url = reverse("training_job_new", args=[world["project"].slug])
    response = client_for(world["user"]).post(url, {"task_set_version": world["train"].pk,
                                                    "cfg_learning_rate": "fast", "cfg_epsilon": "1.5"})
    html = response.content.decode()
    assert response.status_code == 422
    assert "config.learning_rate must be a number, got &#x27;fast&#x27;" in html
    assert 'value="fast"' in html  # what was typed stays in the input
    assert not TrainingJob.objects.exists()


def test_eval_runs_default_to_grpoconfigs_evaluation_settings(world):
    from flywheel.evals.runs import eval_run_create

    run = eval_run_create(project=world["project"], model_version=world["production"],
                          suite_version=world["holdout"], user=world["user"])
    assert run.samples == GRPOConfig().eval_samples_per_prompt
    # A regression suite is sampled as a job samples it for the gate: more, so the rule can see a case fall.
    regression = frozen_version(EvalSuiteVersion, EvalSuite, ticket_rows("r", 2), project=world["project"],
                                name="regression", kind="regression")
    run = eval_run_create(project=world["project"], model_version=world["production"], suite_version=regression,
                          user=world["user"])
    assert run.samples == GRPOConfig().regression_samples_per_prompt > GRPOConfig().eval_samples_per_prompt


def test_a_refused_form_opens_with_a_summary_that_links_each_field(world, client_for):
    url = reverse("training_job_new", args=[world["project"].slug])
    response = client_for(world["user"]).post(url, {"task_set_version": "x", "num_gpus": "two",
                                                    "cfg_learning_rate": "fast"})
    assert response.status_code == 422
    html = response.content.decode()
    summary = html.split('id="job-errors"')[1].split("</div>")[0]
    assert "The job was not started: 3 fields to correct." in summary
    assert '<a href="#task-set-version">Train on</a>: Choose one from the list.' in summary
    assert '<a href="#num-gpus">GPUs</a>: A whole number of GPUs.' in summary
    assert '<a href="#cfg-learning_rate">learning_rate</a>: config.learning_rate must be a number' in summary
    # The summary comes before the list of jobs, at the top of the page.
    assert html.index('id="job-errors"') < html.index('id="jobs"')


def test_the_forms_address_fetched_goes_to_the_form_instead_of_a_blank_405(world, client_for):
    url = reverse("training_job_new", args=[world["project"].slug])
    response = client_for(world["user"]).get(url + "?task_set_version=3")
    assert response.status_code == 302
    assert response["Location"] == reverse("training_jobs", args=[world["project"].slug]) + "?task_set_version=3#new-job"
