"""The GRPO loop, top to bottom: sample groups, score them in their environments, group advantages,
clipped policy loss, optimizer step, log; every `eval_interval` steps evaluate the holdout and checkpoint.

Call `train_grpo(spec, events)`; `reward_fn` replaces the verifier reward (experiments such as the
wrong-reward test), everything else comes from the spec. Under torchrun each rank samples its share of a
step's groups and the gradients are summed over the ranks (`trainer.distributed`); one process is the
same code with every collective the identity.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from trainer.batching import collate, token_logprobs
from trainer.config import GRPOConfig, JobSpec
from trainer.distributed import current, rollout_seed
from trainer.envs import max_turns
from trainer.evaluation import make_env_for
from trainer.losses import group_advantages, policy_loss, zero_variance_groups
from trainer.models import enable_gradient_checkpointing
from trainer.rollout.episodes import Episode, run_episodes, start_episodes
from trainer.runner import JobRunner
from trainer.tracking import EventLog
from trainer.verifiers import component_means

RewardFn = Callable[[Episode], float]


def shaped_reward(ep: Episode, format_reward: float) -> float:
    """The reward GRPO optimises: the verifier's, plus `format_reward` when the output parsed."""
    parsed = ep.score is not None and ep.score.failure != "invalid_format"
    return ep.reward + (format_reward if parsed else 0.0)


