"""The flywheel dashboard on crafted data: the funnel's counts and ratios, a version's lineage back to its job,
modes and trajectories (never another project's rows), trajectories forward to the versions they trained,
what each failure mode has behind it, each mode's pass rate per version from eval runs, and the page
(agent text escaped, a wrong parameter a note, not a 500)."""

from __future__ import annotations

import pytest
from django.urls import reverse
from django.utils import timezone

from flywheel.dashboard import selectors as dashboard
from flywheel.environments.models import Task, TaskSet, TaskSetVersion
from flywheel.evals import rows as row_shape
from flywheel.evals.models import EvalCase, EvalCaseResult, EvalRun, EvalSuite, EvalSuiteVersion
from flywheel.failures.models import FailureMode, FailureModeAssignment
from flywheel.failures.services import taxonomy_seed
from flywheel.registry.models import Alias, AliasAssignment, AliasEvent, BaseModel, ModelVersion
from flywheel.training.models import JobStatus, TrainingJob
from flywheel.trajectories.models import Trajectory

HOSTILE = '<script>window.__pwned=1</script><img src=x onerror="alert(1)">'
VERIFIER = {"type": "tool_call", "expected_calls": [{"name": "refund_order", "arguments": {}}]}


def _item(model, owner_field, owner, trajectory, mode, **extra):
    return model.objects.create(**{owner_field: owner}, messages=[{"role": "user", "content": f"ask {trajectory.pk}"}],
                                tools=[], verifier=VERIFIER, trajectory=trajectory, failure_mode=mode, **extra)


def _task_set_version(task_set, number, tasks):
    rows = [task.row() for task in tasks]
    return TaskSetVersion.objects.create(task_set=task_set, number=number, rows=rows, size=len(rows),
                                         content_hash=row_shape.content_hash(rows))


@pytest.fixture
def loop(project, user, make_project):
    """Ten trajectories part-way round the loop, two modes, suites, a task set trained by two jobs, and
    versions: v1 the base (production first), v2 by job 1 (promoted), v3 by job 2 (not promoted)."""
    t = [Trajectory.objects.create(project=project, external_id=f"t{i}", title=f"conversation {i}",
                                   outcome="failure" if i < 7 else ("success" if i < 9 else "unknown"))
         for i in range(10)]
    Trajectory.objects.filter(pk=t[0].pk).update(title=HOSTILE)
    now = timezone.now()
    # Reviewers confirm t0-t3, clear t6 (success after all), and find t7 failed though the agent said success.
    Trajectory.objects.filter(pk__in=[x.pk for x in t[:4]] + [t[7].pk]).update(reviewed_outcome="failure",
                                                                                  reviewed_at=now)
    Trajectory.objects.filter(pk=t[6].pk).update(reviewed_outcome="success", reviewed_at=now)
    taxonomy_seed(project=project)
    category = project.failure_categories.first()
    mode_a = FailureMode.objects.create(project=project, name="wrong order id", category=category)
    mode_b = FailureMode.objects.create(project=project, name=f"refund {HOSTILE}", category=category)
    for mode, trajectories in ((mode_a, t[0:3]), (mode_b, t[2:4])):
        for trajectory in trajectories:
            FailureModeAssignment.objects.create(failure_mode=mode, trajectory=trajectory)

    holdout = EvalSuite.objects.create(project=project, name="holdout", kind="holdout")
    regression = EvalSuite.objects.create(project=project, name="regressions", kind="regression")
    _item(EvalCase, "suite", holdout, t[0], mode_a)
    _item(EvalCase, "suite", holdout, t[4], None)
    _item(EvalCase, "suite", regression, t[1], mode_a)
    task_set = TaskSet.objects.create(project=project, name="refunds")
    task_2 = _item(Task, "task_set", task_set, t[2], mode_a)
    task_3 = _item(Task, "task_set", task_set, t[3], mode_b)
    variant = _item(Task, "task_set", task_set, t[3], mode_b, parent=task_3, variant_kind="rephrase")
    tsv1 = _task_set_version(task_set, 1, [task_2, task_3, variant])
    tsv2 = _task_set_version(task_set, 2, [task_3])
    untrained = _task_set_version(task_set, 3, [_item(Task, "task_set", task_set, t[5], None)])

    base = BaseModel.objects.create(project=project, name="tiny", path="/models/tiny")
    v1 = ModelVersion.objects.create(project=project, number=1, base=base)
    job_1 = TrainingJob.objects.create(project=project, task_set_version=tsv1, base_version=v1,
                                       status=JobStatus.SUCCEEDED, started_at=now)
    job_2 = TrainingJob.objects.create(project=project, task_set_version=tsv2, base_version=v1,
                                       status=JobStatus.SUCCEEDED, started_at=now)
    TrainingJob.objects.create(project=project, task_set_version=untrained, base_version=v1,
                               status=JobStatus.READY)  # measured, never trained: not "trained on"
    v2 = ModelVersion.objects.create(project=project, number=2, base=base, adapter_path="/a/2",
                                     lineage={"job": job_1.pk, "task_set_version": str(tsv1)})
    v3 = ModelVersion.objects.create(project=project, number=3, base=base, adapter_path="/a/3",
                                     lineage={"job": job_2.pk, "task_set_version": str(tsv2)})
    AliasAssignment.objects.create(project=project, alias=Alias.PRODUCTION, version=v2)
    AliasEvent.objects.create(project=project, alias=Alias.PRODUCTION, kind="set", to_version=v1)
    AliasEvent.objects.create(project=project, alias=Alias.PRODUCTION, kind="promote", from_version=v1, to_version=v2)
    AliasEvent.objects.create(project=project, alias=Alias.CANDIDATE, kind="set", to_version=v3)

    # Another project's rows, named by ids in a lineage that has no job: never shown here.
    other = make_project()
    stranger = Trajectory.objects.create(project=other, external_id="secret", title="another project's text")
    taxonomy_seed(project=other)
    foreign_mode = FailureMode.objects.create(project=other, name="foreign", category=other.failure_categories.first())
    v4 = ModelVersion.objects.create(project=project, number=4, base=base, adapter_path="/a/4",
                                     lineage={"job": 10**9, "trajectories": [stranger.pk, t[9].pk],
                                              "failure_modes": [foreign_mode.pk]})
    return {"t": t, "modes": (mode_a, mode_b), "versions": (v1, v2, v3, v4), "jobs": (job_1, job_2),
            "holdout": holdout, "project": project}


