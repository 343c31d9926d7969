"""The gate's error rates, shown by simulation: pure functions over simulated per-case outcomes.

A simulated holdout draws each case's true pass rate from a spread like a real one (Beta(0.7, 1.3): many
cases production nearly always fails, some it nearly always passes, mean 0.35), samples both models `k`
times per case, and adds invalid outputs, unsafe actions and token counts at realistic rates; both models
are timed on 30 cases (per-request noise lognormal, sigma 0.27). A regression suite draws 20 rates
production passes reliably (0.85 to 1), sampled as often as GRPOConfig's `regression_samples_per_prompt`
says. Run with `-s` to see the figures, each with its 95% (Wilson) interval."""

from __future__ import annotations

import numpy as np

from flywheel.registry.gate import (
    CaseResult,
    GateRules,
    LatencyCase,
    gate_evaluate,
    improved_rates,
    regression_rule,
    smallest_gain,
    success_power,
)
from flywheel.registry.sequential import wilson
from trainer.config import GRPOConfig

# Monte Carlo sign vectors per test inside the simulation: (1 + k) / (1 + B) keeps each test valid at any B.
RULES = GateRules(bootstrap_resamples=500)
REFUSING = ("invalid outputs", "unsafe actions", "time per token", "tokens per case", "regression cases")
REGRESSION_SAMPLES = GRPOConfig().regression_samples_per_prompt
# 0.1% of samples unsafe, in 5 of the 100 cases (2% a sample there) rather than spread over all of them.
CONCENTRATED = np.r_[np.full(5, 0.02), np.zeros(95)]


def share(hits: int, n: int) -> str:
    """A simulated rate with its 95% Wilson interval."""
    low, high = wilson(hits, n)
    return f"{hits / n:.3f} [{low:.3f}, {high:.3f}]"


def _side(rng, rates, k, *, invalid=0.015, unsafe=0.0, tokens=None):
    rates = np.asarray(rates, dtype=float)
    passes = rng.binomial(k, rates)
    # Invalid outputs are failed samples: drawn among the failures at a per-sample rate of `invalid`.
    bad = rng.binomial(k - passes, np.minimum(1.0, invalid / np.maximum(1e-9, 1 - rates)))
    unsafe_samples = rng.binomial(k, np.broadcast_to(unsafe, rates.shape))
    mean_tokens = (None if tokens is None else rng.normal(tokens, 0.1 * tokens / np.sqrt(k)))
    return [CaseResult(f"c{i}", int(passes[i]), k, int(bad[i]), int(unsafe_samples[i]), None,
                       None if mean_tokens is None else float(mean_tokens[i])) for i in range(rates.size)]


def _timings(rng, cases=30):
    cost = rng.lognormal(np.log(60.0), 0.5, size=cases)
    a, b = cost * rng.lognormal(0.0, 0.27, size=(2, cases))
    return [LatencyCase(f"c{i}", float(a[i]), float(b[i])) for i in range(cases)]


def _simulate(*, seed, sims, cases=100, k=8, gain=0.0, invalid=0.015, unsafe=0.0, regression=20,
              regression_k=REGRESSION_SAMPLES, rules=RULES):
    """Over `sims` simulated gates: the share passed, the share refused by each rule, and the share refused
    by any refusing rule (all but success and size), as counts."""
    rng = np.random.default_rng(seed)
    passed, union, refused = 0, 0, {}
    for _ in range(sims):
        base = rng.beta(0.7, 1.3, size=cases)
        tokens = rng.uniform(20, 60, size=cases)
        reliable = rng.uniform(0.85, 1.0, size=regression)
        report = gate_evaluate(
            production=_side(rng, base, k, invalid=invalid, unsafe=unsafe, tokens=tokens),
            candidate=_side(rng, improved_rates(base, gain), k, invalid=invalid, unsafe=unsafe, tokens=tokens),
            production_regression=_side(rng, reliable, regression_k, invalid=0.0),
            candidate_regression=_side(rng, reliable, regression_k, invalid=0.0),
            latency=_timings(rng), rules=rules,
        )
        passed += report.passed
        union += any(not rule.passed for rule in report.rules if rule.name in REFUSING)
        for rule in report.rules:
            refused[rule.name] = refused.get(rule.name, 0) + (not rule.passed)
    return passed, union, refused


def test_an_identical_candidate_passes_at_most_5_percent_and_the_refusing_rules_together_refuse_it_at_most_5_percent():
    # 0.1% unsafe samples: production has none about half the time, where "must stay zero" refused an
    # identical candidate whenever it had one (25%).
    sims = 2000
    passed, union, refused = _simulate(seed=11, sims=sims, unsafe=0.001)
    print(f"\nidentical candidate, {sims} gates of 100 cases x 8 samples (1.5% invalid, 0.1% unsafe per sample; "
          f"30 cases timed; 20 regression cases x {REGRESSION_SAMPLES}): passes the gate {share(passed, sims)}; "
          f"refused by any refusing rule {share(union, sims)}; by rule: "
          + ", ".join(f"{name} {share(count, sims)}" for name, count in sorted(refused.items())))
    assert passed / sims <= 0.05
    assert union / sims <= 0.05  # each rule at the full alpha and "must stay zero": 25%
    for name in REFUSING:
        assert refused[name] / sims <= 0.05, name


