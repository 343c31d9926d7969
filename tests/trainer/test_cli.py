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
         "eval_interval": 1, "eval_samples_per_prompt": 2, "regression_samples_per_prompt": 3, "learning_rate": 1e-3,
         "r": 4, "alpha": 8, "num_threads": 1}


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
    assert done["regression"]["n"] == 3 * SMALL["regression_samples_per_prompt"]
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


def test_score_unscorable_cases_keep_the_row_contract(tmp_path):
    tools = [{"type": "function", "function": {"name": "create_task", "parameters": {
        "type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}}}]
    good = {"type": "tool_call", "expected_calls": [{"name": "create_task", "arguments": {"title": "x"}}]}
    cases = [{"id": "ok", "tools": tools, "verifier": good}, {"id": "lost", "tools": tools, "verifier": good},
             {"id": "bad", "tools": tools, "verifier": {"type": "python", "code": "1"}}]
    call = '<tool_call>{"name": "create_task", "arguments": {"title": "x"}}</tool_call>'
    completions = [{"id": "ok", "completion": call}, {"id": "bad", "completion": call}]
    (tmp_path / "cases.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cases))
    (tmp_path / "completions.jsonl").write_text("".join(json.dumps(c) + "\n" for c in completions))
    code, rows, _ = run_cli("score", str(tmp_path / "cases.jsonl"), str(tmp_path / "completions.jsonl"))
    assert code == 1  # something could not be scored: the caller must know, but every case has its line
    assert [r["id"] for r in rows] == ["ok", "lost", "bad"]
    assert rows[0]["passed"] is True and "error" not in rows[0]
    for row, check in ((rows[1], "completion"), (rows[2], "verifier")):
        assert {"id", "reward", "passed", "failure", "checks", "error"} == set(row)
        assert row["reward"] == 0.0 and row["passed"] is False and row["failure"] == "invalid_format"
        assert row["checks"][check]["ok"] is False and row["checks"][check]["reason"] == row["error"]
    assert "no completion" in rows[1]["error"] and "unknown verifier type" in rows[2]["error"]


def test_score_bad_files_are_an_error_event(tmp_path):
    (tmp_path / "cases.jsonl").write_text('{"id": "a", "verifier": {"type": "regex", "pattern": "a"}}\n{oops\n')
    (tmp_path / "completions.jsonl").write_text('{"id": "a", "completion": "a"}\n')
    for cases, completions, needle in [
        (tmp_path / "missing.jsonl", tmp_path / "completions.jsonl", "missing.jsonl"),
        (tmp_path / "cases.jsonl", tmp_path / "missing.jsonl", "missing.jsonl"),
        (tmp_path / "cases.jsonl", tmp_path / "completions.jsonl", "cases.jsonl:2"),  # names the bad line
    ]:
        code, events, stderr = run_cli("score", str(cases), str(completions))
        assert code == 1, stderr[-2000:]
        assert len(events) == 1 and events[0]["event"] == "error", events
        assert events[0]["message"].startswith("score failed: ") and needle in events[0]["message"]
    (tmp_path / "completions.jsonl").write_text('["a", "a"]\n')
    code, events, _ = run_cli("score", str(tmp_path / "cases.jsonl"), str(tmp_path / "completions.jsonl"))
    assert code == 1 and events[-1]["event"] == "error" and "not a JSON object" in events[-1]["message"]


def _single_turn_rows(tasks: list[dict]) -> list[dict]:
    """Workplace requests as single-turn tool-call cases with `"env": null` (the platform may write it)."""
    rows = []
    for t in tasks:
        call = next(m for m in t["solution"] if m.get("tool_calls"))["tool_calls"][0]["function"]
        rows.append({"id": t["id"], "messages": t["messages"], "tools": t["tools"], "env": None,
                     "verifier": {"type": "tool_call", "expected_calls": [
                         {"name": call["name"], "arguments": json.loads(call["arguments"])}]}})
    return rows


def test_no_holdout_best_is_the_newest_and_env_null_rows_train(tiny_model, job_dir, workplace_tasks):
    (job_dir / "holdout.jsonl").unlink()
    (job_dir / "regression.jsonl").unlink()
    from trainer.config import write_jsonl

    write_jsonl(job_dir / "train.jsonl", _single_turn_rows(workplace_tasks["train"][:8]))
    spec = write_spec(job_dir, tiny_model)  # max_steps 2, eval_interval 1: a checkpoint after each step
    code, events, stderr = run_cli("train", "--spec", str(spec))
    assert code == 0, stderr[-3000:]
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 2 and all(e["turns"] == 1.0 for e in steps if "turns" in e)  # single-turn episodes
    checkpoints = [e for e in events if e["event"] == "checkpoint"]
    assert [(c["step"], c["best"], c["best_step"]) for c in checkpoints] == [(1, True, 1), (2, True, 2)]
    done = events[-1]
    assert done["event"] == "done" and done["step"] == 2 and done["best_step"] == 2
    assert done["holdout_before"] is None and done["holdout_after"] == {}
    best = (Path(done["adapter"]) / "adapter_model.safetensors").read_bytes()
    assert best == (job_dir / "checkpoints" / "step-000002" / "adapter" / "adapter_model.safetensors").read_bytes()
    assert best == (Path(done["last_adapter"]) / "adapter_model.safetensors").read_bytes()


def test_demo_prints_before_and_after(tiny_model, tmp_path):
    work = tmp_path / "demo"
    code, events, stderr = run_cli("demo", "--steps", "2", "--model", str(tiny_model), "--workdir", str(work),
                                   "--train-prompts", "40", "--holdout-prompts", "4", "--threads", "1")
    assert code == 0, stderr[-3000:]
    done = events[-1]
    assert done["event"] == "done" and done["step"] == 2 and done["seconds"] > 0
    for key in ("holdout_before", "holdout_after"):
        metrics = done[key]
        assert {"success_rate", "invalid_output_rate", "unsafe_action_rate", "mean_reward"} <= set(metrics)
        assert metrics["n"] == 4 * 4  # 4 holdout prompts x 4 samples
        assert 0.0 <= metrics["success_rate"] <= 1.0
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2]
    assert not (work / "tiny").exists()  # --model: nothing rebuilt
    assert Path(done["job_dir"], "adapters", "best", "adapter_model.safetensors").exists()


@pytest.mark.parametrize("bad, field", [({"nope": 1}, "nope"), ({"config": {"lr": 1}}, "lr")])
def test_spec_errors_name_the_field(tmp_path, tiny_model, bad, field):
    from trainer.config import SpecError, load_spec

    (tmp_path / "train.jsonl").write_text("{}\n")
    (tmp_path / "spec.json").write_text(json.dumps({"model": str(tiny_model), **bad}))
    with pytest.raises(SpecError, match=field):
        load_spec(tmp_path / "spec.json")


def test_build_tiny_builds_a_qwen2_of_another_size(tmp_path):
    """`build-tiny --arch qwen2 --hidden … --layers …`: the GPU check's model, a normal Qwen2 folder that
    loads through the real-model path and ends its turns with the tokenizer's EOS."""
    from trainer.cli import build_parser
    from trainer.models import load_model
    from trainer.tiny import build_tiny

    args = build_parser().parse_args(["build-tiny", str(tmp_path / "m"), "--arch", "qwen2", "--hidden", "32",
                                      "--layers", "3", "--heads", "4", "--steps", "2"])
    assert (args.arch, args.hidden, args.layers, args.heads, args.device) == ("qwen2", 32, 3, 4, "cpu")
    path = build_tiny(args.out, n_tasks=40, steps=args.steps, arch=args.arch, hidden=args.hidden,
                      layers=args.layers, heads=args.heads, device=args.device)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["hidden_size"] == 32 and config["num_hidden_layers"] == 3
    model, tokenizer = load_model(path, device="cpu")
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == config["eos_token_id"]
    assert json.loads((path / "tiny.json").read_text())["arch"] == "qwen2"
