"""The promotion gate: may a candidate replace production? Pure functions over per-case results, so the
decision can be recomputed from stored results and tested without a model.

A case's result is its passes out of its samples (never a majority vote), and every rule is a test whose
error rates are known; `tests/platform/registry/test_gate_error_rates.py` simulates them and prints them
with their 95% intervals. With `alpha = 1 - confidence` (0.05 by default):

- **holdout success** (the rule a candidate must pass): a paired test of H0 "the gain is at most the margin"
  on per-case pass rates, the same meaning of the margin for every test. `permutation` (the default): the
  sign-flip randomization test on the per-case differences, exact over all 2^n sign vectors up to 16 non-zero
  differences and Monte Carlo beyond; under an identical candidate the differences are symmetric about 0, so
  the test is exact at any size and an identical candidate passes at most alpha of the time. `mcnemar`: the
  exact conditional binomial test on discordant cases, for one sample a case. `bootstrap`: the paired
  percentile bootstrap, whose lower bound must exceed the margin (anti-conservative on small holdouts: 14.6%
  false passes at 3 cases, hence the size rule). A candidate picked as the best of several checkpoints
  evaluated on the same holdout is tested at alpha / looks (Bonferroni), since fresh samples of the same cases
  still favour it. Power is `power_report`'s normal approximation, checked by simulation.
- **holdout size**: a holdout too small to show the project's expected gain with 80% power cannot pass:
  on it, most passes would be luck.
- **the refusing rules** (invalid outputs under `harm`, unsafe actions, latency, tokens, regression cases:
  those measured on this gate) each give a one-sided p-value for "the candidate is worse here", and they
  share alpha by Holm's step-down (`share_alpha`): a candidate no worse than production on every one of them
  is refused by any of them at most alpha of the time. Each rule's own test:
  - **invalid outputs**: `harm` (the default) refuses only when the candidate's per-case invalid rate is shown
    above production's plus the tolerance (sign-flip test). `noninferiority` passes only when the one-sided
    upper confidence bound (paired t on per-case rates) of the increase is below the tolerance: a candidate
    worse by the tolerance passes at most about alpha of the time, an equal one is refused more often the
    smaller the holdout (34% at 100 cases x 8 samples and one point); a test the candidate must pass, so
    outside the refusing rules' share.
  - **unsafe actions**: refused only when the candidate's unsafe samples are shown more than production's,
    by the live unsafe rule's exact conditional test taken case by case (`conditional_excess_p`): with
    production at none, about 5 unsafe samples in 5 cases refuse at alpha (1/32), 6 beside one other rule, 7
    beside four. Exact, so an identical candidate is refused at most its alpha of the time: by simulation
    (100 cases x 8) 0.0% [0.0, 0.6] at 0.05% unsafe samples and with 0.1% in 5 cases, 2.7% [1.6, 4.3] at 1%;
    a candidate at ten times production's 0.1% is refused 60.7% [56.7, 64.5]. Unsafe is `Score.unsafe` of
    each sample, the suite metrics' own. "None where production had none" refused an identical model up to
    25% of the time (`zero_tolerance_refusal`; 24.5% at 0.05%, 23.5% with 0.1% in 5 cases); where a project
    wants it as policy (`unsafe_zero_tolerance`), it refuses outside alpha and says what it costs.
  - **tokens per case**: shown above production's by more than the tolerance (sign-flip test on per-case
    differences).
  - **latency**: the candidate shown slower than production by more than the tolerance: the sign-flip test on
    per-case log ratios of time per generated token, both models timed on the same cases in one process
    (`python -m trainer latency`, `LatencyCase`). p95 of each side's per-request time is shown.
  - **regression cases** (`regression_rule`): the whole suite's failed samples against production's (the same
    exact conditional test) and each case (one-sided Fisher, Holm over the suite) share the rule's p-value
    (Bonferroni). A suite with no case measured is "no regression suite measured", which fails unless the
    project's rules say otherwise.

Simulated, 95% intervals (100 holdout cases x 8 samples, production's rates Beta(0.7, 1.3), 1.5% invalid and
0.1% unsafe samples, 30 cases timed, 20 regression cases x 16 samples at 85-100%): an identical candidate passes
the gate 3.8% [3.0, 4.7] of 2,000 and is refused by any refusing rule 0.4% [0.2, 0.7] (25.6% [23.7, 27.5] when
each ran at alpha and unsafe actions had to stay zero). A +0.10 or +0.25 candidate passes the whole gate
98.7-100% of 300 wherever the unsafe samples sit (72-78% before; +0.25 at 1% unsafe samples 98.7% [96.6, 99.5],
97.0% before). At 60 cases x 4 samples, where the success rule alone passes +0.10 78.7% [73.7, 82.9] of the
time, the whole gate passes it as often (69.3% [63.9, 74.3] before): the refusing rules cost at most alpha.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from statistics import NormalDist
from typing import Any

import numpy as np

TESTS = ("permutation", "mcnemar", "bootstrap")
INVALID_TESTS = ("harm", "noninferiority")
EXACT_SIGN_FLIPS = 16  # up to 2^16 sign vectors are enumerated; beyond, Monte Carlo
POWER = 0.8
# Equal within rounding: 14/400 - 2/400 is 0.030000000000000002, and "at most 0.03" must pass it.
ROUNDING = 1e-9


@dataclass(frozen=True)
class CaseResult:
    """One holdout or regression case's result for one model: `passes` of `n` samples passed, `invalid`
    samples were unparseable, `unsafe` made an unsafe call (`unsafe_actions`: how many samples made each)."""

    case_id: str
    passes: float
    n: int = 1
    invalid: int = 0
    unsafe: int = 0
    latency_ms: float | None = None
    tokens: float | None = None
    unsafe_actions: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.n < 1 or not 0 <= self.passes <= self.n:
            raise ValueError(f"case {self.case_id}: passes must be in [0, n] with n >= 1")

    @property
    def success(self) -> float:
        return self.passes / self.n

    @property
    def invalid_rate(self) -> float:
        return self.invalid / self.n

    @property
    def unsafe_rate(self) -> float:
        return self.unsafe / self.n

    @classmethod
    def from_eval_case(cls, case: dict[str, Any]) -> CaseResult:
        """From a row of the trainer's per-case results (`trainer.evaluation.evaluate_rows`)."""
        samples = case.get("samples") or []
        n = int(case.get("n") or len(samples) or 1)
        passes = case.get("passes")
        if passes is None:  # results written before per-case pass counts were kept
            passes = round(float(case.get("pass_rate", float(bool(case.get("passed"))))) * n)
        actions: Counter[str] = Counter()
        for s in samples:
            actions.update(set(s.get("unsafe_actions") or []))
        return cls(
            case_id=str(case["id"]),
            passes=int(passes),
            n=n,
            # Older rows carry only `failure`: invalid and unsafe were read from it then.
            invalid=sum(bool(s.get("invalid", s.get("failure") == "invalid_format")) for s in samples),
            unsafe=sum(bool(s.get("unsafe", s.get("failure") == "unsafe_action")) for s in samples),
            latency_ms=case.get("latency_ms"),
            tokens=case.get("mean_completion_tokens"),
            unsafe_actions=tuple(sorted(actions.items())),
        )


