"""Eval runs: a model version measured on a suite version by the real trainer through a real worker, a run
recorded from a job's files, and two runs compared case by case with a paired test."""

from __future__ import annotations

import json

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse

from flywheel.evals import runs
from flywheel.evals.models import EvalSuite, EvalSuiteVersion
from flywheel.evals.run_models import EvalCaseResult, EvalRun, EvalRunStatus
from flywheel.registry import services as registry


def _rows(tasks, mode_ids=None):
    rows = []
    for i, task in enumerate(tasks):
        call = next(m for m in task["solution"] if m.get("tool_calls"))["tool_calls"][0]["function"]
        rows.append({"id": f"case-{i}", "messages": task["messages"], "tools": task["tools"],
                     "verifier": {"type": "tool_call", "expected_calls": [
                         {"name": call["name"], "arguments": json.loads(call["arguments"])}]},
                     "origin": {"trajectory_id": 100 + i, "failure_mode": (mode_ids or {}).get(i)}})
    return rows


@pytest.fixture
def suite_version(project):
    from trainer.envs.workplace import generate_tasks

    rows = _rows(generate_tasks(4, seed=3, split="holdout", difficulty="single"), mode_ids={0: 7, 1: 7})
    suite = EvalSuite.objects.create(project=project, name="holdout", kind="holdout")
    return EvalSuiteVersion.objects.create(suite=suite, number=1, rows=rows, size=len(rows), content_hash="0" * 64)


def _case(case_id, passed, answer="ok"):
    return {"id": case_id, "passed": passed, "pass_rate": 1.0 if passed else 0.0, "mean_reward": float(passed),
            "failures": {} if passed else {"wrong_tool": 2},
            "samples": [{"passed": passed, "messages": [{"role": "assistant", "content": answer}]}]}


def test_a_recorded_run_keeps_each_case_with_its_origin(project, suite_version, tiny_model, user):
    version = registry.base_model_register(project=project, name="tiny", path=str(tiny_model), user=user)
    run = runs.eval_run_record(project=project, model_version=version, suite_version=suite_version,
                               cases=[_case("case-0", True, "<b>hi</b>"), _case("case-1", False)],
                               metrics={"success_rate": 0.5})
    results = {r.case_id: r for r in run.results.all()}
    assert results["case-0"].passed and results["case-0"].failure_mode_id == 7 and results["case-0"].trajectory_id == 100
    assert results["case-1"].failures == {"wrong_tool": 2} and results["case-0"].output == "<b>hi</b>"


def test_two_runs_compare_case_by_case_with_a_paired_test(project, suite_version, tiny_model, user, client_for):
    version = registry.base_model_register(project=project, name="tiny", path=str(tiny_model), user=user)
    a = runs.eval_run_record(project=project, model_version=version, suite_version=suite_version,
                             cases=[_case(f"case-{i}", i == 0) for i in range(4)], metrics={})
    b = runs.eval_run_record(project=project, model_version=version, suite_version=suite_version,
                             cases=[_case(f"case-{i}", i != 3, "<script>x</script>") for i in range(4)], metrics={})
    comparison = runs.eval_compare(a=a, b=b)
    assert (comparison["fixed"], comparison["broken"]) == (2, 0)
    assert comparison["p_b_better"] == pytest.approx(0.25)  # two wins of two discordant cases
    page = client_for(user).get(reverse("eval_run_compare", args=[project.slug]), {"a": a.pk, "b": b.pk})
    html = page.content.decode()
    assert page.status_code == 200 and "&lt;script&gt;x&lt;/script&gt;" in html and "<script>x" not in html
    other_suite = EvalSuite.objects.create(project=project, name="other", kind="regression")
    other = EvalSuiteVersion.objects.create(suite=other_suite, number=1, rows=[], size=0, content_hash="1" * 64)
    c = runs.eval_run_record(project=project, model_version=version, suite_version=other, cases=[], metrics={})
    with pytest.raises(ValidationError):
        runs.eval_compare(a=a, b=c)


def test_a_run_measures_a_version_through_the_worker(project, suite_version, tiny_model, user, celery_worker):
    version = registry.base_model_register(project=project, name="tiny", path=str(tiny_model), user=user)
    with pytest.raises(ValidationError):
        runs.eval_run_create(project=project, model_version=version, suite_version=suite_version, samples=0)
    run = runs.eval_run_create(project=project, model_version=version, suite_version=suite_version, samples=2)
    done = celery_worker.wait_for(
        lambda: EvalRun.objects.filter(pk=run.pk).exclude(status__in=(EvalRunStatus.QUEUED, EvalRunStatus.RUNNING))
        .first(), timeout=240)
    assert done.status == EvalRunStatus.SUCCEEDED, done.error
    assert done.metrics["n"] == 4 * 2
    results = EvalCaseResult.objects.filter(run=run)
    assert results.count() == 4 and {r.case_id for r in results} == {f"case-{i}" for i in range(4)}
    assert sum(r.passed for r in results) / 4 == pytest.approx(
        sum(1 for r in results if r.pass_rate > 0.5) / 4)


def test_a_failing_run_says_why(project, suite_version, user, tmp_path, celery_worker):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    version = registry.base_model_register(project=project, name="broken", path=str(broken), user=user)
    run = runs.eval_run_create(project=project, model_version=version, suite_version=suite_version, samples=1)
    failed = celery_worker.wait_for(lambda: EvalRun.objects.filter(pk=run.pk, status=EvalRunStatus.FAILED).first(),
                                    timeout=120)
    assert "tokenizer" in failed.error
