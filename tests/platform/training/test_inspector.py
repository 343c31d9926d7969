"""The checkpoint inspector's reward-hacking flags, each raised by its own pattern and silent on a healthy run."""

from __future__ import annotations

from flywheel.training.inspector import hacking_flags

BASELINE = {"success_rate": 0.5, "invalid_output_rate": 0.1, "unsafe_action_rate": 0.0}


def _steps(rewards, lengths):
    return [{"step": i + 1, "reward_mean": r, "completion_length": n} for i, (r, n) in enumerate(zip(rewards, lengths, strict=True))]


def _kinds(flags):
    return {f["kind"] for f in flags}


def test_a_healthy_run_raises_nothing():
    steps = _steps([0.2, 0.3, 0.4, 0.5, 0.6, 0.7], [20] * 6)
    evals = {6: {"success_rate": 0.7, "invalid_output_rate": 0.05, "unsafe_action_rate": 0.0}}
    assert hacking_flags(steps=steps, evals=evals, baseline=BASELINE, at_step=6) == []


def test_reward_up_holdout_down_and_growing_length_are_flagged():
    steps = _steps([0.2, 0.3, 0.4, 0.6, 0.8, 0.9], [20, 22, 25, 40, 55, 60])
    evals = {6: {"success_rate": 0.3, "invalid_output_rate": 0.1, "unsafe_action_rate": 0.0}}
    flags = hacking_flags(steps=steps, evals=evals, baseline=BASELINE, at_step=6)
    assert _kinds(flags) == {"reward_vs_holdout", "length"}
    assert "0.500 → 0.300" in next(f["message"] for f in flags if f["kind"] == "reward_vs_holdout")


def test_format_and_safety_regressions_are_flagged_against_production():
    steps = _steps([0.2, 0.3], [20, 20])
    evals = {2: {"success_rate": 0.6, "invalid_output_rate": 0.2, "unsafe_action_rate": 0.05}}
    assert _kinds(hacking_flags(steps=steps, evals=evals, baseline=BASELINE, at_step=2)) == {
        "invalid_output_rate", "unsafe_action_rate"}


def test_only_steps_up_to_the_checkpoint_count():
    steps = _steps([0.2, 0.2, 0.2, 0.9, 0.9, 0.9], [20, 20, 20, 90, 90, 90])
    evals = {3: {"success_rate": 0.45, "invalid_output_rate": 0.1, "unsafe_action_rate": 0.0}}
    assert hacking_flags(steps=steps, evals=evals, baseline=BASELINE, at_step=3) == []
