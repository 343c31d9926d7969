"""Trainer fixtures: the tiny model with a LoRA adapter, and small workplace task sets. The tiny model itself
(`tiny_model`) is in tests/conftest.py: the platform's training tests use it too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.config import write_jsonl


@pytest.fixture(scope="session")
def make_lora_policy(tiny_model: Path):
    """`make_lora_policy() -> (model, tokenizer)`: the tiny model with a seeded LoRA adapter (r 4) made non-zero,
    so that gradients reach both LoRA matrices."""
    from trainer.config import GRPOConfig
    from trainer.models import attach_lora, load_model

    def make():
        torch.manual_seed(0)
        base, tok = load_model(tiny_model, device="cpu")
        model = attach_lora(base, GRPOConfig(r=4, alpha=8))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        return model, tok

    return make


@pytest.fixture(scope="session")
def workplace_tasks() -> dict[str, list[dict]]:
    from trainer.envs.workplace import generate_tasks

    return {
        "train": generate_tasks(400, seed=0, split="train", difficulty="single"),
        "holdout": generate_tasks(120, seed=1, split="holdout", difficulty="single"),
    }


@pytest.fixture
def job_dir(tmp_path: Path, workplace_tasks: dict[str, list[dict]]) -> Path:
    """A job directory as the platform writes it (spec.json is the test's to write)."""
    write_jsonl(tmp_path / "train.jsonl", workplace_tasks["train"][:40])
    write_jsonl(tmp_path / "holdout.jsonl", workplace_tasks["holdout"][:6])
    write_jsonl(tmp_path / "regression.jsonl", workplace_tasks["holdout"][6:9])
    return tmp_path
