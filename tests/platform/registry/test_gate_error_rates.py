"""The gate's error rates, shown by simulation: pure functions over simulated per-case outcomes.

A simulated holdout draws each case's true pass rate from a spread like a real one (Beta(0.7, 1.3): many
cases production nearly always fails, some it nearly always passes, mean 0.35), samples both models `k`
times per case, and adds invalid outputs, unsafe actions and token counts at realistic rates. A regression
suite draws rates production passes reliably (0.85 to 1). Run with `-s` to see the figures."""

from __future__ import annotations

import numpy as np

from flywheel.registry.gate import (
    CaseResult,
    GateRules,
    gate_evaluate,
    improved_rates,
    smallest_gain,
    success_power,
)

# Monte Carlo sign vectors per test inside the simulation: (1 + k) / (1 + B) keeps each test valid at any B.
RULES = GateRules(bootstrap_resamples=500)


def _side(rng, rates, k, *, invalid=0.015, unsafe=0.0, tokens=None):
    out = []
    for i, rate in enumerate(rates):
        passes = int(rng.binomial(k, rate))
        # Invalid outputs are failed samples: drawn among the failures at a per-sample rate of `invalid`.
        bad = int(rng.binomial(k - passes, min(1.0, invalid / max(1e-9, 1 - rate)))) if passes < k else 0
        mean_tokens = None if tokens is None else float(rng.normal(tokens[i], 0.1 * tokens[i] / np.sqrt(k)))
        out.append(CaseResult(f"c{i}", passes, k, bad, int(rng.binomial(k, unsafe)), None, mean_tokens))
    return out


def _simulate(*, seed, sims, cases, k, gain=0.0, invalid=0.015, unsafe=0.0, regression=20, rules=RULES):
    """Share of gates passed and of each rule's refusals over `sims` simulated candidates."""
    rng = np.random.default_rng(seed)
    passed, refused = 0, {}
    for _ in range(sims):
        base = rng.beta(0.7, 1.3, size=cases)
        tokens = rng.uniform(20, 60, size=cases)
        reliable = rng.uniform(0.85, 1.0, size=regression)
        report = gate_evaluate(
            production=_side(rng, base, k, invalid=invalid, unsafe=unsafe, tokens=tokens),
            candidate=_side(rng, improved_rates(base, gain), k, invalid=invalid, unsafe=unsafe, tokens=tokens),
            production_regression=_side(rng, reliable, k, invalid=0.0),
            candidate_regression=_side(rng, reliable, k, invalid=0.0),
            rules=rules,
        )
        passed += report.passed
        for rule in report.rules:
            refused[rule.name] = refused.get(rule.name, 0) + (not rule.passed)
    return passed / sims, {name: count / sims for name, count in refused.items()}


def test_an_identical_candidate_passes_at_most_5_percent_and_no_rule_but_success_refuses_it_more():
    sims = 2000
    passed, refused = _simulate(seed=11, sims=sims, cases=100, k=8, unsafe=0.01)
    print(f"\nidentical candidate, {sims} gates of 100 cases x 8 samples (1.5% invalid, 1% unsafe per sample): "
          f"passes the gate {passed:.3f}; refused by rule: "
          + ", ".join(f"{name} {rate:.3f}" for name, rate in sorted(refused.items())))
    assert passed <= 0.05
    assert refused["regression cases"] <= 0.05  # majority votes and one-flip vetoes refused 57-82%
    assert refused["invalid outputs"] <= 0.05  # "no higher" refused about 41%
    assert refused["unsafe actions"] <= 0.05
    assert refused["tokens per case"] <= 0.05


def test_a_candidate_025_better_passes_at_least_80_percent_on_100_cases_of_8_samples():
    passed, refused = _simulate(seed=12, sims=400, cases=100, k=8, gain=0.25)
    print(f"\n+0.25 candidate, 400 gates of 100 cases x 8 samples: passes {passed:.3f}; refused by rule: "
          + ", ".join(f"{name} {rate:.3f}" for name, rate in sorted(refused.items()) if rate))
    assert passed >= 0.80


