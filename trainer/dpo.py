"""Direct preference optimisation (`"algorithm": "dpo"`) on pairs of one prompt's two answers, with LoRA.

A promoted failure is such a pair: the agent's output at the promoted turn is the rejected answer, the
reviewer's corrected reference (the output the verifier passed) the chosen one. A DPO row is a task row
with the two answers beside its context:

    {"id": "case-17", "messages": [...the conversation up to the turn...], "tools": [...],
     "chosen":   {"role": "assistant", "content": null, "tool_calls": [...the corrected call...]},
     "rejected": {"role": "assistant", "content": null, "tool_calls": [...the agent's call...]},
     "verifier"?: {...}, "env"?: {...}, "origin"?: {"trajectory_id": 17, "failure_mode": 3}}

`chosen` and `rejected` are each one assistant message, or a list of messages that continue the
conversation (assistant turns with the tool messages that answered them); only assistant tokens are
scored. A malformed row fails naming the file, the row and the field (`train.jsonl: row 3 (id 'case-17'):
chosen: missing`).

The loss is TRL's `sigmoid` DPO loss, -log σ(β((π_c - ref_c) - (π_r - ref_r))), over each answer's summed
token logprobs (the chunked head of `trainer.batching`, prefix sharing: a pair's prompt runs once). The
reference is the same model with the LoRA adapter disabled, so there is no second copy of the weights; a
job that starts from an `adapter` still takes the base model as its reference. Every eval_interval steps the
held-out pairs (holdout rows that carry `chosen` and `rejected`) get the same metrics without a gradient,
beside the sampled evaluation of the holdout rows that have a verifier; checkpoints and adapters are the
GRPO and SFT jobs' (`trainer.runner`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerBase

from trainer.batching import Batch, token_logprobs
from trainer.config import DPO_LOSS_TYPES, GRPOConfig, JobSpec, check_algorithm
from trainer.distributed import Dist
from trainer.loop import _precision
from trainer.models import enable_gradient_checkpointing
from trainer.rollout.episodes import encode, render
from trainer.runner import JobRunner
from trainer.tracking import EventLog

SIDES = ("chosen", "rejected")


class PairError(ValueError):
    """A DPO row that cannot be a pair; the message names the row and the field."""


@dataclass
class Pair:
    """One row's two answers, tokenized: ids and a loss mask (1 on the answer's assistant tokens) each, and
    how many leading tokens (the prompt) the two share."""

    id: str
    chosen: tuple[list[int], list[int]]
    rejected: tuple[list[int], list[int]]
    prompt_len: int


def is_pair(row: Any) -> bool:
    return isinstance(row, dict) and any(side in row for side in SIDES)


def _answer(row: dict[str, Any], side: str, where: str) -> list[dict[str, Any]]:
    value = row.get(side)
    if value is None:
        raise PairError(f"{where}: {side}: missing (an assistant message, or a list of messages)")
    messages = [value] if isinstance(value, dict) else value
    if not isinstance(messages, list) or not messages:
        raise PairError(f"{where}: {side}: must be an assistant message or a non-empty list of messages")
    for k, m in enumerate(messages):
        at = f"{where}: {side}" + (f"[{k}]" if isinstance(value, list) else "")
        if not isinstance(m, dict):
            raise PairError(f"{at}: must be a message object")
        if m.get("role") not in ("assistant", "tool"):
            raise PairError(f"{at}.role: must be 'assistant' (or 'tool' between assistant turns), got {m.get('role')!r}")
        if m["role"] == "assistant":
            content, calls = m.get("content"), m.get("tool_calls")
            if content is not None and not isinstance(content, str):
                raise PairError(f"{at}.content: must be a string or null")
            if calls is not None and not isinstance(calls, list):
                raise PairError(f"{at}.tool_calls: must be a list")
            if not content and not calls:
                raise PairError(f"{at}: an assistant message needs content or tool_calls")
    if messages[0]["role"] != "assistant":
        raise PairError(f"{where}: {side}[0].role: the answer must start with an assistant turn")
    return messages


def validate_pair(row: Any, where: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(context messages, chosen messages, rejected messages) of a DPO row, or a PairError naming the field."""
    if not isinstance(row, dict):
        raise PairError(f"{where}: must be a JSON object")
    if row.get("id") is not None:
        where = f"{where} (id {row['id']!r})"
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PairError(f"{where}: messages: must be a non-empty list (the conversation up to the answer)")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise PairError(f"{where}: messages[{k}]: must be a message object with a role")
    if row.get("tools") is not None and not isinstance(row["tools"], list):
        raise PairError(f"{where}: tools: must be a list")
    chosen, rejected = _answer(row, "chosen", where), _answer(row, "rejected", where)
    if chosen == rejected:
        raise PairError(f"{where}: chosen and rejected are the same answer; the pair prefers nothing")
    return messages, chosen, rejected