def test_the_funnel_counts_each_step_and_its_share_of_the_one_before(loop):
    stages = {s.key: s for s in dashboard.funnel(project=loop["project"])}
    counts = {key: s.count for key, s in stages.items()}
    assert counts == {
        "ingested": 10,
        "failed": 7,  # t0-t5 by the agent, t7 by a reviewer; t6 cleared by a reviewer
        "reviewed": 5,  # t0-t3 and t7
        "in_modes": 4,  # t0-t3 (t2 carries both modes)
        "promoted": 6,  # cases from t0, t1, t4; tasks from t2, t3, t5 (the variant shares t3)
        "trained": 2,  # t2, t3: the third task set version was never trained on
        "shipped": 2,  # v2 (promoted) trained on t2 and t3
        "versions": 1,  # v2, of the three versions jobs made (v4 names a job that is gone, still a job's)
    }
    assert stages["ingested"].ratio is None
    assert stages["failed"].ratio == pytest.approx(0.7)
    assert stages["reviewed"].ratio == pytest.approx(5 / 7)
    assert stages["in_modes"].ratio == pytest.approx(4 / 5)  # t0-t3 of the reviewed t0-t3 and t7
    # Six promoted, four of them from the modes' four (t4 and t5 went without a mode): 100%, never 150%.
    assert stages["promoted"].ratio == pytest.approx(1.0)
    assert stages["trained"].ratio == pytest.approx(2 / 6)
    assert all(s.ratio is None or 0 <= s.ratio <= 1 for s in stages.values())
    assert stages["versions"].ratio == pytest.approx(1 / 3) and stages["versions"].unit == "versions"
    assert stages["promoted"].detail == "3 behind eval cases, 3 behind tasks"
    assert stages["trained"].detail.startswith("4 task rows in 2 task-set versions")


