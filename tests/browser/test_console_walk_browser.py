"""Every page of both demo projects in real Chromium, with no console error and no Content-Security-Policy
violation: the pages are the project routes of the URLconf (the walk the access tests make), each of its
parameters naming a real object of the project, on the demo's own data (`demo_seed`: the support agent; the
loop demo played by the tiny model, `loop_demo_seed`, with a model in production, a finished job with a
checkpoint, a gate decision, an eval run). Also: the settings page after a key is created (an htmx swap)
and the 404 page. One browser context for the whole walk."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone

from flywheel.accounts.models import ApiKey, Project
from flywheel.accounts.services import api_key_create
from flywheel.environments.models import Task, TaskSet
from flywheel.evals.calibration_models import VerifierCalibration
from flywheel.evals.models import EvalCase, EvalSuite
from flywheel.evals.run_models import EvalRun
from flywheel.failures.clustering.models import ClusteringRun, ClusterSuggestion
from flywheel.failures.models import FailureMode, TaxonomyCategory
from flywheel.failures.services import failure_mode_create
from flywheel.registry import sequential
from flywheel.registry import services as registry
from flywheel.registry.demo import DEMO_MODEL_NAME
from flywheel.registry.models import BaseModel, GateDecision, LiveCheck, ModelVersion
from flywheel.seed.demo import ADMIN_USERNAME, demo_seed
from flywheel.training import services as training
from flywheel.training.demo import loop_demo_seed, loop_project
from flywheel.training.models import Checkpoint, JobEvent, JobStatus, TrainingJob
from flywheel.trajectories.models import Tag, Trajectory, TriageRun, Upload

PROJECT_PREFIX = "p/<slug:project_slug>/"
# The query a page needs to show something (the routes are the URLconf's spelling).
QUERIES = {"p/<slug:project_slug>/training/compare": "?ids={job_id}&ids={other_job_id}",
           "p/<slug:project_slug>/evals/runs/compare": "?a={eval_run_id}&b={other_eval_run_id}"}
PARAM = re.compile(r"<(?:\w+:)?(\w+)>")
# Console messages that are about the page's own answer, not an error on it.
REPORT_CSP = """document.addEventListener("securitypolicyviolation", (e) =>
    console.error(`CSP violation: ${e.violatedDirective} blocked ${e.blockedURI || "inline"} at ${e.sourceFile}:${e.lineNumber}`));"""


def _routes(patterns=None, prefix=""):
    for entry in get_resolver().url_patterns if patterns is None else patterns:
        route = prefix + str(entry.pattern)
        if isinstance(entry, URLResolver):
            yield from _routes(entry.url_patterns, route)
        elif isinstance(entry, URLPattern):
            yield route


def _first(qs) -> Any:
    return qs.order_by("pk").first()


def _model_rows(project: Project, user) -> dict[str, int]:
    """Production v1 (or the project's own), a candidate made by a finished job with two checkpoints whose
    holdout files say what each answered, the gate's refusal of it, and an eval run of production."""
    production = _first(ModelVersion.objects.filter(project=project))
    if production is None:
        base = BaseModel.objects.create(project=project, name="tiny", path="/models/tiny")
        production = registry.model_version_create(project=project, base=base, user=user)
        registry.alias_move(project=project, alias="production", version=production, user=user, reason="first")
    task_set = _first(TaskSet.objects.filter(project=project, versions__isnull=False))
    holdout = _first(EvalSuite.objects.filter(project=project, kind="holdout", versions__isnull=False))
    now = timezone.now()
    job = TrainingJob.objects.create(
        project=project, task_set_version=task_set.versions.order_by("number").last(),
        holdout_version=holdout.versions.order_by("number").last() if holdout else None,
        base_version=production, status=JobStatus.SUCCEEDED, step=4, max_steps=4, attempt=1, created_by=user,
        started_at=now, finished_at=now, heartbeat_at=now,
    )
    folder = training.job_dir(job)
    (folder / "evals").mkdir(parents=True, exist_ok=True)
    rows = holdout.versions.order_by("number").last().rows[:4] if holdout else []

    def cases(passes: int, text: str) -> str:
        return "".join(json.dumps({
            "id": row["id"], "passed": i < passes, "pass_rate": 1.0 if i < passes else 0.0, "samples": [
                {"passed": i < passes, "messages": [{"role": "assistant", "content": f"{text} {i}"}]}]}) + "\n"
            for i, row in enumerate(rows))

    (folder / "production-holdout.jsonl").write_text(cases(1, "production says"))
    for step in (2, 4):
        JobEvent.objects.create(job=job, attempt=1, kind="step", step=step - 1, data={"reward_mean": 0.2, "loss": 0.3})
        JobEvent.objects.create(job=job, attempt=1, kind="step", step=step, data={"reward_mean": 0.3, "loss": 0.2})
        metrics = {"success_rate": 0.5, "invalid_output_rate": 0.0, "unsafe_action_rate": 0.0, "n": len(rows)}
        JobEvent.objects.create(job=job, attempt=1, kind="eval", step=step, data={"split": "holdout", "metrics": metrics})
        Checkpoint.objects.create(job=job, step=step, path=f"checkpoint-{step}", holdout=metrics, best=step == 4)
        (folder / "evals" / f"holdout-step-{step:06d}.jsonl").write_text(cases(2, f"step {step} says"))
    # A second job, failed at its first step, for the comparison page.
    failed = TrainingJob.objects.create(
        project=project, task_set_version=job.task_set_version, holdout_version=job.holdout_version,
        base_version=production, status=JobStatus.FAILED, step=1, max_steps=4, attempt=1, created_by=user,
        started_at=now, finished_at=now, error="step 1: the worker ran out of memory")
    candidate = registry.model_version_create(project=project, base=production.base, user=user,
                                              lineage={"job": job.pk, "task_set_version": str(job.task_set_version)})
    decision = GateDecision.objects.create(project=project, job=job, candidate=candidate, production=production,
                                           passed=False, error="")
    suite_version = (holdout or _first(EvalSuite.objects.filter(project=project, versions__isnull=False)))
    eval_run = EvalRun.objects.create(project=project, model_version=production,
                                      suite_version=suite_version.versions.order_by("number").last())
    other_run = EvalRun.objects.create(project=project, model_version=candidate, suite_version=eval_run.suite_version)
    # A canary decision that flagged the candidate, with a look's evidence, for its page.
    look = sequential.look(subject_n=120, subject_failures=60, subject_unsafe=0, baseline_n=1000,
                           baseline_failures=250, baseline_unsafe=0, min_per_arm=1000).to_dict()
    check = LiveCheck.objects.create(project=project, kind="canary", subject=candidate, baseline=production,
                                     status="flagged", started_at=now, ends_at=now + timedelta(hours=72), looks=1,
                                     evidence={"look": look, "at": now.isoformat(), "looks": 1, "trail": [
                                         [now.isoformat(), 120, 1000, look["failure"]["p"], look["unsafe"]["p"]]]})
    return {"version_number": candidate.number, "decision_id": decision.pk, "job_id": job.pk, "step": 4,
            "eval_run_id": eval_run.pk, "other_job_id": failed.pk, "other_eval_run_id": other_run.pk,
            "check_id": check.pk}


def _collections(project: Project, user) -> None:
    """A holdout suite and a task set with a case and a task each, at v1, where the project has none."""
    from flywheel.environments.services import task_set_create
    from flywheel.evals.services import suite_create, version_create

    trajectory = _first(Trajectory.objects.filter(project=project))
    verifier = {"type": "exact", "expected": "x"}
    if not EvalSuite.objects.filter(project=project, kind="holdout").exists():
        suite = suite_create(project=project, name="Walk holdout", kind="holdout", user=user)
        suite.cases.create(messages=[{"role": "user", "content": "a"}], verifier=verifier, trajectory=trajectory)
        version_create(collection=suite, user=user)
    if not TaskSet.objects.filter(project=project).exists():
        task_set = task_set_create(project=project, name="Walk tasks", user=user)
        task_set.tasks.create(messages=[{"role": "user", "content": "b"}], verifier=verifier, trajectory=trajectory)
        version_create(collection=task_set, user=user)


def _values(project: Project, user) -> dict[str, Any]:
    """A real object of the project for every parameter of its routes: the demo's own where it has one."""
    _collections(project, user)
    trajectory = (_first(Trajectory.objects.filter(project=project, triage_severity__gt=0))
                  or _first(Trajectory.objects.filter(project=project)))
    mode = _first(FailureMode.objects.filter(project=project)) or failure_mode_create(
        project=project, name="Walked", category_key="other", user=user)
    key = _first(ApiKey.objects.filter(project=project))
    if key is None:
        key = api_key_create(project=project, name="walk", scopes=["read"], created_by=user).api_key
    run = ClusteringRun.objects.create(project=project, status="done", stage="done")
    ids = list(Trajectory.objects.filter(project=project).order_by("pk").values_list("pk", flat=True)[:3])
    suggestion = ClusterSuggestion.objects.create(run=run, project=project, size=len(ids), label="walk",
                                                  trajectory_ids=ids)
    suite = _first(EvalSuite.objects.filter(project=project, versions__isnull=False))
    task_set = _first(TaskSet.objects.filter(project=project, versions__isnull=False))
    return {
        "project_slug": project.slug,
        "trajectory_id": trajectory.pk,
        "tag_id": Tag.objects.get_or_create(project=project, name="walked")[0].pk,
        "upload_id": Upload.objects.create(project=project, filename="a.jsonl", content=b"{}", status="failed").pk,
        "user_id": user.pk,
        "key_id": key.pk,
        "run_id": (_first(TriageRun.objects.filter(project=project))
                   or TriageRun.objects.create(project=project, version=1, status="done")).pk,
        "mode_id": mode.pk,
        "category_id": _first(TaxonomyCategory.objects.filter(project=project)).pk,
        "clustering_id": run.pk,
        "suggestion_id": suggestion.pk,
        "suite_id": suite.pk,
        "case_id": _first(EvalCase.objects.filter(suite=suite)).pk,
        "task_set_id": task_set.pk,
        "task_id": _first(Task.objects.filter(task_set=task_set)).pk,
        "number": 1,
        "calibration_id": VerifierCalibration.objects.create(
            project=project, verifier={"type": "exact", "expected": "walked"}, status="failed",
            error="walked").pk,
        **_model_rows(project, user),
    }


def _pages(project: Project, user) -> list[str]:
    """The project's pages: every project route answering GET with HTML (the rest take POST, or download)."""
    values = _values(project, user)
    client = Client()
    client.force_login(user)
    pages = []
    for route in _routes():
        if not route.startswith(PROJECT_PREFIX):
            continue
        names = PARAM.findall(route)
        unknown = [name for name in names if name not in values]
        url = "/" + PARAM.sub(lambda m: str(values.get(m.group(1), 0)), route) + QUERIES.get(route, "").format(**values)
        response = client.get(url)
        if response.status_code == 405:
            continue  # POST only: not a page
        if response.status_code == 302 and response["Location"].startswith(f"/p/{project.slug}/"):
            continue  # a form's address, fetched, goes to the page holding the form (walked as its own route)
        assert not unknown, f"{route}: a page with {unknown}; add an object of the project for it to _values"
        assert response.status_code == 200, f"{url}: {response.status_code}"
        if response["Content-Type"].startswith("text/html") and "attachment" not in response.get("Content-Disposition", ""):
            pages.append(url)
    return pages


@pytest.fixture
def demo_projects(transactional_db, settings, tmp_path, tiny_model):
    """What `make run` seeds, with fewer requests played: the admin, the support agent's demo project, and
    the loop project with the demo model in production and the tiny model's own failures."""
    settings.VAR_DIR = tmp_path  # the demo's secrets file
    admin = get_user_model().objects.create_superuser(username=ADMIN_USERNAME, email="", password="walk-password-1")
    workplace = loop_project(owner=admin)
    # The demo model registered as the worker registers it once built, so that seeding queues no build.
    base = BaseModel.objects.create(project=workplace, name=DEMO_MODEL_NAME, path=str(tiny_model))
    production = registry.model_version_create(project=workplace, base=base, user=admin)
    registry.alias_move(project=workplace, alias="production", version=production, user=admin,
                        reason="First model of the project.")
    seed = demo_seed()
    admin.refresh_from_db()  # seeding gave it the password it prints: a session is made from the new hash
    loop_demo_seed(project=workplace, model_dir=tiny_model, user=admin, n_train=12, n_holdout=6, n_regression=3)
    return admin, [seed.project, workplace]


def _assert_quiet(page, where: str) -> None:
    log = page.log
    problems = log.console_errors + log.page_errors + log.failed_requests
    assert not problems, f"{where}: {problems}"


def test_every_page_of_both_demo_projects_is_free_of_console_errors(open_page, demo_projects):
    admin, projects = demo_projects
    page = open_page(admin)
    page.context.add_init_script(REPORT_CSP)
    walked = 0
    for project in projects:
        for url in _pages(project, admin):
            page.goto(url, wait_until="load")
            page.wait_for_timeout(50)  # deferred scripts and the first htmx loads
            _assert_quiet(page, url)
            walked += 1
    assert walked >= 2 * 30, walked  # both projects' pages, not a handful

    # An htmx swap: a key created on the settings page; and the 404 page (its own answer is the 404).
    page.goto(f"/p/{projects[0].slug}/settings/")
    page.fill("#key-name", "walk key")
    page.locator("#api-keys button", has_text="Create key").click()
    page.wait_for_selector("#issued-key")
    page.wait_for_timeout(200)
    _assert_quiet(page, "settings after a key was created")
    response = page.goto(f"/p/{projects[0].slug}/no-such-page/")
    assert response.status == 404 and page.title().startswith("Not found")
    page.log.failed_requests.clear()  # the page's own 404
    page.wait_for_timeout(100)
    _assert_quiet(page, "the 404 page")