def test_non_inferiority_passes_a_candidate_worse_by_the_tolerance_at_most_about_alpha():
    # Invalid outputs 1% -> 2%: exactly the tolerance worse. An equal one is refused often on this holdout,
    # which the printed figure shows: the price of putting the burden of proof on the candidate.
    rules = GateRules(bootstrap_resamples=500, invalid_test="noninferiority", invalid_tolerance=0.01,
                      require_regression=False, expected_gain=1.0)
    rng = np.random.default_rng(13)
    worse_passes = equal_refusals = 0
    sims = 1000
    for _ in range(sims):
        base = rng.beta(0.7, 1.3, size=100)
        production = _side(rng, base, 8, invalid=0.01)
        worse = gate_evaluate(production=production, candidate=_side(rng, base, 8, invalid=0.02), rules=rules)
        equal = gate_evaluate(production=production, candidate=_side(rng, base, 8, invalid=0.01), rules=rules)
        worse_passes += next(r for r in worse.rules if r.name == "invalid outputs").passed
        equal_refusals += not next(r for r in equal.rules if r.name == "invalid outputs").passed
    print(f"\nnon-inferiority at 1 point, 100 cases x 8 samples: a candidate 1 point worse passes "
          f"{worse_passes / sims:.3f}; an equal one is refused {equal_refusals / sims:.3f}")
    assert worse_passes / sims <= 0.07  # the t bound on skewed rare-event rates: alpha plus a little


def test_the_power_figures_pages_show_hold_in_simulation():
    # The normal approximation's smallest gain at 80% power, then the sign-flip test's power there.
    rng = np.random.default_rng(14)
    base = rng.beta(0.7, 1.3, size=60)
    gain = smallest_gain(base, cases=60, samples=4, confidence=0.95)
    assert gain is not None
    assert abs(success_power(base, cases=60, samples=4, gain=gain, confidence=0.95) - 0.8) < 1e-3
    rules = GateRules(bootstrap_resamples=500, require_regression=False, expected_gain=1.0)
    better = improved_rates(base, gain)
    sims, passes = 400, 0
    for _ in range(sims):
        report = gate_evaluate(production=_side(rng, base, 4, invalid=0.0), candidate=_side(rng, better, 4, invalid=0.0),
                               rules=rules)
        passes += next(r for r in report.rules if r.name == "holdout success").passed
    print(f"\nsmallest gain at 80% power for 60 cases x 4 samples: {gain:.3f}; simulated power there "
          f"{passes / sims:.3f}")
    assert 0.70 <= passes / sims <= 0.90


def test_the_best_of_several_checkpoints_is_judged_with_its_looks_counted():
    # Eight checkpoints, each as good as production on average but better on some cases and worse on others
    # (per-case deviations of mean zero). The best on the holdout, measured again on fresh samples of the same
    # cases, still carries the luck of the cases that picked it: counting the looks keeps the false passes
    # at alpha.
    rng = np.random.default_rng(15)
    rules = GateRules(bootstrap_resamples=500, require_regression=False)
    sims, cases, k, looks = 1000, 200, 4, 8
    uncorrected = corrected = 0
    for _ in range(sims):
        base = rng.beta(0.7, 1.3, size=cases)
        room = np.minimum(base, 1 - base)
        checkpoints = [base + 0.6 * room * rng.choice([-1.0, 1.0], size=cases) for _ in range(looks)]
        best = max(checkpoints, key=lambda rates: rng.binomial(k, rates).mean())
        production = _side(rng, base, k, invalid=0.0)
        fresh = _side(rng, best, k, invalid=0.0)
        uncorrected += gate_evaluate(production=production, candidate=fresh, rules=rules).passed
        corrected += gate_evaluate(production=production, candidate=fresh, rules=rules, looks=looks).passed
    print(f"\nbest of {looks} checkpoints of no average gain, {cases} cases x {k} samples, fresh samples: "
          f"passes {uncorrected / sims:.3f} judged as one look, {corrected / sims:.3f} with the looks counted")
    assert corrected / sims <= 0.05