def test_a_lineage_goes_back_to_the_job_its_modes_and_trajectories_and_stays_in_the_project(loop):
    t, (mode_a, mode_b), (v1, v2, v3, v4) = loop["t"], loop["modes"], loop["versions"]
    back = dashboard.version_lineage(project=loop["project"], version=v2)
    assert back.job == loop["jobs"][0] and back.served
    assert {m.pk for m in back.failure_modes} == {mode_a.pk, mode_b.pk}
    assert [x.pk for x in back.trajectories] == [t[3].pk, t[2].pk] and back.trajectory_count == 2
    assert not dashboard.version_lineage(project=loop["project"], version=v3).served
    base = dashboard.version_lineage(project=loop["project"], version=v1)
    assert base.job is None and base.trajectory_count == 0 and base.failure_modes == []
    gone = dashboard.version_lineage(project=loop["project"], version=v4)
    assert gone.job is None and [x.pk for x in gone.trajectories] == [t[9].pk] and gone.failure_modes == []


def test_a_trajectory_leads_forward_to_the_versions_it_helped_train(loop):
    t, (_, v2, v3, v4) = loop["t"], loop["versions"]
    forward = dashboard.versions_by_trajectory(project=loop["project"])
    assert forward[t[2].pk] == [v2]
    assert forward[t[3].pk] == [v3, v2]  # newest first
    assert t[0].pk not in forward and t[5].pk not in forward
    assert forward[t[9].pk] == [v4]  # from the ids v4's lineage kept
    only = dashboard.versions_by_trajectory(project=loop["project"], trajectory_ids=[t[2].pk])
    assert list(only) == [t[2].pk]
    recent = dashboard.recent_trajectories_forward(project=loop["project"])
    assert [r.trajectory.pk for r in recent] == [t[9].pk, t[3].pk, t[2].pk]


def test_each_mode_shows_what_is_behind_it(loop):
    (mode_a, mode_b) = loop["modes"]
    coverage = {c.mode.pk: c for c in dashboard.mode_coverage(project=loop["project"])}
    a, b = coverage[mode_a.pk], coverage[mode_b.pk]
    assert (a.trajectories, a.holdout_cases, a.regression_cases, a.tasks, a.versions) == (3, 1, 1, 1, [2])
    assert (b.trajectories, b.holdout_cases, b.regression_cases, b.tasks, b.versions) == (2, 0, 0, 2, [2, 3])


def test_pass_rates_per_mode_and_version_come_from_the_latest_finished_run(loop):
    (mode_a, mode_b), (v1, v2, _, _) = loop["modes"], loop["versions"]
    suite_version = EvalSuiteVersion.objects.create(suite=loop["holdout"], number=1, rows=[], size=0,
                                                    content_hash="0" * 64)

    def run(version, results, status="succeeded"):
        r = EvalRun.objects.create(project=loop["project"], model_version=version, suite_version=suite_version,
                                   status=status)
        for i, (mode, passed) in enumerate(results):
            EvalCaseResult.objects.create(run=r, case_id=f"case-{i}", passed=passed, pass_rate=float(passed),
                                          failure_mode_id=mode.pk if mode else None)

    run(v1, [(mode_a, False), (mode_a, False), (mode_b, False), (None, True)])
    run(v2, [(mode_a, False), (mode_a, False), (mode_b, False)])  # superseded by the next run of v2
    run(v2, [(mode_a, True), (mode_a, True), (mode_b, False), (None, False)])
    run(v2, [(mode_a, False)], status="failed")  # a failed run counts for nothing
    rates = dashboard.mode_pass_rates(project=loop["project"])
    assert rates.versions == [1, 2]
    table = {mode.pk: [(c.passed, c.total) if c else None for c in cells] for mode, cells in rates.rows}
    assert table == {mode_a.pk: [(0, 2), (2, 2)], mode_b.pk: [(0, 1), (0, 1)]}


def test_the_page_escapes_agent_text_and_notes_a_wrong_parameter(loop, client_for, user, make_user, make_membership):
    viewer = make_user()
    make_membership(viewer, loop["project"], "viewer")
    url = reverse("flywheel_dashboard", args=[loop["project"].slug])
    page = client_for(viewer).get(url)
    html = page.content.decode()
    assert page.status_code == 200
    assert 'id="funnel-ingested"' in html and 'value="7"' in html  # the failed step's bar
    assert "<script>window.__pwned" not in html and "&lt;script&gt;window.__pwned" in html
    assert "another project" not in html and "foreign" not in html
    assert "v2" in html and f"job {loop['jobs'][0].pk}" in html  # production's lineage by default
    wrong = client_for(viewer).get(url, {"version": "²", "trajectory": "abc"})
    assert wrong.status_code == 200
    assert "No version v² in this project" in wrong.content.decode()
    assert "No trajectory #abc in this project" in wrong.content.decode()
    followed = client_for(viewer).get(url, {"version": "3", "trajectory": str(loop["t"][3].pk)})
    body = followed.content.decode()
    assert f"job {loop['jobs'][1].pk}" in body
    result = body.split('id="forward-result"')[1].split("</p>")[0]
    assert "v3" in result and "v2" in result