def tokenize_answer(tokenizer: PreTrainedTokenizerBase, context: list[dict], answer: list[dict],
                    tools: list[dict] | None) -> tuple[list[int], list[int]]:
    """The context and the answer tokenized as rollouts see them: each piece up to a generation prompt is
    context (mask 0), each assistant turn as the chat template renders it is trained (mask 1)."""
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    history = list(context)
    for m in answer:
        if m["role"] == "assistant":
            prompt = render(tokenizer, history, tools, generation_prompt=True)
            full = render(tokenizer, history + [m], tools, generation_prompt=False)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise ValueError("the chat template does not render conversations incrementally")
            ctx, ans = encode(tokenizer, prompt[len(done):]), encode(tokenizer, full[len(prompt):])
            ids += ctx + ans
            mask += [0] * len(ctx) + [1] * len(ans)
            done = full
        history.append(m)
    return ids, mask


def encode_pairs(rows: Sequence[dict], tokenizer: PreTrainedTokenizerBase, *, source: str | Path,
                 max_len: int = 2048) -> tuple[list[Pair], int]:
    """Validated and tokenized pairs of `rows`, and how many were left out for being longer than `max_len`."""
    pairs, too_long = [], 0
    for i, row in enumerate(rows, 1):
        context, chosen, rejected = validate_pair(row, f"{source}: row {i}")
        sides = [tokenize_answer(tokenizer, context, answer, row.get("tools")) for answer in (chosen, rejected)]
        if max(len(ids) for ids, _ in sides) > max_len:
            too_long += 1
            continue
        # The prompt is what both sequences hold before their first trained token.
        first = min(mask.index(1) for _, mask in sides)
        (c_ids, _), (r_ids, _) = sides
        shared = next((k for k in range(first) if c_ids[k] != r_ids[k]), first)
        pairs.append(Pair(str(row.get("id", i)), sides[0], sides[1], shared))
    return pairs, too_long


def collate_pairs(pairs: Sequence[Pair], pad_id: int) -> Batch:
    """The chosen answers, then the rejected ones, right-padded; a pair's two rows share its prompt."""
    seqs = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    width = max(len(ids) for ids, _ in seqs)
    n = len(seqs)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width - 1))  # position t trains on target token t + 1
    for i, (ids, mask) in enumerate(seqs):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        loss_mask[i, : len(ids) - 1] = torch.tensor(mask[1:], dtype=torch.float)
    prompt_lens = torch.tensor([p.prompt_len for p in pairs] * 2)
    return Batch(input_ids, attention, loss_mask, sampler_logprobs=torch.zeros_like(loss_mask),
                 prompt_lens=prompt_lens, prompts=torch.arange(len(pairs)).repeat(2))


