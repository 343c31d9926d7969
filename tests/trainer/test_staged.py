"""SFT then GRPO in one job (`sft_grpo`): each stage at its own learning rate, the holdout evaluated where
the SFT stage ends, one adapter throughout, and a run resumed at the stage boundary going on exactly as the
uninterrupted one (AdamW's moments started afresh for GRPO either way)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from trainer.config import GRPOConfig, JobSpec, SpecError, check_algorithm
from trainer.staged import train_sft_grpo
from trainer.tracking import EventLog

CONFIG = dict(num_prompts_per_step=2, num_generations_per_prompt=4, max_new_tokens=24, max_steps=4, sft_steps=2,
              sft_learning_rate=5e-3, learning_rate=1e-3, eval_interval=100, eval_on_start=False,
              eval_samples_per_prompt=1, r=4, alpha=8, train_batch_size=4, num_threads=1)


def train(job_dir, model, **spec) -> list[dict]:
    events = EventLog(None)
    job = JobSpec(model=str(model), job_dir=job_dir, algorithm="sft_grpo", train=job_dir / "train.jsonl",
                  holdout=job_dir / "holdout.jsonl", config=GRPOConfig(**CONFIG), mlflow=False, **spec)
    train_sft_grpo(job, events)
    return events.events


def test_sft_then_grpo_one_job_and_resume_at_the_boundary(tiny_model, job_dir, tmp_path):
    events = train(job_dir, tiny_model)
    stages = [(e["stage"], e["first_step"], e["last_step"]) for e in events if e["event"] == "stage"]
    assert stages == [("sft", 1, 2), ("grpo", 3, 4)]
    steps = {e["step"]: e for e in events if e["event"] == "step"}
    assert sorted(steps) == [1, 2, 3, 4]
    # SFT steps carry the imitation loss over reference tokens; GRPO steps carry rewards.
    assert all("tokens" in steps[s] and "reward_mean" not in steps[s] for s in (1, 2))
    assert all("reward_mean" in steps[s] for s in (3, 4))
    assert [steps[s]["lr"] for s in (1, 2, 3, 4)] == pytest.approx([5e-3, 5e-3, 1e-3, 1e-3])
    assert all(steps[s]["grad_norm"] > 0 for s in (1, 2))
    # The holdout is judged where SFT ends and at the last step; both checkpoints exist.
    assert [e["step"] for e in events if e["event"] == "eval"] == [2, 4]
    assert sorted(p.name for p in (job_dir / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    done = [e for e in events if e["event"] == "done"]
    assert done and done[0]["best_step"] in (2, 4)

    # Resumed from the SFT stage's last checkpoint: GRPO goes on as in the uninterrupted run.
    again = tmp_path / "again"
    again.mkdir()
    for name in ("train.jsonl", "holdout.jsonl"):
        (again / name).write_bytes((job_dir / name).read_bytes())
    resumed = train(again, tiny_model, resume_from=str(job_dir / "checkpoints" / "step-000002"))
    assert [e["stage"] for e in resumed if e["event"] == "stage"] == ["grpo"]
    resumed_steps = {e["step"]: e for e in resumed if e["event"] == "step"}
    assert sorted(resumed_steps) == [3, 4]
    for s in (3, 4):
        for key in ("reward_mean", "loss", "grad_norm", "lr"):
            assert resumed_steps[s][key] == pytest.approx(steps[s][key], rel=1e-5, abs=1e-6), (s, key)
    a = load_file(str(again / "adapters" / "last" / "adapter_model.safetensors"))
    b = load_file(str(job_dir / "adapters" / "last" / "adapter_model.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


def test_sft_steps_must_leave_both_stages():
    for bad in (0, 4, 9):
        with pytest.raises(SpecError, match="sft_steps"):
            check_algorithm(GRPOConfig(**{**CONFIG, "sft_steps": bad}), "sft_grpo")
    check_algorithm(GRPOConfig(**CONFIG), "sft_grpo")
    check_algorithm(GRPOConfig(**{**CONFIG, "sft_steps": 9}), "grpo")  # other algorithms ignore it
