"""Supervised fine-tuning on the assistant turns of good trajectories: the warm start before GRPO
(`"algorithm": "sft"`, a LoRA adapter, same job contract and events), and the tiny model's pre-training.

A training row is either a task with a `solution` (its assistant turns are replayed in the environment,
so tool observations are real) or a trajectory whose `messages` already hold the whole conversation;
trajectories with `outcome: "failure"` are skipped. Loss is on assistant tokens only, computed as the GRPO
loss computes logprobs (`trainer.batching.token_logprobs`): the LM head runs on those tokens only, a chunk at a
time, so no (batch, length, vocabulary) logits exist.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler
from transformers import PreTrainedTokenizerBase, get_scheduler

from trainer.batching import Batch, token_logprobs
from trainer.config import JobSpec
from trainer.distributed import Dist
from trainer.rollout.episodes import encode, render
from trainer.runner import JobRunner
from trainer.tracking import EventLog

Example = tuple[list[int], list[int]]  # token ids, loss mask (1 on assistant tokens)


def conversation(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The full conversation a row stands for, or None when it is not a good one to imitate: a task's
    `solution` replayed, a trajectory's own messages, or a promoted row's prompt with its reference
    (`trainer.references`: what the reviewer stated as correct)."""
    if row.get("outcome") == "failure":
        return None
    if row.get("solution"):
        from trainer.envs import replay

        messages, score = replay(row, row["solution"])
        return messages if score.passed or row.get("trust_solution") else None
    messages = row.get("messages") or []
    if any(m.get("role") == "assistant" for m in messages[-1:]):
        return messages
    from trainer.references import reference_messages

    reference = reference_messages(row)
    if reference is not None:
        return [*messages, *reference]
    return messages if any(m.get("role") == "assistant" for m in messages) else None


def tokenize_conversation(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None,
                          ) -> Example:
    """Pieces tokenized exactly as rollouts see them: context up to each generation prompt (mask 0),
    then the assistant turn as rendered by the chat template (mask 1)."""
    ids: list[int] = []
    mask: list[int] = []
    done_text = ""
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        prompt = render(tokenizer, messages[:i], tools, generation_prompt=True)
        full = render(tokenizer, messages[: i + 1], tools, generation_prompt=False)
        if not (prompt.startswith(done_text) and full.startswith(prompt)):
            raise ValueError("the chat template does not render conversations incrementally")
        ctx = encode(tokenizer, prompt[len(done_text):])
        ans = encode(tokenizer, full[len(prompt):])
        ids += ctx + ans
        mask += [0] * len(ctx) + [1] * len(ans)
        done_text = full
    return ids, mask


def build_examples(rows: list[dict], tokenizer: PreTrainedTokenizerBase, max_len: int = 2048) -> list[Example]:
    out = []
    for row in rows:
        messages = conversation(row)
        if messages is None:
            continue
        ids, mask = tokenize_conversation(tokenizer, messages, row.get("tools"))
        if sum(mask) and len(ids) <= max_len:
            out.append((ids, mask))
    return out


def sft_loss(model: torch.nn.Module, batch: list[Example], pad_id: int) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy of the assistant tokens (the mask's 1s) and their number."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    loss_mask = torch.zeros((len(batch), width - 1))  # position t trains on target token t + 1
    for i, (ids, mask) in enumerate(batch):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        loss_mask[i, : len(ids) - 1] = torch.tensor(mask[1:], dtype=torch.float)
    rows = Batch(input_ids, attention, loss_mask, sampler_logprobs=torch.zeros_like(loss_mask),
                 prompt_lens=torch.zeros(len(batch), dtype=torch.long), prompts=torch.arange(len(batch)))
    logp, _ = token_logprobs(model, rows)  # zeros off the mask
    n = int(loss_mask.sum())
    return -logp.sum() / max(n, 1), n


def sft_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
              examples: list[Example], *, pad_id: int, steps: range, batch_size: int, rng: random.Random,
              scheduler: LRScheduler | None = None, lr: float | None = None, total: int | None = None,
              warmup: int = 0, max_grad_norm: float = 1.0, dist: Dist | None = None,
              on_step: Callable[[int, dict[str, float]], None] | None = None) -> None:
    """Minibatch SFT; batches are drawn with replacement from `rng` (checkpointed with the job). The lr
    follows `scheduler`, stepped once a step; without one (the tiny model's pre-training), a cosine from
    `lr` over `total` steps after `warmup`. Under torchrun every rank draws the same batch (one `rng`) and
    trains on its share of the rows, the loss normalised by the whole batch's tokens and the gradients summed."""
    dist = dist or Dist()
    if scheduler is None:
        for group in optimizer.param_groups:
            group["lr"] = lr if lr is not None else group["lr"]
        scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=warmup, num_training_steps=total or steps.stop - 1)
        for _ in range(steps.start - 1):
            scheduler.step()
    model.train()
    for step in steps:
        t0 = time.perf_counter()
        batch = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        mine = batch[dist.rank::dist.world_size]
        lr_now = optimizer.param_groups[0]["lr"]
        optimizer.zero_grad(set_to_none=True)
        loss, n_tokens = sft_loss(model, mine, pad_id) if mine else (torch.zeros(()), 0)
        (n_all,) = dist.sum([n_tokens])
        share = n_tokens / max(n_all, 1)  # this rank's part of the batch's mean
        if mine:
            (loss * share).backward()
        dist.all_reduce_grads(params)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
        optimizer.step()
        scheduler.step()
        (batch_loss,) = dist.sum([loss.item() * share])
        dt = time.perf_counter() - t0
        if on_step:
            on_step(step, {"loss": batch_loss, "grad_norm": grad_norm, "lr": lr_now, "tokens": int(n_all),
                           "step_time": dt, "tokens_per_s": sum(len(ids) for ids, _ in batch) / max(dt, 1e-9)})


def train_sft(spec: JobSpec, events: EventLog) -> dict[str, Any]:
    run = JobRunner(spec, events)
    cfg = run.cfg
    try:
        examples = build_examples(run.train_rows, run.tokenizer, cfg.max_seq_len)
        if not examples:
            raise ValueError(f"{spec.train}: no good trajectories to imitate (no solution that passes, "
                             "no messages with an assistant turn)")
        run.maybe_eval_start()

        def on_step(step: int, stats: dict[str, float]) -> None:
            run.step = step
            run.log_step(step, {"examples": len(examples), **stats})

        run.step = run.state["step"] + 1
        sft_steps(run.model, run.optimizer, run.params, examples, pad_id=run.tokenizer.pad_token_id,
                  steps=range(run.state["step"] + 1, cfg.max_steps + 1), batch_size=cfg.train_batch_size,
                  rng=run.rng, scheduler=run.scheduler, max_grad_norm=cfg.max_grad_norm, dist=run.dist,
                  on_step=on_step)
        return run.finish()
    except Exception as exc:
        raise run.fail(exc) from exc
