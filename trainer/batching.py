"""Episodes -> padded tensors, and the trainer-side token logprobs of the sampled tokens."""

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

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: list[int]) -> Batch:
        """A micro-batch, trimmed to its own longest row."""
        width = int(self.attention_mask[idx].sum(dim=1).max())
        lm = self.loss_mask[idx, : width - 1]
        nz = lm.sum(dim=0).nonzero()
        start = int(nz[0]) if len(nz) else 0
        return Batch(self.input_ids[idx, :width], self.attention_mask[idx, :width], lm,
                     self.sampler_logprobs[idx, : width - 1], start)


def collate(episodes: list[Episode], pad_id: int) -> Batch:
    width = max(len(ep.token_ids) for ep in episodes)
    n = len(episodes)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width - 1))
    sampler = torch.zeros((n, width - 1))
    for i, ep in enumerate(episodes):
        k = len(ep.token_ids)
        input_ids[i, :k] = torch.tensor(ep.token_ids)
        attention[i, :k] = 1
        loss_mask[i, : k - 1] = torch.tensor(ep.mask[1:], dtype=torch.float)
        sampler[i, : k - 1] = torch.tensor(ep.sampler_logprobs[1:])
    start = min(ep.prompt_len for ep in episodes) - 1
    return Batch(input_ids, attention, loss_mask, sampler, max(start, 0))


def token_logprobs(model: torch.nn.Module, batch: Batch, temperature: float = 1.0,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs (B, L-1) of each next token under `model` at the sampling temperature, and the logits
    they came from (B, L-1-start, V). Positions before `batch.start` are zeros (prompts never train)."""
    device = next(model.parameters()).device
    width = batch.input_ids.shape[1]
    keep = width - batch.start  # logits for the last `keep` positions; the final one predicts nothing
    out = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                logits_to_keep=keep, use_cache=False)
    logits = out.logits[:, :-1].float() / temperature
    targets = batch.input_ids[:, batch.start + 1:].to(device)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    full = torch.zeros(batch.input_ids.shape[0], width - 1, device=device, dtype=logp.dtype)
    full = torch.cat([full[:, : batch.start], logp], dim=1)
    return full, logits
