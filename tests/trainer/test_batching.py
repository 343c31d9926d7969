"""Prefix sharing in the training forward: the same logprobs, entropies and gradients as the full forward."""

from __future__ import annotations

import torch

from trainer.batching import collate, token_logprobs
from trainer.evaluation import make_env_for
from trainer.rollout.episodes import run_episodes, start_episodes
from trainer.rollout.hf import HFEngine


def _episodes(make_lora_policy, tasks):
    model, tok = make_lora_policy()
    # Prompts of different lengths, 3 samples each, multi-turn (observations after the first turn).
    eps = start_episodes(tasks, 3, tok, make_env_for)
    run_episodes(HFEngine(model, tok), tok, eps, max_new_tokens=16, temperature=1.0, max_turns=3, max_seq_len=1024)
    return model, tok, eps


def _grads(model, batch, share: bool):
    model.zero_grad(set_to_none=True)
    logp, ent = token_logprobs(model, batch, 0.8, entropy=True, share_prefix=share)
    mask = batch.loss_mask
    (logp * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logp.detach(), ent, grads


def test_shared_prefix_matches_the_full_forward(make_lora_policy, workplace_tasks):
    tasks = workplace_tasks["holdout"][:4]
    model, tok, eps = _episodes(make_lora_policy, tasks)
    assert len({ep.prompt_len for ep in eps}) > 1  # left padding of the prompts is exercised
    batch = collate(eps, tok.pad_token_id)
    assert batch.prompts.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    full_logp, full_ent, full_grads = _grads(model, batch, share=False)
    shared_logp, shared_ent, shared_grads = _grads(model, batch, share=True)
    mask = batch.loss_mask.bool()
    assert mask.sum() > 40
    assert (full_logp - shared_logp)[mask].abs().max() < 1e-4
    assert (full_ent - shared_ent)[mask].abs().max() < 1e-4
    for name, g in full_grads.items():
        assert torch.allclose(g, shared_grads[name], atol=1e-5, rtol=1e-3), name
    assert any(g.abs().sum() > 0 for g in full_grads.values())

    # A micro-batch that splits groups, and the sampler's own logprobs agree with both.
    sub = batch.select([1, 2, 3, 7])
    sub_logp, _, _ = _grads(model, sub, share=True)
    assert (sub_logp - full_logp[[1, 2, 3, 7], : sub_logp.shape[1]])[sub.loss_mask.bool()].abs().max() < 1e-4


def test_rounds_that_reuse_group_numbers_are_not_merged(make_lora_policy, workplace_tasks):
    """Dynamic sampling starts a second round at group 0 again: prompts are told apart by their tokens."""
    _, tok, eps = _episodes(make_lora_policy, workplace_tasks["holdout"][4:6])
    for ep in eps:
        ep.group = 0
    batch = collate(eps, tok.pad_token_id)
    assert batch.prompts.tolist() == [0, 0, 0, 1, 1, 1]
