"""A whole training job through `flywheel train --wait` against the live test server, its real Celery worker and
the real trainer on the tiny model: the job is started by collection ids and version numbers, measured, trained
and judged; the gate refuses the candidate (a 4-case holdout can show no gain), which is exit code 3, and the
refused candidate cannot be promoted (exit 1 with the failing rules). Status prints production first."""

from __future__ import annotations

import json

import pytest
from flywheel_client import Flywheel, cli

from flywheel.environments.models import TaskSet, TaskSetVersion
from flywheel.evals import rows as row_shape
from flywheel.evals.models import EvalSuite, EvalSuiteVersion
from flywheel.registry import services as registry

pytestmark = pytest.mark.slow

# The smallest job that goes through every stage (tests/platform/training/test_training.py's).
SMALL = {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "max_new_tokens": 40, "max_steps": 2,
         "eval_interval": 1, "eval_samples_per_prompt": 2, "regression_samples_per_prompt": 3, "learning_rate": 1e-3,
         "r": 4, "alpha": 8, "num_threads": 1}


def _rows(tasks, prefix):
    rows = []
    for i, task in enumerate(tasks):
        call = next(m for m in task["solution"] if m.get("tool_calls"))["tool_calls"][0]["function"]
        rows.append({"id": f"{prefix}-{i}", "messages": task["messages"], "tools": task["tools"],
                     "verifier": {"type": "tool_call", "expected_calls": [
                         {"name": call["name"], "arguments": json.loads(call["arguments"])}]},
                     "origin": {}})
    return rows


def _version(model, owner, rows, **owner_fields):
    collection = owner.objects.create(**owner_fields)
    key = "task_set" if model is TaskSetVersion else "suite"
    model.objects.create(**{key: collection}, number=1, rows=rows, size=len(rows),
                         content_hash=row_shape.content_hash(rows))
    return collection


def test_train_waits_for_the_gate_and_exits_3_when_it_refuses(live_server, celery_worker, project, user, tiny_model,
                                                               make_api_key, capsys):
    from trainer.envs.workplace import generate_tasks

    production = registry.base_model_register(project=project, name="tiny", path=str(tiny_model), user=user)
    task_set = _version(TaskSetVersion, TaskSet, _rows(generate_tasks(12, seed=0, split="train",
                                                                      difficulty="single"), "task"),
                        project=project, name="refunds")
    holdout = _version(EvalSuiteVersion, EvalSuite, _rows(generate_tasks(4, seed=1, split="holdout",
                                                                         difficulty="single"), "case"),
                       project=project, name="holdout", kind="holdout")
    key = make_api_key(project, scopes=["read", "train", "promote"])
    base = ["--url", live_server.url, "--key", key]
    settings = [arg for name, value in SMALL.items() for arg in ("--config", f"{name}={json.dumps(value)}")]

    code = cli.main([*base, "train", "--task-set", f"{task_set.pk}:1", "--holdout", str(holdout.pk), *settings,
                     "--wait", "--timeout", "600"])
    out, err = capsys.readouterr()
    assert code == cli.GATE_REFUSED == 3, (out, err, celery_worker.log_tail())
    assert "gate: refused" in out and "FAIL holdout size" in out

    with Flywheel(live_server.url, key) as client:
        [job] = client.training_jobs(status="succeeded")
        assert (job.task_set, job.task_set_version, job.holdout, job.holdout_version) == (
            task_set.pk, 1, holdout.pk, 1)  # the latest holdout version, resolved by the client
        assert f"training job {job.id} succeeded; candidate: version {job.candidate_version}" in out
        gate = client.gate_report(job_id=job.id)
        assert gate is not None and not gate.passed and "holdout size" in [r["name"] for r in gate.failing]
        assert client.gate_report(version=job.candidate_version).id == gate.id
        curves = client.curves(job.id)
        assert curves["train"]["step"] == [1, 2] and curves["status"] == "succeeded"

    # A refused candidate cannot be promoted: exit 1 with the server's reason.
    assert cli.main([*base, "promote", str(job.candidate_version)]) == cli.ERROR
    out, err = capsys.readouterr()
    assert "answered 409" in err and "holdout size" in err, err

    assert cli.main([*base, "status"]) == cli.OK
    out, _ = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith(f"production: version {production.number} (tiny")
    assert lines[1] == f"candidate: version {job.candidate_version}"
