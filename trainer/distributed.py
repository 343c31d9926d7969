"""Several processes, one job: `torchrun --nproc_per_node N -m trainer train --spec …`.

Every process (rank) holds the whole model and the same LoRA adapter. A step's prompts are drawn from one
prompt stream that every rank draws identically; the step's groups are cut into generation batches, dealt
round-robin to the ranks, and each rank samples and scores only its own. A group never straddles two ranks,
so its advantages are computed where its samples are. Each rank's loss carries the whole step's normalisers
(sequences, tokens), so the sum of the ranks' gradients is the gradient of the one-process step: the
trainable gradients are summed with one `all_reduce` before clipping, and every rank takes the same
optimizer step, keeping the adapters identical. Rank 0 alone evaluates, checkpoints, writes MLflow and
prints events; the step's metrics are computed there from every rank's numbers.

Why an explicit all_reduce and not DDP: the training forward goes through the decoder and a chunked head
(`trainer.batching`), not the wrapped module's `__call__` that DDP hooks into, and with dynamic sampling the
ranks may run different numbers of micro-batches, which DDP's per-backward reduction would deadlock on.
LoRA gradients are a few MB: one flat buffer, one collective per optimizer step.

Outside torchrun (no `WORLD_SIZE`), `current()` is a single process and every collective here is the
identity, so the loop has one code path.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as tdist

from trainer.tracking import EventLog

# Rank 0 evaluates the holdout alone while the other ranks wait at their next collective; a long
# evaluation must not trip the process group's time-out (torch's default is 10-30 minutes).
COLLECTIVE_TIMEOUT = timedelta(hours=3)


@dataclass(frozen=True)
class Dist:
    """This process's place in the job: rank, world size, and the collectives the loop needs."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def my_batches(self, n_groups: int, batch_groups: int | None) -> list[tuple[int, range]]:
        """(batch index, group indices) of the generation batches this rank samples. The step's groups are cut
        into batches of `batch_groups` (None: one batch per rank) and batch b goes to rank b % world_size."""
        size = batch_groups or max(1, math.ceil(n_groups / self.world_size))
        batches = [range(s, min(s + size, n_groups)) for s in range(0, n_groups, size)]
        return [(b, groups) for b, groups in enumerate(batches) if b % self.world_size == self.rank]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        tdist.all_gather_object(out, obj)
        return out

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over the ranks (float64, so that counts stay exact)."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._device())
        tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
        return t.tolist()

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients of `params` over the ranks, in one flat buffer. A rank with nothing to train on
        this step (possible with dynamic sampling) contributes zeros."""
        if not self.enabled:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        tdist.all_reduce(flat, op=tdist.ReduceOp.SUM)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n

    def broadcast_params(self, params: list[torch.nn.Parameter]) -> None:
        """Make every rank's `params` rank 0's (the same seed already makes them equal; this makes it certain)."""
        if not self.enabled:
            return
        with torch.no_grad():
            for p in params:
                tdist.broadcast(p.data, src=0)

    def barrier(self) -> None:
        if self.enabled:
            tdist.barrier()

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if tdist.get_backend() == "nccl" else \
            torch.device("cpu")


def current() -> Dist:
    """The running process group as a `Dist`, or a single process when there is none."""
    if tdist.is_available() and tdist.is_initialized():
        return Dist(tdist.get_rank(), tdist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
    return Dist()


def init_from_env() -> Dist:
    """Join the process group torchrun describes in the environment (WORLD_SIZE, RANK, LOCAL_RANK,
    MASTER_ADDR/PORT): NCCL with one GPU per process where there are GPUs, else gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or tdist.is_initialized():
        return current()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)  # "cuda" now means this rank's GPU, wherever the model is loaded
        tdist.init_process_group("nccl", timeout=COLLECTIVE_TIMEOUT, device_id=torch.device("cuda", local_rank))
    else:
        tdist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    return current()


def shutdown() -> None:
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


def rollout_seed(seed: int, step: int, sampling_round: int, batch: int) -> int:
    """The torch seed of one generation batch. A batch's samples depend on the run's seed, the step, the
    sampling round and the batch's position in the step, never on which rank draws it or on what was drawn
    before: a resumed run samples what the uninterrupted one did, and a run cut into fixed-size batches
    (`rollout_batch_groups`) samples the same tokens on any number of processes."""
    digest = hashlib.sha256(f"{seed}/{step}/{sampling_round}/{batch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def launch_command(spec_path: str | os.PathLike, nproc: int | None = None, *,
                   python: str = sys.executable) -> list[str]:
    """The command line that runs a training job on `nproc` processes (default: the spec's `num_gpus`):
    `python -m trainer train --spec …` for one, under `torch.distributed.run` (torchrun) on this host for
    more. The GPU worker runs it as the job's subprocess."""
    if nproc is None:
        from trainer.config import load_spec

        nproc = load_spec(spec_path).num_gpus
    train = ["-m", "trainer", "train", "--spec", str(Path(spec_path))]
    if nproc <= 1:
        return [python, *train]
    # --standalone: a rendezvous on a free local port, so two jobs on one host never collide.
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *train]


class RankEventLog(EventLog):
    """The event log of a rank other than 0: rank 0 reports the job, so only this rank's errors are written
    (with its rank), e.g. a rank that fails to load the model on its GPU while rank 0 waits for it."""

    def __init__(self, stream: TextIO | None, *, rank: int) -> None:
        super().__init__(stream, keep=False)
        self.rank = rank

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        if event != "error":
            return {"event": event, **fields}
        return super().emit(event, rank=self.rank, **fields)
