"""The LM head a chunk of tokens at a time: the same logprobs, entropies and gradients as full logits, with
and without prefix sharing and gradient checkpointing, and never more than a chunk of logits at once."""

from __future__ import annotations

import random

import pytest
import torch

from trainer.batching import Batch, collate, token_logprobs
from trainer.config import GRPOConfig, JobSpec
from trainer.models import attach_lora, enable_gradient_checkpointing, load_model
from trainer.rollout.episodes import Episode
from trainer.tracking import EventLog

TEMPERATURE = 0.8


def synthetic_episodes(vocab: int, *, groups: int = 3, group_size: int = 3, seed: int = 0) -> list[Episode]:
    """Groups that share a prompt (prompts of different lengths), multi-turn continuations of different lengths
    with an unmasked observation in the middle, as run_episodes lays them out."""
    rng = random.Random(seed)
    eps = []
    for g in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(9 + 4 * g)]
        for _ in range(group_size):
            turn1, obs, turn2 = (rng.randint(2, 12), rng.randint(1, 5), rng.randint(1, 10))
            ids = prompt + [rng.randrange(vocab) for _ in range(turn1 + obs + turn2)]
            mask = [0] * len(prompt) + [1] * turn1 + [0] * obs + [1] * turn2
            eps.append(Episode(row={}, group=g, env=None, token_ids=ids, mask=mask,
                               sampler_logprobs=[0.0] * len(ids), prompt_len=len(prompt)))
    return eps


def reference(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The full computation: (B, L, V) float32 logits from the model's own forward."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    logp_all = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    logp = logp_all.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent.detach()


def assert_same_grads(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    for name, g in ref.items():  # float32 round-off, relative to each gradient's scale
        assert (grads[name] - g).abs().max() <= 1e-4 * g.abs().max() + 1e-7, name
    assert any(g.abs().sum() > 0 for g in ref.values())


def grads_of(model: torch.nn.Module, logp: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    # Per-token weights, so a wrong gradient at any one position shows.
    weights = torch.linspace(-1.0, 2.0, mask.numel()).view_as(mask)
    (logp * mask * weights).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def policy(make_lora_policy):
    model, tok = make_lora_policy()
    batch = collate(synthetic_episodes(len(tok)), tok.pad_token_id)
    logp, ent = reference(model, batch)
    mask = batch.loss_mask
    return model, batch, logp.detach(), ent, grads_of(model, logp, mask)


def head_rows(model: torch.nn.Module) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    """Rows (tokens) of every call into the LM head, forward and backward recompute alike."""
    rows: list[int] = []
    head = model.get_base_model().get_output_embeddings()
    handle = head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[:-1].numel()))
    return rows, handle


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 7, 16, 10_000])
def test_chunked_head_equals_full_logits(policy, chunk_size, share):
    model, batch, ref_logp, ref_ent, ref_grads = policy
    mask = batch.loss_mask
    n = int(mask.sum())
    assert n > 50 and n % 7 and n % 16  # chunks that do not divide the token count
    rows, handle = head_rows(model)
    try:
        logp, ent = token_logprobs(model, batch, TEMPERATURE, entropy=True, share_prefix=share,
                                   chunk_size=chunk_size)
        grads = grads_of(model, logp, mask)
    finally:
        handle.remove()
    on = mask.bool()
    assert (logp.detach() - ref_logp)[on].abs().max() < 1e-4
    assert (ent - ref_ent)[on].abs().max() < 1e-4
    assert not logp[~on].any() and not ent[~on].any()  # only positions that train reach the head
    assert_same_grads(grads, ref_grads)
    # No call into the head saw more than one chunk of tokens; the backward recomputed each chunk once.
    assert max(rows) <= min(chunk_size, n)
    assert sum(rows) == 2 * n


def test_gradient_checkpointing_gives_the_same_logprobs_and_gradients(tiny_model, policy):
    """Checkpointed layers drop the KV cache in training mode, so prefix sharing must step aside then."""
    _, batch, ref_logp, _, ref_grads = policy
    torch.manual_seed(0)
    base, _ = load_model(tiny_model, device="cpu")
    model = attach_lora(base, GRPOConfig(r=4, alpha=8))
    model.load_state_dict(policy[0].state_dict())
    enable_gradient_checkpointing(model)
    model.train()
    assert model.get_base_model().is_activation_checkpointing
    logp, _ = token_logprobs(model, batch, TEMPERATURE, share_prefix=True, chunk_size=16)
    grads = grads_of(model, logp, batch.loss_mask)
    on = batch.loss_mask.bool()
    assert (logp.detach() - ref_logp)[on].abs().max() < 1e-4
    assert_same_grads(grads, ref_grads)


def test_a_micro_batch_with_nothing_to_train_still_backpropagates(policy):
    """DAPO's overlong filter can mask every row of a micro-batch; its (zero) loss must still backward."""
    model, batch, *_ = policy
    sub = batch.select([0, 1, 4])
    sub.loss_mask.zero_()
    for share in (False, True):
        logp, ent = token_logprobs(model, sub, TEMPERATURE, entropy=True, share_prefix=share)
        assert logp.shape == sub.loss_mask.shape and not logp.any() and not ent.any()
        logp.sum().backward()


def test_training_with_gradient_checkpointing(tiny_model, job_dir, monkeypatch):
    """The config fields reach the loop: a step trains through checkpointed layers (bf16 is a no-op on CPU)."""
    import trainer.loop
    from trainer.loop import train_grpo

    checkpointed = []

    def spy(model):  # the real thing, recording that the loop's model ends up checkpointed
        enable_gradient_checkpointing(model)
        checkpointed.append(model.get_base_model().is_activation_checkpointing)

    monkeypatch.setattr(trainer.loop, "enable_gradient_checkpointing", spy)

    config = {"num_prompts_per_step": 2, "num_generations_per_prompt": 3, "max_new_tokens": 12, "max_steps": 1,
              "eval_on_start": False, "eval_interval": 10, "eval_max_prompts": 1, "eval_samples_per_prompt": 1,
              "learning_rate": 1e-3, "gradient_checkpointing": True, "bf16": True, "r": 4, "alpha": 8}
    spec = JobSpec(model=str(tiny_model), job_dir=job_dir, train=job_dir / "train.jsonl",
                   config=GRPOConfig(**config), mlflow=False)
    events = EventLog(None)
    # Rewards that differ within each group, so the step has a gradient whatever the model samples.
    counter = iter(range(10**6))
    train_grpo(spec, events, reward_fn=lambda ep: float(next(counter) % 2))
    step = next(e for e in events.events if e["event"] == "step")
    assert checkpointed == [True]
    assert step["grad_norm"] > 0 and step["entropy"] > 0