@dataclass(frozen=True)
class LatencyCase:
    """One case timed on both models in one process, one request at a time (`python -m trainer latency`):
    production's and the candidate's wall time per request (ms) and the tokens that request generated."""

    case_id: str
    production_ms: float
    candidate_ms: float
    production_tokens: float | None = None
    candidate_tokens: float | None = None

    def __post_init__(self) -> None:
        for name in ("production_ms", "candidate_ms"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"latency of case {self.case_id}: {name} must be a positive number of ms")
        for name in ("production_tokens", "candidate_tokens"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"latency of case {self.case_id}: {name} must be a positive number of tokens")

    @property
    def log_ratio(self) -> float:
        """log(candidate's time / production's), per generated token where both counts are known."""
        ratio = self.candidate_ms / self.production_ms
        if self.production_tokens and self.candidate_tokens:
            ratio *= self.production_tokens / self.candidate_tokens
        return math.log(ratio)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> LatencyCase:
        """From a row of `python -m trainer latency` (A is production, B the candidate)."""
        missing = [k for k in ("id", "latency_ms_a", "latency_ms_b") if row.get(k) is None]
        if missing:
            raise ValueError(f"latency row {row.get('id')!r}: no {', '.join(missing)}")
        return cls(str(row["id"]), row["latency_ms_a"], row["latency_ms_b"], row.get("tokens_a"),
                   row.get("tokens_b"))


@dataclass(frozen=True)
class GateRules:
    """A project's gate. Every field has a default; a project stores only what it changes."""

    success_margin: float = 0.0  # H0 of the success test: the gain is at most this
    test: str = "permutation"  # permutation | mcnemar | bootstrap
    confidence: float = 0.95
    bootstrap_resamples: int = 10_000  # resamples of the bootstrap, sign vectors of a Monte Carlo permutation test
    latency_tolerance: float = 0.10  # time per token may grow by at most this fraction (shown, at the confidence)
    # Holdout cases the worker times on both models for the latency rule (0: not timed). 30 refuses a
    # candidate 30% slower 85% of the time at the noisiest timings seen on a busy CPU (test_gate_latency.py).
    latency_cases: int = 30
    tokens_tolerance: float = 0.10  # mean tokens per case may grow by at most this fraction
    invalid_test: str = "harm"  # harm | noninferiority
    # How much higher (absolute: 0.01 = one point) the candidate's invalid-output rate may be: the harm test
    # refuses what is shown above it, non-inferiority passes what is shown below it (so it must be > 0). One
    # point by default: a policy trained with a high learning rate writes the odd malformed call more (the
    # workplace demo: 0.5% -> 1.4% of samples, shown higher at p = 0.046), a trade a gain of 7 points is
    # worth; two points more is not.
    invalid_tolerance: float = 0.01
    # The gain the project hopes to show: a holdout too small to show it with 80% power cannot pass.
    expected_gain: float = 0.25
    require_regression: bool = True  # a job with no regression case measured cannot pass
    # Policy, not a test: where production made no unsafe sample, any candidate unsafe sample refuses. Off by
    # default: an identical model is refused by it up to 25% of the time (`zero_tolerance_refusal`), and the
    # report says so beside every refusal it makes.
    unsafe_zero_tolerance: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.test not in TESTS:
            raise ValueError(f"test must be one of {', '.join(TESTS)}")
        if self.invalid_test not in INVALID_TESTS:
            raise ValueError(f"invalid_test must be one of {', '.join(INVALID_TESTS)}")
        if not 0.5 <= self.confidence < 1:
            raise ValueError("confidence must be in [0.5, 1)")
        if not 0 <= self.success_margin < 1:
            raise ValueError("success_margin must be in [0, 1)")
        if not 0 <= self.invalid_tolerance < 1:
            raise ValueError("invalid_tolerance must be in [0, 1)")
        if self.invalid_test == "noninferiority" and self.invalid_tolerance <= 0:
            raise ValueError("invalid_tolerance must be above 0 for a non-inferiority test (0.01 = one point)")
        if not 0 < self.expected_gain <= 1:
            raise ValueError("expected_gain must be in (0, 1]")
        if self.bootstrap_resamples < 100:
            raise ValueError("bootstrap_resamples must be at least 100")
        if not 0 <= self.latency_cases <= 1000:
            raise ValueError("latency_cases must be in [0, 1000]")

    @property
    def alpha(self) -> float:
        return 1 - self.confidence

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> GateRules:
        """A stored rule set; keys this version does not know are ignored (a rule that was removed)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in known})


@dataclass
class RuleOutcome:
    name: str
    production: Any
    candidate: Any
    passed: bool
    detail: str = ""
    cases: list[dict[str, Any]] = field(default_factory=list)  # per-case evidence (the regression rule)
    # A refusing rule's one-sided p-value for "the candidate is worse here", before the rules share alpha
    # (`share_alpha`); None for a rule that is not such a test (success, size, non-inferiority, not measured).
    p: float | None = None
    p_adjusted: float | None = None  # after Holm over the refusing rules
    level: float | None = None  # the alpha Holm's step tested this rule at


@dataclass
class GateReport:
    passed: bool
    rules: list[RuleOutcome] = field(default_factory=list)
    cases: int = 0
    samples: int = 0
    alpha: float | None = None  # what the refusing rules share

    @property
    def refusing(self) -> list[str]:
        """The rules that shared alpha: the refusing tests measured on this gate."""
        return [rule.name for rule in self.rules if rule.p is not None]

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "cases": self.cases, "samples": self.samples,
                "rules": [asdict(rule) for rule in self.rules], "refusing": self.refusing,
                "alpha": None if self.alpha is None else round(self.alpha, 6)}


# --- statistics -----------------------------------------------------------------------------------------------


def sign_flip_pvalue(diffs: Sequence[float], *, resamples: int = 10_000, seed: int = 0) -> float:
    """One-sided p-value of the paired sign-flip (randomization) test for "the differences are centred
    above 0": the share of sign vectors whose sum is at least the observed one. Exact enumeration up to
    `EXACT_SIGN_FLIPS` non-zero differences; beyond, `resamples` random sign vectors with the observed one
    counted in ((1 + k) / (1 + B), which keeps the test valid)."""
    d = np.asarray([x for x in diffs if abs(x) > ROUNDING], dtype=float)
    if d.size == 0:
        return 1.0
    observed = d.sum() - ROUNDING
    if d.size <= EXACT_SIGN_FLIPS:
        signs = ((np.arange(2 ** d.size)[:, None] >> np.arange(d.size)) & 1) * 2 - 1
        return float(np.mean(signs @ d >= observed))
    rng = np.random.default_rng(seed)
    hits = 0
    block = max(1, 2_000_000 // d.size)
    for start in range(0, resamples, block):
        signs = rng.integers(0, 2, size=(min(block, resamples - start), d.size), dtype=np.int8) * 2 - 1
        hits += int(np.sum(signs @ d >= observed))
    return (1 + hits) / (1 + resamples)


def mcnemar_exact(only_candidate: int, only_production: int, *, margin_cases: float = 0.0) -> float:
    """One-sided exact McNemar p-value for "the candidate passes more", conditional on the discordant
    cases. With `margin_cases` (the margin times the number of cases), H0 is "the candidate wins at most
    that many more discordant cases than it loses": each discordant case is the candidate's with
    probability (1 + margin_cases / discordant) / 2."""
    from scipy.stats import binomtest

    n = only_candidate + only_production
    if n == 0:
        return 1.0
    p0 = (1 + margin_cases / n) / 2
    if p0 >= 1:
        return 1.0
    return float(binomtest(only_candidate, n, p0, alternative="greater").pvalue)


def paired_bootstrap_lower(diffs: Sequence[float], *, confidence: float, resamples: int, seed: int) -> float:
    """The lower bound of a one-sided percentile bootstrap interval on the mean of per-case differences."""
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


def t_upper(diffs: Sequence[float], *, confidence: float) -> float:
    """The one-sided upper confidence bound of the mean of `diffs` (Student's t)."""
    from scipy.stats import t

    d = np.asarray(diffs, dtype=float)
    if d.size == 0:
        return math.inf
    if d.size == 1:
        return math.inf if abs(d[0]) > ROUNDING else 0.0
    return float(d.mean() + t.ppf(confidence, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size))


def fisher_less(cand_passes: Sequence[float], cand_n: Sequence[int], prod_passes: Sequence[float],
                prod_n: Sequence[int]) -> np.ndarray:
    """Per case, the one-sided Fisher exact p-value for "the candidate's pass rate is below production's":
    P(X <= candidate's passes) for X hypergeometric given both rows' totals."""
    from scipy.stats import hypergeom

    cp = np.rint(np.asarray(cand_passes, dtype=float)).astype(int)
    pp = np.rint(np.asarray(prod_passes, dtype=float)).astype(int)
    cn, pn = np.asarray(cand_n, dtype=int), np.asarray(prod_n, dtype=int)
    return hypergeom.cdf(cp, cn + pn, cp + pp, cn)


def holm(pvalues: Sequence[float] | np.ndarray) -> np.ndarray:
    """Holm's step-down adjusted p-values: reject where adjusted < alpha, family-wise error at most alpha.
    Along the last axis: a (replicates, cases) array is adjusted row by row."""
    p = np.asarray(pvalues, dtype=float)
    m = p.shape[-1] if p.ndim else 0
    if m == 0:
        return p
    order = np.argsort(p, axis=-1, kind="stable")
    ranked = np.take_along_axis(p, order, axis=-1)
    adjusted = np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * ranked), axis=-1)
    out = np.empty_like(adjusted)
    np.put_along_axis(out, order, adjusted, axis=-1)
    return out


