"""Prefix sharing and packing in the training forward: the same logprobs, entropies and gradients as the full
forward."""

from __future__ import annotations

import torch

from trainer.batching import collate, pack_layout, pack_width, token_logprobs
from trainer.evaluation import make_env_for
from trainer.rollout.episodes import Episode, run_episodes, start_episodes
from trainer.rollout.hf import HFEngine


def _episodes(make_lora_policy, tasks):
    model, tok = make_lora_policy()
    # Prompts of different lengths, 3 samples each, multi-turn (observations after the first turn).
    eps = start_episodes(tasks, 3, tok, make_env_for)
    run_episodes(HFEngine(model, tok), tok, eps, max_new_tokens=16, temperature=1.0, max_turns=3, max_seq_len=1024)
    return model, tok, eps


def _grads(model, batch, share: bool, pack: bool = False):
    model.zero_grad(set_to_none=True)
    logp, ent = token_logprobs(model, batch, 0.8, entropy=True, share_prefix=share, pack=pack)
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


def _synthetic_episodes(vocab: int) -> list[Episode]:
    """Three prompts (12, 30 and 20 tokens), each with continuations from 3 to 70 tokens, some with an
    observation (tokens the model did not produce) in the middle: rows from a quarter to all of the longest."""
    g = torch.Generator().manual_seed(0)
    eps = []
    for group, (plen, conts) in enumerate([(12, [3, 70, 8, 5]), (30, [40, 4, 6]), (20, [10, 52, 3, 9, 7])]):
        prompt = torch.randint(4, vocab, (plen,), generator=g).tolist()
        for n in conts:
            mask = [1] * n
            if n > 20:
                mask[8:14] = [0] * 6
            eps.append(Episode(row={}, group=group, env=None, prompt_len=plen,
                               token_ids=prompt + torch.randint(4, vocab, (n,), generator=g).tolist(),
                               mask=[0] * plen + mask, sampler_logprobs=[0.0] * (plen + n)))
    return eps


def test_packed_rows_match_the_padded_forward(make_lora_policy, monkeypatch):
    """Rows laid end to end, with and without one copy of a shared prompt, at the longest row's width and at a
    group's whole width, under gradient checkpointing too, with sdpa's and eager attention's masks."""
    import trainer.batching
    from trainer.models import enable_gradient_checkpointing

    model, tok = make_lora_policy()
    batch = collate(_synthetic_episodes(model.config.vocab_size), tok.pad_token_id)
    lens = batch.attention_mask.sum(dim=1)
    full_logp, full_ent, full_grads = _grads(model, batch, share=False)
    mask = batch.loss_mask.bool()
    for share in (False, True):
        bins, width = pack_layout(batch, share)
        assert width == int(lens.max())
        assert sorted(i for b in bins for _, rows in b for i in rows) == list(range(len(batch)))
        assert len(bins) <= len(batch) / 2  # a packed row holds two rows or more on average
        assert any(len(rows) > 1 for b in bins for _, rows in b) == share  # units of one prompt and 2+ rows
        logp, ent, grads = _grads(model, batch, share=share, pack=True)
        assert (full_logp - logp)[mask].abs().max() < 1e-4, share
        assert (full_ent - ent)[mask].abs().max() < 1e-4, share
        assert (logp[~mask] == 0).all()
        for name, g in full_grads.items():
            assert torch.allclose(g, grads[name], atol=1e-5, rtol=1e-3), (share, name)
    # Wide enough that every group is one unit: each prompt once, all its continuations after it.
    wide = int(lens.max()) * 3
    bins, _ = pack_layout(batch, True, wide)
    assert sorted(len(rows) for b in bins for _, rows in b) == [3, 4, 5]
    monkeypatch.setattr(trainer.batching, "pack_width", lambda *_: wide)
    logp, _, grads = _grads(model, batch, share=True, pack=True)
    assert (full_logp - logp)[mask].abs().max() < 1e-4
    for name, g in full_grads.items():
        assert torch.allclose(g, grads[name], atol=1e-5, rtol=1e-3), name
    monkeypatch.undo()
    enable_gradient_checkpointing(model)
    model.train()
    logp, _, grads = _grads(model, batch, share=True, pack=True)
    assert (full_logp - logp)[mask].abs().max() < 1e-4
    for name, g in full_grads.items():
        assert torch.allclose(g, grads[name], atol=1e-5, rtol=1e-3), name
    # Eager attention takes the packed mask as an additive one.
    model.get_base_model().set_attn_implementation("eager")
    logp, _, _ = _grads(model, batch, share=True, pack=True)
    assert (full_logp - logp)[mask].abs().max() < 1e-4


def test_the_packed_width_weighs_positions_against_attention(make_lora_policy):
    """A large model (positions dear) packs each prompt's whole group in one unit; a model whose attention
    dominates keeps rows at the longest; without sharing, wider rows save nothing."""
    _, tok = make_lora_policy()
    batch = collate(_synthetic_episodes(500), tok.pad_token_id)
    longest = int(batch.attention_mask.sum(dim=1).max())
    whole = 20 + 10 + 52 + 3 + 9 + 7  # the longest group: its prompt and its five continuations
    assert pack_width(batch, True, (2 * 7_000_000_000, 4 * 3584 * 28)) == whole
    assert pack_width(batch, True, (1000, 1_000_000)) == longest
    assert pack_width(batch, False, (2 * 7_000_000_000, 1)) == longest
    # However dear positions are, a packed row grows no wider than the cap for sharing's sake (its mask is
    # width x width), and a row longer than the cap is packed at its own length.
    from trainer.batching import PACK_MAX_WIDTH, Batch

    def one_group(rows: int, length: int, prompt: int) -> Batch:
        return Batch(torch.zeros(rows, length, dtype=torch.long), torch.ones(rows, length, dtype=torch.long),
                     torch.zeros(rows, length - 1), torch.zeros(rows, length - 1), torch.full((rows,), prompt),
                     torch.zeros(rows, dtype=torch.long))

    assert pack_width(one_group(64, 2048, 1024), True, (10**12, 1)) == PACK_MAX_WIDTH
    assert pack_width(one_group(2, PACK_MAX_WIDTH + 100, 100), True, (10**12, 1)) == PACK_MAX_WIDTH + 100
