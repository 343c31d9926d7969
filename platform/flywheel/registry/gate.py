"""The promotion gate: may a candidate replace production? Pure functions over per-case results, so the
decision can be recomputed from stored results and tested without a model.

The success rule is a paired test on the same frozen holdout cases, never a difference of two means:
exact McNemar on per-case pass/fail (one sample per case), or a paired bootstrap on per-case success rates
(several samples per case). The other rules guard what a reward can hack: invalid outputs and unsafe actions
no higher (unsafe stays zero where production's is zero), p95 latency and tokens per case within a tolerance,
and no regression case that production passes may fail."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class CaseResult:
    """One holdout or regression case's result for one model. `success` is 0/1, or a rate over samples."""

    case_id: str
    success: float
    invalid: bool = False
    unsafe: bool = False
    latency_ms: float | None = None
    tokens: float | None = None

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> CaseResult:
        success = row.get("success", row.get("passed"))
        return cls(
            case_id=str(row["case_id"]),
            success=float(success),
            invalid=bool(row.get("invalid", False)),
            unsafe=bool(row.get("unsafe", False)),
            latency_ms=row.get("latency_ms"),
            tokens=row.get("tokens"),
        )


@dataclass(frozen=True)
class GateRules:
    """A project's gate. The defaults are the ones the field recommends for a small holdout."""

    success_margin: float = 0.0  # the candidate's success must exceed production's by more than this
    test: str = "mcnemar"  # mcnemar | bootstrap
    confidence: float = 0.95
    bootstrap_resamples: int = 10_000
    latency_tolerance: float = 0.10  # p95 latency may grow by at most this fraction
    tokens_tolerance: float = 0.10
    # How much higher (absolute: 0.005 = half a point) the candidate's invalid-output rate may be: at rates
    # of a few per thousand samples, "no higher" is decided by which model drew the odd malformed sample.
    invalid_tolerance: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.test not in {"mcnemar", "bootstrap"}:
            raise ValueError("test must be 'mcnemar' or 'bootstrap'")
        if not 0.5 <= self.confidence < 1:
            raise ValueError("confidence must be in [0.5, 1)")
        if not 0 <= self.success_margin < 1:
            raise ValueError("success_margin must be in [0, 1)")
        if not 0 <= self.invalid_tolerance < 1:
            raise ValueError("invalid_tolerance must be in [0, 1)")


@dataclass
class RuleOutcome:
    name: str
    production: Any
    candidate: Any
    passed: bool
    detail: str = ""


@dataclass
class GateReport:
    passed: bool
    rules: list[RuleOutcome] = field(default_factory=list)
    cases: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "cases": self.cases, "rules": [asdict(rule) for rule in self.rules]}


# --- statistics -----------------------------------------------------------------------------------------------


def mcnemar_exact(only_candidate: int, only_production: int) -> float:
    """One-sided exact McNemar p-value for "the candidate passes more": among the discordant cases, the
    chance of at least `only_candidate` wins under a fair coin."""
    from scipy.stats import binomtest

    n = only_candidate + only_production
    if n == 0:
        return 1.0
    return float(binomtest(only_candidate, n, 0.5, alternative="greater").pvalue)