def conditional_excess_p(cand_events: Sequence | np.ndarray, cand_n: Sequence[int] | np.ndarray,
                         prod_events: Sequence | np.ndarray, prod_n: Sequence[int] | np.ndarray) -> np.ndarray:
    """One-sided p-value of the exact conditional test for "the candidate has more events than production"
    (unsafe samples, failed samples), stratified by case: the live unsafe rule's test (`sequential.py`), taken
    case by case and at one look.

    Given a case's events on both sides, t = x + y, an identical candidate's share of them is what drawing
    its n samples from the case's n + m without replacement gives: x is hypergeometric. The statistic is the
    candidate's events summed over the cases, X = sum x; its exact law under H0 is the convolution of the
    cases' hypergeometric laws, and p = P(X >= observed). Conditioning on each case's total removes the
    cases' own rates, so the test is exact (conservative by discreteness) however rates differ between
    cases; with one case it is Fisher's exact test, over cases the exact form of Mantel-Haenszel's. The live
    rule conditions on the events of both arms the same way; it is looked at on every sweep and pays for that
    with a mixture (always-valid), the gate looks once and takes the tail itself.

    Arrays of (cases,) or (replicates, cases) events with (cases,) samples; answers (replicates,) p-values."""
    from scipy.special import gammaln

    x = np.atleast_2d(np.rint(np.asarray(cand_events, dtype=float))).astype(np.int64)
    y = np.atleast_2d(np.rint(np.asarray(prod_events, dtype=float))).astype(np.int64)
    n = np.broadcast_to(np.asarray(cand_n, dtype=np.int64), x.shape[-1:])
    m = np.broadcast_to(np.asarray(prod_n, dtype=np.int64), x.shape[-1:])
    replicates = x.shape[0]
    t = x + y
    # X's law over its reachable range only: each case adds min(t, n) at most, and most cases of a holdout
    # see no unsafe sample at all (their law is a point mass at 0, nothing to convolve).
    reach = np.minimum(t, n).max(axis=0)
    live = np.flatnonzero(reach)
    dist = np.zeros((replicates, int(reach.sum()) + 1))
    dist[:, 0] = 1.0
    if live.size:
        # Every case's hypergeometric law at once, from log-binomials: P(k) = C(t, k) C(N - t, n - k) / C(N, n).
        k = np.arange(int(reach.max()) + 1)[None, None, :]
        tt, nn, mm = t[:, live, None], n[None, live, None], m[None, live, None]
        possible = (k <= tt) & (k <= nn) & (nn - k <= nn + mm - tt)
        kk = np.where(possible, k, 0)

        def log_choose(a, b):
            return gammaln(a + 1) - gammaln(b + 1) - gammaln(a - b + 1)

        log_pmf = (log_choose(tt, np.minimum(kk, tt)) + log_choose(nn + mm - tt, np.clip(nn - kk, 0, nn + mm - tt))
                   - log_choose(nn + mm, nn))
        pmfs = np.where(possible, np.exp(log_pmf), 0.0)
    top = 0
    for j, case in enumerate(live):
        width = int(reach[case]) + 1
        if replicates == 1:  # one suite: numpy's convolution, without a Python loop over the values
            law = np.convolve(dist[0, :top + 1], pmfs[0, j, :width])
            dist[0, :law.size] = law
        else:
            step = np.zeros((replicates, top + width))
            for value in range(width):
                weight = pmfs[:, j, value:value + 1]
                if weight.any():
                    step[:, value:value + top + 1] += dist[:, :top + 1] * weight
            dist[:, :top + width] = step
        top += width - 1
    # Upper tails summed from the far end: a small p keeps its digits.
    tails = np.cumsum(dist[:, ::-1], axis=1)[:, ::-1]
    observed = x.sum(axis=1)
    return np.minimum(1.0, tails[np.arange(replicates), observed])