def test_each_promotion_shows_what_it_cost_and_what_it_bought(loop, client_for, user):
    """v1 → v2 (job 1): the job's GPU-hours, the judge's tokens over the turn that led to it, the gate's holdout
    gain, and the live failure rate and cost of v1's last day against v2's first."""
    from datetime import timedelta

    from flywheel.evals.online_models import OnlineScore
    from flywheel.registry import cost, live, serving
    from flywheel.registry.models import GateDecision

    project, (v1, v2, _, _), (job_1, _) = loop["project"], loop["versions"], loop["jobs"]
    now = timezone.now()
    moved = now - timedelta(hours=30)
    AliasEvent.objects.filter(project=project, kind="set", alias=Alias.PRODUCTION).update(at=now - timedelta(hours=60))
    AliasEvent.objects.filter(project=project, kind="promote").update(at=moved)
    TrainingJob.objects.filter(pk=job_1.pk).update(device="gpu", devices=2, wall_seconds=2700, device_seconds=5400)
    GateDecision.objects.create(project=project, candidate=v2, production=v1, passed=True, report={"rules": [
        {"name": "holdout success", "production": 0.5, "candidate": 0.75, "passed": True}]})
    t = loop["t"]
    for i, (hours, tokens) in enumerate([(-40, 100), (-2, 200), (3, 300)]):  # the first is outside the turn
        OnlineScore.objects.create(project=project, trajectory=t[i], verifier="llm_judge", reward=1, passed=True,
                                   below_threshold=False, checks={}, input_tokens=tokens, output_tokens=tokens // 10,
                                   scored_at=moved + timedelta(hours=hours))
    cost.price_set(target=v1.base, data={"price_input_per_m": "1", "price_output_per_m": "2"})
    # v1's last day: 4 requests, 2 failed; v2's first: 4, 1 failed; each 1,000 + 1,000 tokens (v2: + 500 out).
    for i, (number, hours, outcome, out) in enumerate(
            [(1, -3, "failure", 1000), (1, -5, "failure", 1000), (1, -6, "success", 1000), (1, -7, "success", 1000),
             (2, 3, "failure", 1500), (2, 4, "success", 1500), (2, 5, "success", 1500), (2, 6, "success", 1500),
             (1, -30, "failure", 1000)]):  # v1 a day and more before the move: outside its window
        Trajectory.objects.create(project=project, external_id=f"live-{i}", outcome=outcome,
                                  model_version=serving.adapter_name(project.slug, number),
                                  started_at=moved + timedelta(hours=hours, minutes=30),
                                  usage={"prompt_tokens": 1000, "completion_tokens": out})
    live.rollup_refresh(full=True)

    [promotion] = dashboard.promotion_costs(project=project, now=now)
    assert promotion.event.to_version == v2 and promotion.job == job_1 and promotion.job.gpu_hours == 1.5
    assert promotion.judge == {"input_tokens": 200, "output_tokens": 20, "scores": 1}
    assert promotion.holdout_gain == pytest.approx(0.25)
    assert promotion.before["metrics"]["trajectories"] == 4 and promotion.after["metrics"]["trajectories"] == 4
    assert promotion.live_change == pytest.approx(0.25 - 0.5)
    # 1k requests: 1M input at $1 + 1M (v1) or 1.5M (v2) output at $2: $3 → $4.
    assert promotion.cost_change == pytest.approx(1.0)

    html = client_for(user).get(reverse("flywheel_dashboard", args=[project.slug])).content.decode()
    row = html.split(f'id="promotion-{promotion.event.pk}"')[1].split("</tr>")[0]
    assert "1.5 GPU-hours (2 GPUs)" in row and "200 in / 20 out tokens" in row
    assert "(+0.250)" in row and "(-0.250)" in row and "$3.00" in row and "$4.00" in row
