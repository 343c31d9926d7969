"""Sequential tests on live traffic: is one version's rate of an event (a failure, an unsafe action) higher
than another's? Valid however often it is looked at, so the canary decision and the watch may look at every
sweep and stop the moment the evidence is there. Two rules, each at alpha / 2 (Bonferroni), so that an equal
version is called worse by either at most alpha (5%) of the time.

**Failures: mSPRT** (mixture sequential probability ratio test; Robbins 1970, as used for always-valid
p-values by Johari, Pekelis and Walsh, "Always valid inference", 2017). The difference of the two rates,
theta = p_subject - p_baseline, is estimated by theta_hat with variance v = p(1-p)(1/n_s + 1/n_b) (p pooled: the
variance under H0 "no difference"). Against a normal mixture theta ~ N(0, tau^2) over the alternatives, the
likelihood ratio of the normal approximation is

    Lambda = sqrt(v / (v + tau^2)) * exp(theta_hat^2 tau^2 / (2 v (v + tau^2)))

Under H0, Lambda is a nonnegative martingale with mean 1 along the stream, so by Ville's inequality P(Lambda
ever >= 1/alpha) <= alpha: the always-valid p-value, min over looks of 1/Lambda, is below alpha with
probability at most alpha however many looks are taken. tau = 0.1, the ten points the test should find
fastest. "Worse" needs the subject's rate to be the higher one too (one-sided; the two-sided bound covers
it).

**Unsafe actions: an exact conditional test**, because the normal approximation fails on rare events with
unequal arms (simulated, an equal canary at 5% of the traffic and a 1% unsafe rate was called worse 6% of
the time at alpha 2.5%). Given k unsafe trajectories in both arms, under H0 each is the subject's with
probability q0 = n_s / (n_s + n_b), its share of the traffic; the mixture over that probability, q ~
Beta(1, 1), gives the likelihood ratio

    Lambda = B(1 + x, 1 + k - x) / (q0^x (1 - q0)^(k - x))

for x of the k in the subject: a martingale in the events under H0, so the same always-valid p-value. It
is strict: a handful of unsafe actions where the baseline had almost none is enough.

Error rates, by simulation (`tests/platform/registry/test_sequential.py` prints them; 2,000 streams, 20%
failures and 1% unsafe actions in the baseline, a look every 50 trajectories per arm, 2,000 per arm at most):
- equal versions: called worse 1.1% of the time by both rules together (failure rule 0.5%, unsafe 0.5%); at a
  canary's 10% share (looks every 20 canary / 180 production trajectories, to 1,000 canary) 1.6%, at a 5%
  share 1.6%. The bound is 5%; the discrete looks make it conservative;
- failures ten points worse (20% → 30%): caught in 100% of streams within 2,000 per arm, after a median of
  400 canary trajectories; unsafe actions 1% → 4%: caught in 100%, median 550.
A canary not shown worse once each arm has `canary_min_per_arm` trajectories is promoted there, so that
minimum sets the power: at 500 (the default) a ten-point failure rise is caught 70% of the time and unsafe
1% → 4% about 50%; at 1,000, 98% and 91%.
The watch compares a growing stream with a fixed baseline (the replaced version's traffic before the move,
2,000 trajectories in the simulation): equal versions flagged 0.9%; ten points worse caught 100% (median 200
trajectories); unsafe 1% → 4% caught 99.9% (median 250).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

ALPHA = 0.05  # both rules together: each is tested at ALPHA / 2
TAU_FAILURE = 0.1
MIN_EVENTS_SEEN = 5  # failures in both arms together before the normal approximation may call a version worse


@dataclass(frozen=True)
class Arm:
    """One version's traffic over the comparison's window: `n` trajectories, `events` of them with the event."""

    n: int
    events: int

    @property
    def rate(self) -> float | None:
        return self.events / self.n if self.n else None


def log_mixture_ratio(subject: Arm, baseline: Arm, *, tau: float) -> float:
    """log Lambda of the mSPRT above; 0.0 (no evidence) while either arm is empty or no event was seen."""
    if subject.n == 0 or baseline.n == 0:
        return 0.0
    pooled = (subject.events + baseline.events) / (subject.n + baseline.n)
    v = pooled * (1 - pooled) * (1 / subject.n + 1 / baseline.n)
    if v <= 0:
        return 0.0
    theta = subject.events / subject.n - baseline.events / baseline.n
    t2 = tau * tau
    return 0.5 * math.log(v / (v + t2)) + theta * theta * t2 / (2 * v * (v + t2))


def always_valid_p(subject: Arm, baseline: Arm, *, tau: float, previous: float = 1.0) -> float:
    """The always-valid p-value after this look: the smaller of the previous look's and 1 / Lambda now."""
    return min(previous, 1.0, math.exp(-log_mixture_ratio(subject, baseline, tau=tau)))


