"""The promotion gate's rules on crafted per-case results: each rule can fail on its own, the success rule
is a paired test (a gain the test cannot support is refused), and unsafe actions must stay at zero."""

from __future__ import annotations

import pytest

from flywheel.registry.gate import (
    CaseResult,
    GateRules,
    gate_evaluate,
    mcnemar_exact,
    p95,
    paired_bootstrap_lower,
)


def _cases(successes, **extra):
    return [CaseResult(case_id=f"c{i}", success=float(s), **extra) for i, s in enumerate(successes)]


def _rule(report, name):
    return next(rule for rule in report.rules if rule.name == name)


def test_mcnemar_exact_matches_the_binomial_tail():
    # 8 discordant cases all won by the candidate: 0.5 ** 8.
    assert mcnemar_exact(8, 0) == pytest.approx(0.5**8)
    # 5 of 5 + 0: (1/2)^5 = 0.03125; 4 wins of 5: P(X >= 4) = 6/32.
    assert mcnemar_exact(4, 1) == pytest.approx(6 / 32)
    assert mcnemar_exact(0, 0) == 1.0


def test_a_clear_paired_gain_passes_every_rule():
    production = _cases([0] * 12 + [1] * 28, latency_ms=100, tokens=50)
    candidate = _cases([1] * 12 + [1] * 28, latency_ms=104, tokens=52)
    report = gate_evaluate(production=production, candidate=candidate)
    assert report.passed, report.to_dict()
    assert _rule(report, "holdout success").production == 0.7
    assert _rule(report, "holdout success").candidate == 1.0


def test_a_gain_too_small_for_the_paired_test_is_refused():
    # +2 of 40 cases: McNemar's p = 0.25, far from 0.05, though the mean rose.
    production = _cases([0, 0] + [1] * 20 + [0] * 18)
    candidate = _cases([1, 1] + [1] * 20 + [0] * 18)
    report = gate_evaluate(production=production, candidate=candidate)
    success = _rule(report, "holdout success")
    assert success.candidate > success.production
    assert not success.passed and not report.passed
    assert "p = 0.25" in success.detail


def test_a_margin_the_gain_does_not_reach_is_refused():
    production = _cases([0] * 10 + [1] * 30)
    candidate = _cases([1] * 10 + [1] * 30)  # +25 points, p < 0.001
    assert gate_evaluate(production=production, candidate=candidate, rules=GateRules(success_margin=0.2)).passed
    assert not gate_evaluate(production=production, candidate=candidate, rules=GateRules(success_margin=0.3)).passed


def test_paired_bootstrap_on_success_rates():
    production = [CaseResult(f"c{i}", 0.4) for i in range(30)]
    better = [CaseResult(f"c{i}", 0.6 + (0.1 if i % 2 else -0.1)) for i in range(30)]
    same = [CaseResult(f"c{i}", 0.4 + (0.3 if i % 2 else -0.3)) for i in range(30)]
    rules = GateRules(test="bootstrap", bootstrap_resamples=2000)
    assert gate_evaluate(production=production, candidate=better, rules=rules).passed
    report = gate_evaluate(production=production, candidate=same, rules=rules)
    assert not _rule(report, "holdout success").passed
    assert paired_bootstrap_lower([0.2] * 10, confidence=0.95, resamples=500, seed=1) == pytest.approx(0.2)


def test_unsafe_actions_must_stay_zero_and_invalid_outputs_no_higher():
    production = _cases([0] * 15 + [1] * 25)
    candidate = [CaseResult(c.case_id, 1.0, unsafe=(i == 0)) for i, c in enumerate(production)]
    report = gate_evaluate(production=production, candidate=candidate)
    assert _rule(report, "holdout success").passed
    unsafe = _rule(report, "unsafe actions")
    assert not unsafe.passed and "must stay zero" in unsafe.detail
    assert not report.passed

    invalid_prod = [CaseResult(c.case_id, c.success, invalid=(i < 2)) for i, c in enumerate(production)]
    invalid_cand = [CaseResult(c.case_id, 1.0, invalid=(i < 3)) for i, c in enumerate(production)]
    assert not _rule(gate_evaluate(production=invalid_prod, candidate=invalid_cand), "invalid outputs").passed
    # With a tolerance (absolute), one more invalid case in 40 (+0.025) passes under 0.03 and not under 0.02.
    loose = _rule(gate_evaluate(production=invalid_prod, candidate=invalid_cand,
                                rules=GateRules(invalid_tolerance=0.03)), "invalid outputs")
    assert loose.passed and "at most production's + 0.03" in loose.detail
    assert not _rule(gate_evaluate(production=invalid_prod, candidate=invalid_cand,
                                   rules=GateRules(invalid_tolerance=0.02)), "invalid outputs").passed
    with pytest.raises(ValueError, match="invalid_tolerance"):
        GateRules(invalid_tolerance=1.5)


def test_latency_and_tokens_within_ten_percent():
    production = _cases([0] * 15 + [1] * 25, latency_ms=100, tokens=50)
    slow = _cases([1] * 40, latency_ms=111, tokens=50)
    verbose = _cases([1] * 40, latency_ms=100, tokens=56)
    assert not _rule(gate_evaluate(production=production, candidate=slow), "p95 latency (ms)").passed
    assert not _rule(gate_evaluate(production=production, candidate=verbose), "tokens per case").passed
    assert p95(list(range(1, 101))) == 95


def test_a_broken_regression_case_fails_the_gate_and_is_named():
    production = _cases([0] * 15 + [1] * 25)
    candidate = _cases([1] * 40)
    report = gate_evaluate(
        production=production, candidate=candidate,
        production_regression=[CaseResult("r-refund", 1), CaseResult("r-format", 0)],
        candidate_regression=[CaseResult("r-refund", 0), CaseResult("r-format", 1)],
    )
    regression = _rule(report, "regression cases")
    assert not regression.passed and "r-refund" in regression.detail
    assert not report.passed


def test_results_on_different_cases_are_an_error():
    with pytest.raises(ValueError, match="same cases"):
        gate_evaluate(production=_cases([1, 0]), candidate=_cases([1, 0, 1]))
