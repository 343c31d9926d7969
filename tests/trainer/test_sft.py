"""SFT: the loss through the chunked head equals cross-entropy on full logits (value and gradients) while the
head only ever sees the trained tokens; an SFT job follows the lr schedule and checkpoints every save_steps;
under torchrun two processes split each batch and train as one."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.config import GRPOConfig, JobSpec, write_jsonl
from trainer.distributed import launch_command
from trainer.sft import sft_loss, train_sft
from trainer.tracking import EventLog

REPO = Path(__file__).resolve().parents[2]


def full_logits_loss(model, batch, pad_id) -> torch.Tensor:
    """What sft_loss computed before: (B, T, V) logits from the model's forward, cross-entropy with -100 labels."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), -100)
    for i, (ids, mask) in enumerate(batch):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        labels[i, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), -100)
    logits = model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             labels[:, 1:].reshape(-1), ignore_index=-100)


def test_sft_loss_equals_full_logits_and_heads_only_trained_tokens(make_lora_policy):
    model, tok = make_lora_policy()
    rng = random.Random(0)
    batch = []
    for length in (7, 19, 12):  # different lengths: padding; two assistant spans each
        ids = [rng.randrange(len(tok)) for _ in range(length)]
        mask = [0] * 3 + [1] * 2 + [0] * 2 + [1] * (length - 7)
        batch.append((ids, mask))
    params = [p for p in model.parameters() if p.requires_grad]

    ref = full_logits_loss(model, batch, tok.pad_token_id)
    ref_grads = torch.autograd.grad(ref, params)
    rows: list[int] = []
    head = model.get_base_model().get_output_embeddings()
    handle = head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[:-1].numel()))
    try:
        loss, n = sft_loss(model, batch, tok.pad_token_id)
        grads = torch.autograd.grad(loss, params)
    finally:
        handle.remove()
    assert n == sum(sum(mask[1:]) for _, mask in batch) == 2 + 14 + 7
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        assert (g - r).abs().max() <= 1e-4 * r.abs().max() + 1e-7
    assert any(r.abs().sum() > 0 for r in ref_grads)
    # The head ran on the n trained tokens only (forward and its recompute), never on all B x T positions.
    assert rows and all(r == n for r in rows)


CONFIG = {"max_steps": 3, "train_batch_size": 6, "learning_rate": 1e-2, "lr_scheduler_type": "linear",
          "warmup_steps": 1, "save_steps": 1, "eval_interval": 100, "eval_on_start": False, "r": 4, "alpha": 8,
          "num_threads": 1}


def sft_job(job: Path, model: Path, tasks: list[dict]) -> Path:
    job.mkdir(exist_ok=True)
    write_jsonl(job / "train.jsonl", tasks[:30])
    (job / "spec.json").write_text(json.dumps({"model": str(model), "algorithm": "sft", "mlflow": False,
                                               "num_gpus": 2, "config": CONFIG}))
    return job / "spec.json"


def test_sft_job_schedule_checkpoints_and_two_processes(tiny_model, workplace_tasks, tmp_path):
    spec = sft_job(tmp_path / "two", tiny_model, workplace_tasks["train"])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(launch_command(spec), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)

    one = tmp_path / "one"
    sft_job(one, tiny_model, workplace_tasks["train"])
    events = EventLog(None)
    train_sft(JobSpec(model=str(tiny_model), job_dir=one, algorithm="sft", train=one / "train.jsonl",
                      config=GRPOConfig(**CONFIG), mlflow=False), events)
    single = [e for e in events.events if e["event"] == "step"]
    # Warmup 1, then linear to 0 at step 3; save_steps 1: a checkpoint after every step.
    assert [e["lr"] for e in single] == pytest.approx([0.0, 1e-2, 5e-3])
    assert sorted(p.name for p in (one / "checkpoints").iterdir()) == ["step-000002", "step-000003"]

    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-4000:]
    steps = [e for e in map(json.loads, out.splitlines()) if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3]
    for two, ref in zip(steps, single, strict=True):
        assert two["tokens"] == ref["tokens"]
        for key in ("loss", "grad_norm", "lr"):
            assert two[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-8), (two["step"], key)
    a = load_file(str(tmp_path / "two" / "adapters" / "last" / "adapter_model.safetensors"))
    b = load_file(str(one / "adapters" / "last" / "adapter_model.safetensors"))
    assert any(bool(torch.count_nonzero(w)) for k, w in b.items() if "lora_B" in k)
    # Two processes sum their halves' gradients in another order than one process: float noise of about 1e-5
    # after three steps at lr 1e-2 (1.2e-5 with the tiny model some CPUs build), where a wrong batch or a lost
    # gradient moves the weights by about the lr.
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 5e-5