def _log_beta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def log_conditional_ratio(subject: Arm, baseline: Arm) -> float:
    """log Lambda of the exact conditional test above (Beta(1, 1) mixture); 0.0 while there is no event."""
    k = subject.events + baseline.events
    if k == 0 or subject.n == 0 or baseline.n == 0:
        return 0.0
    q0 = subject.n / (subject.n + baseline.n)
    x = subject.events
    return _log_beta(1 + x, 1 + k - x) - x * math.log(q0) - (k - x) * math.log1p(-q0)


@dataclass(frozen=True)
class RateLook:
    """One rate's comparison at one look."""

    metric: str  # "failure" | "unsafe"
    subject_rate: float | None
    baseline_rate: float | None
    p: float  # always-valid, running minimum over the looks so far
    worse: bool  # p <= alpha and the subject's rate is the higher one

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _higher(subject: Arm, baseline: Arm) -> bool:
    return subject.rate is not None and baseline.rate is not None and subject.rate > baseline.rate


def look_failure(subject: Arm, baseline: Arm, *, alpha: float = ALPHA / 2, previous_p: float = 1.0) -> RateLook:
    p = always_valid_p(subject, baseline, tau=TAU_FAILURE, previous=previous_p)
    enough = subject.events + baseline.events >= MIN_EVENTS_SEEN
    return RateLook(metric="failure", subject_rate=subject.rate, baseline_rate=baseline.rate, p=p,
                    worse=bool(enough and _higher(subject, baseline) and p <= alpha))


def look_unsafe(subject: Arm, baseline: Arm, *, alpha: float = ALPHA / 2, previous_p: float = 1.0) -> RateLook:
    p = min(previous_p, 1.0, math.exp(-log_conditional_ratio(subject, baseline)))
    return RateLook(metric="unsafe", subject_rate=subject.rate, baseline_rate=baseline.rate, p=p,
                    worse=bool(_higher(subject, baseline) and p <= alpha))


@dataclass(frozen=True)
class Look:
    """Both rules at one look, and what they decide: `worse` (roll back or flag), `enough` (every arm has its
    minimum, so a canary with no harm found may be promoted), else keep watching."""

    subject: dict[str, int]
    baseline: dict[str, int]
    failure: RateLook
    unsafe: RateLook
    enough: bool

    @property
    def worse(self) -> bool:
        return self.failure.worse or self.unsafe.worse

    def reason(self) -> str:
        if self.failure.worse:
            return (f"failure rate {self.failure.subject_rate:.1%} against {self.failure.baseline_rate:.1%}, "
                    f"always-valid p = {self.failure.p:.4f}")
        if self.unsafe.worse:
            return (f"unsafe-action rate {self.unsafe.subject_rate:.1%} against {self.unsafe.baseline_rate:.1%}, "
                    f"always-valid p = {self.unsafe.p:.4f}")
        if self.enough:
            return "no harm found with the minimum traffic in each arm"
        return "watching: not enough traffic yet"

    def to_dict(self) -> dict[str, Any]:
        return {"subject": self.subject, "baseline": self.baseline, "failure": self.failure.to_dict(),
                "unsafe": self.unsafe.to_dict(), "enough": self.enough, "worse": self.worse,
                "reason": self.reason()}


def look(*, subject_n: int, subject_failures: int, subject_unsafe: int, baseline_n: int, baseline_failures: int,
         baseline_unsafe: int, min_per_arm: int, previous: dict[str, Any] | None = None,
         alpha: float = ALPHA) -> Look:
    """One look of the canary decision or the watch. `previous` is the last look's `to_dict()` (its p-values
    carry over: the always-valid p is a running minimum). `alpha` is for both rules together."""
    prev_failure = float((previous or {}).get("failure", {}).get("p", 1.0))
    prev_unsafe = float((previous or {}).get("unsafe", {}).get("p", 1.0))
    failure = look_failure(Arm(subject_n, subject_failures), Arm(baseline_n, baseline_failures), alpha=alpha / 2,
                           previous_p=prev_failure)
    unsafe = look_unsafe(Arm(subject_n, subject_unsafe), Arm(baseline_n, baseline_unsafe), alpha=alpha / 2,
                         previous_p=prev_unsafe)
    return Look(subject={"n": subject_n, "failures": subject_failures, "unsafe": subject_unsafe},
                baseline={"n": baseline_n, "failures": baseline_failures, "unsafe": baseline_unsafe},
                failure=failure, unsafe=unsafe, enough=min(subject_n, baseline_n) >= min_per_arm)
