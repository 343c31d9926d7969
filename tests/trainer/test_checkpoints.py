"""Checkpoint files are read without unpickling code: the `.pt` files with torch's safe loader
(`weights_only=True`), Python's RNG states as JSON; a checkpoint from before `rng.json` still resumes.

The exact-resume behaviour over a whole run is tests/trainer/test_resume.py."""

from __future__ import annotations

import json
import random

import pytest
import torch

from trainer.checkpoints import load_checkpoint, restore_rng, rng_state, save_checkpoint


def _policy_and_optimizer(make_lora_policy):
    model, _ = make_lora_policy()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    # One real step, so the optimizer holds moments and the scheduler has moved.
    loss = sum((p * p).sum() for p in params)
    loss.backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def _draws(sampler: random.Random) -> tuple:
    return torch.rand(3).tolist(), random.random(), sampler.random()


def test_a_checkpoint_round_trips_through_the_safe_loader(make_lora_policy, tmp_path):
    model, optimizer, scheduler = _policy_and_optimizer(make_lora_policy)
    sampler = random.Random(7)
    random.seed(3)
    torch.manual_seed(5)
    path = save_checkpoint(tmp_path, 1, model, optimizer, {"step": 1}, rng_state(sampler), scheduler=scheduler)
    expected = _draws(sampler)

    # Every .pt file opens with weights_only=True; Python's states are plain JSON.
    for name in ("optimizer.pt", "scheduler.pt", "rng.pt"):
        torch.load(path / name, weights_only=True)
    saved_rng = json.loads((path / "rng.json").read_text())
    assert set(saved_rng) == {"python", "sampler"}
    assert set(torch.load(path / "rng.pt", weights_only=True)) <= {"torch", "cuda"}

    model2, optimizer2, scheduler2 = _policy_and_optimizer(make_lora_policy)
    optimizer2.state.clear()
    random.seed(99)
    torch.manual_seed(99)
    sampler2 = random.Random(0)
    state, rng = load_checkpoint(path, model2, optimizer2, scheduler2)
    restore_rng(rng, sampler2)
    assert state == {"step": 1}
    assert _draws(sampler2) == expected
    assert scheduler2.state_dict()["last_epoch"] == scheduler.state_dict()["last_epoch"]
    for (key, want), got in zip(optimizer.state.items(), optimizer2.state.values(), strict=True):
        assert torch.equal(want["exp_avg"], got["exp_avg"]), key


def test_a_checkpoint_from_before_rng_json_still_resumes(make_lora_policy, tmp_path):
    """The old layout kept every RNG state in rng.pt (Python's as tuples of ints): the safe loader reads it."""
    model, optimizer, scheduler = _policy_and_optimizer(make_lora_policy)
    sampler = random.Random(11)
    path = save_checkpoint(tmp_path, 2, model, optimizer, {"step": 2}, rng_state(sampler), scheduler=scheduler)
    (path / "rng.json").unlink()
    torch.save(rng_state(sampler), path / "rng.pt")  # as the old save wrote it
    expected = _draws(sampler)

    sampler2 = random.Random(0)
    random.seed(1)
    torch.manual_seed(1)
    _, rng = load_checkpoint(path, model, optimizer, scheduler)
    restore_rng(rng, sampler2)
    assert _draws(sampler2) == expected


class _Payload:
    """Stands in for anything that is not a tensor or a plain container (a pickled object that runs code)."""


def test_a_checkpoint_file_holding_an_object_is_refused_with_its_name(make_lora_policy, tmp_path):
    model, optimizer, scheduler = _policy_and_optimizer(make_lora_policy)
    path = save_checkpoint(tmp_path, 3, model, optimizer, {"step": 3}, rng_state(random.Random(0)),
                           scheduler=scheduler)
    torch.save({"state": {}, "param_groups": [], "x": _Payload()}, path / "optimizer.pt")
    with pytest.raises(ValueError, match=r"optimizer\.pt cannot be read safely"):
        load_checkpoint(path, model, optimizer, scheduler)
