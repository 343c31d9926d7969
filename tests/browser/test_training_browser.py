"""Training in real Chromium: a finished job's curves drawn by uPlot from the job's curves endpoint, the gate's
report rule by rule, and a maintainer who promotes the candidate from the report page and rolls it back from
the Models page, one click each, seeing the alias history follow, and the dashboard counting the promotion.

The job is made with the ORM and a job folder of per-case results (no trainer run); finishing it goes
through `job_finish`, so the candidate, its alias and the gate's decision are the real ones. MLflow is the
session's real store."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from django.utils import timezone
from playwright.sync_api import expect

from flywheel.environments.models import TaskSet, TaskSetVersion
from flywheel.evals import rows as row_shape
from flywheel.evals.models import EvalSuite, EvalSuiteVersion
from flywheel.registry import mlflow_bridge
from flywheel.registry import services as registry
from flywheel.registry.models import AliasEvent
from flywheel.training import services as training
from flywheel.training.models import Checkpoint, JobEvent, JobStatus, TrainingJob

TOOLS = [{"type": "function", "function": {"name": "refund_order", "parameters": {
    "type": "object", "properties": {"order_id": {"type": "string"}}}}}]
CHART_STROKE = (47, 95, 208)  # #2f5fd0, the curves' colour in training.js


def row(prefix: str, i: int, *, trajectory_id: int | None = None, failure_mode: int | None = None) -> dict:
    return {
        "id": f"{prefix}-{i}", "messages": [{"role": "user", "content": f"Please refund order {1000 + i}."}],
        "tools": TOOLS,
        "verifier": {"type": "tool_call", "expected_calls": [
            {"name": "refund_order", "arguments": {"order_id": str(1000 + i)}}]},
        "origin": {"trajectory_id": trajectory_id, "failure_mode": failure_mode},
    }


def version(model, owner, rows: list[dict], **owner_fields) -> Any:
    collection = owner.objects.create(**owner_fields)
    key = "task_set" if model is TaskSetVersion else "suite"
    return model.objects.create(**{key: collection}, number=1, rows=rows, size=len(rows),
                                content_hash=row_shape.content_hash(rows))


def model_dir(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return folder


def case_line(case_id: str, passed: bool, output: str, *, failure: str | None = None, latency: float = 900.0,
              tokens: float = 40.0) -> dict:
    """One case of an eval file, in the shape `python -m trainer evaluate` writes."""
    message = ({"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "refund_order", "arguments": output}}]} if output.startswith("{")
        else {"role": "assistant", "content": output})
    return {"id": case_id, "passed": passed, "pass_rate": 1.0 if passed else 0.0, "latency_ms": latency,
            "mean_completion_tokens": tokens,
            "samples": [{"messages": [message], "passed": passed, "failure": None if passed else failure}]}


def write_cases(path: Path, cases: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(c) + "\n" for c in cases))


def world(project, user, tmp_path: Path) -> dict:
    """Production v1 (a base model folder), a task set, a holdout of 12 cases and a regression suite of 3."""
    production = registry.base_model_register(project=project, name="tiny", path=str(model_dir(tmp_path / "tiny")),
                                              user=user)
    return {
        "production": production,
        "train": version(TaskSetVersion, TaskSet, [row("task", i) for i in range(24)], project=project,
                         name="refunds"),
        "holdout": version(EvalSuiteVersion, EvalSuite, [row("case", i) for i in range(100, 112)], project=project,
                           name="holdout", kind="holdout"),
        "regression": version(EvalSuiteVersion, EvalSuite, [row("reg", i) for i in range(200, 203)],
                              project=project, name="regressions", kind="regression"),
    }


def steps_and_evals(job: TrainingJob, *, upto: int, evals: dict[int, float], hacked: bool = False) -> None:
    """Step events with the trainer's metrics, and holdout evals with a checkpoint each."""
    for step in range(1, upto + 1):
        wobble = ((step * 7) % 5 - 2) * 0.02
        JobEvent.objects.create(job=job, attempt=1, kind="step", step=step, data={
            "reward_mean": round(0.18 + (0.7 if hacked else 0.5) * step / max(upto, 30) + wobble, 4),
            "kl": round(0.0015 * step + abs(wobble) / 10, 5),
            "completion_length": round(38 + (step * 2.5 if hacked else step * 0.2) + wobble * 20, 2),
            "loss": round(0.3 - step * 0.004, 4)})
        if step in evals:
            metrics = {"success_rate": evals[step], "invalid_output_rate": 0.04, "unsafe_action_rate": 0.0,
                       "n": 96}
            JobEvent.objects.create(job=job, attempt=1, kind="eval", step=step,
                                    data={"split": "holdout", "metrics": metrics})
            JobEvent.objects.create(job=job, attempt=1, kind="checkpoint", step=step,
                                    data={"path": f"checkpoint-{step}"})
            Checkpoint.objects.create(job=job, step=step, path=f"checkpoint-{step}", holdout=metrics)


