"""Rollout engines behind one interface: sample completions for token-id prompts, with sampling logprobs.

`hf` (transformers `generate`, CPU and GPU) is always available; `vllm` is imported lazily and needs the
`gpu` extra. `episodes.run_episodes` drives either engine through single- or multi-turn environments.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from trainer.config import GRPOConfig


@dataclass
class Generation:
    """One sampled turn: the new token ids (the stop token included), their sampler logprobs, and whether
    it stopped on its own (False: cut at max_new_tokens)."""

    token_ids: list[int]
    logprobs: list[float] | None
    finished: bool


class PromptTooLong(ValueError):
    """A prompt that leaves the engine no room for one token; `index` is its position in the batch, so the
    caller can name the task (`run_episodes` does)."""

    def __init__(self, index: int, length: int, limit: int) -> None:
        super().__init__(f"its prompt is {length} tokens, and the engine takes at most {limit - 1} "
                         f"(max_model_len {limit} = config.max_seq_len): shorten the task or raise max_seq_len")
        self.index = index


class RolloutEngine(Protocol):
    def generate(
        self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float
    ) -> list[Generation]: ...

    def sync(self, model: PreTrainedModel, version: int) -> None:
        """Make the trainer's current policy (base + adapter) the one that samples."""
        ...


def make_engine(
    config: GRPOConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
    model_path: str | None = None, work_dir: str | Path | None = None,
) -> RolloutEngine:
    if config.rollout_engine == "hf":
        from trainer.rollout.hf import HFEngine

        return HFEngine(model, tokenizer, top_k=config.top_k, top_p=config.top_p, compile=config.rollout_compile)
    from trainer.rollout.vllm import VLLMEngine  # lazy: vLLM exists only with the `gpu` extra

    if model_path is None or work_dir is None:
        raise ValueError("the vllm engine needs model_path and work_dir (adapters are saved there per version)")
    return VLLMEngine(model_path, tokenizer, config, work_dir=work_dir)
