"""An evaluation during training keeps each sample's turns, as `python -m trainer evaluate` does: the
platform's checkpoint inspector shows a checkpoint's outputs beside production's on the same prompts, and
reads both from the same per-case shape (`samples[].messages`)."""

from __future__ import annotations

import json

from trainer.config import GRPOConfig, JobSpec, write_jsonl
from trainer.loop import train_grpo
from trainer.tracking import EventLog

CONFIG = {"num_prompts_per_step": 2, "num_generations_per_prompt": 2, "max_new_tokens": 16, "max_steps": 1,
          "train_batch_size": 4, "r": 4, "alpha": 8, "eval_interval": 1, "eval_on_start": False,
          "eval_samples_per_prompt": 2, "eval_max_prompts": 3, "num_threads": 1}


def test_a_checkpoint_s_holdout_cases_carry_what_the_policy_said(tiny_model, workplace_tasks, tmp_path):
    write_jsonl(tmp_path / "train.jsonl", workplace_tasks["train"][:8])
    write_jsonl(tmp_path / "holdout.jsonl", workplace_tasks["holdout"][:3])
    train_grpo(JobSpec(model=str(tiny_model), job_dir=tmp_path, train=tmp_path / "train.jsonl",
                       holdout=tmp_path / "holdout.jsonl", config=GRPOConfig(**CONFIG), mlflow=False), EventLog(None))
    lines = (tmp_path / "evals" / "holdout-step-000001.jsonl").read_text().splitlines()
    cases = [json.loads(line) for line in lines]
    assert len(cases) == 3
    for case in cases:
        assert len(case["samples"]) == 2
        for sample in case["samples"]:
            turns = sample["messages"]
            # The policy's turns only (the prompt is the row's), the first of them the assistant's answer.
            assert turns and turns[0]["role"] == "assistant", case["id"]
            assert "content" in turns[0] or "tool_calls" in turns[0], case["id"]