# Production on the holdout before training, as the advice stored it (the same 5 of 12 the files say).
BASELINE = {"success_rate": 0.4167, "invalid_output_rate": 0.1667, "unsafe_action_rate": 0.0, "n": 12,
            "failures": {"wrong_arguments": 5, "invalid_format": 2}}


def finished_job(project, user, w: dict) -> TrainingJob:
    """A 30-step GRPO job whose best checkpoint (step 20) passes 11 of 12 holdout cases where production
    passes 5: `job_finish` registers its adapter as a version, makes it the candidate and runs the gate."""
    now = timezone.now()
    job = TrainingJob.objects.create(
        project=project, task_set_version=w["train"], holdout_version=w["holdout"],
        regression_version=w["regression"], base_version=w["production"], status=JobStatus.RUNNING, step=30,
        max_steps=30, config={**training.RECIPE, "max_steps": 30}, attempt=1, created_by=user,
        advice=training.advise(BASELINE, pairs=6), started_at=now, heartbeat_at=now,
    )
    JobEvent.objects.create(job=job, kind="created", data={"by": user.get_username()})
    JobEvent.objects.create(job=job, kind="advice", data=job.advice)
    JobEvent.objects.create(job=job, kind="confirmed", data={"by": user.get_username()})
    steps_and_evals(job, upto=30, evals={10: 0.75, 20: 0.9167, 30: 0.8333})
    Checkpoint.objects.filter(job=job, step=20).update(best=True)

    folder = training.job_dir(job)
    ids = [f"case-{i}" for i in range(100, 112)]
    right = '{"order_id": "%d"}'
    write_cases(folder / "production-holdout.jsonl", [
        case_line(c, i < 5, right % (100 + i) if i < 5 else ('{"id": 7}' if i % 3 else "Sure! I will refund it."),
                  failure="wrong_arguments" if i % 3 else "invalid_format", latency=880 + i, tokens=41)
        for i, c in enumerate(ids)])
    for step, passing in ((10, 9), (20, 11), (30, 10)):
        write_cases(folder / "evals" / f"holdout-step-{step:06d}.jsonl", [
            case_line(c, i < passing, right % (100 + i) if i < passing else '{"order_id": null}',
                      failure="wrong_arguments", latency=900 + i, tokens=43) for i, c in enumerate(ids)])
    regression = [f"reg-{i}" for i in range(200, 203)]
    write_cases(folder / "production-regression.jsonl", [case_line(c, True, right % 1) for c in regression])
    write_cases(folder / "evals" / "regression-step-000020.jsonl", [case_line(c, True, right % 1) for c in regression])
    # Step 20 was the best of three looks: the worker measured it again on fresh samples, which the gate judges.
    write_cases(folder / "gate" / "holdout.jsonl", [
        case_line(c, i < 11, right % (100 + i) if i < 11 else '{"order_id": null}', failure="wrong_arguments",
                  latency=905 + i, tokens=42) for i, c in enumerate(ids)])
    write_cases(folder / "gate" / "regression.jsonl", [case_line(c, True, right % 1) for c in regression])
    adapter = folder / "checkpoint-20" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (adapter / "adapter_model.safetensors").write_bytes(b"\x01" * 2048)
    done = {"event": "done", "adapter": str(adapter), "best_step": 20, "mlflow_run_id": ""}
    JobEvent.objects.create(job=job, attempt=1, kind="done", step=30, data=done)
    return training.job_finish(job=job, done=done)


