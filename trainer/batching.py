"""Episodes -> padded tensors, and the trainer-side token logprobs of the sampled tokens.

The G episodes of a group start with the same prompt. `token_logprobs` can run each distinct prompt
through the model once and let its G continuations attend to that one copy (prefix sharing): the prompt
is usually most of an episode's tokens, so the training forward and backward shrink by about that share,
with the same logprobs and gradients as the full forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.rollout.episodes import Episode


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, L) right-padded
    attention_mask: torch.Tensor  # (B, L)
    loss_mask: torch.Tensor  # (B, L-1): 1 where target token t+1 is the model's own
    sampler_logprobs: torch.Tensor  # (B, L-1)
    start: int  # first target position any row trains on: logits before it are never computed
    prompt_lens: torch.Tensor  # (B,) tokens of the row's prompt
    prompts: torch.Tensor  # (B,) rows with the same value share their first prompt_lens tokens

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: list[int]) -> Batch:
        """A micro-batch, trimmed to its own longest row."""
        width = int(self.attention_mask[idx].sum(dim=1).max())
        lm = self.loss_mask[idx, : width - 1]
        nz = lm.sum(dim=0).nonzero()
        start = int(nz[0]) if len(nz) else 0
        return Batch(self.input_ids[idx, :width], self.attention_mask[idx, :width], lm,
                     self.sampler_logprobs[idx, : width - 1], start, self.prompt_lens[idx], self.prompts[idx])


def collate(episodes: list[Episode], pad_id: int) -> Batch:
    width = max(len(ep.token_ids) for ep in episodes)
    n = len(episodes)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width - 1))
    sampler = torch.zeros((n, width - 1))
    prompt_ids: dict[tuple[int, ...], int] = {}
    prompts = []
    for i, ep in enumerate(episodes):
        k = len(ep.token_ids)
        input_ids[i, :k] = torch.tensor(ep.token_ids)
        attention[i, :k] = 1
        loss_mask[i, : k - 1] = torch.tensor(ep.mask[1:], dtype=torch.float)
        sampler[i, : k - 1] = torch.tensor(ep.sampler_logprobs[1:])
        # Keyed by the tokens themselves: two rounds of sampling may reuse group numbers.
        prompts.append(prompt_ids.setdefault(tuple(ep.token_ids[: ep.prompt_len]), len(prompt_ids)))
    start = min(ep.prompt_len for ep in episodes) - 1
    return Batch(input_ids, attention, loss_mask, sampler, max(start, 0),
                 torch.tensor([ep.prompt_len for ep in episodes]), torch.tensor(prompts))


def token_logprobs(model: torch.nn.Module, batch: Batch, temperature: float = 1.0, *, entropy: bool = False,
                   share_prefix: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (B, L-1) of each next token under `model` at the sampling temperature and, if asked, the
    entropy (B, L-1) of those distributions (no gradient). Positions that are prompt-only may be zeros
    (prompts never train). `share_prefix` computes each distinct prompt once (see the module docstring)."""
    if share_prefix and len(batch.prompts.unique()) < len(batch):
        logits, targets, cols = _shared_prefix_logits(model, batch)
    else:
        logits, targets, cols = _full_logits(model, batch)
    logits = logits.float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = None
    if entropy:
        with torch.no_grad():
            ent = _place(-(logp_all.exp() * logp_all).sum(dim=-1), cols, batch)
    return _place(logp, cols, batch), ent


def _place(values: torch.Tensor, cols: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Scatter per-target values into the batch's (B, L-1) layout; columns past the end fall off."""
    width = batch.input_ids.shape[1] - 1
    out = torch.zeros(values.shape[0], width + values.shape[1], device=values.device, dtype=values.dtype)
    return out.scatter(1, cols.to(values.device), values)[:, :width]


def _full_logits(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    device = next(model.parameters()).device
    width = batch.input_ids.shape[1]
    keep = width - batch.start  # logits for the last `keep` positions; the final one predicts nothing
    out = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                logits_to_keep=keep, use_cache=False)
    targets = batch.input_ids[:, batch.start + 1:].to(device)
    cols = torch.arange(batch.start, width - 1).expand(len(batch), -1)
    return out.logits[:, :-1], targets, cols


def _shared_prefix_logits(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct prompts, left-padded, in one forward with a KV cache; the cache is then indexed out to
    every row and the rows' continuations attend to it. Autograd flows through the cache into the prompt."""
    device = next(model.parameters()).device
    pad = 0  # any id: padding is masked out
    _, row_prompt = torch.unique(batch.prompts, return_inverse=True)  # row -> distinct prompt
    n_prompts = int(row_prompt.max()) + 1
    first = torch.zeros(n_prompts, dtype=torch.long).scatter_(0, row_prompt, torch.arange(len(batch)))
    plen = batch.prompt_lens
    lp = int(plen.max())
    pre_ids = torch.full((n_prompts, lp), pad, dtype=torch.long)
    pre_mask = torch.zeros((n_prompts, lp), dtype=torch.long)
    for u, i in enumerate(first.tolist()):
        p = int(plen[i])
        pre_ids[u, lp - p:] = batch.input_ids[i, :p]
        pre_mask[u, lp - p:] = 1
    out = model(input_ids=pre_ids.to(device), attention_mask=pre_mask.to(device),
                position_ids=(pre_mask.cumsum(-1) - 1).clamp(min=0).to(device), use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    cache.batch_select_indices(row_prompt.to(device))

    lens = batch.attention_mask.sum(dim=1)
    slen = lens - plen
    ls = max(int(slen.max()), 1)
    suf_ids = torch.full((len(batch), ls), pad, dtype=torch.long)
    suf_mask = torch.zeros((len(batch), ls), dtype=torch.long)
    for i in range(len(batch)):
        p, s = int(plen[i]), int(slen[i])
        suf_ids[i, :s] = batch.input_ids[i, p:p + s]
        suf_mask[i, :s] = 1
    out2 = model(input_ids=suf_ids.to(device), attention_mask=torch.cat([pre_mask[row_prompt], suf_mask], 1).to(device),
                 position_ids=(plen[:, None] + torch.arange(ls)).to(device), past_key_values=cache, use_cache=True)
    # The prompt's last position predicts the first continuation token; continuation position j predicts j+1.
    logits = torch.cat([out.logits[:, -1:][row_prompt.to(device)], out2.logits[:, :-1]], dim=1)
    cols = plen[:, None] - 1 + torch.arange(ls)
    return logits, suf_ids.to(device), cols
