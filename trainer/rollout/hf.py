"""Batched sampling with transformers `generate`: the CPU engine (tests, demo) and a GPU fallback.

The policy is the trainer's own model, so there is nothing to sync; for speed the LoRA weights are merged
into the base for the duration of `generate` and the base restored exactly after (`trainer.models.lora_merged`:
in every dtype, where the copy fits).

The sampling distribution is ours alone. `generate` fills every field a `GenerationConfig` leaves unset
from the model's `generation_config.json`, so a model shipped with `min_p`, `typical_p`,
`no_repeat_ngram_size`, `bad_words_ids`, `suppress_tokens` or `min_new_tokens` would sample from a
distribution the loss knows nothing of. During `generate` the model's config is therefore replaced by ours
(`_only_our_config`), which turns every logits processor off, and `_Sampler` applies temperature, top-k
and top-p itself: the last processor to touch the scores, so the logprobs it records are those of the
distribution the token was drawn from.

top-k/top-p: the recorded logprobs are those of the truncated, renormalised distribution, while the
trainer computes logprobs under the full softmax at the same temperature; the loop's truncated importance
weight min(pi_train / pi_sampler, C) (<= 1 on a truncated draw) corrects for the difference, as vLLM-based
trainers do. The alternative, truncating the trainer's distribution the same way, would sort the whole
vocabulary at every trained position in the training forward ((B, T, V) at a 150k vocabulary), and train a
policy that only exists with that truncation; the IS route needs nothing in the forward and is the same
path the vLLM engine (whose sampler the trainer cannot replay) already takes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.configuration_utils import CompileConfig

from trainer.models import lora_merged
from trainer.rollout import Generation


def truncate_scores(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k, then top-p (nucleus) on (B, V) scores: what is cut becomes -inf. Same order and tie
    handling as transformers' and vLLM's samplers; the most likely token is always kept."""
    if top_k > 0 and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1)  # ascending
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        cut = cumulative <= 1 - top_p
        cut[..., -1] = False
        scores = scores.masked_fill(cut.scatter(-1, order, cut), float("-inf"))
    return scores


