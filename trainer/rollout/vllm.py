"""vLLM rollout engine (GPU, `pip install -e .[gpu]`): the base model stays resident in vLLM and each
policy version is a LoRA adapter saved by the trainer and loaded with its own `LoRARequest`.

vLLM samples with its own kernels, so its logprobs differ slightly from the trainer's; the loop corrects
for that with truncated importance sampling (`importance_sampling_correction`), using the logprobs
returned here. While the trainer updates, vLLM sleeps (`sleep(level=1)`: weights to CPU, KV cache freed)
so that both fit on one GPU. This module imports vLLM lazily so the package works without it.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.rollout import Generation, PromptTooLong

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from trainer.config import GRPOConfig

log = logging.getLogger(__name__)

# The LoRA ranks vLLM's engine accepts for `max_lora_rank` (it refuses any other value).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Engine arguments an older vLLM does not know; without them the engine still runs, with the consequences
# handled in __init__.
OPTIONAL_ENGINE_ARGS = ("logprobs_mode", "enable_sleep_mode")


def vllm_lora_rank(r: int) -> int:
    """The smallest rank vLLM accepts that holds an adapter of rank r."""
    for allowed in VLLM_LORA_RANKS:
        if r <= allowed:
            return allowed
    raise ValueError(f"config.r = {r}: vLLM serves LoRA adapters up to rank {VLLM_LORA_RANKS[-1]}")


class VLLMEngine:
    def __init__(
        self, model_path: str, tokenizer: PreTrainedTokenizerBase, config: GRPOConfig, *, work_dir: str | Path,
        keep_versions: int = 2, engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        try:
            from vllm import LLM
        except ImportError as exc:  # the error a user can act on
            raise RuntimeError("rollout_engine=vllm needs vLLM: pip install -e '.[gpu]'") from exc
        self.tokenizer = tokenizer
        self.config = config
        self.adapter_root = Path(work_dir) / "rollout_adapters"
        self.adapter_root.mkdir(parents=True, exist_ok=True)
        self.keep_versions = keep_versions
        self.lora_request = None  # None until the first sync: the base model samples
        self.version: int | None = None
        self.eos_ids = [tokenizer.eos_token_id]
        self.asleep = False
        kwargs: dict[str, Any] = dict(
            model=model_path, tokenizer=model_path, enable_lora=True, max_lora_rank=vllm_lora_rank(config.r),
            max_loras=2, gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            max_model_len=config.max_seq_len, seed=config.seed, enable_prefix_caching=True, dtype="bfloat16",
            # Logprobs after temperature, i.e. of the distribution actually sampled from.
            logprobs_mode="processed_logprobs",
            # Lets the engine give its GPU memory back while the trainer updates (see `sleep`).
            enable_sleep_mode=True,
        )
        kwargs.update(engine_kwargs or {})
        self.max_model_len = int(kwargs["max_model_len"])
        self.llm, dropped = self._start(LLM, kwargs)
        # An older vLLM without logprobs_mode returns raw (pre-temperature) logprobs.
        self.raw_logprobs = "logprobs_mode" in dropped
        # Without sleep mode vLLM keeps vllm_gpu_memory_utilization of the GPU for the whole run; the
        # trainer's model, optimizer state and activations must fit in the rest.
        self.sleep_mode = "enable_sleep_mode" not in dropped
        self.plain_sampling = config.top_p == 1.0 and config.top_k == 0
        if self.raw_logprobs and config.importance_sampling_correction and not (
                config.temperature == 1.0 and self.plain_sampling):
            # Raw logprobs are the sampler's only at T = 1 without top-k/top-p, and the correction cannot be
            # computed from them (that needs the whole distribution). Training on anyway would drop the
            # correction for the whole run with one line on stderr, and top_p/top_k rely on it, so the job
            # stops here: a vLLM with logprobs_mode, or the correction off in the spec, is the user's choice.
            raise ValueError(
                "importance_sampling_correction needs the sampler's logprobs at temperature "
                f"{config.temperature}, top_p {config.top_p}, top_k {config.top_k}, and this vLLM has no "
                "logprobs_mode (it returns the logprobs before temperature and truncation): upgrade vLLM, "
                "or set config.importance_sampling_correction to false (or sample at temperature 1.0)"
            )
        if not self.sleep_mode:
            log.warning("this vLLM has no sleep mode: it keeps %.0f%% of the GPU during updates "
                        "(config.vllm_gpu_memory_utilization)", 100 * config.vllm_gpu_memory_utilization)

    @staticmethod
    def _start(llm_class: Any, kwargs: dict[str, Any]) -> tuple[Any, set[str]]:
        """LLM(**kwargs), dropping the optional arguments this vLLM rejects; returns which were dropped."""
        dropped: set[str] = set()
        while True:
            try:
                return llm_class(**kwargs), dropped
            except TypeError as exc:  # an unknown engine argument: vLLM raises TypeError naming it
                unknown = [k for k in OPTIONAL_ENGINE_ARGS if k in kwargs and k in str(exc)]
                if not unknown:
                    raise
                for k in unknown:
                    kwargs.pop(k)
                    dropped.add(k)

    def sync(self, model: PreTrainedModel, version: int) -> None:
        """Save the current adapter and point the next generate at it (a new id: vLLM caches by id)."""
        from vllm.lora.request import LoRARequest

        if version == self.version:  # nothing changed since the last save (an eval right before a step)
            return
        self.version = version
        path = self.adapter_root / f"v{version:06d}"
        model.save_pretrained(str(path))
        self.lora_request = LoRARequest(f"policy-v{version}", version + 1, str(path))
        old = sorted(self.adapter_root.glob("v*"))[: -self.keep_versions]
        for p in old:
            shutil.rmtree(p, ignore_errors=True)

    def sleep(self) -> None:
        """Free vLLM's GPU memory for the trainer's update: level 1 moves the weights to CPU memory and drops
        the KV cache (level 2 would discard the weights, and crashes with LoRA in some versions)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float) -> list[Generation]:
        if not prompts:
            return []
        from vllm import SamplingParams

        for i, p in enumerate(prompts):
            if len(p) >= self.max_model_len:  # no room for one token: vLLM would refuse the whole batch
                raise PromptTooLong(i, len(p), self.max_model_len)
        self.wake_up()  # after an update
        by_budget: dict[int, Any] = {}
        params = []
        for p in prompts:
            # A turn never runs past max_model_len: vLLM refuses a request that would.
            budget = min(max_new_tokens, self.max_model_len - len(p))
            if budget not in by_budget:
                by_budget[budget] = SamplingParams(
                    n=1, temperature=temperature, top_p=self.config.top_p, max_tokens=budget,
                    top_k=self.config.top_k or -1,  # -1: off in every vLLM version (0 only in newer ones)
                    logprobs=0,  # 0 = the sampled token's logprob only
                    stop_token_ids=self.eos_ids, skip_special_tokens=False,
                )
            params.append(by_budget[budget])
        inputs = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(inputs, params, lora_request=self.lora_request, use_tqdm=False)
        results = []
        for out in outputs:
            o = out.outputs[0]
            ids = list(o.token_ids)
            logprobs = None
            if o.logprobs is not None:
                logprobs = [float(step[tid].logprob) for step, tid in zip(o.logprobs, ids, strict=False)]
                if self.raw_logprobs and not (temperature == 1.0 and self.plain_sampling):
                    logprobs = None  # not the sampling distribution (e.g. an eval at another temperature)
            results.append(Generation(token_ids=ids, logprobs=logprobs, finished=o.finish_reason == "stop"))
        return results
