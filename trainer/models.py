"""Load a causal LM and its tokenizer from a local directory and attach (or load) a LoRA adapter.

Real models and the tiny CPU model take this same path; nothing is fetched from a hub.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from trainer.config import GRPOConfig


def load_model(
    path: str | os.PathLike, *, device: str | None = None, dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """AutoModelForCausalLM + AutoTokenizer from a local path (local_files_only: a hub id fails loudly)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json); models load from local paths")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    model.to(device)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The model directory's tokenizer as saved in its tokenizer.json, with a pad token (the EOS when the model
    has none)."""
    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not _as_saved(tokenizer, path):
        # transformers 5 loads every `qwen2` folder with Qwen2Tokenizer, which swaps in Qwen's own pre-tokenizer
        # whatever tokenizer.json says: a Qwen2 trained with another one (the tiny model's, where words and digit
        # runs are whole tokens) would then see token sequences it never saw, and solved 0-2% of the tasks its
        # own tokenization solves a third of. The file is what the model was trained with.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _as_saved(tokenizer: PreTrainedTokenizerBase, path: Path) -> bool:
    """Whether `tokenizer` splits and normalises text as the folder's tokenizer.json does (True without one)."""
    saved = path / "tokenizer.json"
    if not saved.exists() or not getattr(tokenizer, "is_fast", False):
        return True
    spec = json.loads(saved.read_text())
    loaded = json.loads(tokenizer.backend_tokenizer.to_str())
    return all(loaded.get(key) == spec.get(key) for key in ("normalizer", "pre_tokenizer"))


def lora_config(config: GRPOConfig, model: PreTrainedModel) -> LoraConfig:
    # Only wrap modules the architecture has: a config listing gate_proj still works on a model without it.
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [m for m in config.target_modules if m in present]
    if not targets:
        raise ValueError(f"none of target_modules {config.target_modules} exist in {type(model).__name__}")
    return LoraConfig(
        r=config.r, lora_alpha=config.alpha, lora_dropout=config.dropout, target_modules=targets,
        bias="none", task_type="CAUSAL_LM",
    )


def attach_lora(
    model: PreTrainedModel, config: GRPOConfig, adapter: str | os.PathLike | None = None
) -> PeftModel:
    """A trainable LoRA adapter on a frozen base: new, or loaded from `adapter` to continue from it."""
    if adapter is not None:
        peft_model = PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    else:
        peft_model = get_peft_model(model, lora_config(config, model))
    return peft_model


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward instead of keeping them (transformers'
    activation checkpointing, non-reentrant)."""
    lm = model.get_base_model() if isinstance(model, PeftModel) else model
    lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    # With LoRA the embeddings are frozen, so what enters the first checkpointed layer does not require grad:
    # a reentrant checkpoint (what older transformers and peft's helpers pick) would then hand back outputs
    # without grad and the adapter would learn nothing. Making the embeddings' output require grad rules
    # that out whichever kind runs; it costs one (B, T, H) gradient.
    lm.enable_input_require_grads()


@contextmanager
def lora_merged(model: torch.nn.Module) -> Iterator[bool]:
    """While inside: the active LoRA adapter merged into the base weights, and the adapter layers off, so a
    forward costs what the base model's does (True); after: the base weights restored bit for bit.

    Sampling runs a forward per token, and unmerged, each wrapped projection adds the adapter's two matmuls
    and (in bfloat16, where peft keeps the adapter in float32) the casts around them: twice the kernels per
    decoding step of the 2-layer demo model. Merging and unmerging in place (peft's `merge_adapter` then
    `unmerge_adapter`) would round the base twice, and in bfloat16 the rounding of W + BA - BA drifts the
    frozen base a little more every step; here the merged weight is rounded once, from float32, and the
    original is copied back. The copy of the wrapped weights is held only while inside, and only where it
    fits in half the free memory of their device; otherwise (or for a LoRA variant such as DoRA, or an
    adapter with biases) nothing is merged and the adapter runs unmerged (False).

    A merged bfloat16 weight holds BA only to bfloat16's precision around W: a sampler on it is not exactly
    the policy the loss computes (nor is vLLM's, whose kernels differ too). Sampling logprobs are recorded
    from what sampled, and the loop's truncated importance weight corrects for the difference.
    """
    layers = _merge_targets(model)
    if not layers or not _copy_fits(layers):
        yield False
        return
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for layer in layers:
                weight = layer.get_base_layer().weight
                delta = sum(layer.get_delta_weight(name).float() for name in _active(layer))
                saved.append((weight, weight.detach().clone()))
                weight.copy_((weight.float() + delta).to(weight.dtype))
        with model.disable_adapter():
            yield True
    finally:
        with torch.no_grad():
            for weight, original in saved:
                weight.copy_(original)


def _active(layer: torch.nn.Module) -> list[str]:
    return [name for name in layer.active_adapters if name in layer.lora_A]


def _merge_targets(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The LoRA layers an exact merge would change; [] when there are none or one of them cannot be merged as
    W + BA (a variant, an adapter bias, an adapter already merged by peft, or adapters turned off)."""
    if not isinstance(model, PeftModel):
        return []
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer) and _active(m)]
    for layer in layers:
        names = _active(layer)
        if (layer.merged or layer.disable_adapters or not isinstance(layer.get_base_layer(), torch.nn.Linear)
                or any(n in layer.lora_variant or layer.lora_bias.get(n) for n in names)):
            return []
    return layers


def _copy_fits(layers: list[torch.nn.Module]) -> bool:
    weights = [layer.get_base_layer().weight for layer in layers]
    need = sum(w.numel() * w.element_size() for w in weights)
    device = weights[0].device
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import psutil

        free = psutil.virtual_memory().available
    return need <= free / 2
