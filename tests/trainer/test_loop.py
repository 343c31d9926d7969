"""The GRPO loop, through `train_grpo`: one step per loss variant, DAPO's dynamic sampling dropping and
refilling groups, its overlong filter giving cut-off episodes exactly zero loss and gradient, the clip
biting on the second pass over a batch, the advantages of each `scale_rewards` mode, and the KL reference
being the base model (the adapter disabled, no second copy)."""

from __future__ import annotations

import dataclasses
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
    # IS correction is on and the HF sampler's logprobs are the trainer's: every weight is 1 (GSPO too).
    assert step["is_weight"] == pytest.approx(1.0, abs=1e-3)


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
    assert step["grad_norm"] > 0 and adapter_b_nonzero(job_dir)


@pytest.mark.parametrize("overlong_filter", [True, False])
def test_overlong_filter_gives_truncated_episodes_zero_loss_and_gradient(tiny_model, job_dir, monkeypatch,
                                                                         overlong_filter):
    """DAPO's overlong filter: whatever tokens a cut-off episode holds, the step's loss and gradient are the
    same, i.e. it contributes exactly zero. Without the filter the same change moves both: the check can fail."""
    results = []
    real = trainer.loop.optimize

    def spy(run, episodes, rewards):
        for ep in episodes[::4]:  # the first episode of each group counts as cut off
            ep.truncated = True
        vocab = len(run.tokenizer)
        scrambled = [dataclasses.replace(ep, token_ids=[(t * 7 + 3) % vocab if m else t
                                                        for t, m in zip(ep.token_ids, ep.mask, strict=True)])
                     if ep.truncated else ep for ep in episodes]
        step = run.optimizer.step
        grads = []
        run.optimizer.step = lambda *a, **k: grads.append([p.grad.clone() for p in run.params])
        losses = [real(run, eps, rewards)["loss"] for eps in (episodes, scrambled)]
        run.optimizer.step = step
        results.append((losses, grads))
        return real(run, episodes, rewards)

    monkeypatch.setattr(trainer.loop, "optimize", spy)
    config = small_config(loss_type="dapo", dynamic_sampling=False, mask_truncated_completions=overlong_filter)
    run(tiny_model, job_dir, config, reward_fn=alternating_rewards())
    (losses, (grads, grads_scrambled)), = results
    assert any(bool(g.abs().sum()) for g in grads)  # the other episodes do train
    diff = max(float((a - b).abs().max()) for a, b in zip(grads, grads_scrambled, strict=True))
    if overlong_filter:
        assert losses[0] == losses[1] and diff == 0.0
    else:
        assert losses[0] != losses[1] and diff > 1e-6


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


def test_num_iterations_makes_the_clip_bite(tiny_model, job_dir, monkeypatch):
    """With two passes over a batch the second pass's ratio is against the policy that sampled it, which
    the first pass's update moved: some tokens are clipped and the loss is no longer the unclipped one.
    (With old = current logprobs on every pass, the ratio would stay 1 and the clip would never act.)"""
    calls = []
    real = trainer.loop.policy_loss

    def spy(logp, old_logp, advantages, mask, **kw):
        loss, metrics = real(logp, old_logp, advantages, mask, **kw)
        unclipped, _ = real(logp, old_logp, advantages, mask, **{**kw, "epsilon": 1e9, "epsilon_high": 1e9})
        calls.append((metrics["clip_fraction"], loss.item(), unclipped.item()))
        return loss, metrics

    monkeypatch.setattr(trainer.loop, "policy_loss", spy)
    config = small_config(num_iterations=2, epsilon=0.05, train_batch_size=64, learning_rate=2e-2)
    _, steps = run(tiny_model, job_dir, config, reward_fn=alternating_rewards())
    assert len(calls) == 2  # one micro-batch, two passes
    (clip1, loss1, unclipped1), (clip2, loss2, unclipped2) = calls
    assert clip1 == 0.0 and loss1 == pytest.approx(unclipped1, abs=1e-7)  # pass 1: ratio 1 everywhere
    assert clip2 > 0 and abs(loss2 - unclipped2) > 1e-6
    assert steps[0]["clip_fraction"] == pytest.approx(clip2 / 2)  # the mean over the two passes


@pytest.mark.parametrize("mode", ["group", "batch", "none"])
def test_scale_rewards_advantages_inside_the_loop(tiny_model, job_dir, monkeypatch, mode):
    """The advantages the loop hands to the loss are (r - group mean) divided by the group's std, the
    batch's std, or nothing. The rewards are chosen so that the three give different numbers."""
    seen = []
    real = trainer.loop.policy_loss

    def spy(logp, old_logp, advantages, mask, **kw):
        seen.append(advantages.detach().cpu().clone())
        return real(logp, old_logp, advantages, mask, **kw)

    monkeypatch.setattr(trainer.loop, "policy_loss", spy)
    values = [0.0, 1.0, 3.0, 0.5, 2.0, 2.5, 0.0, 7.0]  # group stds 1.3 and 3.1, batch std 2.3
    given = []

    def reward_fn(ep):
        given.append(values[len(given) % len(values)])
        return given[-1]

    run(tiny_model, job_dir, small_config(scale_rewards=mode, train_batch_size=64), reward_fn=reward_fn)
    r = torch.tensor(given).view(2, 4)
    centred = r - r.mean(dim=1, keepdim=True)
    formulas = {"group": centred / (r.std(dim=1, keepdim=True) + 1e-4), "batch": centred / (r.std() + 1e-4),
                "none": centred}
    (got,) = seen  # one micro-batch (its episodes sorted by group and length: compare as sorted lists)
    expected = sorted(formulas[mode].flatten().tolist())
    assert sorted(got.tolist()) == pytest.approx(expected, rel=1e-5)
    for other in set(formulas) - {mode}:
        assert sorted(formulas[other].flatten().tolist()) != pytest.approx(expected, rel=1e-3)


def test_a_format_reward_ranks_a_parsed_failure_above_an_unparseable_one_and_leaves_passing_alone():
    """A group where every sample fails carries no gradient on the verifier's reward alone; with a format
    reward, the samples whose output parsed are pulled up against those that did not."""
    from trainer.losses import group_advantages
    from trainer.rollout.episodes import Episode
    from trainer.verifiers import Score

    def episode(reward: float, failure: str | None) -> Episode:
        ep = Episode(row={}, group=0, env=None, token_ids=[], mask=[], sampler_logprobs=[], prompt_len=0)
        ep.score, ep.reward = Score(reward, failure is None, {}, failure), reward
        return ep

    group = [episode(0.0, "invalid_format"), episode(0.0, "wrong_arguments"), episode(0.0, "wrong_tool"),
             episode(0.0, "invalid_format")]
    plain = torch.tensor([trainer.loop.shaped_reward(ep, 0.0) for ep in group])
    shaped = torch.tensor([trainer.loop.shaped_reward(ep, 0.1) for ep in group])
    assert torch.count_nonzero(group_advantages(plain, 4, "group")) == 0
    advantages = group_advantages(shaped, 4, "group")
    assert advantages[1] > 0 and advantages[2] > 0 and advantages[0] < 0 and advantages[3] < 0
    assert trainer.loop.shaped_reward(episode(1.0, None), 0.1) == pytest.approx(1.1)
    with pytest.raises(Exception, match="format_reward"):
        GRPOConfig(format_reward=-0.1)
