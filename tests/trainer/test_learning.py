"""Shown, not claimed: GRPO on workplace tasks raises sampled holdout success on CPU by a margin well
outside its noise, and a deliberately wrong reward (one that pays for length) does not, while it does buy
what it pays for (longer completions): a trainer that does nothing fails both tests."""

from __future__ import annotations

import math
import os

import pytest

from trainer.cli import demo_config
from trainer.config import JobSpec, write_jsonl
from trainer.tracking import EventLog

pytestmark = pytest.mark.slow
HOLDOUT_SAMPLES = 8
# The demo's recipe (lr 1e-3), 80 steps: the three seeds measured gained +0.10 to +0.14. At lr 2e-3 a run
# now and then stalls (seed 2 for 80 steps: +0.02).
STEPS = 80
# The control runs long enough for a length reward to show what it does (success falls), not as long as
# the real run: its completions are the longest there are, so its steps are the slowest.
WRONG_REWARD_STEPS = 30
# How much longer the length reward makes holdout completions at least. Seed 0 measured 3.1x (25 -> 78 tokens
# per episode); the same 30 steps at learning rate 0 (a trainer that does nothing): 1.00x.
LENGTH_GROWTH = 1.3
# The spread over seeds is measured with FLYWHEEL_LEARNING_SEED=0,1,2 (the seed of the GRPO run; the
# tiny model and the task sets stay the same).
SEED = int(os.environ.get("FLYWHEEL_LEARNING_SEED", "0"))


def run_job(tmp_path, tiny_model, tasks, *, steps: int, reward_fn=None, baseline=None):
    write_jsonl(tmp_path / "train.jsonl", tasks["train"])
    write_jsonl(tmp_path / "holdout.jsonl", tasks["holdout"])
    config = demo_config(steps, seed=SEED)
    config.eval_samples_per_prompt = HOLDOUT_SAMPLES
    # One thread: on a shared 2-core machine two threads per process thrash (measured 5x slower).
    config.num_threads = int(os.environ.get("FLYWHEEL_TEST_THREADS", "1"))
    config.eval_on_start = baseline is None
    spec = JobSpec(model=str(tiny_model), job_dir=tmp_path, train=tmp_path / "train.jsonl",
                   holdout=tmp_path / "holdout.jsonl", config=config, mlflow=False)
    from trainer.loop import train_grpo

    done = train_grpo(spec, EventLog(None), reward_fn=reward_fn)
    return (baseline or done["holdout_before"]), done["holdout_after"]


def noise(p: float, n: int) -> float:
    """Standard error of the difference of two success rates measured on n samples each."""
    return math.sqrt(2 * p * (1 - p) / n)


@pytest.fixture(scope="module")
def baseline_and_trained(tiny_model, workplace_tasks, tmp_path_factory):
    return run_job(tmp_path_factory.mktemp("grpo"), tiny_model, workplace_tasks, steps=STEPS)


def test_grpo_raises_holdout_success(baseline_and_trained):
    before, after = baseline_and_trained
    n = before["n"]
    assert n >= 100 * HOLDOUT_SAMPLES
    assert 0.1 <= before["success_rate"] <= 0.6, before  # the tiny model sometimes succeeds, not always
    margin = 3 * noise(before["success_rate"], n)
    gain = after["success_rate"] - before["success_rate"]
    print(f"seed {SEED}: holdout success {before['success_rate']:.3f} -> {after['success_rate']:.3f} "
          f"(gain {gain:+.3f}, 3 sigma {margin:.3f}, n={n})")
    assert gain > margin, f"gain {gain:.3f} not above 3 sigma ({margin:.3f}): {before} -> {after}"


def test_wrong_reward_does_not_raise_holdout_success(baseline_and_trained, tiny_model, workplace_tasks,
                                                     tmp_path):
    before, _ = baseline_and_trained

    def pays_for_length(ep) -> float:  # rewards talking, not solving
        return ep.completion_tokens / 100.0

    _, after = run_job(tmp_path, tiny_model, workplace_tasks, steps=WRONG_REWARD_STEPS, reward_fn=pays_for_length,
                       baseline=before)
    n = before["n"]
    grown = after["mean_completion_tokens"] / before["mean_completion_tokens"]
    print(f"seed {SEED}, length reward: holdout success {before['success_rate']:.3f} -> {after['success_rate']:.3f}, "
          f"completion tokens {before['mean_completion_tokens']:.1f} -> {after['mean_completion_tokens']:.1f}")
    # The trainer did learn, only what it was paid for: holdout completions got longer. Without this a
    # trainer that changes nothing would pass (success would not rise either).
    assert grown >= LENGTH_GROWTH, (before, after)
    assert after["success_rate"] <= before["success_rate"] + 2 * noise(before["success_rate"], n), (before, after)
