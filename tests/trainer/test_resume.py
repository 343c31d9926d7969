"""The learning-rate schedule, `save_steps` checkpoints and resuming from any of them.

A run killed after step 2 and retried, and a run resumed with `resume_from` from a step that was neither
evaluated nor the newest, must go on exactly as the uninterrupted run did: same prompts (the prompt
stream's state), same samples (seeded per step), same optimizer moments and learning rate (the scheduler's
state), hence the same losses and the same adapter. Tolerances: 1e-6 on step metrics; 1e-5 on adapter
weights (the HF engine restores the base weights bit for bit after merging the adapter to sample, so this is
room for float noise only). A step taken from a wrong state moves the weights by about the lr, 1e-3 to 1e-2.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from trainer.config import GRPOConfig, JobSpec, SpecError, load_spec
from trainer.loop import train_grpo
from trainer.runner import JobFailed, make_scheduler
from trainer.tracking import EventLog

BASE_LR = 1e-2
CONFIG = dict(num_prompts_per_step=2, num_generations_per_prompt=4, max_new_tokens=24, max_steps=4,
              eval_interval=100, eval_on_start=False, save_steps=1, learning_rate=BASE_LR,
              lr_scheduler_type="linear", warmup_steps=2, r=4, alpha=8, train_batch_size=8, num_threads=1)
COMPARED = ("reward_mean", "completion_tokens", "loss", "entropy", "grad_norm", "lr")


def train(job_dir, reward_fn=None, **spec) -> list[dict]:
    events = EventLog(None)
    job = JobSpec(model=spec.pop("model"), job_dir=job_dir, train=job_dir / "train.jsonl",
                  config=GRPOConfig(**CONFIG), mlflow=False, **spec)
    try:
        train_grpo(job, events, reward_fn=reward_fn)
    except JobFailed:
        pass
    return events.events


def steps_of(events: list[dict]) -> dict[int, dict]:
    return {e["step"]: e for e in events if e["event"] == "step"}


def adapter(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "adapter_model.safetensors"))


def assert_same(got: dict, want: dict) -> None:
    # abs 1e-6: with one pass the GRPO loss is -mean(advantage) ~ 0, float noise around it
    for key in COMPARED:
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), (got["step"], key)


def test_resume_from_any_saved_step_continues_the_uninterrupted_run(tiny_model, job_dir, tmp_path_factory):
    # The uninterrupted run: 4 steps, a checkpoint after each (save_steps 1), no evaluation before the last.
    full = steps_of(train(job_dir, model=str(tiny_model)))
    assert sorted(full) == [1, 2, 3, 4] and any(full[s]["grad_norm"] > 0 for s in (3, 4))
    # Warmup 2 then linear decay to 0 at step 4 (transformers' schedule): step 1 trains at lr 0 ...
    assert [full[s]["lr"] for s in (1, 2, 3, 4)] == pytest.approx([0.0, BASE_LR / 2, BASE_LR, BASE_LR / 2])
    ckpts = job_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000003", "step-000004"]  # newest 2 kept
    last = adapter(job_dir / "adapters" / "last")

    # The same job killed during step 3 (after step 2's save_steps checkpoint), then retried.
    killed = tmp_path_factory.mktemp("killed")
    for name in ("train.jsonl",):
        (killed / name).write_text((job_dir / name).read_text())
    calls = 0

    def dies_in_step_3(ep):
        nonlocal calls
        calls += 1
        if calls > 2 * 2 * 4:  # two steps of 2 prompts x 4 samples
            raise RuntimeError("killed")
        return ep.reward

    first = train(killed, dies_in_step_3, model=str(tiny_model))
    assert first[-1]["event"] == "error" and first[-1]["step"] == 3
    # ... step 1 ran at lr 0, so its checkpoint's adapter is still the initial one (LoRA B zero):
    # the optimizer used the schedule's lr, not only the log.
    step1 = adapter(killed / "checkpoints" / "step-000001" / "adapter")
    assert all(not torch.count_nonzero(w) for k, w in step1.items() if "lora_B" in k)
    retry = train(killed, model=str(tiny_model))
    assert retry[-1]["resumed_from"].endswith("step-000002")
    resumed = steps_of(retry)
    assert sorted(resumed) == [3, 4]
    for s in (3, 4):
        assert_same(resumed[s], full[s])
    b = adapter(killed / "adapters" / "last")
    assert max(float((last[k] - b[k]).abs().max()) for k in last) < 1e-5

    # resume_from an earlier checkpoint of the finished job: step 4 again, as it was; the abandoned step-4
    # checkpoint is discarded before the new one is written.
    (ckpts / "step-000004" / "marker").write_text("abandoned")
    again = train(job_dir, model=str(tiny_model), resume_from=str(ckpts / "step-000003"))
    assert again[-1]["resumed_from"].endswith("step-000003")
    assert sorted(steps_of(again)) == [4]
    assert_same(steps_of(again)[4], full[4])
    assert not (ckpts / "step-000004" / "marker").exists()
    c = adapter(job_dir / "adapters" / "last")
    assert max(float((last[k] - c[k]).abs().max()) for k in last) < 1e-5


@pytest.mark.parametrize("kind, warmup, expected", [
    # (lr / base per step; step s trains at the schedule's value at s - 1)
    ("constant", {}, [1, 1, 1, 1, 1, 1, 1, 1]),
    ("constant", {"warmup_steps": 2}, [0, 0.5, 1, 1, 1, 1, 1, 1]),  # warmup is never ignored
    ("linear", {"warmup_ratio": 0.25}, [0, 0.5, 1, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6]),
    ("cosine", {"warmup_steps": 2}, [0, 0.5] + [0.5 * (1 + math.cos(math.pi * k / 6)) for k in range(6)]),
])
def test_lr_schedule(kind, warmup, expected):
    cfg = GRPOConfig(learning_rate=2.0, max_steps=8, lr_scheduler_type=kind, **warmup)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=cfg.learning_rate)
    scheduler = make_scheduler(cfg, optimizer)
    seen = []
    for _ in range(cfg.max_steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([2.0 * x for x in expected])


def test_defaults_and_bad_values():
    assert GRPOConfig().scheduler_name("grpo") == "constant" and GRPOConfig().scheduler_name("sft") == "cosine"
    for bad, field in [({"lr_scheduler_type": "exp"}, "lr_scheduler_type"), ({"warmup_steps": -1}, "warmup_steps"),
                       ({"warmup_ratio": 1.5}, "warmup_ratio"), ({"save_steps": 0}, "save_steps"),
                       ({"rollout_batch_groups": 0}, "rollout_batch_groups")]:
        with pytest.raises(SpecError, match=field):
            GRPOConfig.from_dict(bad)


def test_spec_num_gpus_and_resume_from(tiny_model, job_dir):
    spec = job_dir / "spec.json"
    spec.write_text(f'{{"model": "{tiny_model}", "num_gpus": 4}}')
    assert load_spec(spec).num_gpus == 4 and load_spec(spec).resume_from is None
    for bad, field in [('"num_gpus": 0', "num_gpus"), ('"num_gpus": "2"', "num_gpus"),
                       ('"resume_from": "checkpoints/step-000009"', "resume_from")]:
        spec.write_text(f'{{"model": "{tiny_model}", {bad}}}')
        with pytest.raises(SpecError, match=field):
            load_spec(spec)
