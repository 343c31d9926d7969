"""Load a causal LM and its tokenizer from a local directory and attach (or load) a LoRA adapter.

Real models and the tiny CPU model take this same path; nothing is fetched from a hub.
"""

from __future__ import annotations

import json
import os
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
