"""Scratch: screenshots of every training page state (not part of the suite; removed after review)."""
import importlib.util
import os
from datetime import timedelta
from pathlib import Path

from django.utils import timezone
from playwright.sync_api import expect

spec = importlib.util.spec_from_file_location("ttb", Path(__file__).with_name("test_training_browser.py"))
ttb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ttb)

from flywheel.training import services as training
from flywheel.training.models import JobEvent, JobStatus, TrainingJob, Checkpoint

OUT = Path(os.environ.get("FLYWHEEL_SCREENSHOTS", "/tmp/shots_h"))


def snap(page, name):
    page.screenshot(path=str(OUT / name), full_page=True)


def canvases(page):
    return page.locator(".job-chart canvas").evaluate_all("cs => cs.map(c => [c.width, c.height])")


def test_tour(open_page, project, user, tmp_path):
    w = ttb.world(project, user, tmp_path)
    done = ttb.finished_job(project, user, w)
    now = timezone.now()
    # running
    running = TrainingJob.objects.create(project=project, task_set_version=w["train"], holdout_version=w["holdout"],
        regression_version=w["regression"], base_version=w["production"], status=JobStatus.RUNNING, step=14,
        max_steps=40, config={**training.RECIPE, "max_steps": 40}, attempt=1, created_by=user,
        advice=training.advise(ttb.BASELINE), started_at=now, heartbeat_at=now, worker="gpu-0:1234")
    ttb.steps_and_evals(running, upto=14, evals={5: 0.5, 10: 0.3333}, hacked=True)
    # failed
    failed = TrainingJob.objects.create(project=project, task_set_version=w["train"], holdout_version=w["holdout"],
        base_version=w["production"], status=JobStatus.FAILED, step=7, failed_step=7, max_steps=30, attempt=1,
        config=training.RECIPE, created_by=user, advice=training.advise(ttb.BASELINE), started_at=now,
        finished_at=now,
        error="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity; 77.02 GiB already allocated; 1.12 GiB free; 77.80 GiB reserved in total by PyTorch) If reserved memory is >> allocated memory try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.\n  File \"/srv/trainer/loop.py\", line 212, in train_grpo\n    loss.backward()\n<script>alert(1)</script>")
    ttb.steps_and_evals(failed, upto=7, evals={5: 0.45})
    JobEvent.objects.create(job=failed, kind="failed", step=7, data={"message": failed.error})
    # ready
    ready = TrainingJob.objects.create(project=project, task_set_version=w["train"], holdout_version=w["holdout"],
        base_version=w["production"], status=JobStatus.READY, max_steps=30, config=training.RECIPE, created_by=user,
        advice=training.advise({"success_rate": 0.02, "invalid_output_rate": 0.7, "unsafe_action_rate": 0.0, "n": 96,
                                "failures": {"invalid_format": 70, "wrong_tool": 24}}, pairs=6))
    JobEvent.objects.create(job=ready, kind="created", data={"by": user.get_username()})
    JobEvent.objects.create(job=ready, kind="advice", data=ready.advice)

    page = open_page(user)
    page.goto(f"/p/{project.slug}/training/")
    page.click("summary")
    snap(page, "jobs-advanced.png")
    page.goto(f"/p/{project.slug}/training/{ready.pk}/")
    expect(page.locator(".job-charts-empty")).to_be_visible()
    snap(page, "job-ready.png")
    page.goto(f"/p/{project.slug}/training/{running.pk}/")
    expect(page.locator(".job-chart canvas")).to_have_count(4)
    print("running canvases", canvases(page))
    snap(page, "job-running.png")
    page.goto(f"/p/{project.slug}/training/{failed.pk}/")
    expect(page.locator(".job-chart canvas")).to_have_count(4)
    snap(page, "job-failed.png")
    page.goto(f"/p/{project.slug}/training/{done.pk}/")
    expect(page.locator(".job-chart canvas")).to_have_count(4)
    snap(page, "job-succeeded.png")
    page.goto(f"/p/{project.slug}/models/gate/{done.gate_decisions.first().pk}/")
    snap(page, "gate.png")
    page.goto(f"/p/{project.slug}/training/{running.pk}/checkpoints/10/")
    snap(page, "checkpoint-running-10.png")
    page.goto(f"/p/{project.slug}/training/{done.pk}/checkpoints/30/")
    snap(page, "checkpoint-30.png")
    page.goto(f"/p/{project.slug}/training/{done.pk}/checkpoints/20/")
    snap(page, "checkpoint-20.png")
    page.goto(f"/p/{project.slug}/models/")
    snap(page, "models.png")
    page.set_viewport_size({"width": 800, "height": 900})
    page.goto(f"/p/{project.slug}/training/{done.pk}/")
    expect(page.locator(".job-chart canvas")).to_have_count(4)
    snap(page, "job-narrow.png")
    print("console", page.log.console_errors, page.log.page_errors, page.log.failed_requests)
    assert not page.log.console_errors and not page.log.page_errors


spec2 = importlib.util.spec_from_file_location("tdash", Path(__file__).parents[1] / "platform/registry/test_dashboard.py")
tdash = importlib.util.module_from_spec(spec2)
spec2.loader.exec_module(tdash)


def test_dashboard_tour(open_page, project, user, make_project):
    data = tdash.loop._get_wrapped_function()(project, user, make_project)
    from flywheel.evals.models import EvalCaseResult, EvalRun, EvalSuiteVersion
    sv = EvalSuiteVersion.objects.create(suite=data["holdout"], number=1, rows=[], size=0, content_hash="0" * 64)
    a, b = data["modes"]
    for v, res in ((data["versions"][0], [(a, 0), (a, 0), (a, 1), (b, 0)]), (data["versions"][1], [(a, 1), (a, 1), (a, 1), (b, 0)]),
                   (data["versions"][2], [(a, 1), (a, 0), (a, 1), (b, 1)])):
        r = EvalRun.objects.create(project=project, model_version=v, suite_version=sv, status="succeeded")
        for i, (m, p) in enumerate(res):
            EvalCaseResult.objects.create(run=r, case_id=f"c{i}", passed=bool(p), pass_rate=float(p), failure_mode_id=m.pk)
    page = open_page(user)
    page.goto(f"/p/{project.slug}/dashboard/")
    snap(page, "dashboard.png")
    page.goto(f"/p/{project.slug}/dashboard/?version=3&trajectory={data['t'][3].pk}#forward")
    snap(page, "dashboard-v3.png")
    page.set_viewport_size({"width": 800, "height": 900})
    page.goto(f"/p/{project.slug}/dashboard/")
    snap(page, "dashboard-narrow.png")
    print("console", page.log.console_errors, page.log.page_errors, page.log.failed_requests)
    assert page.evaluate("window.__pwned") is None
    assert not page.log.console_errors and not page.log.page_errors