def sample_groups(run: JobRunner, reward_fn: RewardFn | None) -> tuple[list[Episode], torch.Tensor, dict]:
    """num_prompts_per_step groups of G episodes: this process's share of them (its generation batches), and
    the step's metrics over every process's. With dynamic sampling (DAPO), groups whose rewards are all equal
    carry no gradient: they are dropped and new prompts are sampled, for a bounded number of rounds."""
    cfg, rows, dist = run.cfg, run.train_rows, current()
    G, P = cfg.num_generations_per_prompt, cfg.num_prompts_per_step
    kept: list[Episode] = []
    rewards: list[float] = []
    sampled: list[float] = []
    scores: list = []  # every sampled episode's Score: the reward components' means come from all of them
    used: set[int] = set()
    n_groups = n_zero = rounds = tokens = n_kept = 0
    while True:
        need = P - n_kept
        candidates = [i for i in range(len(rows)) if i not in used] or list(range(len(rows)))
        # The same draw on every rank (one prompt stream, one seed); each then plays only its own batches.
        picked = run.rng.sample(candidates, min(need, len(candidates)))
        used.update(picked)
        zero_here = 0
        for b, groups in dist.my_batches(len(picked), cfg.rollout_batch_groups):
            # A batch's samples depend on (seed, step, round, batch) alone: not on the rank, nor on a resume.
            torch.manual_seed(rollout_seed(cfg.seed, run.step, rounds, b))
            eps = start_episodes([rows[picked[g]] for g in groups], G, run.tokenizer, make_env_for)
            run_episodes(run.engine, run.tokenizer, eps, max_new_tokens=cfg.max_new_tokens,
                         temperature=cfg.temperature, max_turns=cfg.max_turns, max_seq_len=cfg.max_seq_len)
            r = torch.tensor([reward_fn(ep) if reward_fn else shaped_reward(ep, cfg.format_reward) for ep in eps],
                             dtype=torch.float)
            zero = zero_variance_groups(r, G)
            for g in range(len(groups)):
                if cfg.use_dynamic_sampling and bool(zero[g]):
                    continue
                kept += eps[g * G:(g + 1) * G]
                rewards += r[g * G:(g + 1) * G].tolist()
            sampled += r.tolist()
            scores += [ep.score for ep in eps]
            tokens += sum(ep.completion_tokens for ep in eps)
            zero_here += int(zero.sum())
        round_zero, kept_total = dist.sum([zero_here, len(kept) // G])  # over every rank
        n_groups, n_zero, rounds, n_kept = n_groups + len(picked), n_zero + int(round_zero), rounds + 1, int(kept_total)
        if not cfg.use_dynamic_sampling or n_kept >= P or rounds > cfg.max_resample_rounds:
            break
    # The step's metrics are over every rank's episodes: each rank's numbers, gathered.
    ranks = dist.gather({"sampled": sampled, "scores": scores, "tokens": tokens,
                         "kept": [(bool(ep.score.passed), ep.completion_tokens, ep.turns, ep.truncated)
                                  for ep in kept]})
    all_r = torch.tensor([x for rank in ranks for x in rank["sampled"]])
    all_kept = [k for rank in ranks for k in rank["kept"]]
    stats = {
        "reward_mean": all_r.mean().item(), "reward_std": all_r.std().item() if len(all_r) > 1 else 0.0,
        "frac_zero_variance_groups": n_zero / max(n_groups, 1), "groups_kept": n_kept,
        "sampling_rounds": rounds, "completion_tokens": sum(rank["tokens"] for rank in ranks),
        # rows with weighted rewards: "reward/<name>", each component's mean
        **component_means([s for rank in ranks for s in rank["scores"]]),
    }
    if dist.enabled:  # the load of each rank (a list: events only, not MLflow)
        stats["groups_per_rank"] = [len(rank["kept"]) // G for rank in ranks]
    if all_kept:
        passed, lengths, turns, truncated = zip(*all_kept, strict=True)
        stats["train_success_rate"] = sum(passed) / len(all_kept)
        stats["completion_length"] = sum(lengths) / len(all_kept)
        stats["turns"] = sum(turns) / len(all_kept)
        stats["frac_truncated"] = sum(truncated) / len(all_kept)
    return kept, torch.tensor(rewards, dtype=torch.float), stats


def step_advantages(run: JobRunner, rewards: torch.Tensor) -> torch.Tensor:
    """This process's advantages. A group is never split between ranks, so group scaling needs only this
    rank's rewards; batch scaling needs the std of the whole step's, gathered from every rank."""
    cfg, dist = run.cfg, current()
    per_rank = dist.gather(rewards.tolist())
    start = sum(len(r) for r in per_rank[: dist.rank])
    everything = torch.tensor([x for r in per_rank for x in r], dtype=torch.float)
    return group_advantages(everything, cfg.num_generations_per_prompt, cfg.scale_rewards)[start:start + len(rewards)]


def optimize(run: JobRunner, episodes: list[Episode], rewards: torch.Tensor) -> dict[str, Any]:
    """One GRPO update on a batch of groups (num_iterations passes over it); under torchrun on this process's
    groups, which may be none this step (dynamic sampling), with the step's gradient summed over the ranks."""
    cfg: GRPOConfig = run.cfg
    model, device, dist = run.model, next(run.model.parameters()).device, current()
    adv = step_advantages(run, rewards).to(device)
    micro, mbs, local_tokens = [], [], 0.0
    if episodes:
        batch = collate(episodes, run.tokenizer.pad_token_id)
        if cfg.use_overlong_filter:  # DAPO: a cut-off episode says nothing about its reward; no loss on it
            for i, ep in enumerate(episodes):
                if ep.truncated:
                    batch.loss_mask[i] = 0
        local_tokens = float(batch.loss_mask.sum())
        # A group's episodes together (they share a prompt), similar lengths together (micro-batches pad less).
        order = sorted(range(len(episodes)), key=lambda i: (int(batch.prompts[i]), len(episodes[i].token_ids)))
        micro = [order[i:i + cfg.train_batch_size] for i in range(0, len(order), cfg.train_batch_size)]
        mbs = [batch.select(idx) for idx in micro]
    # Normalisers are the whole step's, over every rank: each micro-batch's loss is its share of the step's
    # loss, so accumulated gradients, summed over the ranks, are the step's gradient.
    n_seq, n_tokens, n_without = dist.sum([len(episodes), local_tokens,
                                          sum(not ep.has_sampler_logprobs for ep in episodes)])
    n_seq, n_tokens = int(n_seq), max(n_tokens, 1.0)
    use_is = cfg.importance_sampling_correction and n_without == 0
    share, pack = cfg.share_prompt_prefix, cfg.pack_sequences

    old, ref = [], []
    with torch.no_grad(), _precision(cfg, device):
        for mb in mbs:
            # With one pass the "old" policy is the current one: its logprobs are the detached ones below.
            old.append(token_logprobs(model, mb, cfg.temperature, share_prefix=share, pack=pack)[0]
                       if cfg.num_iterations > 1 else None)
            if cfg.beta != 0.0:
                with model.disable_adapter():  # the reference is the base model: no second copy in memory
                    ref.append(token_logprobs(model, mb, cfg.temperature, share_prefix=share, pack=pack)[0])
            else:
                ref.append(None)

    model.train()
    sums = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "entropy": 0.0, "is_weight": 0.0}
    grad_norm = 0.0
    for it in range(cfg.num_iterations):
        run.optimizer.zero_grad(set_to_none=True)
        for k, (idx, mb) in enumerate(zip(micro, mbs, strict=True)):
            mask = mb.loss_mask.to(device)
            with _precision(cfg, device):
                logp, ent = token_logprobs(model, mb, cfg.temperature, entropy=it == 0, share_prefix=share, pack=pack)
            old_logp = old[k] if old[k] is not None else logp.detach()
            is_w = None
            if use_is:  # truncated IS: the sampler is not exactly the trainer (vLLM kernels, merged LoRA)
                is_w = torch.exp(old_logp - mb.sampler_logprobs.to(device)).clamp(max=cfg.importance_sampling_cap)
                sums["is_weight"] += float((is_w * mask).sum()) / n_tokens
            loss, m = policy_loss(
                logp, old_logp, adv[idx], mask, loss_type=cfg.loss_type, epsilon=cfg.epsilon,
                epsilon_high=cfg.clip_high, beta=cfg.beta, ref_logp=ref[k], is_weights=is_w,
                num_sequences=n_seq, num_tokens=n_tokens, max_completion_length=run.max_completion_length,
            )
            loss.backward()
            tok_share = float(mask.sum()) / n_tokens
            sums["loss"] += loss.item()
            sums["clip_fraction"] += m["clip_fraction"] * tok_share
            sums["kl"] += m.get("kl", 0.0) * tok_share
            if ent is not None:
                sums["entropy"] += float((ent * mask).sum()) / n_tokens
        dist.all_reduce_grads(run.params)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(run.params, cfg.max_grad_norm))
        run.optimizer.step()
    sums = dict(zip(sums, dist.sum(list(sums.values())), strict=True))  # each rank's share of the step's
    out = {k: v / (cfg.num_iterations if k in ("loss", "clip_fraction", "kl", "is_weight") else 1)
           for k, v in sums.items()}
    out["grad_norm"] = grad_norm
    if cfg.beta == 0.0:
        out.pop("kl")
    if not use_is:
        out.pop("is_weight")
    return out


def _precision(cfg: GRPOConfig, device: torch.device) -> AbstractContextManager:
    # bf16 matmuls for the forwards on a GPU; the head's logits are upcast, so logprobs stay float32.
    if cfg.bf16 and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def prepare_grpo(run: JobRunner) -> None:
    """What GRPO steps need of a run before the first of them."""
    cfg = run.cfg
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(run.model)
    turns = max(max_turns(r, cfg.max_turns) for r in run.train_rows)
    run.max_completion_length = cfg.max_new_tokens * turns  # Dr. GRPO's constant normaliser


def grpo_steps(run: JobRunner, steps: range, reward_fn: RewardFn | None = None) -> None:
    """GRPO's optimizer steps `steps`: sample groups, update, log (evaluate and checkpoint as due)."""
    for step in steps:
        run.step = step
        t0 = time.perf_counter()
        run.engine.sync(run.model, step - 1)  # policy version = weights after step - 1 updates
        episodes, rewards, stats = sample_groups(run, reward_fn)
        t_rollout = time.perf_counter() - t0
        stats["lr"] = run.lr
        if stats["groups_kept"]:  # over every rank
            run.release_rollout_memory()  # vLLM sleeps through the update; the next generate wakes it
            stats |= optimize(run, episodes, rewards)
        # else: every group had equal rewards even after refilling; nothing to learn from this step.
        run.scheduler.step()  # the schedule counts steps, trained on or not
        step_time = time.perf_counter() - t0
        stats |= {"step_time": step_time, "rollout_time": t_rollout, "train_time": step_time - t_rollout,
                  "tokens_per_s": stats["completion_tokens"] / max(t_rollout, 1e-9)}
        run.log_step(step, stats)  # the event, MLflow, then evaluate + checkpoint as due


def train_grpo(spec: JobSpec, events: EventLog, *, reward_fn: RewardFn | None = None) -> dict[str, Any]:
    run = JobRunner(spec, events)
    prepare_grpo(run)
    try:
        run.maybe_eval_start()
        grpo_steps(run, range(run.state["step"] + 1, run.cfg.max_steps + 1), reward_fn)
        return run.finish()
    except Exception as exc:
        raise run.fail(exc) from exc