def _unsafe_refused(*, seed, sims, production, candidate):
    """Share of `sims` holdouts of 100 cases x 8 samples on which the unsafe rule refuses, with production's
    and the candidate's unsafe rates a sample (a number, or one per case) and nothing else to tell them apart.
    Beside it only the invalid-outputs rule (Holm over two rules: a little more room than in a whole gate)."""
    rng = np.random.default_rng(seed)
    rules = GateRules(bootstrap_resamples=200, require_regression=False, expected_gain=1.0)
    refused = 0
    for _ in range(sims):
        base = rng.beta(0.7, 1.3, size=100)
        report = gate_evaluate(production=_side(rng, base, 8, unsafe=production),
                               candidate=_side(rng, base, 8, unsafe=candidate), rules=rules)
        refused += not next(r for r in report.rules if r.name == "unsafe actions").passed
    return refused


def test_the_unsafe_rule_refuses_an_identical_candidate_at_most_5_percent_wherever_unsafe_samples_sit():
    sims = 600
    for seed, unsafe, where in ((21, 0.0005, "0.05% a sample"), (22, CONCENTRATED, "0.1%, in 5 of 100 cases"),
                                (23, 0.01, "1% a sample")):
        refused = _unsafe_refused(seed=seed, sims=sims, production=unsafe, candidate=unsafe)
        print(f"\nidentical candidate, unsafe samples {where}, {sims} holdouts of 100 x 8: refused by the unsafe "
              f"rule {share(refused, sims)}")
        assert refused / sims <= 0.05, where  # "must stay zero": 20-25%
    # What it catches: ten times production's unsafe samples.
    for seed, before, after in ((24, 0.001, 0.01), (25, 0.0, 0.01)):
        caught = _unsafe_refused(seed=seed, sims=sims, production=before, candidate=after)
        print(f"unsafe {before:.1%} -> {after:.0%} a sample, {sims} holdouts of 100 x 8: refused {share(caught, sims)}")
        assert caught / sims >= 0.5


def test_the_whole_gate_passes_a_better_candidate_nearly_as_often_as_its_success_rule_does():
    # The refusing rules share alpha, so together they cost a candidate that is better and no worse
    # elsewhere at most alpha of its power. "Must stay zero" capped it: +0.25 passed 96.75% (90% with
    # concentrated unsafe samples) although the success rule passed it every time.
    sims = 300
    for seed, gain, unsafe, where, cases, k in ((31, 0.10, 0.001, "0.1% unsafe a sample", 100, 8),
                                                (32, 0.25, 0.001, "0.1% unsafe a sample", 100, 8),
                                                (33, 0.25, 0.01, "1% unsafe a sample", 100, 8),
                                                (34, 0.10, CONCENTRATED, "0.1% unsafe in 5 cases", 100, 8),
                                                (35, 0.25, CONCENTRATED, "0.1% unsafe in 5 cases", 100, 8),
                                                # where the success rule's power is about 80%, not saturated
                                                (36, 0.10, 0.001, "0.1% unsafe a sample", 60, 4)):
        passed, union, refused = _simulate(seed=seed, sims=sims, cases=cases, k=k, gain=gain, unsafe=unsafe)
        success = sims - refused["holdout success"]
        print(f"\n+{gain:.2f} candidate, {where}, {sims} gates of {cases} x {k}: passes the whole gate "
              f"{share(passed, sims)}; its success rule alone {share(success, sims)}; refused by any refusing rule "
              f"{share(union, sims)}")
        assert passed / sims >= success / sims - 0.05 - 2 * np.sqrt(0.05 * 0.95 / sims), (gain, where)
        if gain == 0.25:
            assert passed / sims >= 0.95


def _regression_refused(*, seed, scenario, samples, sims, cases=20, confidence=0.95):
    """Share of simulated regression suites the regression rule refuses, alone at 1 - confidence."""
    rng = np.random.default_rng(seed)
    rules = GateRules(confidence=confidence)
    refused = 0
    for _ in range(sims):
        before = rng.uniform(0.85, 1.0, size=cases)
        if scenario == "three cases 100% -> 50%":
            before[:3] = 1.0
            after = before.copy()
            after[:3] = 0.5
        elif scenario == "every case -20 points":
            after = before - 0.2
        elif scenario == "one case 100% -> 0%":
            before[0] = 1.0
            after = before.copy()
            after[0] = 0.0
        else:
            after = before
        refused += not regression_rule(_side(rng, before, samples, invalid=0.0),
                                       _side(rng, after, samples, invalid=0.0), rules).passed
    return refused


def test_the_regression_rule_holds_alpha_and_sees_losses_no_single_case_shows():
    # 20 cases production passes 85-100%. At 0.05 (the rule alone) and at 0.01 (the first level Holm's step
    # tests it at beside the gate's four other refusing rules). Fisher per case with Holm alone refused three
    # cases falling 100% -> 50% 9.9% of the time at 8 samples and every case falling 20 points 0.4%.
    sims = 500
    figures = {}
    for i, (scenario, confidence) in enumerate((("identical", 0.95), ("three cases 100% -> 50%", 0.95),
                                                ("three cases 100% -> 50%", 0.99), ("every case -20 points", 0.99),
                                                ("one case 100% -> 0%", 0.99))):
        for samples in sorted({8, REGRESSION_SAMPLES}):
            hits = _regression_refused(seed=40 + i, scenario=scenario, samples=samples, sims=sims,
                                       confidence=confidence)
            figures[scenario, confidence, samples] = hits / sims
            print(f"\nregression rule, 20 cases x {samples} samples a side, at {1 - confidence:.2f}: {scenario} "
                  f"refused {share(hits, sims)}")
    k = REGRESSION_SAMPLES
    assert figures["identical", 0.95, k] <= 0.05
    assert figures["three cases 100% -> 50%", 0.95, k] >= 0.9
    assert figures["three cases 100% -> 50%", 0.99, k] >= 0.7
    assert figures["every case -20 points", 0.99, k] >= 0.95
    assert figures["one case 100% -> 0%", 0.99, k] >= 0.95


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
