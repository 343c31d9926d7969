"""One GRPO step per loss variant through the real loop: KL against the adapter-disabled base,
several passes per batch, DAPO's dynamic sampling and overlong filter all run and report."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from trainer.config import GRPOConfig, JobSpec
from trainer.loop import train_grpo
from trainer.tracking import EventLog


@pytest.mark.parametrize("loss_type, beta, iterations", [("dapo", 0.0, 1), ("gspo", 0.05, 2), ("dr_grpo", 0.1, 1)])
def test_one_step_per_variant(tiny_model, job_dir, loss_type, beta, iterations):
    config = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=4, max_new_tokens=32, max_steps=1,
                        loss_type=loss_type, beta=beta, num_iterations=iterations, learning_rate=1e-2,
                        eval_on_start=False, r=4, alpha=8, train_batch_size=3, num_threads=1,
                        epsilon=0.2 if loss_type != "gspo" else 3e-3)
    spec = JobSpec(model=str(tiny_model), job_dir=job_dir, train=job_dir / "train.jsonl", config=config,
                   mlflow=False)
    events = EventLog(None)
    done = train_grpo(spec, events)
    step = next(e for e in events.events if e["event"] == "step")
    assert ("kl" in step) == (beta > 0)
    if beta > 0:
        assert step["kl"] >= 0.0
    if loss_type == "dapo":
        assert step["sampling_rounds"] >= 1 and "groups_kept" in step
    if step.get("groups_kept", 0):
        weights = load_file(str(job_dir / "adapters" / "last" / "adapter_model.safetensors"))
        # LoRA B starts at zero: any non-zero B means a gradient reached the adapter and a step was taken.
        assert any(torch.count_nonzero(w) for k, w in weights.items() if "lora_B" in k)
    assert done["step"] == 1
