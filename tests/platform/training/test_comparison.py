"""The settings a job ran with, jobs compared side by side, and the training and eval-comparison pages' query
counts, which must not grow with the rows they show.

Jobs are made with the ORM (no trainer run): their config merged by `config_check` as `job_create` stores it,
eval events as the trainer prints them, and gate decisions with the report `gate_evaluate` writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.test.utils import CaptureQueriesContext

from flywheel.evals.run_models import EvalCaseResult, EvalRun
from flywheel.registry import services as registry
from flywheel.registry.gate import CaseResult, GateRules, gate_evaluate
from flywheel.registry.models import GateDecision
from flywheel.training import comparison, services
from flywheel.training.models import JobEvent, JobStatus, TrainingJob
from tests.platform.training.worlds import tickets_world


@pytest.fixture
def world(project, user, tmp_path: Path):
    return tickets_world(project, user, tmp_path / "tiny", holdout_cases=8)


def _job(world, config: dict, *, algorithm: str = "grpo", evals: dict[int, float] | None = None,
         passed: bool | None = None, rules: dict | None = None) -> TrainingJob:
    """A finished job: its config stored as job_create stores it, holdout evals, and a gate decision (when
    `passed` is not None) on eight cases where production passes three."""
    merged = services.config_check(algorithm=algorithm, config=config, project=world["project"])
    job = TrainingJob.objects.create(
        project=world["project"], task_set_version=world["train"], holdout_version=world["holdout"],
        base_version=world["production"], algorithm=algorithm, config=merged, status=JobStatus.SUCCEEDED,
        step=merged.get("max_steps", 100), max_steps=merged.get("max_steps", 100), created_by=world["user"],
        advice={"metrics": {"success_rate": 0.375}},
    )
    for step, success in (evals or {}).items():
        JobEvent.objects.create(job=job, attempt=1, kind="eval", step=step,
                                data={"split": "holdout", "metrics": {"success_rate": success}})
        JobEvent.objects.create(job=job, attempt=1, kind="step", step=step, data={"reward_mean": success})
    if passed is not None:
        candidate = registry.model_version_create(project=world["project"], base=world["production"].base)
        production = [CaseResult(f"case-{i}", passes=1.0 if i < 3 else 0.0) for i in range(8)]
        wins = 8 if passed else 3
        judged = [CaseResult(f"case-{i}", passes=1.0 if i < wins else 0.0) for i in range(8)]
        # Eight cases of one sample show a gain of 0.6 at most; no regression suite in this world.
        gate_rules = GateRules.from_dict({"require_regression": False, "expected_gain": 0.6, **(rules or {})})
        report = gate_evaluate(production=production, candidate=judged, rules=gate_rules)
        assert report.passed is passed
        GateDecision.objects.create(project=world["project"], job=job, candidate=candidate,
                                    production=world["production"], passed=report.passed, rules=gate_rules.__dict__,
                                    report=report.to_dict())
        job.candidate_version = candidate
        job.save(update_fields=["candidate_version"])
    return job


def _row(rows: list[dict], name: str) -> dict:
    return next(r for r in rows if r["name"] == name)


def test_a_jobs_settings_list_every_config_field_resolved_with_the_defaults_marked(world):
    from dataclasses import fields

    from trainer.config import GRPOConfig

    job = _job(world, {"learning_rate": 1e-3, "max_steps": 30, "loss_type": "dapo"})
    settings = comparison.job_settings(job=job, project_rules={"confidence": 0.9})
    config = settings["config"]
    assert [r["name"] for r in config] == [f.name for f in fields(GRPOConfig)]
    lr = _row(config, "learning_rate")
    assert (lr["value"], lr["default"], lr["is_default"]) == (1e-3, 1e-5, False)
    assert _row(config, "temperature") == {**_row(config, "temperature"), "value": 1.0, "is_default": True}
    # The field's recipe (8 samples a prompt) was merged in by job_create: stored, so shown as what it ran with.
    assert _row(config, "num_generations_per_prompt")["value"] == 8
    # None means "worked out": the page says what the trainer used (DAPO's clip-higher, its dynamic sampling).
    assert _row(config, "epsilon_high")["resolved"] == 0.28
    assert _row(config, "dynamic_sampling")["resolved"] is True
    assert _row(config, "lr_scheduler_type")["resolved"] == "constant"
    assert settings["set_count"] == sum(not r["is_default"] for r in config) >= 3
    assert [v["name"] for v in settings["versions"]] == ["task_set_version", "holdout_version", "regression_version",
                                                         "base_version"]
    assert settings["versions"][0]["value"].startswith("tickets v1 · 6 rows · ")
    # Named as the API names versioned things: the collection's id and the version's number.
    assert (settings["versions"][0]["task_set"], settings["versions"][0]["task_set_version"]) == (
        job.task_set_version.task_set_id, job.task_set_version.number)
    # Not judged yet: the project's rules now, each marked against GateRules' defaults.
    assert settings["gate_rules_judged"] is False
    confidence = _row(settings["gate_rules"], "confidence")
    assert (confidence["value"], confidence["default"], confidence["is_default"]) == (0.9, 0.95, False)
    assert _row(settings["gate_rules"], "test")["is_default"] is True


def test_an_algorithms_own_defaults_count_as_defaults_and_an_unknown_stored_key_is_shown(world):
    job = _job(world, {}, algorithm="dpo")
    config = comparison.resolved_config(algorithm="dpo", config={**job.config, "retired_knob": 3})
    assert _row(config, "beta") == {**_row(config, "beta"), "value": 0.1, "default": 0.1, "is_default": True}
    assert _row(config, "loss_type")["value"] == "sigmoid" and _row(config, "loss_type")["is_default"]
    assert _row(config, "retired_knob")["help"].startswith("Not a field")


def test_the_job_page_shows_the_settings_and_the_rules_it_was_judged_by(world, client_for):
    job = _job(world, {"learning_rate": 2e-3, "max_steps": 20}, evals={10: 0.5, 20: 0.625}, passed=True,
               rules={"test": "mcnemar"})
    page = client_for(world["user"]).get(f"/p/{world['project'].slug}/training/{job.pk}/").content.decode()
    assert 'id="settings"' in page
    assert 'data-setting="learning_rate"' in page and "0.002" in page and "default 1e-05" in page
    assert "The gate's rules it was judged by" in page
    assert 'data-setting="test"' in page and "mcnemar" in page


def test_compare_jobs_puts_settings_side_by_side_with_curves_and_gate_outcomes(world):
    a = _job(world, {"learning_rate": 1e-3, "max_steps": 20}, evals={10: 0.5, 20: 0.75}, passed=True)
    b = _job(world, {"learning_rate": 2e-3, "max_steps": 20}, evals={10: 0.375, 20: 0.5}, passed=False)
    c = _job(world, {"learning_rate": 1e-3, "max_steps": 20, "r": 8})  # not judged yet
    data = comparison.compare_jobs(project=world["project"], jobs=[a, b, c])
    json.dumps(data)  # the API serves it as it is

    assert [j["id"] for j in data["jobs"]] == [a.pk, b.pk, c.pk]
    lr = _row(data["settings"], "learning_rate")
    assert lr["values"] == [1e-3, 2e-3, 1e-3] and lr["differs"] and lr["defaults"] == [False, False, False]
    assert _row(data["settings"], "r")["values"] == [16, 16, 8] and _row(data["settings"], "r")["differs"]
    temperature = _row(data["settings"], "temperature")
    assert not temperature["differs"] and temperature["defaults"] == [True, True, True]
    assert not _row(data["data"], "task_set_version")["differs"]

    assert data["curves"][0] == {"job": a.pk, "step": [10, 20], "success_rate": [0.5, 0.75],
                                 "production_success": 0.375}
    assert data["curves"][2]["step"] == []
    gates = data["gates"]
    assert gates[0]["passed"] is True and gates[1]["passed"] is False and gates[2] is None
    assert gates[0]["production_success"] == pytest.approx(0.375) and gates[0]["candidate_success"] == 1.0
    assert gates[0]["cases"] == 8
    success = next(r for r in data["gate_outcomes"] if "success" in r["name"])
    assert [cell["passed"] if cell else None for cell in success["cells"]] == [True, False, None]
    assert data["gate_rules_judged"] == [True, True, False]


def test_compare_jobs_refuses_fewer_than_two_a_repeat_and_another_projects_job(world, make_project):
    a = _job(world, {})
    b = _job(world, {})
    with pytest.raises(ValidationError) as one:
        comparison.compare_jobs(project=world["project"], jobs=[a])
    assert "ids" in one.value.message_dict
    with pytest.raises(ValidationError, match="twice"):
        comparison.compare_jobs(project=world["project"], jobs=[a, a])
    other = make_project(owner=world["user"])
    with pytest.raises(ValidationError) as foreign:
        comparison.compare_jobs(project=other, jobs=[a, b])
    assert f"No job {a.pk}, {b.pk} in this project" in foreign.value.message_dict["ids"][0]


def test_the_comparison_page_checks_who_asks_and_which_project(world, client_for, make_user, make_project,
                                                               make_membership):
    a = _job(world, {"learning_rate": 1e-3}, evals={10: 0.5}, passed=True)
    b = _job(world, {"learning_rate": 2e-3}, evals={10: 0.25}, passed=False)
    slug = world["project"].slug
    url = f"/p/{slug}/training/compare?ids={a.pk}&ids={b.pk}"
    viewer = make_user()
    make_membership(viewer, world["project"], "viewer")
    page = client_for(viewer).get(url)
    assert page.status_code == 200
    html = page.content.decode()
    assert 'class="differs" data-setting="learning_rate"' in html
    assert 'data-verdict="passed"' in html and 'data-verdict="refused"' in html
    assert 'id="compare-curves-data"' in html and "vendor/uplot/uPlot.iife.min.js" in html

    assert client_for(make_user()).get(url).status_code == 404  # not a member
    assert client_for(None).get(url).status_code == 302  # to the login page
    # A job of another project, even one the user may see there, is not in this one.
    other = make_project(owner=world["user"])
    foreign = TrainingJob.objects.create(project=other, task_set_version=world["train"],
                                         base_version=world["production"])
    member = client_for(world["user"])
    assert member.get(f"/p/{slug}/training/compare?ids={a.pk}&ids={foreign.pk}").status_code == 404
    assert member.get(f"/p/{other.slug}/training/compare?ids={a.pk}&ids={b.pk}").status_code == 404
    assert member.get(f"/p/{slug}/training/compare?ids={a.pk},{b.pk}").status_code == 200
    one = member.get(f"/p/{slug}/training/compare?ids={a.pk}")
    assert one.status_code == 400 and "Choose two or more jobs" in one.content.decode()
    bad = member.get(f"/p/{slug}/training/compare?ids={a.pk}&ids=x1")
    assert bad.status_code == 400 and "is not a job number" in bad.content.decode()


def test_the_list_offers_the_comparison(world, client_for):
    a, b = _job(world, {}), _job(world, {})
    html = client_for(world["user"]).get(f"/p/{world['project'].slug}/training/").content.decode()
    assert f'name="ids" value="{a.pk}"' in html and f'name="ids" value="{b.pk}"' in html
    assert 'id="compare-jobs"' in html and f'action="/p/{world["project"].slug}/training/compare"' in html


# --- query counts: the pages read a fixed number of queries whatever the number of rows --------------------------


def _queries(client, url: str) -> int:
    client.get(url)  # the first request of a test may fill caches (content types, the session)
    with CaptureQueriesContext(connection) as captured:
        response = client.get(url)
    assert response.status_code == 200, url
    return len(captured.captured_queries)


def test_compare_jobs_reads_the_same_queries_for_two_jobs_as_for_six(world):
    jobs = [_job(world, {"learning_rate": 1e-3 * (i + 1)}, evals={10: 0.5, 20: 0.6}, passed=i % 2 == 0)
            for i in range(6)]
    counts = []
    for n in (2, 6):
        with CaptureQueriesContext(connection) as captured:
            comparison.compare_jobs(project=world["project"], jobs=jobs[:n])
        counts.append(len(captured.captured_queries))
    assert counts[0] == counts[1], counts


def test_the_training_pages_queries_do_not_grow_with_jobs_events_or_the_jobs_compared(world, client_for):
    client = client_for(world["user"])
    slug = world["project"].slug
    first = _job(world, {}, evals={10: 0.5}, passed=True)
    second = _job(world, {}, evals={10: 0.5}, passed=False)
    few = {"list": _queries(client, f"/p/{slug}/training/"),
           "job": _queries(client, f"/p/{slug}/training/{first.pk}/"),
           "compare": _queries(client, f"/p/{slug}/training/compare?ids={first.pk}&ids={second.pk}")}
    more = [_job(world, {"r": 8}, evals={s: 0.5 for s in range(10, 110, 10)}, passed=True) for _ in range(5)]
    JobEvent.objects.bulk_create([JobEvent(job=first, kind="step", step=s, data={"reward_mean": 0.1})
                                  for s in range(1, 200)])
    ids = "&".join(f"ids={j.pk}" for j in (first, second, *more))
    many = {"list": _queries(client, f"/p/{slug}/training/"),
            "job": _queries(client, f"/p/{slug}/training/{first.pk}/"),
            "compare": _queries(client, f"/p/{slug}/training/compare?{ids}")}
    assert few == many


def test_the_eval_comparison_reads_the_same_queries_for_ten_cases_as_for_sixty(world, client_for):
    client = client_for(world["user"])
    counts = []
    for n in (10, 60):
        runs = [EvalRun.objects.create(project=world["project"], model_version=world["production"],
                                       suite_version=world["holdout"], status="succeeded") for _ in range(2)]
        for k, run in enumerate(runs):
            EvalCaseResult.objects.bulk_create([
                EvalCaseResult(run=run, case_id=f"case-{i}", passed=(i + k) % 2 == 0, pass_rate=float((i + k) % 2),
                               output=f"close_ticket({{\"id\": {i}}})") for i in range(n)])
        counts.append(_queries(client, f"/p/{world['project'].slug}/evals/runs/compare?a={runs[0].pk}&b={runs[1].pk}"))
    assert counts[0] == counts[1], counts