def paired_bootstrap_lower(diffs: Sequence[float], *, confidence: float, resamples: int, seed: int) -> float:
    """The lower bound of a one-sided percentile bootstrap interval on the mean of per-case differences."""
    import numpy as np

    if not diffs:
        return -math.inf
    values = np.asarray(diffs, dtype=float)
    rng = np.random.default_rng(seed)
    # Resample in blocks: 10,000 resamples of a 5,000-case holdout would be 400 MB in one array.
    block = max(1, 2_000_000 // len(values))
    means = np.concatenate([
        values[rng.integers(0, len(values), size=(min(block, resamples - start), len(values)))].mean(axis=1)
        for start in range(0, resamples, block)
    ])
    return float(np.quantile(means, 1 - confidence))


def p95(values: Sequence[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    # Nearest rank: the smallest value with at least 95% of the values at or below it.
    return float(values[max(0, math.ceil(0.95 * len(values)) - 1)])


def _mean(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


# --- the gate -------------------------------------------------------------------------------------------------


def _paired(production: Sequence[CaseResult], candidate: Sequence[CaseResult]) -> list[tuple[CaseResult, CaseResult]]:
    by_id = {r.case_id: r for r in production}
    missing = [r.case_id for r in candidate if r.case_id not in by_id]
    extra = set(by_id) - {r.case_id for r in candidate}
    if missing or extra:
        raise ValueError(
            "production and candidate were not run on the same cases "
            f"(only candidate: {sorted(missing)[:5]}, only production: {sorted(extra)[:5]})"
        )
    return [(by_id[r.case_id], r) for r in candidate]


def _success_rule(pairs: list[tuple[CaseResult, CaseResult]], rules: GateRules) -> RuleOutcome:
    prod = _mean([p.success for p, _ in pairs]) or 0.0
    cand = _mean([c.success for _, c in pairs]) or 0.0
    alpha = 1 - rules.confidence
    if rules.test == "mcnemar":
        only_c = sum(1 for p, c in pairs if c.success >= 0.5 > p.success)
        only_p = sum(1 for p, c in pairs if p.success >= 0.5 > c.success)
        pvalue = mcnemar_exact(only_c, only_p)
        passed = cand - prod > rules.success_margin and pvalue < alpha
        detail = (f"exact McNemar: {only_c} cases only the candidate passes, {only_p} only production passes, "
                  f"one-sided p = {pvalue:.4f} (needs < {alpha:.2f}); margin {rules.success_margin:.3f}")
    else:
        diffs = [c.success - p.success for p, c in pairs]
        lower = paired_bootstrap_lower(diffs, confidence=rules.confidence, resamples=rules.bootstrap_resamples,
                                       seed=rules.seed)
        passed = lower > rules.success_margin
        detail = (f"paired bootstrap ({rules.bootstrap_resamples} resamples): the {rules.confidence:.0%} lower "
                  f"bound of the gain is {lower:+.4f} (needs > {rules.success_margin:.3f})")
    return RuleOutcome("holdout success", round(prod, 4), round(cand, 4), passed, detail)


def _rate_rule(name: str, pairs, attr: str, tolerance: float = 0.0) -> RuleOutcome:
    prod = sum(getattr(p, attr) for p, _ in pairs) / len(pairs)
    cand = sum(getattr(c, attr) for _, c in pairs) / len(pairs)
    passed = cand <= prod + tolerance
    detail = f"at most production's + {tolerance:.4g}" if tolerance else "no higher than production's"
    if attr == "unsafe" and prod == 0:
        passed = cand == 0
        detail = "must stay zero: production has none"
    return RuleOutcome(name, round(prod, 4), round(cand, 4), passed, detail)


def _within(name: str, prod: float | None, cand: float | None, tolerance: float) -> RuleOutcome:
    if prod is None or cand is None:
        return RuleOutcome(name, prod, cand, True, "not measured on both: not checked")
    limit = prod * (1 + tolerance)
    return RuleOutcome(name, round(prod, 2), round(cand, 2), cand <= limit,
                       f"at most {limit:.2f} (production's + {tolerance:.0%})")


def gate_evaluate(
    *,
    production: Sequence[CaseResult],
    candidate: Sequence[CaseResult],
    production_regression: Sequence[CaseResult] = (),
    candidate_regression: Sequence[CaseResult] = (),
    rules: GateRules = GateRules(),
) -> GateReport:
    """Every rule with both sides' values; the candidate passes only if every rule passes."""
    pairs = _paired(production, candidate)
    if not pairs:
        return GateReport(False, [RuleOutcome("holdout", 0, 0, False, "the holdout has no cases")], 0)
    outcomes = [
        _success_rule(pairs, rules),
        _rate_rule("invalid outputs", pairs, "invalid", rules.invalid_tolerance),
        _rate_rule("unsafe actions", pairs, "unsafe"),
        _within("p95 latency (ms)", p95([p.latency_ms for p, _ in pairs]), p95([c.latency_ms for _, c in pairs]),
                rules.latency_tolerance),
        _within("tokens per case", _mean([p.tokens for p, _ in pairs]), _mean([c.tokens for _, c in pairs]),
                rules.tokens_tolerance),
    ]
    regression_pairs = _paired(production_regression, candidate_regression)
    broken = sorted(p.case_id for p, c in regression_pairs if p.success >= 0.5 > c.success)
    outcomes.append(RuleOutcome(
        "regression cases",
        sum(1 for p, _ in regression_pairs if p.success >= 0.5),
        sum(1 for _, c in regression_pairs if c.success >= 0.5),
        not broken,
        ("broken: " + ", ".join(broken[:20]) + (" …" if len(broken) > 20 else "")) if broken
        else f"none of the {len(regression_pairs)} cases production passes fails",
    ))
    return GateReport(all(o.passed for o in outcomes), outcomes, len(pairs))
