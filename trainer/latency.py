"""Per-case generation time of two models, for the gate's latency rule: production (A: its adapter, or the base
with none) and a candidate (B: its adapter) on the same cases, in one process, on one loaded base model.

Each case's first model turn (the prompt the environment opens with, rendered as evaluation renders it) is
generated one request at a time (batch size 1), greedy by default, in the order A, B, B, A (B, A, A, B every
other case): a drift of the machine's load during a case (another process, a clock change) falls on both
models alike, neither is always first or always the one that runs twice in a row, and of a model's
two requests the faster is kept (another process can only add time). Before the timed cases each model answers one untimed request, so that
neither pays the first call's allocations. The clock stops after the tokens are back on the host, so a GPU's
queued kernels are counted.

An adapter is timed as evaluation samples it (`trainer.rollout.hf.HFEngine`): merged into the base weights
(`trainer.models.lora_merged`, in every dtype, the base restored exactly after; the merge is done before the
clock starts, so a merged LoRA costs what the base costs per token); the base with no adapter runs with the
adapters disabled. Before, a bfloat16 model (every GPU) ran the candidate's adapter unmerged, about twice the
kernels per token of the 2-layer demo model, against a production base without one: a latency rule that
judged the adapter's bookkeeping, not the model. On a vLLM engine its per-request metrics would serve instead; this
probe runs transformers only.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from trainer.evaluation import make_env_for
from trainer.models import lora_merged
from trainer.rollout.episodes import start_episodes
from trainer.rollout.hf import HFEngine

# Per case: drift within a case falls on both models; every other case starts with the candidate, so that
# neither model is always the one that runs first, or twice in a row.
ORDERS = (("a", "b", "b", "a"), ("b", "a", "a", "b"))
# PEFT's adapter names ("a" would be read as part of its "lora_" prefix when loading).
ADAPTER_NAMES = {"a": "production", "b": "candidate"}


def pick_cases(rows: list[dict[str, Any]], cases: int, seed: int) -> list[dict[str, Any]]:
    """Up to `cases` rows of the suite, chosen by `seed`, in suite order."""
    if cases >= len(rows):
        return list(rows)
    keep = sorted(random.Random(seed).sample(range(len(rows)), cases))
    return [rows[i] for i in keep]


def _prompts(rows: list[dict[str, Any]], tokenizer: Any) -> list[list[int]]:
    """The token ids of each case's first model turn, as evaluation renders it."""
    episodes = start_episodes(rows, 1, tokenizer, make_env_for)
    return [list(ep.token_ids) for ep in episodes]


class TwoModels:
    """One base model with production's adapter (side "a", or none) and the candidate's ("b") loaded beside it;
    `use(side)` makes one of them the model that generates."""

    def __init__(self, model_path: str | Path, adapter_a: str | None, adapter_b: str) -> None:
        from peft import PeftModel

        from trainer.models import load_model

        base, self.tokenizer = load_model(model_path)
        self.model = PeftModel.from_pretrained(base, adapter_b, adapter_name=ADAPTER_NAMES["b"])
        self.has_a = bool(adapter_a)
        if self.has_a:
            self.model.load_adapter(adapter_a, adapter_name=ADAPTER_NAMES["a"])
        self.model.eval()
        # Merging is ours, outside the clock: the engine must not merge inside generate.
        self.engine = HFEngine(self.model, self.tokenizer, merge_lora=False)

    @contextlib.contextmanager
    def use(self, side: str) -> Iterator[None]:
        if side == "a" and not self.has_a:
            with self.model.disable_adapter():
                yield
            return
        self.model.set_adapter(ADAPTER_NAMES[side])
        with lora_merged(self.model):
            yield


def _timed(engine: HFEngine, prompt: list[int], *, max_new_tokens: int, temperature: float,
           seed: int) -> tuple[float, int]:
    torch.manual_seed(seed)  # with sampling, both models draw from the same random stream
    start = time.perf_counter()
    (gen,) = engine.generate([prompt], max_new_tokens=max_new_tokens, temperature=temperature)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000.0, len(gen.token_ids)


def measure_latency(
    model_path: str | Path, rows: list[dict[str, Any]], *, adapter_a: str | None, adapter_b: str, cases: int,
    max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
    on_case: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Per case: each model's wall time of its faster request (ms) and the tokens that request generated:
    `id, latency_ms_a, latency_ms_b, tokens_a, tokens_b` (A is production, B the candidate), with both
    requests' times in `requests_ms_a` and `requests_ms_b`."""
    if not adapter_b:
        raise ValueError("--adapter-b: the candidate's adapter is required")
    chosen = pick_cases(rows, cases, seed)
    if not chosen:
        raise ValueError("the suite has no cases to time")
    models = TwoModels(model_path, adapter_a, adapter_b)
    prompts = _prompts(chosen, models.tokenizer)
    for side in ("a", "b"):  # warm-up, untimed
        with models.use(side):
            _timed(models.engine, prompts[0], max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    out = []
    for i, (row, prompt) in enumerate(zip(chosen, prompts, strict=True)):
        ms: dict[str, list[float]] = {"a": [], "b": []}
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        for side in ORDERS[i % 2]:
            with models.use(side):
                took, n = _timed(models.engine, prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                                 seed=seed + i)
            ms[side].append(took)
            tokens[side].append(n)
        result: dict[str, Any] = {"id": row.get("id", i), "prompt_tokens": len(prompt)}
        for side in ("a", "b"):
            # The faster of a model's two requests: another process can only add time to a request, so the
            # faster one is the nearer to the model's own cost (both are kept in `requests_ms_*`).
            result[f"latency_ms_{side}"] = round(min(ms[side]), 3)
            result[f"tokens_{side}"] = tokens[side][ms[side].index(min(ms[side]))]
            result[f"requests_ms_{side}"] = [round(x, 3) for x in ms[side]]
        out.append(result)
        if on_case is not None:
            on_case(result)
    return out
