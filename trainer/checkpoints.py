"""Checkpoints in the job directory: the adapter, optimizer and RNG states, and where the run stood.

Layout: `checkpoints/step-000010/{adapter/, optimizer.pt, scheduler.pt, rng.pt, rng.json, state.json}`,
`adapters/best/`, `adapters/last/`. A checkpoint is written to a temporary folder and renamed, so a run
killed while saving never leaves a half-written "latest" for the retry to trip on.

Every file is read without unpickling code: the `.pt` files hold only tensors and plain containers and are
loaded with `weights_only=True`; Python's RNG states are JSON. A checkpoint written before `rng.json` existed
(its `rng.pt` holding the Python states as tuples of ints) still loads: the safe loader reads those too.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel, set_peft_model_state_dict
from safetensors.torch import load_file
from torch.optim.lr_scheduler import LRScheduler

from trainer import jobdir


def checkpoint_dirs(job_dir: Path) -> list[Path]:
    root = jobdir.checkpoints_dir(job_dir)
    return sorted(p for p in root.glob("step-*") if (p / "state.json").exists()) if root.exists() else []


def latest_checkpoint(job_dir: Path) -> Path | None:
    dirs = checkpoint_dirs(job_dir)
    return dirs[-1] if dirs else None


def save_checkpoint(job_dir: Path, step: int, model: PeftModel, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], rng: dict[str, Any], keep: int = 2,
                    scheduler: LRScheduler | None = None) -> Path:
    final = jobdir.checkpoint_dir(job_dir, step)
    tmp = final.with_name(f".tmp-{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp / "adapter"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    if scheduler is not None:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save({k: v for k, v in rng.items() if k in _TENSOR_RNG}, tmp / "rng.pt")
    (tmp / "rng.json").write_text(json.dumps({k: _listed(v) for k, v in rng.items() if k not in _TENSOR_RNG}))
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    # Keep the newest `keep` and the best; older ones only cost disk.
    best = state.get("best_step")
    for old in checkpoint_dirs(job_dir)[:-keep]:
        if best is None or old.name != jobdir.checkpoint_dir(job_dir, best).name:
            shutil.rmtree(old, ignore_errors=True)
    return final


def publish_adapter(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".tmp-{dst.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)


def load_checkpoint(path: Path, model: PeftModel, optimizer: torch.optim.Optimizer,
                    scheduler: LRScheduler | None = None) -> tuple[dict, dict]:
    weights = load_file(str(path / "adapter" / "adapter_model.safetensors"))
    set_peft_model_state_dict(model, weights)
    optimizer.load_state_dict(_load(path / "optimizer.pt"))
    rng = _load(path / "rng.pt")
    if (path / "rng.json").exists():
        rng.update({k: _tupled(v) for k, v in json.loads((path / "rng.json").read_text()).items()})
    state = json.loads((path / "state.json").read_text())
    if scheduler is not None:
        if (path / "scheduler.pt").exists():
            scheduler.load_state_dict(_load(path / "scheduler.pt"))
        else:  # a checkpoint from before schedules: the schedule is a function of the step
            for _ in range(state["step"]):
                scheduler.step()
    return state, rng


def _load(path: Path) -> Any:
    """A checkpoint file read by torch's safe loader: tensors and plain containers, never code."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # the safe loader refuses anything but tensors and plain containers
        raise ValueError(f"checkpoint file {path} cannot be read safely (tensors and plain containers only): "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None


# RNG states that are tensors stay in rng.pt; Python's (nested tuples of ints) go to rng.json.
_TENSOR_RNG = frozenset({"torch", "cuda"})


def _listed(value: Any) -> Any:
    return [_listed(v) for v in value] if isinstance(value, tuple | list) else value


def _tupled(value: Any) -> Any:
    """random.setstate wants the nested tuples back that JSON turned into lists."""
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


def discard_after(job_dir: Path, step: int) -> list[Path]:
    """Remove the checkpoints of steps after `step`: resuming from an earlier one starts another future, and
    a later retry must not pick the abandoned one up as the newest."""
    later = [p for p in checkpoint_dirs(job_dir) if jobdir.checkpoint_step(p) > step]
    for p in later:
        shutil.rmtree(p, ignore_errors=True)
    return later


def rng_state(sampler_rng: random.Random) -> dict[str, Any]:
    out = {"torch": torch.get_rng_state(), "python": random.getstate(), "sampler": sampler_rng.getstate()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng(rng: dict[str, Any], sampler_rng: random.Random) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    sampler_rng.setstate(rng["sampler"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