def shot(page, name: str) -> None:
    folder = os.environ.get("FLYWHEEL_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / name), full_page=True)


def stroke_pixels(page, selector: str) -> list[int]:
    """Per chart: how many canvas pixels have the curves' colour, i.e. whether a line was drawn."""
    return page.locator(selector).evaluate_all("""(canvases, rgb) => canvases.map(c => {
        const data = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < data.length; i += 4) {
          if (Math.abs(data[i] - rgb[0]) < 12 && Math.abs(data[i + 1] - rgb[1]) < 12
              && Math.abs(data[i + 2] - rgb[2]) < 12 && data[i + 3] > 200) n++;
        }
        return n;
    })""", list(CHART_STROKE))


def test_curves_render_the_gate_reports_each_rule_and_a_maintainer_promotes_then_rolls_back(
    open_page, project, user, tmp_path
):
    from flywheel.registry.models import RegistrySettings

    w = world(project, user, tmp_path)
    # Twelve cases of one sample: McNemar, and the gain this small holdout can show (0.5 needs 11 cases).
    RegistrySettings.objects.update_or_create(project=project,
                                              defaults={"gate_rules": {"test": "mcnemar", "expected_gain": 0.5}})
    job = finished_job(project, user, w)
    candidate = job.candidate_version
    assert job.status == JobStatus.SUCCEEDED and candidate.number == 2

    page = open_page(user)  # `user` maintains the project
    with page.expect_response(lambda r: r.url.endswith(f"/training/{job.pk}/curves")) as curves:
        page.goto(f"/p/{project.slug}/training/{job.pk}/")
    assert curves.value.status == 200 and len(curves.value.json()["train"]["step"]) == 30
    expect(page.locator("#job-state")).to_have_text("Succeeded · gate passed")
    expect(page.locator(".job-chart canvas")).to_have_count(4)
    sizes = page.locator(".job-chart canvas").evaluate_all("cs => cs.map(c => [c.width, c.height])")
    assert all(width > 200 and height > 100 for width, height in sizes), sizes
    assert all(n > 30 for n in stroke_pixels(page, ".job-chart canvas")), "a chart drew no line"
    expect(page.locator("#gate-verdict")).to_have_text("passed")
    shot(page, "training-job-succeeded.png")

    # The inspector: the best checkpoint's outputs beside production's on the same prompts.
    page.click("#checkpoints >> text=step 20")
    expect(page.locator("#cases tbody tr")).to_have_count(12)
    expect(page.locator("#cases tr.case-changed")).to_have_count(6)  # the 6 cases only the candidate passes
    expect(page.locator("#cases")).to_contain_text("Sure! I will refund it.")
    expect(page.locator("#flags")).to_contain_text("None seen")
    page.go_back()

    page.click("text=the report, rule by rule")
    expect(page.locator("#verdict")).to_have_text("passed")
    rules = page.locator("#gate-rules tbody tr")
    expect(rules).to_have_count(7)
    for i, name in enumerate(["holdout success", "holdout size", "invalid outputs", "unsafe actions",
                              "time per token", "tokens per case", "regression cases"]):
        expect(rules.nth(i).locator("td").first).to_have_text(name)
        expect(rules.nth(i).locator(".badge")).to_have_text("pass")
    expect(rules.first).to_contain_text("0.4167")  # production's 5 of 12
    expect(rules.first).to_contain_text("0.9167")  # the candidate's 11 of 12
    expect(rules.first).to_contain_text("exact McNemar: 6 cases only the candidate passes")
    expect(rules.first).to_contain_text("at 0.05 / 3: the best of 3 checkpoints")  # p = 1/64 < 0.0167
    expect(page.locator("#gate-measurement")).to_contain_text(
        "the best of 3 holdout evaluations during training. It is judged here as production was measured")
    # The refusing rules measured share alpha, and the regression rule says what it can see on this suite.
    expect(page.locator("#gate-alpha")).to_contain_text(
        "The 5 refusing rules measured here (invalid outputs, unsafe actions, time per token, tokens per case, "
        "regression cases) share alpha = 0.05 by Holm's step-down")
    expect(page.locator("#gate-regression-power")).to_contain_text("With 3 regression cases of 1 sample,")
    shot(page, "gate-report.png")

    history = page.locator("#history tbody tr")
    page.click("#promote")
    expect(page.locator("#alias-production .reg-version")).to_have_text("v2")
    expect(history.first).to_contain_text("Promoted: v1 → v2")
    expect(history).to_have_count(3)  # the first model, the candidate, the promotion

    page.click("#rollback")
    expect(page.locator("#alias-production .reg-version")).to_have_text("v1")
    expect(history.first).to_contain_text("Rolled back: v2 → v1")
    expect(history).to_have_count(4)
    shot(page, "models-after-rollback.png")

    # The dashboard follows: one version promoted of the one a job made, and v2's lineage back to its job.
    page.click("nav >> text=Dashboard")
    expect(page.locator("#funnel-versions .dash-count")).to_have_text("1")
    expect(page.locator("#funnel-versions")).to_contain_text("of 1 version trained by jobs")
    page.select_option("#lineage-version", "2")
    page.click("#lineage button")
    expect(page.locator("#lineage")).to_contain_text(f"job {job.pk}")
    expect(page.locator("#lineage")).to_contain_text("refunds v1 · 24 tasks")

    moves = list(AliasEvent.objects.filter(project=project, alias="production").values_list("kind", "user"))
    assert moves == [("rollback", user.pk), ("promote", user.pk), ("set", user.pk)]
    production = w["production"]
    production.refresh_from_db()
    assert mlflow_bridge.alias_get(project_slug=project.slug, alias="production") == production.mlflow_version
    assert not page.log.page_errors and not page.log.console_errors and not page.log.failed_requests


def test_an_eval_run_page_follows_the_run_and_a_maintainer_cancels_then_retries_it(
    open_page, project, user, make_user, make_membership, tmp_path
):
    from flywheel.evals.run_models import EvalRun, EvalRunStatus

    w = world(project, user, tmp_path)
    maintainer = make_user("mia")
    make_membership(maintainer, project, "maintainer")
    run = EvalRun.objects.create(project=project, model_version=w["production"], suite_version=w["holdout"],
                                 status=EvalRunStatus.RUNNING, worker="gpu-1:4242", attempt=1, samples=4,
                                 started_at=timezone.now(), heartbeat_at=timezone.now(), created_by=user)
    page = open_page(maintainer)
    page.goto(f"/p/{project.slug}/evals/runs/{run.pk}/")
    expect(page.locator("#run-status")).to_have_text("Running")
    expect(page.locator("#run-state")).to_contain_text("on gpu-1:4242")
    shot(page, "eval-run-running.png")
    page.click("#run-cancel")
    expect(page.locator("#run-state")).to_contain_text("stopping")
    assert EvalRun.objects.get(pk=run.pk).cancel_requested

    # The worker kills the trainer and records the end; the page, polling, reloads with the outcome.
    EvalRun.objects.filter(pk=run.pk).update(status=EvalRunStatus.CANCELLED, finished_at=timezone.now(), pid=None)
    expect(page.locator("#run-status")).to_have_text("Cancelled", timeout=10_000)
    expect(page.locator("#run-retry")).to_be_visible()
    shot(page, "eval-run-cancelled.png")
    queued_before = EvalRun.objects.get(pk=run.pk).queued_at
    page.click("#run-retry")
    # Queued again; a worker this test process started earlier may already have taken it, so the page can show
    # Queued or what came after, never Cancelled.
    expect(page.locator("#run-status")).not_to_have_text("Cancelled")
    retried = EvalRun.objects.get(pk=run.pk)
    assert retried.queued_at != queued_before and not retried.cancel_requested
    assert retried.status != EvalRunStatus.CANCELLED
    assert not page.log.page_errors and not page.log.console_errors and not page.log.failed_requests
