"""Jobs compared in real Chromium: a member checks two jobs on the training list, presses Compare, and sees the
settings that differ highlighted, both jobs' holdout curves drawn on one chart by uPlot (served by the app),
and each job's gate outcome; the job page shows the settings it ran with.

Jobs are made with the ORM (no trainer run): configs merged by `config_check` as `job_create` stores them,
holdout evals as the trainer prints them, and gate decisions with the report `gate_evaluate` writes."""

from __future__ import annotations

import os
from pathlib import Path

from playwright.sync_api import expect

from flywheel.environments.models import TaskSet, TaskSetVersion
from flywheel.evals import rows as row_shape
from flywheel.evals.models import EvalSuite, EvalSuiteVersion
from flywheel.registry import services as registry
from flywheel.registry.gate import CaseResult, GateRules, gate_evaluate
from flywheel.registry.models import GateDecision
from flywheel.training import services
from flywheel.training.models import JobEvent, JobStatus, TrainingJob

# The first two series colours of training_compare.js.
JOB_COLOURS = [(47, 95, 208), (217, 72, 15)]


def rows(prefix: str, n: int) -> list[dict]:
    tools = [{"type": "function", "function": {"name": "close_ticket", "parameters": {"type": "object"}}}]
    return [{"id": f"{prefix}-{i}", "messages": [{"role": "user", "content": f"Close ticket {i}."}], "tools": tools,
             "verifier": {"type": "tool_call", "expected_calls": [{"name": "close_ticket", "arguments": {"id": i}}]}}
            for i in range(n)]


def version(model, owner, data: list[dict], **owner_fields):
    collection = owner.objects.create(**owner_fields)
    key = "task_set" if model is TaskSetVersion else "suite"
    return model.objects.create(**{key: collection}, number=1, rows=data, size=len(data),
                                content_hash=row_shape.content_hash(data))


def finished_job(w: dict, config: dict, evals: dict[int, float], wins: int) -> TrainingJob:
    """A job with holdout evals and a gate decision: the candidate passes `wins` of 8 cases, production 3."""
    merged = services.config_check(algorithm="grpo", config=config, project=w["project"])
    candidate = registry.model_version_create(project=w["project"], base=w["production"].base)
    job = TrainingJob.objects.create(
        project=w["project"], task_set_version=w["train"], holdout_version=w["holdout"], base_version=w["production"],
        candidate_version=candidate, config=merged, status=JobStatus.SUCCEEDED, step=merged["max_steps"],
        max_steps=merged["max_steps"], created_by=w["user"], advice={"metrics": {"success_rate": 0.375}},
    )
    for step, success in evals.items():
        JobEvent.objects.create(job=job, attempt=1, kind="eval", step=step,
                                data={"split": "holdout", "metrics": {"success_rate": success}})
    rules = GateRules.from_dict({"require_regression": False, "expected_gain": 0.6})
    report = gate_evaluate(production=[CaseResult(f"case-{i}", passes=float(i < 3)) for i in range(8)],
                           candidate=[CaseResult(f"case-{i}", passes=float(i < wins)) for i in range(8)], rules=rules)
    GateDecision.objects.create(project=w["project"], job=job, candidate=candidate, production=w["production"],
                                passed=report.passed, rules=rules.__dict__, report=report.to_dict())
    return job


