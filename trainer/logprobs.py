"""The language-model head a chunk of tokens at a time: each target token's logprob and its distribution's
entropy, from the final hidden states, so the (tokens, vocabulary) float32 logits never exist for more than
one chunk, in the forward or the backward.

At a 152k vocabulary one token's float32 logits are 0.6 MB, and a log-softmax, its exp and their gradients
each take as much again: full logits for a micro-batch of 32 x 2048 tokens would be tens of GB. Here each
chunk is computed and reduced to two numbers a token, and the backward recomputes the chunk
(`torch.utils.checkpoint`), so the peak is a few chunks' worth however long the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

# Bytes of one float32 copy of a chunk's logits; a chunk's backward holds about five copies at its peak. On CPU
# a chunk also has to stay above glibc's largest mmap threshold (32 MB), so that freed chunks go back to the
# system: at 33 MB chunks the heap fragmented and bench/memory.py's step peaked at 2.3 GB instead of 0.8 GB.
LOGITS_CHUNK_BYTES = 128 * 2**20

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def chunk_tokens(vocab_size: int, budget: int = LOGITS_CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's float32 logits take about `budget` bytes."""
    return max(1, budget // (4 * vocab_size))


def head_logprobs(hidden: torch.Tensor, targets: torch.Tensor, logits_fn: LogitsFn, *, chunk_size: int,
                  entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob (N,) of `targets` (N,) under `logits_fn(hidden)` and, if asked, the entropy (N,) of each row's
    distribution (no gradient). `hidden` is (N, H); `logits_fn` maps a chunk of it to float32 logits of the
    distribution tokens were sampled from (temperature applied). Gradients flow into `hidden` and into whatever
    parameters `logits_fn` uses."""
    logps, ents = [], []
    # Recomputing in the backward pays only when there is a backward: without grad a chunk is freed anyway.
    recompute = torch.is_grad_enabled()
    for s in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[s:s + chunk_size], targets[s:s + chunk_size]
        if recompute:
            # Non-reentrant checkpoint stops its recompute once the saved tensors are rebuilt, so the entropy
            # (computed after, without grad) is not paid for twice.
            lp, ent = checkpoint(_chunk, h, t, logits_fn, entropy, use_reentrant=False, preserve_rng_state=False)
        else:
            lp, ent = _chunk(h, t, logits_fn, entropy)
        logps.append(lp)
        if ent is not None:
            ents.append(ent)
    if not logps:  # no target at all (every row masked): still part of the graph, so backward() works
        empty = hidden.float().sum(dim=-1)
        return empty, (empty.detach() if entropy else None)
    return torch.cat(logps), (torch.cat(ents) if entropy else None)


def _chunk(h: torch.Tensor, t: torch.Tensor, logits_fn: LogitsFn, entropy: bool
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    logp_all = torch.log_softmax(logits_fn(h), dim=-1)
    logp = logp_all.gather(-1, t.unsqueeze(-1)).squeeze(-1)
    ent = None
    if entropy:
        with torch.no_grad():
            # In place, one more chunk-sized tensor; p log p is 0 * -inf = NaN where a logit was masked to -inf
            # (top-k/top-p), and those tokens add nothing.
            ent = -logp_all.exp().mul_(logp_all).nan_to_num_(0.0).sum(dim=-1)
    return logp, ent
