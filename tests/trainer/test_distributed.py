"""`torchrun --nproc_per_node 2 -m trainer train`: two CPU processes (gloo) do one process's work between them.

The step's four groups are cut into two generation batches of two groups (`rollout_batch_groups`), each
seeded by (seed, step, round, batch): one process samples both batches, two processes one each. So the two
runs see the same episodes, and everything else must come out the same: the step metrics rank 0 reports
(aggregated over the ranks), the gradients (summed over the ranks), the adapter after three steps, and the
final holdout evaluation. Tolerance: 1e-5 relative on losses and metrics, 1e-6 absolute on adapter weights
(the two runs do the same float operations but may sum the two ranks' gradients in another order).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.config import GRPOConfig, JobSpec, write_jsonl
from trainer.distributed import Dist, launch_command
from trainer.loop import train_grpo
from trainer.tracking import EventLog

REPO = Path(__file__).resolve().parents[2]
CONFIG = {"num_prompts_per_step": 4, "num_generations_per_prompt": 4, "max_new_tokens": 24, "max_steps": 3,
          "rollout_batch_groups": 2, "scale_rewards": "batch", "learning_rate": 2e-2, "r": 4, "alpha": 8,
          "train_batch_size": 8, "eval_interval": 100, "eval_on_start": False, "eval_samples_per_prompt": 2,
          "eval_max_prompts": 2, "num_threads": 1}
COMPARED = ("reward_mean", "reward_std", "completion_tokens", "groups_kept", "train_success_rate", "loss",
            "entropy", "grad_norm", "clip_fraction", "lr")


def write_job(job: Path, model: Path, tasks: dict[str, list[dict]]) -> Path:
    job.mkdir()
    write_jsonl(job / "train.jsonl", tasks["train"][:40])
    write_jsonl(job / "holdout.jsonl", tasks["holdout"][:2])
    spec = {"model": str(model), "mlflow": False, "num_gpus": 2, "config": CONFIG}
    (job / "spec.json").write_text(json.dumps(spec))
    return job / "spec.json"


def test_two_processes_train_as_one(tiny_model, workplace_tasks, tmp_path):
    spec_path = write_job(tmp_path / "two", tiny_model, workplace_tasks)
    command = launch_command(spec_path)  # the spec's num_gpus: 2 -> torchrun
    assert command[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    # Meanwhile, the same job in this process (one rank).
    one = tmp_path / "one"
    write_job(one, tiny_model, workplace_tasks)
    events = EventLog(None)
    train_grpo(JobSpec(model=str(tiny_model), job_dir=one, train=one / "train.jsonl", holdout=one / "holdout.jsonl",
                       config=GRPOConfig(**CONFIG), mlflow=False), events)
    single = [e for e in events.events if e["event"] == "step"]

    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-4000:]
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]  # every stdout line is JSON
    steps = [e for e in lines if e["event"] == "step"]
    # Rank 0 alone speaks: one event per step, one final evaluation, one done.
    assert [e["step"] for e in steps] == [1, 2, 3]
    assert [e["event"] for e in lines].count("eval") == 1 and lines[-1]["event"] == "done"
    assert all(e["groups_per_rank"] == [2, 2] for e in steps)  # each rank sampled and trained its half
    assert "groups_per_rank" not in single[0]

    assert any(e["grad_norm"] > 0 for e in single)  # there was something to learn, so the comparison bites
    for two, ref in zip(steps, single, strict=True):
        for key in COMPARED:
            assert two[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (two["step"], key)
    holdout_two = next(e for e in lines if e["event"] == "eval")["metrics"]
    holdout_one = next(e for e in events.events if e["event"] == "eval")["metrics"]
    assert holdout_two.pop("failures") == holdout_one.pop("failures")
    assert holdout_two == pytest.approx(holdout_one, rel=1e-5)

    a = load_file(str(tmp_path / "two" / "adapters" / "last" / "adapter_model.safetensors"))
    b = load_file(str(one / "adapters" / "last" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    assert any(bool(torch.count_nonzero(w)) for k, w in b.items() if "lora_B" in k)  # the adapter moved
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    # Rank 0 alone checkpoints: one checkpoint, written once (no temp folder left by a second writer).
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["step-000003"]


def test_generation_batches_are_dealt_round_robin():
    # Six groups in batches of two: ranks 0 and 1 of 2 take batches 0, 2 and 1; groups never split.
    assert Dist(0, 2).my_batches(6, 2) == [(0, range(0, 2)), (2, range(4, 6))]
    assert Dist(1, 2).my_batches(6, 2) == [(1, range(2, 4))]
    # No batch size: one batch per rank, as even as the groups allow; a single process takes them all.
    assert Dist(1, 2).my_batches(5, None) == [(1, range(3, 5))]
    assert Dist().my_batches(5, None) == [(0, range(0, 5))]


def test_launch_command_for_one_process(tmp_path):
    assert launch_command(tmp_path / "spec.json", 1, python="py") == ["py", "-m", "trainer", "train", "--spec",
                                                                     str(tmp_path / "spec.json")]
    assert sys.executable == launch_command(tmp_path / "spec.json", 3)[0]
