"""The command-line contract the platform relies on: JSON lines on stdout, an error event and a non-zero
exit on failure, resume from the last checkpoint, and the verifier-only `score` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMALL = {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "max_new_tokens": 40, "max_steps": 2,
         "eval_interval": 1, "eval_samples_per_prompt": 2, "learning_rate": 1e-3, "r": 4, "alpha": 8,
         "num_threads": 1}


def run_cli(*args: str, timeout: int = 240) -> tuple[int, list[dict], str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run([sys.executable, "-m", "trainer", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    events = [json.loads(line) for line in lines]  # every stdout line must parse, or this raises
    return proc.returncode, events, proc.stderr


def write_spec(job_dir: Path, model: Path, **overrides) -> Path:
    spec = {"model": str(model), "algorithm": "grpo", "mlflow": False, "config": dict(SMALL)}
    config = overrides.pop("config", {})
    spec["config"].update(config)
    spec.update(overrides)
    (job_dir / "spec.json").write_text(json.dumps(spec))
    return job_dir / "spec.json"


def test_train_events_checkpoints_and_resume(tiny_model, job_dir):
    spec = write_spec(job_dir, tiny_model, mlflow=True)
    code, events, stderr = run_cli("train", "--spec", str(spec))
    assert code == 0, stderr[-3000:]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "eval" and kinds[-1] == "done", kinds
    assert kinds.count("step") == 2 and kinds.count("checkpoint") == 2
    step = next(e for e in events if e["event"] == "step")
    for key in ("reward_mean", "reward_std", "frac_zero_variance_groups", "clip_fraction", "entropy",
                "completion_length", "tokens_per_s", "step_time"):
        assert key in step, key
    holdout = next(e for e in events if e["event"] == "eval")["metrics"]
    assert {"success_rate", "invalid_output_rate", "unsafe_action_rate", "mean_reward"} <= set(holdout)
    done = events[-1]
    assert Path(done["adapter"], "adapter_model.safetensors").exists()
    assert done["regression"]["n"] == 3 * SMALL["eval_samples_per_prompt"]
    assert done["mlflow_run_id"] and done["mlflow_error"] is None
    assert (job_dir / "mlflow.db").exists() and (job_dir / "checkpoints" / "step-000002").exists()

    # A retry on the same job dir (more steps now) resumes after the last checkpoint, same MLflow run.
    write_spec(job_dir, tiny_model, mlflow=True, config={"max_steps": 3})
    code, events2, stderr = run_cli("train", "--spec", str(spec))
    assert code == 0, stderr[-3000:]
    steps = [e["step"] for e in events2 if e["event"] == "step"]
    assert steps == [3]
    assert events2[-1]["resumed_from"].endswith("step-000002")
    assert events2[-1]["mlflow_run_id"] == done["mlflow_run_id"]


def test_failure_is_an_error_event_and_nonzero_exit(tiny_model, job_dir):
    spec = write_spec(job_dir, tiny_model, config={"loss_type": "ppo"})
    code, events, _ = run_cli("train", "--spec", str(spec))
    assert code == 1
    assert events[-1]["event"] == "error" and "config.loss_type" in events[-1]["message"]

    # A failure mid-run names its step: a task whose env type does not exist breaks the first rollout.
    rows = [json.loads(x) for x in (job_dir / "train.jsonl").read_text().splitlines()]
    for r in rows:
        r["env"]["type"] = "spaceship"
    (job_dir / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = write_spec(job_dir, tiny_model, config={"eval_on_start": False})
    code, events, _ = run_cli("train", "--spec", str(spec))
    assert code == 1
    err = events[-1]
    assert err["event"] == "error" and err["step"] == 1 and "spaceship" in err["message"]


def test_sft_job_same_contract(tiny_model, job_dir):
    spec = write_spec(job_dir, tiny_model, algorithm="sft",
                      config={"max_steps": 2, "train_batch_size": 4, "eval_on_start": False})
    code, events, stderr = run_cli("train", "--spec", str(spec))
    assert code == 0, stderr[-3000:]
    kinds = [e["event"] for e in events]
    assert kinds.count("step") == 2 and kinds.count("checkpoint") == 2 and kinds[-1] == "done"
    assert "loss" in events[0]


def test_evaluate_reports_cases_and_metrics(tiny_model, job_dir):
    code, events, stderr = run_cli("evaluate", "--model", str(tiny_model), "--suite",
                                   str(job_dir / "holdout.jsonl"), "--samples", "2", "--threads", "1")
    assert code == 0, stderr[-3000:]
    cases = [e["case"] for e in events if e["event"] == "eval"]
    assert len(cases) == 6 and all(c["n"] == 2 for c in cases)
    assert events[-1]["event"] == "done" and events[-1]["metrics"]["n"] == 12


def test_score_command(tmp_path):
    tools = [{"type": "function", "function": {"name": "create_task", "parameters": {
        "type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}}}]
    verifier = {"type": "tool_call", "expected_calls": [{"name": "create_task", "arguments": {"title": "Fix login"}}]}
    cases = [{"id": "a", "tools": tools, "verifier": verifier}, {"id": "b", "tools": tools, "verifier": verifier}]
    completions = [
        {"id": "a", "completion": {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "create_task", "arguments": '{"title": "fix login"}'}}]}},
        {"id": "b", "completion": '<tool_call>{"name": "delete_task", "arguments": {}}</tool_call>'},
    ]
    (tmp_path / "cases.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cases))
    (tmp_path / "completions.jsonl").write_text("".join(json.dumps(c) + "\n" for c in completions))
    code, rows, stderr = run_cli("score", str(tmp_path / "cases.jsonl"), str(tmp_path / "completions.jsonl"))
    assert code == 0, stderr[-2000:]
    assert [r["id"] for r in rows] == ["a", "b"]
    assert rows[0]["passed"] is True and rows[0]["reward"] == 1.0
    assert rows[1]["passed"] is False and rows[1]["failure"] == "hallucinated_api"
    assert set(rows[0]) == {"id", "reward", "passed", "failure", "checks"}


@pytest.mark.parametrize("bad, field", [({"nope": 1}, "nope"), ({"config": {"lr": 1}}, "lr")])
def test_spec_errors_name_the_field(tmp_path, tiny_model, bad, field):
    from trainer.config import SpecError, load_spec

    (tmp_path / "train.jsonl").write_text("{}\n")
    (tmp_path / "spec.json").write_text(json.dumps({"model": str(tiny_model), **bad}))
    with pytest.raises(SpecError, match=field):
        load_spec(tmp_path / "spec.json")
