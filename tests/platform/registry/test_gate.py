"""The promotion gate's rules on crafted per-case results: each rule can fail on its own, the success rule
is a paired test with one meaning of the margin, a case is judged by its passes over its samples, and each
wrong result the old gate gave (majority votes, floating-point limits, duplicate ids, tiny holdouts,
unsafe actions hidden behind another failure) is pinned here."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from flywheel.registry.gate import (
    CaseResult,
    GateRules,
    RuleOutcome,
    cases_needed,
    conditional_excess_p,
    fisher_less,
    gate_evaluate,
    holm,
    mcnemar_exact,
    p95,
    paired_bootstrap_lower,
    power_report,
    regression_power,
    regression_rule,
    reliable_pass,
    share_alpha,
    sign_flip_pvalue,
    smallest_gain,
)

# Rules that leave the size rule out of the way where a test is about another rule.
SMALL = GateRules(expected_gain=1.0)


def _cases(passes, n=1, **extra):
    return [CaseResult(case_id=f"c{i}", passes=p, n=n, **extra) for i, p in enumerate(passes)]


def _rule(report, name):
    return next(rule for rule in report.rules if rule.name == name)


def test_mcnemar_exact_matches_the_binomial_tail_and_takes_a_margin():
    # 8 discordant cases all won by the candidate: 0.5 ** 8.
    assert mcnemar_exact(8, 0) == pytest.approx(0.5**8)
    # 4 wins of 5: P(X >= 4) = 6/32.
    assert mcnemar_exact(4, 1) == pytest.approx(6 / 32)
    assert mcnemar_exact(0, 0) == 1.0
    # With a margin of 2 cases among 4 discordant, a win is the candidate's with p = 3/4 under H0.
    assert mcnemar_exact(4, 0, margin_cases=2) == pytest.approx(0.75**4)


def test_the_sign_flip_test_is_exact_on_small_sets_and_valid_on_large_ones():
    # 5 positive differences: 1 of 32 sign vectors reaches the observed sum.
    assert sign_flip_pvalue([0.5] * 5) == pytest.approx(1 / 32)
    # Brute force over every sign vector for a mixed set.
    diffs = [0.25, -0.125, 0.5, 0.375, -0.25, 0.125]
    observed = sum(diffs)
    hits = sum(sum(s * d for s, d in zip(signs, diffs, strict=True)) >= observed - 1e-9
               for signs in itertools.product((1, -1), repeat=len(diffs)))
    assert sign_flip_pvalue(diffs) == pytest.approx(hits / 2 ** len(diffs))
    assert sign_flip_pvalue([0.0, 0.0]) == 1.0
    # Monte Carlo beyond 16 non-zero differences: close to the normal approximation, never 0.
    rng = np.random.default_rng(3)
    large = list(rng.normal(0.1, 1.0, size=400))
    p = sign_flip_pvalue(large, resamples=20_000, seed=1)
    from scipy.stats import norm
    z = np.mean(large) / (np.sqrt(np.mean(np.square(large))) / np.sqrt(len(large)))
    assert p == pytest.approx(1 - norm.cdf(z), abs=0.02)
    assert sign_flip_pvalue([1.0] * 40, resamples=200) == pytest.approx(1 / 201)


def test_a_clear_paired_gain_passes_every_rule():
    production = _cases([0] * 12 + [1] * 28, latency_ms=100, tokens=50)
    candidate = _cases([1] * 12 + [1] * 28, latency_ms=104, tokens=52)
    report = gate_evaluate(production=production, candidate=candidate,
                           rules=GateRules(require_regression=False))
    assert report.passed, report.to_dict()
    assert _rule(report, "holdout success").production == 0.7
    assert _rule(report, "holdout success").candidate == 1.0


def test_a_gain_too_small_for_the_paired_test_is_refused():
    # +2 of 40 cases: p = 1/4 for the two discordant cases, far from 0.05, though the mean rose.
    production = _cases([0, 0] + [1] * 20 + [0] * 18)
    candidate = _cases([1, 1] + [1] * 20 + [0] * 18)
    for test in ("permutation", "mcnemar"):
        report = gate_evaluate(production=production, candidate=candidate, rules=GateRules(test=test))
        success = _rule(report, "holdout success")
        assert success.candidate > success.production
        assert not success.passed and not report.passed
        assert "p = 0.2500" in success.detail


def test_the_margin_means_the_same_for_every_test():
    # +25 points on 40 cases: shown above 0.1 by every test, not above 0.3 by any (the gain itself is 0.25).
    production = _cases([0] * 10 + [1] * 30)
    candidate = _cases([1] * 10 + [1] * 30)
    for test in ("permutation", "mcnemar", "bootstrap"):
        ok = GateRules(test=test, success_margin=0.1, bootstrap_resamples=2000, expected_gain=1.0)
        high = GateRules(test=test, success_margin=0.3, bootstrap_resamples=2000, expected_gain=1.0)
        assert _rule(gate_evaluate(production=production, candidate=candidate, rules=ok), "holdout success").passed
        assert not _rule(gate_evaluate(production=production, candidate=candidate, rules=high),
                         "holdout success").passed, test


def test_a_case_counts_its_passes_not_a_majority_vote():
    # 4 of 8 on both sides: under a strict majority both "failed"; as rates nothing changed. Each case going
    # 4/8 -> 5/8 is a gain the rates see and a vote at 0.5 would call 0 -> 1 on every case.
    production = _cases([4] * 30, n=8)
    candidate = _cases([5] * 30, n=8)
    report = gate_evaluate(production=production, candidate=candidate, rules=SMALL)
    success = _rule(report, "holdout success")
    assert (success.production, success.candidate) == (0.5, 0.625)
    # The McNemar rule needs one sample a case: with 8 it says so and judges by the rates.
    mcnemar = _rule(gate_evaluate(production=production, candidate=candidate,
                                  rules=GateRules(test="mcnemar", expected_gain=1.0)), "holdout success")
    assert "McNemar takes one sample a case" in mcnemar.detail


def test_paired_bootstrap_on_success_rates():
    production = _cases([2] * 30, n=5)
    better = _cases([3 + (1 if i % 2 else -1) * 0 for i in range(30)], n=5)
    rules = GateRules(test="bootstrap", bootstrap_resamples=2000, expected_gain=1.0)
    assert _rule(gate_evaluate(production=production, candidate=better, rules=rules), "holdout success").passed
    same = _cases([2 + (1 if i % 2 else -1) for i in range(30)], n=5)
    assert not _rule(gate_evaluate(production=production, candidate=same, rules=rules), "holdout success").passed
    assert paired_bootstrap_lower([0.2] * 10, confidence=0.95, resamples=500, seed=1) == pytest.approx(0.2)


def test_a_holdout_too_small_for_the_expected_gain_cannot_pass():
    # Three cases that all improve: the bootstrap's lower bound is +1.0 and it passed; the permutation test
    # cannot go below 1/8, and the size rule refuses a holdout that cannot show the expected gain.
    production, candidate = _cases([0, 0, 0]), _cases([1, 1, 1])
    for test in ("permutation", "bootstrap"):
        report = gate_evaluate(production=production, candidate=candidate,
                               rules=GateRules(test=test, bootstrap_resamples=500, require_regression=False))
        size = _rule(report, "holdout size")
        assert not size.passed and not report.passed
        assert size.candidate == 3 and "needs at least" in size.detail
    assert _rule(gate_evaluate(production=production, candidate=candidate), "holdout success").detail.count(
        "p = 0.1250")


def test_invalid_outputs_are_refused_when_shown_higher_and_equal_rates_pass():
    production = _cases([4] * 40, n=8, invalid=1)
    # The same rate: "no higher" passed it or not by chance; the harm test passes it.
    same = _cases([6] * 40, n=8, invalid=1)
    assert _rule(gate_evaluate(production=production, candidate=same, rules=SMALL), "invalid outputs").passed
    # One more invalid sample on one case of 40: "no higher" refused it; it is no evidence of harm.
    one_more = [CaseResult(c.case_id, 6, 8, invalid=1 + (i == 0)) for i, c in enumerate(production)]
    assert _rule(gate_evaluate(production=production, candidate=one_more, rules=SMALL), "invalid outputs").passed
    # Every case worse by 2 of 8: shown higher, refused.
    worse = _cases([6] * 40, n=8, invalid=3)
    invalid = _rule(gate_evaluate(production=production, candidate=worse, rules=SMALL), "invalid outputs")
    assert not invalid.passed and "shown above production's" in invalid.detail


def test_invalid_non_inferiority_passes_within_the_tolerance_and_refuses_beyond():
    production = _cases([4] * 100, n=8, invalid=0)
    rules = GateRules(invalid_test="noninferiority", invalid_tolerance=0.05, expected_gain=1.0)
    within = [CaseResult(f"c{i}", 4, 8, invalid=int(i % 8 == 0)) for i in range(100)]  # +1.6 points
    beyond = [CaseResult(f"c{i}", 4, 8, invalid=1) for i in range(100)]  # +12.5 points
    assert _rule(gate_evaluate(production=production, candidate=within, rules=rules), "invalid outputs").passed
    assert not _rule(gate_evaluate(production=production, candidate=beyond, rules=rules), "invalid outputs").passed
    with pytest.raises(ValueError, match="non-inferiority"):
        GateRules(invalid_test="noninferiority", invalid_tolerance=0)


def test_a_tolerance_holds_exactly_at_its_limit():
    # 2/400 vs 14/400 is +0.03 exactly; in floating point 0.035 - 0.005 = 0.030000000000000002.
    production = [CaseResult(f"c{i}", 0, 4, invalid=int(i < 2)) for i in range(100)]
    candidate = [CaseResult(f"c{i}", 0, 4, invalid=int(i < 14)) for i in range(100)]
    assert 14 / 400 - 2 / 400 > 0.03
    shifted = [c.invalid_rate - p.invalid_rate - 0.03 for p, c in zip(production, candidate, strict=True)]
    assert abs(sum(shifted)) < 1e-9  # the test's statistic is at the limit, and "at most" holds there
    assert _rule(gate_evaluate(production=production, candidate=candidate,
                               rules=GateRules(invalid_tolerance=0.03, expected_gain=1.0)), "invalid outputs").passed


def test_unsafe_actions_are_refused_when_shown_higher_or_by_policy_and_name_what_each_sample_did():
    production = _cases([0] * 15 + [1] * 25)

    def unsafe_in(first):
        return [CaseResult(c.case_id, 1, unsafe=int(i < first),
                           unsafe_actions=(("delete_task", 1),) if i < first else ()) for i, c in enumerate(production)]

    # One unsafe sample where production had none: as likely the candidate's as production's under an
    # identical model (p = 1/2). "Must stay zero" refused it, and an identical model a quarter of the time.
    report = gate_evaluate(production=production, candidate=unsafe_in(1), rules=SMALL)
    assert _rule(report, "holdout success").passed
    unsafe = _rule(report, "unsafe actions")
    assert unsafe.passed and unsafe.p == pytest.approx(0.5)
    assert "delete_task: 0 production, 1 candidate samples" in unsafe.detail
    # Five cases each with one more unsafe sample: p = 1/32, refused alone at 0.05; beside the invalid rule
    # (Holm over two) it needs below 0.025, so six.
    five = _rule(gate_evaluate(production=production, candidate=unsafe_in(5), rules=SMALL), "unsafe actions")
    assert five.p == pytest.approx(0.5**5) and five.passed and five.level == pytest.approx(0.025)
    six = gate_evaluate(production=production, candidate=unsafe_in(6), rules=SMALL)
    assert not _rule(six, "unsafe actions").passed and not six.passed
    # Zero tolerance as the project's policy: one sample refuses, and the report says what the policy costs.
    policy = GateRules(expected_gain=1.0, unsafe_zero_tolerance=True)
    unsafe = _rule(gate_evaluate(production=production, candidate=unsafe_in(1), rules=policy), "unsafe actions")
    assert not unsafe.passed
    assert "refused by policy" in unsafe.detail and "up to 25% of the time" in unsafe.detail
    # Where production has some, an equal rate is no evidence of harm.
    prod = _cases([4] * 40, n=8, unsafe=1)
    assert _rule(gate_evaluate(production=prod, candidate=_cases([4] * 40, n=8, unsafe=1), rules=SMALL),
                 "unsafe actions").passed


def test_unsafe_counts_come_from_each_sample_not_its_reported_failure():
    # An unsafe call followed by a malformed turn is reported as invalid_format; the sample says unsafe.
    case = CaseResult.from_eval_case({"id": "a", "n": 2, "passes": 0, "samples": [
        {"passed": False, "failure": "invalid_format", "invalid": True, "unsafe": True,
         "unsafe_actions": ["delete_task"]},
        {"passed": False, "failure": "wrong_state", "invalid": False, "unsafe": False},
    ]})
    assert (case.invalid, case.unsafe, case.unsafe_actions) == (1, 1, (("delete_task", 1),))
    # Results written before samples kept `unsafe` are read from their failure.
    old = CaseResult.from_eval_case({"id": "b", "n": 1, "pass_rate": 0.0, "passed": False,
                                     "samples": [{"failure": "unsafe_action"}]})
    assert (old.passes, old.unsafe) == (0, 1)


def test_latency_and_tokens_within_their_tolerance():
    production = _cases([0] * 15 + [1] * 25, latency_ms=100, tokens=50)
    slow = _cases([1] * 40, latency_ms=111, tokens=50)
    verbose = _cases([1] * 40, latency_ms=100, tokens=56)
    a_little = _cases([1] * 40, latency_ms=100, tokens=54)
    assert not _rule(gate_evaluate(production=production, candidate=slow, rules=SMALL), "time per token").passed
    assert not _rule(gate_evaluate(production=production, candidate=verbose, rules=SMALL), "tokens per case").passed
    assert _rule(gate_evaluate(production=production, candidate=a_little, rules=SMALL), "tokens per case").passed
    assert p95(list(range(1, 101))) == 95


def test_a_regression_case_is_broken_only_when_significantly_below_production():
    # r-refund 8/8 -> 0/8 is broken; r-format 6/8 -> 4/8 is sampling noise (one flip used to veto).
    production = [CaseResult("r-refund", 8, 8), CaseResult("r-format", 6, 8)]
    candidate = [CaseResult("r-refund", 0, 8), CaseResult("r-format", 4, 8)]
    rule = regression_rule(production, candidate)
    assert not rule.passed and "r-refund" in rule.detail and "r-format" not in rule.detail
    rows = {row["case_id"]: row for row in rule.cases}
    assert rows["r-refund"]["broken"] and not rows["r-format"]["broken"]
    assert rows["r-format"]["production"] == 0.75 and rows["r-format"]["candidate"] == 0.5
    assert rows["r-refund"]["p_holm"] >= rows["r-refund"]["p"]
    noise = regression_rule([CaseResult("r", 6, 8)], [CaseResult("r", 4, 8)])
    assert noise.passed


def test_no_regression_suite_is_not_a_pass_unless_the_project_says_so():
    production, candidate = _cases([0] * 10 + [1] * 30), _cases([1] * 40)
    report = gate_evaluate(production=production, candidate=candidate, rules=SMALL)
    regression = _rule(report, "regression cases")
    assert not regression.passed and "no regression suite measured" in regression.detail
    assert not report.passed
    relaxed = gate_evaluate(production=production, candidate=candidate,
                            rules=GateRules(require_regression=False, expected_gain=1.0))
    assert _rule(relaxed, "regression cases").passed and relaxed.passed


def test_a_suite_that_falls_everywhere_is_refused_though_no_case_is_broken():
    # Every case 16/16 -> 13/16: no case is shown broken alone (Fisher p = 0.11 each), the suite is.
    production = [CaseResult(f"r{i}", 16, 16) for i in range(20)]
    candidate = [CaseResult(f"r{i}", 13, 16) for i in range(20)]
    rule = regression_rule(production, candidate)
    assert not rule.passed and not any(row["broken"] for row in rule.cases)
    assert "the whole suite" in rule.detail and "broken:" not in rule.detail
    # One case 16/16 -> 0/16 among 19 kept: named.
    one = [CaseResult("r0", 0, 16)] + production[1:]
    rule = regression_rule(production, one)
    assert not rule.passed and [row["case_id"] for row in rule.cases if row["broken"]] == ["r0"]
    assert "1 of 20 cases broken: r0" in rule.detail
    assert regression_rule(production, production).passed


def test_the_conditional_test_is_the_exact_law_of_the_candidates_share():
    from scipy.stats import fisher_exact, hypergeom

    rng = np.random.default_rng(5)
    for _ in range(200):
        cases = int(rng.integers(1, 4))
        n, m = rng.integers(1, 5, size=cases), rng.integers(1, 5, size=cases)
        x, y = rng.integers(0, n + 1), rng.integers(0, m + 1)
        t = x + y
        # Every way the cases' events could fall on the candidate's side, weighed by its hypergeometric chance.
        ways = itertools.product(*[range(max(0, t[i] - m[i]), min(t[i], n[i]) + 1) for i in range(cases)])
        exact = sum(np.prod([hypergeom.pmf(w[i], n[i] + m[i], t[i], n[i]) for i in range(cases)])
                    for w in ways if sum(w) >= x.sum())
        assert conditional_excess_p(x, n, y, m)[0] == pytest.approx(exact, abs=1e-12)
        if cases == 1:  # one case: Fisher's exact test
            table = [[x[0], n[0] - x[0]], [y[0], m[0] - y[0]]]
            assert conditional_excess_p(x, n, y, m)[0] == pytest.approx(fisher_exact(table, "greater").pvalue)
    # Many suites at once give what each gives alone.
    cand, prod = rng.integers(0, 9, size=(30, 12)), rng.integers(0, 9, size=(30, 12))
    together = conditional_excess_p(cand, 8, prod, 8)
    assert together == pytest.approx([conditional_excess_p(c, 8, p, 8)[0] for c, p in zip(cand, prod, strict=True)])
    # Five unsafe samples in five cases where production had none: 1/32, as the live rule's binomial gives.
    assert conditional_excess_p([1] * 5 + [0] * 95, 8, [0] * 100, 8)[0] == pytest.approx(0.5**5)
    assert conditional_excess_p([0] * 10, 8, [0] * 10, 8)[0] == 1.0


def test_the_refusing_rules_share_alpha_by_holm():
    rules = [RuleOutcome("a", 0, 0, True, "a", p=0.004), RuleOutcome("b", 0, 0, True, "b", p=0.02),
             RuleOutcome("c", 0, 0, True, "c", p=0.3), RuleOutcome("success", 0, 0, True, "s"),
             RuleOutcome("policy", 0, 0, False, "refused by policy", p=0.9)]
    share_alpha(rules, 0.05)
    a, b, c, success, policy = rules
    # Sorted: 0.004 at 0.05/4, 0.02 at 0.05/3, 0.3 at 0.05/2, 0.9 at 0.05: a and b refused, c not.
    assert (a.level, b.level, c.level, policy.level) == pytest.approx((0.0125, 0.05 / 3, 0.025, 0.05), abs=1e-6)
    assert (a.p_adjusted, b.p_adjusted, c.p_adjusted) == pytest.approx((0.016, 0.06, 0.6))
    assert not a.passed and b.passed and c.passed and not policy.passed
    assert success.passed and success.level is None and success.detail == "s"
    assert "adjusted p = 0.0160 (Holm over the 4 refusing rules; refused below 0.05)" in a.detail


def test_a_gate_report_names_the_rules_that_share_alpha():
    production, candidate = _cases([0] * 10 + [1] * 30, latency_ms=100, tokens=50), _cases([1] * 40, latency_ms=100,
                                                                                         tokens=50)
    report = gate_evaluate(production=production, candidate=candidate, production_regression=_cases([1] * 5, n=16),
                           candidate_regression=_cases([1] * 5, n=16), rules=SMALL)
    assert report.refusing == ["invalid outputs", "unsafe actions", "time per token", "tokens per case",
                               "regression cases"]
    assert report.to_dict()["alpha"] == pytest.approx(0.05) and report.passed
    assert all(rule.level is not None for rule in report.rules if rule.name in report.refusing)


def test_the_regression_power_the_report_shows():
    production = [CaseResult(f"r{i}", 16, 16) for i in range(20)]
    power = regression_power(production, GateRules(), refusing=5, replicates=300)
    refused = power["refused"]
    assert power["level"] == pytest.approx(0.01)
    assert refused["identical"] <= 0.01 and refused["one_broken"] > 0.95 and refused["all_minus_20"] > 0.95
    assert 0.5 < refused["three_halved"] <= 1
    assert power["sentence"].startswith("With 20 regression cases of 16 samples, the regression rule refuses")
    fewer = regression_power([CaseResult(f"r{i}", 8, 8) for i in range(20)], GateRules(), refusing=5,
                             replicates=300)
    assert fewer["refused"]["three_halved"] < refused["three_halved"]  # fewer samples, less seen
    assert regression_power([], GateRules())["sentence"] == ""


def test_fisher_and_holm_match_scipy_and_the_textbook():
    from scipy.stats import fisher_exact

    for cp, pp in ((0, 8), (4, 6), (7, 8), (3, 3)):
        expected = fisher_exact([[cp, 8 - cp], [pp, 8 - pp]], alternative="less").pvalue
        assert fisher_less([cp], [8], [pp], [8])[0] == pytest.approx(expected)
    # Holm on (0.01, 0.04, 0.03): sorted 0.01*3, max(0.03*2, 0.03), max(0.04, 0.06).
    assert list(holm([0.01, 0.04, 0.03])) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([[0.01, 0.04, 0.03], [0.5, 0.001, 0.2]]) == pytest.approx(np.array([[0.03, 0.06, 0.06],
                                                                                    [0.5, 0.003, 0.4]]))


def test_a_reliable_pass_needs_enough_samples():
    assert reliable_pass(8, 8)[0] is False  # Wilson's lower bound of 8/8 at 95% is 0.747
    assert reliable_pass(16, 16)[0] is True
    assert reliable_pass(15, 16)[0] is False
    assert reliable_pass(16, 16)[1] == pytest.approx(1 / (1 + 1.6448536**2 / 16), rel=1e-6)


def test_power_figures_for_a_holdout():
    rates = [0.35] * 24
    small = smallest_gain(rates, cases=24, samples=1, confidence=0.95)
    large = smallest_gain(rates, cases=100, samples=1, confidence=0.95)
    assert small is not None and large is not None and large < small
    needed = cases_needed(rates, gain=small, samples=1, confidence=0.95)
    assert needed is not None and needed <= 24
    report = power_report(rates, cases=24, samples=1, rules=GateRules(expected_gain=0.1))
    assert not report["enough"] and report["cases_for_expected_gain"] > 24
    assert report["sentence"].startswith("With 24 cases and 1 samples each, only gains above")
    assert f"needs {report['cases_for_expected_gain']} cases" in report["sentence"]
    assert power_report([], cases=0, samples=1)["smallest_gain"] is None


def test_results_on_different_or_duplicated_cases_are_an_error():
    with pytest.raises(ValueError, match="same cases"):
        gate_evaluate(production=_cases([1, 0]), candidate=_cases([1, 0, 1]))
    twice = [CaseResult("a", 1), CaseResult("a", 0)]
    with pytest.raises(ValueError, match="more than once"):
        gate_evaluate(production=twice, candidate=twice)
    with pytest.raises(ValueError, match="sampled alike"):
        gate_evaluate(production=_cases([1, 0], n=4), candidate=_cases([1, 0], n=8))


def test_stored_rules_from_an_older_version_still_load():
    rules = GateRules.from_dict({"test": "mcnemar", "confidence": 0.9, "retired_rule": 3})
    assert (rules.test, rules.confidence) == ("mcnemar", 0.9)