class _Sampler(LogitsProcessor):
    """Applies temperature, top-k and top-p, and records the sampler's logprob of each chosen token.

    A processor sees the scores of step t and the ids up to t-1, so the logprob of the token chosen at
    step t-1 is gathered from the distribution kept from the previous call; the last one after generate.
    Only one (B, V) row is held at a time, so this is cheap even for a 150k vocabulary.
    """

    def __init__(self, temperature: float, top_k: int = 0, top_p: float = 1.0) -> None:
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.prev: torch.Tensor | None = None
        self.chosen: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prev is not None:
            self.chosen.append(self.prev.gather(1, input_ids[:, -1:]).squeeze(1))
        scores = scores.float()
        if self.temperature > 0:
            scores = truncate_scores(scores / self.temperature, self.top_k, self.top_p)
        self.prev = torch.log_softmax(scores, dim=-1)
        return scores

    def finish(self, last_ids: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:
            self.chosen.append(self.prev.gather(1, last_ids.unsqueeze(1)).squeeze(1))
        return torch.stack(self.chosen, dim=1) if self.chosen else torch.zeros(last_ids.shape[0], 0)


@contextmanager
def _only_our_config(model: PreTrainedModel, config: GenerationConfig) -> Iterator[None]:
    """Make `config` the model's generation config while generating.

    `generate` copies every field our config leaves None from the model's own config; with the model's
    config being ours there is nothing left to copy, and what is still None falls back to transformers'
    global defaults, all neutral for sampling except top_k=50, which we pin. (Pinning fields one by one
    is not enough: bad_words_ids, suppress_tokens, min_p and others are off only when None.)
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # the one generate reads
    saved = inner.generation_config
    inner.generation_config = config
    try:
        yield
    finally:
        inner.generation_config = saved


# With `compile`: prompts are left-padded to a multiple of this many tokens and a batch to a power of two, so
# that the static cache's shapes (rows, prompt + new tokens) repeat and each is compiled once.
WIDTH_STEP = 64


def compiled_shape(rows: int, width: int) -> tuple[int, int]:
    """The (rows, prompt width) a compiled `generate` of `rows` prompts at most `width` tokens long runs at."""
    return 1 << max(rows - 1, 0).bit_length(), -(-width // WIDTH_STEP) * WIDTH_STEP


class HFEngine:
    """`compile`: decode with transformers' static KV cache and its compiled forward (torch.compile, mode
    reduce-overhead: CUDA graphs on a GPU), without the shared prefill (which builds a dynamic cache); the
    sampler stays ours, a Python hook between two compiled steps. Rows added to reach a power of two repeat
    the first prompt and are dropped from the result."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, merge_lora: bool = True,
                 top_k: int = 0, top_p: float = 1.0, compile: bool = False):  # noqa: A002 (the config's word)
        self.model = model
        self.compile = compile
        self.compile_config = None
        if compile:
            self.compile_config = CompileConfig(fullgraph=False, dynamic=False)
            self.compile_config._compile_all_devices = True  # transformers compiles on accelerators only
        self.top_k = top_k
        self.top_p = top_p
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
        self.eos_ids = sorted({*eos, tokenizer.eos_token_id} - {None})
        self.merge_lora = merge_lora

    def sync(self, model: PreTrainedModel, version: int) -> None:
        self.model = model  # same object, same weights: generate always samples the current policy

    def _shared_prefill(self, prompts: list[list[int]], input_ids: torch.Tensor, attention: torch.Tensor,
                        device: torch.device) -> Any:
        """A KV cache of every prompt but its last token, computed once per distinct prompt and indexed out
        to its rows: a group's G samples share one prompt, so prefill costs 1/G. None when nothing repeats."""
        distinct: dict[tuple[int, ...], int] = {}
        rows = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
        if len(distinct) == len(prompts) or input_ids.shape[1] < 2:
            return None
        first = torch.tensor([rows.index(u) for u in range(len(distinct))])
        ids, mask = input_ids[first, :-1], attention[first, :-1]
        # Positions as generate derives them from the attention mask, so the cache is the one it would build.
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        out = self.model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                         use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_select_indices(torch.tensor(rows, device=device))
        return cache

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float) -> list[Generation]:
        if not prompts:
            return []
        device = next(self.model.parameters()).device
        asked = len(prompts)
        width = max(len(p) for p in prompts)
        if self.compile:
            rows, width = compiled_shape(asked, width)
            prompts = prompts + [prompts[0]] * (rows - asked)
        # Left padding so that every row's next token is at the same position.
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention[i, width - len(p):] = 1
        recorder = _Sampler(temperature, self.top_k, self.top_p)
        # Everything that shapes the distribution is `recorder`'s: transformers' own warpers stay off.
        gen_config = GenerationConfig(
            do_sample=temperature > 0, max_new_tokens=max_new_tokens, temperature=1.0, top_k=0, top_p=1.0,
            pad_token_id=self.pad_id, eos_token_id=self.eos_ids, repetition_penalty=1.0,
        )
        if self.compile:
            gen_config.cache_implementation = "static"
            gen_config.compile_config = self.compile_config
        was_training = self.model.training
        self.model.eval()
        try:
            with lora_merged(self.model) if self.merge_lora else nullcontext(), _only_our_config(self.model, gen_config):
                out = self.model.generate(
                    input_ids=input_ids.to(device), attention_mask=attention.to(device),
                    generation_config=gen_config, logits_processor=[recorder],
                    past_key_values=None if self.compile else self._shared_prefill(prompts, input_ids, attention,
                                                                                   device),
                )
        finally:
            if was_training:
                self.model.train()
        new = out[:, width:].cpu()
        logprobs = recorder.finish(new[:, -1].to(recorder.prev.device) if new.shape[1] else new[:, 0]).cpu()
        eos = set(self.eos_ids)
        results = []
        for i in range(asked):
            ids = new[i].tolist()
            end = next((j for j, t in enumerate(ids) if t in eos), None)
            finished = end is not None
            ids = ids[: end + 1] if finished else ids
            results.append(Generation(token_ids=ids, logprobs=logprobs[i, : len(ids)].tolist(), finished=finished))
        return results