def shot(page, name: str) -> None:
    folder = os.environ.get("FLYWHEEL_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / name), full_page=True)


def colour_pixels(page, selector: str, rgb: tuple[int, int, int]) -> int:
    """Canvas pixels of one colour: whether that series' line was drawn."""
    return page.locator(selector).evaluate("""(c, rgb) => {
        const data = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < data.length; i += 4) {
          if (Math.abs(data[i] - rgb[0]) < 12 && Math.abs(data[i + 1] - rgb[1]) < 12
              && Math.abs(data[i + 2] - rgb[2]) < 12 && data[i + 3] > 200) n++;
        }
        return n;
    }""", list(rgb))


def test_a_member_compares_two_jobs_and_reads_a_jobs_settings(open_page, project, user, make_user,
                                                               make_membership, tmp_path):
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    w = {"project": project, "user": user,
         "production": registry.base_model_register(project=project, name="tiny", path=str(folder), user=user),
         "train": version(TaskSetVersion, TaskSet, rows("task", 6), project=project, name="tickets"),
         "holdout": version(EvalSuiteVersion, EvalSuite, rows("case", 8), project=project, name="holdout",
                            kind="holdout")}
    fast = finished_job(w, {"learning_rate": 2e-3, "max_steps": 30}, {10: 0.5, 20: 0.75, 30: 0.875}, wins=8)
    slow = finished_job(w, {"learning_rate": 1e-4, "max_steps": 30}, {10: 0.375, 20: 0.375, 30: 0.5}, wins=4)
    finished_job(w, {"learning_rate": 1e-3, "max_steps": 30}, {30: 0.5}, wins=3)  # listed, not compared
    viewer = make_user()
    make_membership(viewer, project, "viewer")

    page = open_page(viewer)
    page.goto(f"/p/{project.slug}/training/")
    page.check(f"#compare-{fast.pk}")
    page.check(f"#compare-{slow.pk}")
    page.click("#compare-jobs")
    page.wait_for_url(f"**/training/compare?ids={slow.pk}&ids={fast.pk}")  # the list's order, newest first
    expect(page.locator("h1")).to_have_text(f"Jobs {slow.pk}, {fast.pk} compared")

    differs = page.locator("#settings-table tr.differs")
    expect(differs).to_have_count(1)
    expect(differs.first).to_have_attribute("data-setting", "learning_rate")
    expect(differs.first.locator("td")).to_have_text(["learning_rate", "0.0001", "0.002"])
    # What they share is there too, behind one click.
    page.click("#settings-same summary")
    expect(page.locator('#settings-same tr[data-setting="max_steps"] td').nth(1)).to_have_text("30")

    canvas = page.locator(".compare-chart canvas")
    expect(canvas).to_have_count(1)
    legend = page.locator(".compare-chart .u-legend .u-series th")
    expect(legend).to_contain_text([f"job {slow.pk}", f"job {fast.pk}", "production before training"])
    for rgb in JOB_COLOURS:
        assert colour_pixels(page, ".compare-chart canvas", rgb) > 30, f"no line in {rgb}"

    verdicts = page.locator("#gate-table [data-verdict]")
    expect(verdicts).to_have_text(["refused", "passed"])
    success = page.locator('#gate-table tr[data-rule="holdout success"] td')
    expect(success.nth(2)).to_contain_text("pass")
    expect(success.nth(2)).to_contain_text("0.375 → 1")
    shot(page, "training-compare.png")
    assert not page.log.console_errors and not page.log.page_errors, (page.log.console_errors, page.log.page_errors)
    assert not page.log.failed_requests, page.log.failed_requests

    page.click(f"#settings-table thead a:text('job {fast.pk}')")
    page.wait_for_url(f"**/training/{fast.pk}/")
    settings = page.locator("#settings")
    expect(settings.locator('#settings-config [data-setting="learning_rate"] dd')).to_contain_text("0.002")
    expect(settings.locator('#settings-config [data-setting="learning_rate"] dd')).to_contain_text("default 1e-05")
    expect(settings.locator("#settings-config-defaults")).not_to_have_attribute("open", "")
    settings.locator("#settings-config-defaults summary").click()
    expect(settings.locator('#settings-config-defaults [data-setting="temperature"] .badge')).to_have_text("default")
    expect(settings.locator('#settings-gate-rules [data-setting="expected_gain"] dd')).to_contain_text("0.6")
    expect(settings).to_contain_text("The gate's rules it was judged by")
    shot(page, "training-job-settings.png")
    assert not page.log.console_errors and not page.log.page_errors