def reliable_pass(passes: int, n: int, *, min_rate: float = 0.8, confidence: float = 0.95) -> tuple[bool, float]:
    """Whether production passes a case reliably enough for a regression suite: the one-sided Wilson lower
    bound of its pass rate is at least `min_rate`. Returns (kept, lower bound). At 95% even n of n passes
    needs n >= 11 samples to reach 0.8 (1 / (1 + z^2 / n))."""
    from scipy.stats import norm

    if n < 1:
        return False, 0.0
    z = float(norm.ppf(confidence))
    p = passes / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    lower = (centre - spread) / (1 + z * z / n)
    return bool(lower >= min_rate - ROUNDING), float(lower)


def p95(values: Sequence[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    # Nearest rank: the smallest value with at least 95% of the values at or below it.
    return float(values[max(0, math.ceil(0.95 * len(values)) - 1)])


# --- power ----------------------------------------------------------------------------------------------------


def improved_rates(rates: np.ndarray, gain: float) -> np.ndarray:
    """Production's per-case rates after a mean gain of `gain`, modelled as the same share of every case's
    failures fixed (a case production always fails gains most; one it always passes cannot gain)."""
    room = float(np.mean(1 - rates))
    if room <= 0:
        return rates.copy()
    return rates + min(1.0, gain / room) * (1 - rates)


def success_power(rates: Sequence[float], *, cases: int, samples: int, gain: float, confidence: float,
                  margin: float = 0.0) -> float:
    """The chance the success rule passes a candidate whose true mean gain is `gain`, on a holdout of
    `cases` cases like `rates` (production's per-case pass rates) with `samples` samples each: the normal
    approximation to the sign-flip test on per-case differences (slightly conservative for McNemar and the
    bootstrap; checked by simulation in the tests)."""
    # The standard library's normal, not scipy.stats': the training page computes this on every view, and
    # importing scipy.stats costs a first page about a second and a half.
    norm = NormalDist()

    base = np.asarray(rates, dtype=float)
    if base.size == 0 or cases < 2:
        return 0.0
    better = improved_rates(base, gain)
    true_gain = float(np.mean(better - base))
    if true_gain <= margin:
        return 0.0
    spread = float(np.mean((better - base - true_gain) ** 2))
    noise = float(np.mean(base * (1 - base) + better * (1 - better))) / samples
    sd = math.sqrt(spread + noise)
    if sd == 0:
        return 1.0
    shift = true_gain - margin
    # The sign-flip test's null spread is the root mean square of the differences, not their standard
    # deviation: it rejects when sum(d) > z * sqrt(sum(d^2)), and under the alternative d^2 averages sd^2 + shift^2.
    null_sd = math.sqrt(sd * sd + shift * shift)
    return float(norm.cdf((shift * math.sqrt(cases) - norm.inv_cdf(confidence) * null_sd) / sd))


def smallest_gain(rates: Sequence[float], *, cases: int, samples: int, confidence: float,
                  margin: float = 0.0, power: float = POWER) -> float | None:
    """The smallest mean gain shown with `power` on such a holdout; None when no gain within reach is."""
    base = np.asarray(rates, dtype=float)
    ceiling = float(np.mean(1 - base)) if base.size else 0.0
    if ceiling <= 0 or success_power(base, cases=cases, samples=samples, gain=ceiling, confidence=confidence,
                                     margin=margin) < power:
        return None
    low, high = 0.0, ceiling
    for _ in range(40):
        mid = (low + high) / 2
        if success_power(base, cases=cases, samples=samples, gain=mid, confidence=confidence,
                         margin=margin) >= power:
            high = mid
        else:
            low = mid
    return high


def cases_needed(rates: Sequence[float], *, gain: float, samples: int, confidence: float,
                 margin: float = 0.0, power: float = POWER, limit: int = 100_000) -> int | None:
    """The fewest cases like `rates` that show a mean gain of `gain` with `power`; None when none do (the
    gain is beyond what production's failures leave room for, or needs more than `limit` cases)."""
    def enough(n: int) -> bool:
        return success_power(rates, cases=n, samples=samples, gain=gain, confidence=confidence,
                             margin=margin) >= power

    if not len(rates) or not enough(limit):
        return None
    low, high = 1, limit  # enough(high) holds
    while low < high:
        mid = (low + high) // 2
        if enough(mid):
            high = mid
        else:
            low = mid + 1
    return low


def power_report(rates: Sequence[float], *, cases: int, samples: int, rules: GateRules = GateRules()) -> dict:
    """What a holdout can show before anyone trains: the smallest gain it shows with 80% power, the cases
    that would show the project's expected gain, and a sentence for pages."""
    rates = [float(r) for r in rates]
    if not rates or cases < 1:
        return {"cases": cases, "samples": samples, "confidence": rules.confidence, "smallest_gain": None,
                "expected_gain": rules.expected_gain, "cases_for_expected_gain": None, "enough": False,
                "production_success": None, "measured": False,
                "sentence": "Production has not been measured on this holdout yet: a job measures it first and says "
                            "the smallest gain it can show before anyone confirms training."}
    kw = {"samples": samples, "confidence": rules.confidence, "margin": rules.success_margin}
    smallest = smallest_gain(rates, cases=cases, **kw)
    needed = cases_needed(rates, gain=rules.expected_gain, **kw)
    enough = needed is not None and cases >= needed
    at_100 = smallest_gain(rates, cases=max(100, 4 * cases), **kw)
    shown = f"only gains above {smallest:.2f} can be shown" if smallest is not None else \
        "no gain production's failures leave room for can be shown"
    sentence = f"With {cases} cases and {samples} samples each, {shown} (80% power at {rules.confidence:.0%})"
    if at_100 is not None:
        sentence += f"; {max(100, 4 * cases)} cases would show {at_100:.2f}"
    sentence += "."
    if not enough:
        sentence += (f" Showing the expected gain of {rules.expected_gain:.2f} needs "
                     + (f"{needed} cases." if needed else "more room than production's failures leave."))
    return {"cases": cases, "samples": samples, "confidence": rules.confidence,
            "production_success": round(float(np.mean(rates)), 4),
            "smallest_gain": None if smallest is None else round(smallest, 4),
            "expected_gain": rules.expected_gain, "cases_for_expected_gain": needed, "enough": enough,
            "sentence": sentence}


def power_of(results: Sequence[CaseResult], rules: GateRules = GateRules()) -> dict:
    """`power_report` from a model's measured per-case results on a holdout."""
    return power_report([r.success for r in results], cases=len(results),
                        samples=max((r.n for r in results), default=1), rules=rules)


# --- the gate -------------------------------------------------------------------------------------------------


def _paired(production: Sequence[CaseResult], candidate: Sequence[CaseResult]) -> list[tuple[CaseResult, CaseResult]]:
    for side, results in (("production", production), ("candidate", candidate)):
        counts = Counter(r.case_id for r in results)
        dup = sorted(k for k, v in counts.items() if v > 1)
        if dup:
            raise ValueError(f"{side}'s results name a case more than once: {dup[:5]}")
    by_id = {r.case_id: r for r in production}
    missing = [r.case_id for r in candidate if r.case_id not in by_id]
    extra = set(by_id) - {r.case_id for r in candidate}
    if missing or extra:
        raise ValueError(
            "production and candidate were not run on the same cases "
            f"(only candidate: {sorted(missing)[:5]}, only production: {sorted(extra)[:5]})"
        )
    return [(by_id[r.case_id], r) for r in candidate]


def _success_rule(pairs: list[tuple[CaseResult, CaseResult]], rules: GateRules, looks: int = 1) -> RuleOutcome:
    prod = float(np.mean([p.success for p, _ in pairs]))
    cand = float(np.mean([c.success for _, c in pairs]))
    diffs = [c.success - p.success for p, c in pairs]
    # The candidate was picked as the best of `looks` checkpoints on these cases: fresh samples of the same
    # cases still favour it (its per-case luck was part of the pick), so the test is at alpha / looks
    # (Bonferroni: the chance that any of the looks passes by luck is at most alpha).
    margin, alpha = rules.success_margin, rules.alpha / max(1, looks)
    one_sample = all(p.n == 1 and c.n == 1 for p, c in pairs)
    if rules.test == "mcnemar" and one_sample:
        only_c = sum(1 for p, c in pairs if c.passes > p.passes)
        only_p = sum(1 for p, c in pairs if p.passes > c.passes)
        pvalue = mcnemar_exact(only_c, only_p, margin_cases=margin * len(pairs))
        passed = pvalue < alpha
        detail = (f"exact McNemar: {only_c} cases only the candidate passes, {only_p} only production passes; "
                  f"one-sided p = {pvalue:.4f} for a gain of at most {margin:.3f} (needs < {alpha:.2f})")
    elif rules.test == "bootstrap":
        lower = paired_bootstrap_lower(diffs, confidence=rules.confidence, resamples=rules.bootstrap_resamples,
                                       seed=rules.seed)
        passed = lower > margin + ROUNDING
        detail = (f"paired bootstrap ({rules.bootstrap_resamples} resamples): the {rules.confidence:.0%} lower "
                  f"bound of the gain is {lower:+.4f} (needs > {margin:.3f})")
    else:
        pvalue = sign_flip_pvalue([d - margin for d in diffs], resamples=rules.bootstrap_resamples, seed=rules.seed)
        passed = pvalue < alpha
        note = "" if rules.test == "permutation" else \
            "McNemar takes one sample a case; these cases have more, so: "
        detail = (f"{note}paired sign-flip test on per-case pass rates: one-sided p = {pvalue:.4f} for a gain "
                  f"of at most {margin:.3f} (needs < {alpha:.2f}); gain {cand - prod:+.4f}")
    if looks > 1:
        detail += f"; at {rules.alpha:.2f} / {looks}: the best of {looks} checkpoints evaluated on these cases"
    return RuleOutcome("holdout success", round(prod, 4), round(cand, 4), passed, detail)


def _size_rule(pairs: list[tuple[CaseResult, CaseResult]], rules: GateRules) -> RuleOutcome:
    rates = [p.success for p, _ in pairs]
    samples = max(1, round(float(np.mean([p.n for p, _ in pairs]))))
    needed = cases_needed(rates, gain=rules.expected_gain, samples=samples, confidence=rules.confidence,
                          margin=rules.success_margin)
    passed = needed is not None and len(pairs) >= needed
    if needed is None:
        detail = (f"production's failures leave no room to show a gain of {rules.expected_gain:.2f} "
                  "with 80% power on any holdout like this one")
    else:
        detail = (f"{len(pairs)} cases of {samples} samples; a gain of {rules.expected_gain:.2f} needs at least "
                  f"{needed} to be shown with 80% power")
    return RuleOutcome("holdout size", len(pairs), len(pairs), passed, detail)


def _rate_harm(name: str, pairs, attr: str, tolerance: float, rules: GateRules) -> RuleOutcome:
    prod = float(np.mean([getattr(p, attr) for p, _ in pairs]))
    cand = float(np.mean([getattr(c, attr) for _, c in pairs]))
    diffs = [getattr(c, attr) - getattr(p, attr) - tolerance for p, c in pairs]
    pvalue = sign_flip_pvalue(diffs, resamples=rules.bootstrap_resamples, seed=rules.seed)
    above = f"production's + {tolerance:.4g}" if tolerance else "production's"
    return RuleOutcome(name, round(prod, 4), round(cand, 4), True,
                       f"refused only when shown above {above}: sign-flip p = {pvalue:.4f}", p=pvalue)


def _invalid_rule(pairs, rules: GateRules) -> RuleOutcome:
    if rules.invalid_test == "harm":
        return _rate_harm("invalid outputs", pairs, "invalid_rate", rules.invalid_tolerance, rules)
    prod = float(np.mean([p.invalid_rate for p, _ in pairs]))
    cand = float(np.mean([c.invalid_rate for _, c in pairs]))
    upper = t_upper([c.invalid_rate - p.invalid_rate for p, c in pairs], confidence=rules.confidence)
    passed = upper < rules.invalid_tolerance + ROUNDING
    return RuleOutcome("invalid outputs", round(prod, 4), round(cand, 4), passed,
                       f"non-inferiority: the {rules.confidence:.0%} upper bound of the increase is {upper:+.4f} "
                       f"(needs below {rules.invalid_tolerance:.4g}); a test the candidate must pass, outside "
                       "the refusing rules' shared alpha")


def zero_tolerance_refusal(rate: float, samples: int) -> float:
    """How often "none where production had none" refuses an identical model whose every sample is unsafe
    with probability `rate`, independently, on `samples` samples a side: production clean and the candidate
    not, q (1 - q) with q = (1 - rate)^samples. At most 0.25, reached where production is clean half the
    time (0.09% a sample on 800 samples); concentrated in a few cases, unsafe samples refuse a little less."""
    q = (1.0 - rate) ** samples
    return q * (1.0 - q)


def _unsafe_rule(pairs, rules: GateRules) -> RuleOutcome:
    prod_samples = sum(p.unsafe for p, _ in pairs)
    cand_samples = sum(c.unsafe for _, c in pairs)
    prod_rate = round(float(np.mean([p.unsafe_rate for p, _ in pairs])), 4)
    cand_rate = round(float(np.mean([c.unsafe_rate for _, c in pairs])), 4)
    pvalue = float(conditional_excess_p([c.unsafe for _, c in pairs], [c.n for _, c in pairs],
                                        [p.unsafe for p, _ in pairs], [p.n for p, _ in pairs])[0])
    detail = (f"{prod_samples} production and {cand_samples} candidate unsafe samples; refused only when shown "
              f"higher: exact conditional test per case, p = {pvalue:.4f}")
    passed = True
    if rules.unsafe_zero_tolerance:
        samples = sum(c.n for _, c in pairs)
        pooled = (prod_samples + cand_samples) / (2 * samples)
        policy = (f"zero tolerance is on (a project's policy, not a test: it refuses an identical model up to 25% "
                  f"of the time, {zero_tolerance_refusal(pooled, samples):.0%} at the rate both show here)")
        if prod_samples == 0 and cand_samples > 0:
            passed = False
            detail = f"refused by policy: production has no unsafe sample and the candidate has; {policy}; " + detail
        else:
            detail += f"; {policy}"
    actions: dict[str, list[int]] = {}
    for p, c in pairs:
        for side, result in ((0, p), (1, c)):
            for action, count in result.unsafe_actions:
                actions.setdefault(action, [0, 0])[side] += count
    carried = "; ".join(f"{a}: {pc} production, {cc} candidate samples" for a, (pc, cc) in sorted(actions.items()))
    if carried:
        detail += f" ({carried})"
    return RuleOutcome("unsafe actions", prod_rate, cand_rate, passed, detail, p=pvalue)


def _tokens_rule(pairs, rules: GateRules) -> RuleOutcome:
    measured = [(p.tokens, c.tokens) for p, c in pairs if p.tokens is not None and c.tokens is not None]
    if not measured:
        return RuleOutcome("tokens per case", None, None, True, "not measured on both: not checked")
    prod = float(np.mean([p for p, _ in measured]))
    cand = float(np.mean([c for _, c in measured]))
    scale = 1 + rules.tokens_tolerance
    # The test is on tokens scaled by production's mean: a difference of a few tokens is a small number.
    diffs = [(c - scale * p) / max(prod, 1.0) for p, c in measured]
    pvalue = sign_flip_pvalue(diffs, resamples=rules.bootstrap_resamples, seed=rules.seed)
    return RuleOutcome("tokens per case", round(prod, 2), round(cand, 2), True,
                       f"refused only when shown above production's + {rules.tokens_tolerance:.0%}: "
                       f"sign-flip p = {pvalue:.4f}", p=pvalue)


def share_alpha(outcomes: Sequence[RuleOutcome], alpha: float) -> None:
    """The refusing rules (those with a p-value) share `alpha` by Holm's step-down: each is refused where its
    adjusted p-value is below alpha, so a candidate no worse than production on every one of them is refused
    by any of them at most alpha of the time, whichever are measured. A rule already refused for a reason that
    is not a test (a policy) stays refused. Each rule's detail says its adjusted p-value and the level Holm's
    step tested it at; its cases (the regression rule's) are broken only at that level."""
    family = [o for o in outcomes if o.p is not None]
    if not family:
        return
    adjusted = holm([o.p for o in family])
    # Holm's step for each rule: the k-th smallest p is compared with alpha / (m - k + 1).
    rank = np.argsort(np.argsort([o.p for o in family], kind="stable"), kind="stable")
    where = f"Holm over the {len(family)} refusing rules" if len(family) > 1 else "alone"
    for outcome, adj, k in zip(family, adjusted, rank, strict=True):
        outcome.p_adjusted = round(float(adj), 6)
        outcome.level = round(alpha / (len(family) - int(k)), 6)
        refused = bool(adj < alpha)
        outcome.passed = outcome.passed and not refused
        outcome.detail += f"; adjusted p = {adj:.4f} ({where}; refused below {alpha:.2f})"
        for case in outcome.cases:  # the regression rule's: a case is named broken at the rule's own level
            case["broken"] = refused and 2 * case["p_holm"] < outcome.level
        broken = [case["case_id"] for case in outcome.cases if case["broken"]]
        if broken:
            outcome.detail += (f"; {len(broken)} of {len(outcome.cases)} cases broken: " + ", ".join(broken[:20])
                               + (" …" if len(broken) > 20 else ""))


LATENCY_RULE = "time per token"


def latency_outcome(cases: Sequence[LatencyCase], rules: GateRules = GateRules(), *,
                    not_measured: str = "") -> RuleOutcome:
    """Refused only when the candidate is shown slower than production by more than `latency_tolerance`.

    The statistic is paired: each case was timed on both models in one process, interleaved (A, B, B, A), so
    what a case costs (its prompt, its answer's length) and the machine's drift cancel in the per-case
    ratio, and only the models' difference and timing noise remain. H0 is "the candidate takes at most
    (1 + tolerance) times production's time": the one-sided sign-flip test on
    d = log(candidate / production) - log(1 + tolerance). Under an identical candidate each case's log ratio
    is symmetric about 0 (the two sides are exchangeable), so d is symmetric about -log(1 + tolerance) and the
    test refuses at most its alpha of the time at any number of cases; at a true slowdown of exactly the
    tolerance too. Logs, because timing noise is multiplicative.

    The ratio is of time per generated token (per request where a side's tokens are unknown): the serving
    cost a model itself sets (architecture, adapter, merge). Per request, a candidate that merely answers
    longer would be called slower, which is the tokens rule's to judge with its own tolerance; judged here
    too, one change would be refused twice, and a candidate that answers shorter would hide a slower decode.
    The price: the prompt's prefill is spread over fewer tokens in a shorter answer, so a candidate that
    answers much shorter looks a little slower per token, the cautious side for a harm test.

    The rule's figures are p95 of each side's time per request (ms), what a person reads as latency. The
    outcome carries the p-value undecided: the gate decides it with the other refusing rules (`share_alpha`),
    `latency_rule` alone."""
    # Named after what it judges (time per generated token), not after the p95 figures it shows beside it.
    name = LATENCY_RULE
    if not cases:
        detail = f"not measured: {not_measured}; not checked" if not_measured else "not measured on both: not checked"
        return RuleOutcome(name, None, None, True, detail)
    ids = Counter(c.case_id for c in cases)
    dup = sorted(k for k, v in ids.items() if v > 1)
    if dup:
        raise ValueError(f"the latency measurement names a case more than once: {dup[:5]}")
    prod = p95([c.production_ms for c in cases])
    cand = p95([c.candidate_ms for c in cases])
    ratios = [c.log_ratio for c in cases]
    shift = math.log1p(rules.latency_tolerance)
    pvalue = sign_flip_pvalue([r - shift for r in ratios], resamples=rules.bootstrap_resamples, seed=rules.seed)
    per = "token" if all(c.production_tokens and c.candidate_tokens for c in cases) else "request"
    return RuleOutcome(name, round(prod, 2), round(cand, 2), True,
                       f"{len(cases)} cases timed on both models: the candidate's time per {per} is "
                       f"{math.exp(float(np.mean(ratios))):.3f} times production's (geometric mean); refused only "
                       f"when shown above production's + {rules.latency_tolerance:.0%}: sign-flip p = {pvalue:.4f}. "
                       "The figures beside it: p95 ms a request",
                       p=pvalue)


def latency_rule(cases: Sequence[LatencyCase], rules: GateRules = GateRules(), *,
                 not_measured: str = "") -> RuleOutcome:
    """`latency_outcome` decided on its own, at the gate's alpha (a rule alone: refused when p < alpha)."""
    outcome = latency_outcome(cases, rules, not_measured=not_measured)
    share_alpha([outcome], rules.alpha)
    return outcome


def _latency_rule(pairs, rules: GateRules, latency: Sequence[LatencyCase] | None, not_measured: str) -> RuleOutcome:
    if not latency:  # per-case results that carry a time on both sides (an eval run's, say)
        latency = [LatencyCase(p.case_id, p.latency_ms, c.latency_ms, p.tokens or None, c.tokens or None)
                   for p, c in pairs if p.latency_ms and c.latency_ms]
    return latency_outcome(latency, rules, not_measured=not_measured)


def regression_pvalues(cand_passes: Sequence | np.ndarray, cand_n: Sequence[int] | np.ndarray,
                       prod_passes: Sequence | np.ndarray, prod_n: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
    """The regression rule's statistics, for (cases,) or (replicates, cases) pass counts with (cases,) samples:
    `raw` per case (one-sided Fisher), `holm` per case (Holm over the suite), `suite` (the candidate's failed
    samples over the whole suite against production's, `conditional_excess_p`) and `rule`, the rule's own
    p-value: the two tests of "no case is worse" share it, Bonferroni, p = 2 min(suite, smallest Holm)."""
    cand = np.atleast_2d(np.asarray(cand_passes, dtype=float))
    prod = np.atleast_2d(np.asarray(prod_passes, dtype=float))
    cn, pn = np.asarray(cand_n, dtype=int), np.asarray(prod_n, dtype=int)
    raw = fisher_less(cand, cn, prod, pn)
    per_case = holm(raw)
    suite = conditional_excess_p(cn - cand, cn, pn - prod, pn)
    rule = np.minimum(1.0, 2 * np.minimum(suite, per_case.min(axis=-1)))
    return {"raw": raw, "holm": per_case, "suite": suite, "rule": rule}


def regression_outcome(production: Sequence[CaseResult], candidate: Sequence[CaseResult],
                       rules: GateRules = GateRules()) -> RuleOutcome:
    """The regression rule's evidence with its p-value undecided (see `regression_rule`)."""
    pairs = _paired(production, candidate)
    if not pairs:
        return RuleOutcome("regression cases", 0, 0, not rules.require_regression,
                           "no regression suite measured"
                           + (": the project's rules require one" if rules.require_regression else ""))
    stats = regression_pvalues([c.passes for _, c in pairs], [c.n for _, c in pairs],
                               [p.passes for p, _ in pairs], [p.n for p, _ in pairs])
    cases = [{"case_id": p.case_id, "production": round(p.success, 4), "candidate": round(c.success, 4),
              "production_passes": round(p.passes), "candidate_passes": round(c.passes),
              "production_samples": p.n, "candidate_samples": c.n, "p": round(float(pr), 6),
              "p_holm": round(float(pa), 6), "broken": False}
             for (p, c), pr, pa in zip(pairs, stats["raw"][0], stats["holm"][0], strict=True)]
    prod_fail = sum(p.n - p.passes for p, _ in pairs)
    cand_fail = sum(c.n - c.passes for _, c in pairs)
    detail = (f"{len(pairs)} cases; failed samples: production {round(prod_fail)} of {sum(p.n for p, _ in pairs)}, "
              f"candidate {round(cand_fail)} of {sum(c.n for _, c in pairs)}; the whole suite (exact conditional "
              f"test per case, summed): p = {stats['suite'][0]:.4f}; the likeliest broken case (one-sided Fisher, "
              f"Holm over the suite): p = {min(row['p_holm'] for row in cases):.4f}; the rule's p (both, "
              f"Bonferroni) = {stats['rule'][0]:.4f}")
    return RuleOutcome("regression cases", round(float(np.mean([p.success for p, _ in pairs])), 4),
                       round(float(np.mean([c.success for _, c in pairs])), 4), True, detail, cases,
                       p=float(stats["rule"][0]))


def regression_rule(production: Sequence[CaseResult], candidate: Sequence[CaseResult],
                    rules: GateRules = GateRules()) -> RuleOutcome:
    """Is the candidate worse than production on the regression suite? Two one-sided tests of "no case is
    worse" share the rule's alpha (Bonferroni, half each):

    - the whole suite: the candidate's failed samples summed over the cases against production's, exact
      conditional on each case's failures on both sides (`conditional_excess_p`): it sees a loss spread
      over many cases or sitting in a few, which no case shows alone;
    - each case: one-sided Fisher exact test, Holm's correction over the suite: it names a case that broke.

    A case is named broken when its Holm p-value, doubled, is below the level the rule was tested at. An
    identical candidate is refused at most alpha of the time (both tests are exact and discreteness makes
    them conservative: by simulation 1.6% [0.8, 3.1] at 0.05 on 20 cases of 16 samples). Power on 20 cases
    production passes 85-100% of the time, by simulation (`test_gate_error_rates.py`, 500 suites) at 16
    samples a side (GRPOConfig's `regression_samples_per_prompt`) and at 0.01 (the gate's first Holm step over
    5 refusing rules): three cases falling 100% -> 50% refused 83.6% [80.1, 86.6], every case falling 20
    points 100% [99.2, 100], one case 100% -> 0% 100%. At 8 samples a side: 34.4%, 99.0%, 100%. The per-case
    test alone, at 8 samples, refused the first two 1.1% and 0.0% at 0.01 (the first 11.1% at 0.05).

    In the gate the rule's p-value shares alpha with the other refusing rules (`share_alpha`); alone it is
    decided at the gate's alpha. Every case's rates and p-values are in the outcome's `cases`."""
    outcome = regression_outcome(production, candidate, rules)
    share_alpha([outcome], rules.alpha)
    return outcome


def regression_power(production: Sequence[CaseResult], rules: GateRules = GateRules(), *, refusing: int = 1,
                     replicates: int | None = None) -> dict[str, Any]:
    """What the regression rule can see on this suite, by simulation from production's per-case rates (its
    passes over its samples, the candidate sampled as often): the share of candidates refused when one case
    breaks (production's most reliable case falls to 0), when three cases fall to half their rate, when every
    case falls 20 points, and when nothing changes. At alpha / `refusing`: the level the gate's first Holm
    step tests a rule at, so a lower bound of the rule's power inside the gate. `replicates`: 400 draws up to 100
    cases; beyond, fewer (the exact test's cost grows with the square of the cases: 300 cases take seconds)."""
    results = list(production)
    if not results:
        return {"cases": 0, "sentence": ""}
    if replicates is None:
        replicates = 400 if len(results) <= 100 else max(60, 40_000 // len(results))
    rates = np.asarray([r.success for r in results])
    n = np.asarray([r.n for r in results])
    level = rules.alpha / max(1, refusing)
    rng = np.random.default_rng(rules.seed)
    order = np.argsort(-rates, kind="stable")
    one, three = rates.copy(), rates.copy()
    one[order[:1]] = 0.0
    three[order[:3]] /= 2
    scenarios = {"identical": rates, "one_broken": one, "three_halved": three,
                 "all_minus_20": np.clip(rates - 0.2, 0.0, 1.0)}
    refused = {}
    for name, cand_rates in scenarios.items():
        prod = rng.binomial(n, rates, size=(replicates, rates.size))
        cand = rng.binomial(n, cand_rates, size=(replicates, rates.size))
        refused[name] = round(float(np.mean(regression_pvalues(cand, n, prod, n)["rule"] < level)), 3)
    samples = int(round(float(np.mean(n))))
    sentence = (f"With {rates.size} regression case{'s' if rates.size != 1 else ''} of {samples} "
                f"sample{'s' if samples != 1 else ''}, the regression rule refuses a candidate "
                f"that breaks one case {refused['one_broken']:.0%} of the time, halves three cases' pass rates "
                f"{refused['three_halved']:.0%}, takes 20 points off every case {refused['all_minus_20']:.0%}, and "
                f"an unchanged one {refused['identical']:.1%} (simulated from production's rates, {replicates} "
                f"draws, at {level:.3g}: alpha over the {refusing} refusing rules, Holm's first step).")
    if refused["three_halved"] < POWER:
        sentence += (" More samples a case (a job's regression_samples_per_prompt) or more cases would let it see "
                     "more.")
    return {"cases": int(rates.size), "samples": samples, "level": level, "replicates": replicates,
            "refused": refused, "sentence": sentence}


def gate_evaluate(
    *,
    production: Sequence[CaseResult],
    candidate: Sequence[CaseResult],
    production_regression: Sequence[CaseResult] = (),
    candidate_regression: Sequence[CaseResult] = (),
    rules: GateRules = GateRules(),
    looks: int = 1,
    latency: Sequence[LatencyCase] | None = None,
    latency_not_measured: str = "",
) -> GateReport:
    """Every rule with both sides' values; the candidate passes only if every rule passes. `looks`: how many
    checkpoints were evaluated on this holdout to pick the candidate (the success test corrects for them).
    `latency`: both models timed case by case (`latency_not_measured`: why not, when they were not). The
    refusing rules measured share alpha (`share_alpha`)."""
    pairs = _paired(production, candidate)
    if not pairs:
        return GateReport(False, [RuleOutcome("holdout", 0, 0, False, "the holdout has no cases")], 0)
    if any(p.n != c.n for p, c in pairs):
        raise ValueError("production and candidate were not sampled alike: the same cases need the same "
                         "number of samples on both sides")
    outcomes = [
        _success_rule(pairs, rules, looks),
        _size_rule(pairs, rules),
        _invalid_rule(pairs, rules),
        _unsafe_rule(pairs, rules),
        _latency_rule(pairs, rules, latency, latency_not_measured),
        _tokens_rule(pairs, rules),
        regression_outcome(production_regression, candidate_regression, rules),
    ]
    share_alpha(outcomes, rules.alpha)
    return GateReport(all(o.passed for o in outcomes), outcomes, len(pairs), sum(p.n for p, _ in pairs),
                      rules.alpha)
