"""The gate's latency rule as a statistic: simulated gates with timing noise like the trainer's probe's (each case
timed on both models, the faster of two requests kept), error rates printed. Pure functions, no model."""

from __future__ import annotations

import numpy as np
import pytest

from flywheel.registry.gate import CaseResult, GateRules, LatencyCase, gate_evaluate, latency_rule

GATES = 2000
RULES = GateRules()
# Per-request timing noise: lognormal (sigma 0.27), and one request in ten caught behind another process
# (up to twice as long). The probe on the tiny model (20 cases, a 2-core machine under a load of 3.5) showed a
# per-case log-ratio spread of 0.03 to 0.33 between models of equal cost; this noise gives 0.33, the worst.
SIGMA, SPIKE_RATE = 0.27, 0.1


def _timed(rng: np.random.Generator, cost: np.ndarray) -> np.ndarray:
    """The faster of two requests of per-case true cost `cost` (ms)."""
    noise = rng.lognormal(0.0, SIGMA, size=(2, cost.size))
    noise *= 1 + (rng.random((2, cost.size)) < SPIKE_RATE) * rng.random((2, cost.size))
    return (cost * noise).min(axis=0)


def _gate(rng: np.random.Generator, slowdown: float, cases: int) -> bool:
    """One simulated gate: cases of spread cost (a prompt and an answer each), both models timed on each."""
    tokens = rng.integers(8, 48, size=cases).astype(float)
    per_token = rng.lognormal(np.log(3.0), 0.3, size=cases)  # ms a token, varying with the case
    cost = tokens * per_token
    rows = [LatencyCase(f"c{i}", float(a), float(b), float(t), float(t))
            for i, (a, b, t) in enumerate(zip(_timed(rng, cost), _timed(rng, cost * slowdown), tokens, strict=True))]
    return latency_rule(rows, RULES).passed


def _refused(slowdown: float, cases: int = RULES.latency_cases, gates: int = GATES, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    return 1 - float(np.mean([_gate(rng, slowdown, cases) for _ in range(gates)]))


def test_an_identical_candidate_is_refused_at_most_alpha_of_the_time():
    rate = _refused(1.0)
    at_tolerance = _refused(1 + RULES.latency_tolerance, seed=1)
    print(f"\nlatency rule, {RULES.latency_cases} cases, {GATES} gates: identical candidate refused {rate:.2%}; "
          f"exactly {RULES.latency_tolerance:.0%} slower refused {at_tolerance:.2%} (alpha {RULES.alpha:.2f})")
    assert rate <= RULES.alpha
    # At the boundary of H0 the test is exact: alpha, within three Monte Carlo standard errors.
    assert at_tolerance <= RULES.alpha + 3 * np.sqrt(RULES.alpha * (1 - RULES.alpha) / GATES)


def test_a_candidate_30_percent_slower_is_refused_at_the_default_case_count():
    rate = _refused(1.3, seed=2)
    small = _refused(1.3, cases=10, seed=3)
    print(f"\nlatency rule, {GATES} gates: 30% slower refused {rate:.2%} at {RULES.latency_cases} cases, "
          f"{small:.2%} at 10 cases")
    assert rate >= 0.8
    assert small < rate  # the rule's power grows with the cases timed


def test_latency_is_judged_per_token_and_shown_as_p95_per_request():
    # The candidate answers twice as long at the same speed per token: not slower (the tokens rule judges length).
    longer = [LatencyCase(f"c{i}", 100.0 + i, 2 * (100.0 + i), 20, 40) for i in range(20)]
    rule = latency_rule(longer)
    assert rule.passed and "time per token is 1.000 times" in rule.detail
    assert (rule.production, rule.candidate) == (118.0, 236.0)  # p95 (nearest rank) of the per-request times
    # 30% slower per token on every case: shown, refused.
    slower = [LatencyCase(f"c{i}", 100.0 + i, 1.3 * (100.0 + i), 20, 20) for i in range(20)]
    rule = latency_rule(slower)
    assert not rule.passed and "sign-flip p = 0.0001" in rule.detail


def test_latency_not_measured_is_not_checked_and_says_why():
    production = [CaseResult(f"c{i}", 1) for i in range(40)]
    report = gate_evaluate(production=production, candidate=production, rules=GateRules(require_regression=False))
    rule = next(r for r in report.rules if r.name == "time per token")
    assert (rule.passed, rule.production, rule.candidate) == (True, None, None)
    assert rule.detail == "not measured on both: not checked"
    report = gate_evaluate(production=production, candidate=production, rules=GateRules(require_regression=False),
                           latency_not_measured="the probe failed: out of memory")
    rule = next(r for r in report.rules if r.name == "time per token")
    assert rule.passed and rule.detail == "not measured: the probe failed: out of memory; not checked"
    # Paired rows, when given, are what the rule judges.
    rows = [LatencyCase(f"c{i}", 50.0, 80.0, 10, 10) for i in range(20)]
    report = gate_evaluate(production=production, candidate=production, rules=GateRules(require_regression=False),
                           latency=rows)
    assert not next(r for r in report.rules if r.name == "time per token").passed


@pytest.mark.parametrize("row, field", [
    ({"id": "c1", "latency_ms_a": 10.0}, "latency_ms_b"),
    ({"id": "c1", "latency_ms_a": 10.0, "latency_ms_b": -1.0}, "candidate_ms"),
    ({"id": "c1", "latency_ms_a": 10.0, "latency_ms_b": 5.0, "tokens_a": 0}, "production_tokens"),
])
def test_a_bad_latency_row_names_its_case_and_field(row, field):
    with pytest.raises(ValueError, match=f"c1.*{field}"):
        LatencyCase.from_row(row)


def test_a_latency_case_named_twice_is_refused():
    with pytest.raises(ValueError, match="more than once"):
        latency_rule([LatencyCase("c1", 1.0, 1.0), LatencyCase("c1", 1.0, 1.0)])
