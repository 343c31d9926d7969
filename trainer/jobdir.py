"""The names of a job directory's files, in one place: the trainer writes most of them, the platform writes the
rest and reads them all.

    spec.json                            the job spec (`trainer.config.load_spec`)
    train.jsonl, holdout.jsonl, regression.jsonl
                                         the frozen rows: tasks, and the suites' cases
    production-holdout.jsonl, production-regression.jsonl
                                         production's per-case results, measured before training
    evals/holdout-step-000010.jsonl      the trainer's per-case results at each evaluation (and regression-…)
    gate/holdout.jsonl, gate/regression.jsonl
                                         the chosen checkpoint measured afresh for the gate (seed FRESH_SEED)
    gate/latency.jsonl                   both models' per-case timings (`python -m trainer latency`), or
    gate/latency-not-measured.txt        why there are none
    checkpoints/step-000010/             a checkpoint (`trainer.checkpoints`)
    adapters/best/, adapters/last/       the best and the newest adapter
    stderr-1-train.log                   a subprocess's stderr, by attempt and kind (train, evaluate, …)

An eval run's folder holds `suite.jsonl`, `results.jsonl` and `stderr-1.log`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SPEC = "spec.json"
TRAIN = "train.jsonl"
SPLITS = ("holdout", "regression")
CHECKPOINTS = "checkpoints"
EVALS = "evals"
GATE = "gate"
ADAPTERS = "adapters"
# An eval run's folder.
RUN_SUITE = "suite.jsonl"
RUN_RESULTS = "results.jsonl"
# In the gate folder: both models' per-case timings, or why there are none (the probe was not run, or failed),
# which the gate's latency rule then says.
LATENCY_RESULTS = "latency.jsonl"
LATENCY_NOT_MEASURED = "latency-not-measured.txt"
# The seed of the gate's own measurement of the chosen checkpoint: none of the trainer's evals (seeded by
# the job's seed and the step) nor production's measurement (seed 0) draws these samples.
FRESH_SEED = 104_729


def suite_file(split: str) -> str:
    """A suite's rows, relative to the job directory (as spec.json names them): `holdout.jsonl`."""
    return f"{split}.jsonl"


def production_results(job_dir: Path, split: str) -> Path:
    """Production's per-case results on a suite, measured before training."""
    return job_dir / f"production-{split}.jsonl"


def eval_results(job_dir: Path, split: str, step: int) -> Path:
    """The trainer's per-case results of its evaluation at `step`."""
    return job_dir / EVALS / f"{split}-step-{step:06d}.jsonl"


def eval_steps(job_dir: Path, split: str = "holdout") -> list[int]:
    """The steps at which the trainer wrote per-case results for `split`, in order."""
    return sorted(int(path.stem.rsplit("-", 1)[1]) for path in (job_dir / EVALS).glob(f"{split}-step-*.jsonl"))


def holdout_looks(job_dir: Path) -> list[int]:
    """The steps at which the trainer evaluated a checkpoint on the holdout (step 0 is production's baseline,
    not a candidate)."""
    return [step for step in eval_steps(job_dir, "holdout") if step > 0]


def read_cases(path: Path) -> list[dict[str, Any]]:
    """The per-case rows `python -m trainer evaluate --out` wrote (an eval run's results, a job's
    measurements)."""
    from trainer.config import read_jsonl  # trainer.config names its files from this module

    return read_jsonl(path)


def gate_dir(job_dir: Path) -> Path:
    """Where the worker's own measurements for the gate go."""
    return job_dir / GATE


def gate_results(job_dir: Path, split: str) -> Path:
    """The chosen checkpoint's per-case results on a suite, measured afresh for the gate."""
    return gate_dir(job_dir) / f"{split}.jsonl"


def checkpoints_dir(job_dir: Path) -> Path:
    return job_dir / CHECKPOINTS


def checkpoint_dir(job_dir: Path, step: int) -> Path:
    """The checkpoint of `step`: `checkpoints/step-000010`."""
    return checkpoints_dir(job_dir) / f"step-{step:06d}"


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint folder (`step-000010`) holds."""
    return int(path.name.split("-")[1])


def best_adapter(job_dir: Path) -> Path:
    return job_dir / ADAPTERS / "best"


def last_adapter(job_dir: Path) -> Path:
    return job_dir / ADAPTERS / "last"


def stderr_log(folder: Path, attempt: int, kind: str | None = None) -> Path:
    """A subprocess's stderr: `stderr-1-train.log` in a job directory, `stderr-1.log` in an eval run's."""
    return folder / (f"stderr-{attempt}-{kind}.log" if kind else f"stderr-{attempt}.log")