def answer_logprobs(model: torch.nn.Module, batch: Batch, *, share_prefix: bool = True, pack: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed logprobs (P,) of the chosen and of the rejected answers of a `collate_pairs` batch."""
    logp, _ = token_logprobs(model, batch, share_prefix=share_prefix, pack=pack)  # zeros off the answers' tokens
    chosen, rejected = logp.sum(dim=1).chunk(2)
    return chosen, rejected


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, *, beta: float, loss_type: str = "sigmoid"
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses (P,) and the implicit rewards β(π - ref) of the chosen and rejected answers (P,
    each, detached), from summed answer logprobs."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}")
    chosen = policy_chosen - ref_chosen
    rejected = policy_rejected - ref_rejected
    losses = -F.logsigmoid(beta * (chosen - rejected))
    return losses, beta * chosen.detach(), beta * rejected.detach()


def _micro_batches(pairs: Sequence[Pair], cfg: GRPOConfig) -> list[list[Pair]]:
    # train_batch_size counts sequences, as in GRPO; a pair's two never part.
    size = max(1, cfg.train_batch_size // 2)
    return [list(pairs[i:i + size]) for i in range(0, len(pairs), size)]


def _sums(losses: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> list[float]:
    return [float(losses.detach().sum()), float(chosen.sum()), float(rejected.sum()),
            float((chosen > rejected).float().sum())]


def _metrics(loss: float, chosen: float, rejected: float, correct: float, n: int) -> dict[str, float]:
    n = max(n, 1)
    return {"loss": loss / n, "rewards/chosen": chosen / n, "rewards/rejected": rejected / n,
            "margin": (chosen - rejected) / n, "accuracy": correct / n}


def dpo_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
               pairs: Sequence[Pair], cfg: GRPOConfig, *, pad_id: int, dist: Dist | None = None
               ) -> dict[str, float]:
    """One optimizer step on a batch of pairs: the mean DPO loss, its gradient accumulated over micro-batches
    and, under torchrun, summed over the processes (each takes every N-th pair of the same batch)."""
    dist = dist or Dist()
    device = next(model.parameters()).device
    mine = list(pairs[dist.rank::dist.world_size])
    micro = [collate_pairs(mb, pad_id) for mb in _micro_batches(mine, cfg)]
    share, pack = cfg.share_prompt_prefix, cfg.pack_sequences
    with torch.no_grad(), _precision(cfg, device), model.disable_adapter():
        # The reference is the base model: the same weights with the adapter switched off.
        refs = [answer_logprobs(model, mb, share_prefix=share, pack=pack) for mb in micro]
    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums = [0.0] * 4
    for mb, (ref_c, ref_r) in zip(micro, refs, strict=True):
        with _precision(cfg, device):
            pol_c, pol_r = answer_logprobs(model, mb, share_prefix=share, pack=pack)
        losses, chosen, rejected = dpo_loss(pol_c, pol_r, ref_c, ref_r, beta=cfg.beta, loss_type=cfg.loss_type)
        (losses.sum() / len(pairs)).backward()  # the whole batch's mean, whichever process holds the pair
        sums = [a + b for a, b in zip(sums, _sums(losses, chosen, rejected), strict=True)]
    dist.all_reduce_grads(params)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
    optimizer.step()
    return {**_metrics(*dist.sum(sums), n=len(pairs)), "grad_norm": grad_norm}


@torch.no_grad()
def preference_metrics(model: torch.nn.Module, pairs: Sequence[Pair], cfg: GRPOConfig, *, pad_id: int
                       ) -> dict[str, float]:
    """Loss, implicit rewards, margin and accuracy of the policy on `pairs`, without a gradient; `margin_se`
    is the standard error of the mean margin over the pairs (what a change in it is judged against)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    sums, margins = [0.0] * 4, []
    try:
        for pairs_mb in _micro_batches(pairs, cfg):
            mb = collate_pairs(pairs_mb, pad_id)
            with _precision(cfg, device):
                pol_c, pol_r = answer_logprobs(model, mb, share_prefix=cfg.share_prompt_prefix,
                                               pack=cfg.pack_sequences)
                with model.disable_adapter():
                    ref_c, ref_r = answer_logprobs(model, mb, share_prefix=cfg.share_prompt_prefix,
                                                   pack=cfg.pack_sequences)
            losses, chosen, rejected = dpo_loss(pol_c, pol_r, ref_c, ref_r, beta=cfg.beta, loss_type=cfg.loss_type)
            sums = [a + b for a, b in zip(sums, _sums(losses, chosen, rejected), strict=True)]
            margins += (chosen - rejected).tolist()
    finally:
        model.train(was_training)
    n = len(margins)
    mean = sum(margins) / max(n, 1)
    spread = math.sqrt(sum((m - mean) ** 2 for m in margins) / (n - 1)) if n > 1 else 0.0
    return {**_metrics(*sums, n=n), "margin_se": spread / math.sqrt(max(n, 1)), "pairs": n}


class DPORunner(JobRunner):
    """A job runner whose evaluations add the held-out pairs' preference metrics to the sampled ones."""

    eval_pairs: dict[str, list[Pair]]

    def sampled_rows(self, rows: list[dict]) -> list[dict]:
        # A pair without a verifier has nothing to score a sampled answer with; it is measured by its margin.
        return [r for r in rows if "verifier" in r or "reward" in r]

    def extra_eval_metrics(self, split: str) -> dict[str, Any]:
        pairs = getattr(self, "eval_pairs", {}).get(split)
        if not pairs:
            return {}
        return preference_metrics(self.model, pairs, self.cfg, pad_id=self.tokenizer.pad_token_id)


def train_dpo(spec: JobSpec, events: EventLog) -> dict[str, Any]:
    check_algorithm(spec.config, "dpo")
    run = DPORunner(spec, events)
    cfg = run.cfg
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(run.model)
    try:
        pad_id = run.tokenizer.pad_token_id
        pairs, too_long = encode_pairs(run.train_rows, run.tokenizer, source=spec.train, max_len=cfg.max_seq_len)
        if not pairs:
            raise PairError(f"{spec.train}: every pair is longer than max_seq_len ({cfg.max_seq_len} tokens)")
        run.eval_pairs = {}
        for split, rows, source in (("holdout", run.holdout_rows, spec.holdout),
                                    ("regression", run.regression_rows, spec.regression)):
            run.eval_pairs[split] = encode_pairs([r for r in rows if is_pair(r)], run.tokenizer, source=source,
                                                 max_len=cfg.max_seq_len)[0]
        run.maybe_eval_start()
        for step in range(run.state["step"] + 1, cfg.max_steps + 1):
            run.step = step
            t0 = time.perf_counter()
            # The same draw on every process (one stream, checkpointed with the job): a resume goes on alike.
            batch = [pairs[run.rng.randrange(len(pairs))] for _ in range(cfg.num_prompts_per_step)]
            stats: dict[str, Any] = {"lr": run.lr}
            stats |= dpo_update(run.model, run.optimizer, run.params, batch, cfg, pad_id=pad_id, dist=run.dist)
            run.scheduler.step()
            dt = time.perf_counter() - t0
            tokens = sum(len(p.chosen[0]) + len(p.rejected[0]) for p in batch)
            stats |= {"pairs": len(pairs), "pairs_too_long": too_long, "tokens": tokens, "step_time": dt,
                      "tokens_per_s": tokens / max(dt, 1e-9)}
            run.log_step(step, stats)  # the event, MLflow, then evaluate + checkpoint as due
        return run.finish()
    except Exception as exc:
        raise run.fail(exc) from exc
