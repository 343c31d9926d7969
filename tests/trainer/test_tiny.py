"""The tiny model's warm start computes the same recipe on every device: float32 arithmetic whatever the
process's matmul precision or default dtype, a learning rate that falls with the width, and the model that
was trained is the one saved, read back with the tokenizer it was trained with (as a Qwen2 too, the
architecture the GPU suite builds)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from trainer.tiny import build_tiny, default_lr


@pytest.fixture
def restore_precision():
    precision, dtype = torch.get_float32_matmul_precision(), torch.get_default_dtype()
    yield
    torch.set_float32_matmul_precision(precision)
    torch.set_default_dtype(dtype)


def test_the_warm_start_runs_in_float32_whatever_the_process_set(tmp_path, restore_precision):
    """A process that has switched float32 matmuls to TF32/bf16 internals (what transformers' Trainer does on a
    GPU with tf32=True) or made bfloat16 the default dtype still warm-starts in true float32, and gets its
    settings back afterwards."""
    torch.set_float32_matmul_precision("medium")
    torch.set_default_dtype(torch.bfloat16)
    seen = []

    def log(event):
        seen.append((torch.get_float32_matmul_precision(), torch.is_autocast_enabled("cpu")))

    path = build_tiny(tmp_path / "m", n_tasks=40, steps=2, hidden=32, layers=1, log=log)
    assert seen and all(s == ("highest", False) for s in seen)
    assert torch.get_float32_matmul_precision() == "medium"
    weights = load_file(path / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}


def test_the_saved_weights_are_the_trained_ones(tmp_path):
    """What is saved moved away from the initialisation (the steps reached it) and loads back as it was."""
    from trainer.models import load_model

    path = build_tiny(tmp_path / "trained", n_tasks=40, steps=3, hidden=32, layers=1, lr=1e-2)
    untrained = build_tiny(tmp_path / "untrained", n_tasks=40, steps=0, hidden=32, layers=1)
    a, b = load_file(path / "model.safetensors"), load_file(untrained / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(not torch.equal(a[k], b[k]) for k in a if k.endswith("proj.weight"))
    model, _ = load_model(path, device="cpu")
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in a.items())


def test_the_learning_rate_falls_with_the_width(tmp_path):
    """3e-3 at the tiny model's width and below (the CPU recipe unchanged), 1/width above (GPT-3 trained 125M at
    6e-4), where a constant 3e-3 was used before."""
    assert default_lr(64) == default_lr(128) == 3e-3
    assert default_lr(512) == pytest.approx(7.5e-4) and default_lr(1024) == pytest.approx(3.75e-4)
    meta = json.loads((build_tiny(tmp_path / "m", n_tasks=40, steps=1, hidden=256, layers=1, heads=4)
                       / "tiny.json").read_text())
    assert meta["lr"] == pytest.approx(1.5e-3) and meta["device"] == "cpu"


def test_a_qwen2_build_loads_back_with_the_tokenization_it_was_trained_on(tmp_path):
    """transformers 5 reads every `qwen2` folder with Qwen2Tokenizer, whose own pre-tokenizer splits the
    tiny model's whole-word and digit-run tokens apart (`2026` into four digits): the GPU suite's Qwen2 builds
    were evaluated on token sequences they never saw and solved 0-2% of the tasks (a third with their own
    tokenizer). `load_tokenizer` reads a folder's tokenizer.json as saved."""
    from tokenizers import Tokenizer

    from trainer.models import load_tokenizer

    path = build_tiny(tmp_path / "q", n_tasks=40, steps=1, hidden=32, layers=1, arch="qwen2")
    saved = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = '<|assistant|><tool_call>{"name": "reschedule_event", "arguments": {"date": "2026-03-13"}}</tool_call>'
    tokenizer = load_tokenizer(path)
    assert tokenizer.encode(text, add_special_tokens=False) == saved.encode(text, add_special_tokens=False).ids
    assert "2026" in tokenizer.tokenize(text)
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<|pad|>", "<|end|>") and tokenizer.chat_template
