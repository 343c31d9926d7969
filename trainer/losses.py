"""Group advantages and the policy-gradient losses: grpo, dr_grpo, dapo and gspo side by side.

Shapes: per-token tensors are (B, T) over completion positions, `mask` is 1 on the model's own tokens
(tool observations and padding are 0), `advantages` is (B,). Normalisers can be passed in so that the
sum of micro-batch losses equals the loss of the whole step (gradient accumulation stays exact).
"""

from __future__ import annotations

import torch

EPS_STD = 1e-4


def group_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str = "group") -> torch.Tensor:
    """A_i = r_i - mean(group), divided by the group's std, the batch's std, or nothing (Dr. GRPO).

    Rewards are laid out group after group: [g0s0, g0s1, ..., g1s0, ...]. std is torch's unbiased one, as TRL.
    """
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + EPS_STD)
    elif scale_rewards == "batch":
        centred = centred / (rewards.std() + EPS_STD)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be group, batch or none; got {scale_rewards!r}")
    return centred.reshape(-1)


def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(num_groups,) bool: groups whose rewards are all equal carry no learning signal."""
    grouped = rewards.view(-1, group_size)
    return (grouped.max(dim=1).values - grouped.min(dim=1).values).abs() < 1e-8


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref), per token: unbiased and always >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "grpo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    max_completion_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate loss (to minimise) and metrics. `is_weights` is the truncated IS correction."""
    eps_hi = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(1)  # one advantage per sequence, broadcast over its tokens
    lengths = mask.sum(dim=1).clamp(min=1.0)
    n_seq = num_sequences if num_sequences is not None else logp.shape[0]
    n_tok = num_tokens if num_tokens is not None else float(mask.sum().clamp(min=1.0))
    kl = kl_k3(logp, ref_logp) if (beta != 0.0 and ref_logp is not None) else None

    if loss_type == "gspo":
        # GSPO: one importance ratio per sequence, the length-normalised likelihood ratio.
        log_ratio = ((logp - old_logp) * mask).sum(dim=1) / lengths
        ratio = torch.exp(log_ratio)
        a = adv.squeeze(1)
        per_seq = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - epsilon, 1 + eps_hi) * a)
        if is_weights is not None:
            per_seq = per_seq * ((is_weights * mask).sum(dim=1) / lengths)
        if kl is not None:
            per_seq = per_seq + beta * (kl * mask).sum(dim=1) / lengths
        loss = per_seq.sum() / n_seq
        clipped = ((ratio < 1 - epsilon) & (a < 0)) | ((ratio > 1 + eps_hi) & (a > 0))
        clip_fraction = clipped.float().mean().item()
    else:
        ratio = torch.exp(logp - old_logp)
        per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + eps_hi) * adv)
        if is_weights is not None:
            per_token = per_token * is_weights
        if kl is not None:
            per_token = per_token + beta * kl
        if loss_type == "grpo":  # mean over each sequence's tokens, then over sequences
            loss = ((per_token * mask).sum(dim=1) / lengths).sum() / n_seq
        elif loss_type == "dr_grpo":  # a constant normaliser: no length bias (Dr. GRPO)
            if max_completion_length is None:
                raise ValueError("dr_grpo needs max_completion_length")
            loss = (per_token * mask).sum() / (n_seq * max_completion_length)
        elif loss_type == "dapo":  # token-level: every token of the step weighs the same
            loss = (per_token * mask).sum() / n_tok
        else:
            raise ValueError(f"unknown loss_type {loss_type!r}")
        clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + eps_hi) & (adv > 0))
        clip_fraction = ((clipped.float() * mask).sum() / mask.sum().clamp(min=1.0)).item()

    metrics = {"clip_fraction": clip_fraction}
    if kl is not None:
        metrics["kl"] = ((kl * mask).sum() / mask.sum().clamp(min=1.0)).item()
    return loss, metrics
