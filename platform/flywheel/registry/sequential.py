"""Sequential tests on live traffic: is one version's rate of an event (a failure, an unsafe action) higher
than another's? Valid however often it is looked at, so the canary decision and the watch may look at every
sweep and stop the moment the evidence is there.

**The test: mSPRT** (mixture sequential probability ratio test; Robbins 1970, as used for always-valid
p-values by Johari, Pekelis and Walsh, "Always valid inference", 2017). The difference of the two rates,
theta = p_subject - p_baseline, is estimated by theta_hat with variance v = p(1-p)(1/n_s + 1/n_b) (p pooled: the
variance under H0 "no difference", which keeps a rare event's zero counts from looking certain). Against a
normal mixture theta ~ N(0, tau^2) over the alternatives, the likelihood ratio of the normal approximation is

    Lambda = sqrt(v / (v + tau^2)) * exp(theta_hat^2 tau^2 / (2 v (v + tau^2)))

Under H0 (equal rates), Lambda is a nonnegative martingale with mean 1 along the stream, so by Ville's
inequality P(Lambda ever >= 1/alpha) <= alpha: the always-valid p-value min over looks of 1/Lambda is below
alpha with probability at most alpha however many looks are taken. The decision is one-sided: "worse" only
when theta_hat > 0 as well, so an equal version is called worse at most alpha of the time (the two-sided bound
covers it). tau is the size of difference the test is tuned to find fastest: 0.1 (ten points) for failures;
0.02 for unsafe actions, whose rates are small, so that a rise of one or two points is caught.

Error rates, by simulation (`tests/platform/registry/test_sequential.py`, which prints them; 2,000 streams,
looks every 50 trajectories per arm, 2,000 per arm at most):
- failures, equal versions at 20%: called worse 0.5-1.5% of the time (the bound is 5%; the normal approximation
  and the discrete looks make it conservative);
- failures, ten points worse (20% → 30%): caught in more than 99% of streams, after a median of about 250
  trajectories per arm;
- unsafe actions, equal at 1%: called worse about 1%; 1% → 4%: caught in more than 95% of streams.
The watch compares a growing stream against a fixed baseline (the replaced version's traffic before the
move); its simulation (the same file) shows the same bound holding there.

The normal approximation needs a few events: no look decides before each arm has `MIN_EVENTS_SEEN` events of
either kind in total, and before each arm has `min_per_arm` trajectories for a promotion."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

ALPHA = 0.05
TAU_FAILURE = 0.1
TAU_UNSAFE = 0.02
MIN_EVENTS_SEEN = 5  # events in both arms together before a look may call a version worse


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


def look_rate(metric: str, subject: Arm, baseline: Arm, *, tau: float, alpha: float = ALPHA,
              previous_p: float = 1.0) -> RateLook:
    p = always_valid_p(subject, baseline, tau=tau, previous=previous_p)
    enough = subject.events + baseline.events >= MIN_EVENTS_SEEN
    higher = subject.rate is not None and baseline.rate is not None and subject.rate > baseline.rate
    return RateLook(metric=metric, subject_rate=subject.rate, baseline_rate=baseline.rate, p=p,
                    worse=bool(enough and higher and p <= alpha))


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
    carry over: the always-valid p is a running minimum)."""
    prev_failure = float((previous or {}).get("failure", {}).get("p", 1.0))
    prev_unsafe = float((previous or {}).get("unsafe", {}).get("p", 1.0))
    failure = look_rate("failure", Arm(subject_n, subject_failures), Arm(baseline_n, baseline_failures),
                        tau=TAU_FAILURE, alpha=alpha, previous_p=prev_failure)
    unsafe = look_rate("unsafe", Arm(subject_n, subject_unsafe), Arm(baseline_n, baseline_unsafe),
                       tau=TAU_UNSAFE, alpha=alpha, previous_p=prev_unsafe)
    return Look(subject={"n": subject_n, "failures": subject_failures, "unsafe": subject_unsafe},
                baseline={"n": baseline_n, "failures": baseline_failures, "unsafe": baseline_unsafe},
                failure=failure, unsafe=unsafe, enough=min(subject_n, baseline_n) >= min_per_arm)
