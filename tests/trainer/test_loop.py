"""The GRPO loop, through `train_grpo`: one step per loss variant, DAPO's dynamic sampling dropping and
refilling groups, and the KL reference being the base model (the adapter disabled, no second copy)."""

from __future__ import annotations

import itertools

import pytest
import torch
from safetensors.torch import load_file

import trainer.loop
from trainer.batching import token_logprobs
from trainer.config import GRPOConfig, JobSpec
from trainer.loop import train_grpo
from trainer.models import load_model
from trainer.tracking import EventLog


def small_config(**overrides) -> GRPOConfig:
    base = dict(num_prompts_per_step=2, num_generations_per_prompt=4, max_new_tokens=48, max_steps=1,
                learning_rate=1e-2, eval_on_start=False, r=4, alpha=8, train_batch_size=3, num_threads=1)
    return GRPOConfig(**{**base, **overrides})


def run(tiny_model, job_dir, config: GRPOConfig, reward_fn=None) -> tuple[dict, list[dict]]:
    spec = JobSpec(model=str(tiny_model), job_dir=job_dir, train=job_dir / "train.jsonl", config=config,
                   mlflow=False)
    events = EventLog(None)
    done = train_grpo(spec, events, reward_fn=reward_fn)
    return done, [e for e in events.events if e["event"] == "step"]


def alternating_rewards(start_after: int = 0):
    """A reward_fn whose first `start_after` rewards are all 0 (groups with nothing to learn from), then
    0, 1, 0, 1, ...: every later group of an even size has both rewards, so it always carries a gradient."""
    counter = itertools.count()
    return lambda ep: 0.0 if (n := next(counter)) < start_after else float(n % 2)


def adapter_b_nonzero(job_dir) -> bool:
    weights = load_file(str(job_dir / "adapters" / "last" / "adapter_model.safetensors"))
    # LoRA B starts at zero: any non-zero B means a gradient reached the adapter and a step was taken.
    return any(bool(torch.count_nonzero(w)) for k, w in weights.items() if "lora_B" in k)


@pytest.mark.parametrize("loss_type, beta, iterations", [("grpo", 0.0, 1), ("gspo", 0.05, 2), ("dr_grpo", 0.1, 1)])
def test_one_step_per_variant(tiny_model, job_dir, loss_type, beta, iterations):
    config = small_config(loss_type=loss_type, beta=beta, num_iterations=iterations,
                          epsilon=0.2 if loss_type != "gspo" else 3e-3)
    done, steps = run(tiny_model, job_dir, config, reward_fn=alternating_rewards())
    step = steps[0]
    assert done["step"] == 1
    assert ("kl" in step) == (beta > 0)
    # No dynamic sampling outside dapo: one round, every group kept.
    assert step["sampling_rounds"] == 1 and step["groups_kept"] == 2 and step["frac_zero_variance_groups"] == 0.0
    if iterations == 1 and beta > 0:
        # At the first step LoRA B is zero, so the policy is the reference: KL is exactly zero.
        assert step["kl"] == pytest.approx(0.0, abs=1e-7)
    assert step["grad_norm"] > 0 and adapter_b_nonzero(job_dir)


def test_dapo_drops_zero_variance_groups_and_refills(tiny_model, job_dir):
    G, P = 4, 2
    config = small_config(loss_type="dapo", num_generations_per_prompt=G, num_prompts_per_step=P)
    assert config.use_dynamic_sampling and config.use_overlong_filter  # dapo's defaults
    # The first round's groups all get reward 0 and must be dropped; the refill's groups all vary.
    done, steps = run(tiny_model, job_dir, config, reward_fn=alternating_rewards(start_after=P * G))
    step = steps[0]
    assert step["sampling_rounds"] == 2 and step["groups_kept"] == P
    assert step["frac_zero_variance_groups"] == 0.5  # 2 of the 4 groups sampled
    assert step["reward_mean"] == pytest.approx(0.25)  # over all 16 samples: 8 zeros, then 0/1 alternating
    assert step["frac_truncated"] < 1  # the overlong filter leaves tokens to train on
    assert step["grad_norm"] > 0 and adapter_b_nonzero(job_dir)


def test_kl_reference_is_the_base_model(tiny_model, job_dir, monkeypatch):
    """The loop's reference logprobs (adapter disabled) equal a freshly loaded base model's on the same
    sequences once the adapter has moved, and the reported KL is then positive."""
    calls: list[tuple[bool, object, torch.Tensor]] = []
    real = trainer.loop.token_logprobs

    def spy(model, batch, temperature=1.0, **kw):
        out = real(model, batch, temperature, **kw)
        calls.append((torch.is_grad_enabled(), batch, out[0].detach().clone()))
        return out

    monkeypatch.setattr(trainer.loop, "token_logprobs", spy)
    config = small_config(loss_type="grpo", beta=0.1, max_steps=2, train_batch_size=64, temperature=0.8)
    done, steps = run(tiny_model, job_dir, config, reward_fn=alternating_rewards())
    assert done["step"] == 2
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-7)  # B == 0: policy == reference
    assert steps[1]["kl"] > 1e-6  # after one update the policy has moved away from the base

    # With one pass per batch and one micro-batch per step, the no-grad calls are the reference ones.
    ref_calls = [(batch, logp) for grad, batch, logp in calls if not grad]
    policy_calls = [(batch, logp) for grad, batch, logp in calls if grad]
    assert len(ref_calls) == 2 and len(policy_calls) == 2
    batch, ref = ref_calls[-1]
    assert policy_calls[-1][0] is batch
    mask = batch.loss_mask.bool()
    assert mask.sum() > 10

    base, _ = load_model(tiny_model, device="cpu")
    base.eval()
    with torch.no_grad():
        fresh, _ = token_logprobs(base, batch, 0.8)
    assert (ref - fresh)[mask].abs().max() < 1e-4
    # ... and the policy's own logprobs at that step are not the base's: the check above is not vacuous.
    assert (policy_calls[-1][1] - fresh)[mask].abs().max() > 1e-3
