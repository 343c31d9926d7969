"""Trainer fixtures: the tiny CPU model, built once per session (cached by the hash of the code that
builds it, so a rerun on the same machine reuses it), and small workplace task sets."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

from trainer.config import write_jsonl

REPO = Path(__file__).resolve().parents[2]
# The model depends on these files only: a change to any of them rebuilds it.
TINY_SOURCES = ["trainer/tiny.py", "trainer/sft.py", "trainer/envs/workplace/tasks.py",
                "trainer/envs/workplace/world.py", "trainer/envs/workplace/tools.py"]


def _tiny_key() -> str:
    h = hashlib.sha256()
    for rel in TINY_SOURCES:
        h.update((REPO / rel).read_bytes())
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ready tiny model directory (the path `trainer.models.load_model` takes)."""
    from trainer.tiny import build_tiny

    # pytest-of-<user>/ outlives one session's basetemp; that is the "cached under a tmp dir".
    cache = tmp_path_factory.getbasetemp().parent / f"flywheel-tiny-{_tiny_key()}"
    if not (cache / "tiny.json").exists():
        threads = torch.get_num_threads()
        torch.set_num_threads(int(os.environ.get("FLYWHEEL_TEST_THREADS", "1")))
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        build_tiny(tmp)
        shutil.rmtree(cache, ignore_errors=True)
        tmp.rename(cache)
        torch.set_num_threads(threads)
    return cache


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
