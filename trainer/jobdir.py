"""The names of a job directory's files, in one place: the trainer writes most of them, the platform writes the
rest and reads them all.

    spec.json                            the job spec (`trainer.config.load_spec`)
    train.jsonl, holdout.jsonl, regression.jsonl
                                         the frozen rows: tasks, and the suites' cases
    production-holdout.jsonl, production-regression.jsonl
                                         production's per-case results, measured before training
    evals/holdout-step-000010.jsonl      the trainer's per-case results at each evaluation (and regression-…)
    gate/holdout.jsonl, gate/regression.jsonl
                                         the chosen checkpoint measured afresh for the gate
    checkpoints/step-000010/             a checkpoint (`trainer.checkpoints`)
    adapters/best/, adapters/last/       the best and the newest adapter
    stderr-1-train.log                   a subprocess's stderr, by attempt and kind (train, evaluate, …)

An eval run's folder holds `suite.jsonl`, `results.jsonl` and `stderr-1.log`.
"""

from __future__ import annotations

from pathlib import Path

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
