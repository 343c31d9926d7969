"""vLLM rollout engine (GPU, `pip install -e .[gpu]`): the base model stays resident in vLLM and each
policy version is a LoRA adapter saved by the trainer and loaded with its own `LoRARequest`.

vLLM samples with its own kernels, so its logprobs differ slightly from the trainer's; the loop corrects
for that with truncated importance sampling (`importance_sampling_correction`), using the logprobs
returned here. This module imports vLLM lazily so the package works without it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.rollout import Generation

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from trainer.config import GRPOConfig


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
        kwargs: dict[str, Any] = dict(
            model=model_path, tokenizer=model_path, enable_lora=True, max_lora_rank=max(8, config.r),
            max_loras=2, gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            max_model_len=config.max_seq_len, seed=config.seed, enable_prefix_caching=True, dtype="bfloat16",
            # Logprobs after temperature, i.e. of the distribution actually sampled from.
            logprobs_mode="processed_logprobs",
        )
        kwargs.update(engine_kwargs or {})
        try:
            self.llm = LLM(**kwargs)
        except TypeError:  # older vLLM without logprobs_mode returns raw (pre-temperature) logprobs
            kwargs.pop("logprobs_mode")
            self.llm = LLM(**kwargs)
            self.raw_logprobs = True
        else:
            self.raw_logprobs = False

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

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float) -> list[Generation]:
        if not prompts:
            return []
        from vllm import SamplingParams

        params = SamplingParams(
            n=1, temperature=temperature, top_p=1.0, max_tokens=max_new_tokens,  # top_k: off by default
            logprobs=0,  # 0 = the sampled token's logprob only
            stop_token_ids=self.eos_ids, skip_special_tokens=False,
        )
        inputs = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(inputs, params, lora_request=self.lora_request, use_tqdm=False)
        results = []
        for out in outputs:
            o = out.outputs[0]
            ids = list(o.token_ids)
            logprobs = None
            if o.logprobs is not None:
                logprobs = [float(step[tid].logprob) for step, tid in zip(o.logprobs, ids, strict=False)]
                if self.raw_logprobs and temperature not in (0, 1):
                    logprobs = None  # not the sampling distribution: skip the correction rather than lie
            results.append(Generation(token_ids=ids, logprobs=logprobs, finished=o.finish_reason == "stop"))
        return results
