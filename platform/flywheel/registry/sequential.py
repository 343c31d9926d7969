"""Sequential tests on live traffic: is one version's rate of an event (a failure, an unsafe action, an unknown
outcome) higher than another's? Valid however often they are looked at, so the canary decision and the watch may
look at every sweep and stop the moment the evidence is there. Three rules, each at alpha / 3 (Bonferroni), so
that an equal version is called worse by any of them at most alpha (5%) of the time. Each is one-sided: a look
carries evidence forward only when the subject's rate is the higher one (evidence that it was better is not
evidence that it is worse).

**Failures, over known outcomes** (success or failure: an `unknown` outcome, or one still to come, is neither).
Two always-valid tests, each with its own running minimum, combined as p = 2 min(p1, p2):

- an mSPRT (mixture sequential probability ratio test; Robbins 1970, as used for always-valid p-values by
  Johari, Pekelis and Walsh, "Always valid inference", 2017). The difference of the two rates, theta =
  p_subject - p_baseline, is estimated by theta_hat with variance v = p(1-p)(1/n_s + 1/n_b) (p pooled: the
  variance under H0). Against a normal mixture theta ~ N(0, tau^2), tau = 0.1,

      Lambda = sqrt(v / (v + tau^2)) * exp(theta_hat^2 tau^2 / (2 v (v + tau^2)))

  is a nonnegative martingale with mean 1 under H0, so by Ville's inequality P(Lambda ever >= 1/alpha) <=
  alpha. It rests on the normal approximation, so only looks where each arm has MIN_EACH (5) failures and 5
  successes enter its minimum: an early look (1 failure of 2 against 0 of 58 gave p = 0.0005) no longer carries
  forward for good;
- the exact conditional test below, sound from the first failure (a production with no failure yet).

**Unsafe actions, over triaged trajectories, and unknown outcomes, over all: an exact conditional test.** Given
k events in both arms, under H0 each is the subject's with probability q0 = n_s / (n_s + n_b), its share of the
traffic (whatever the rate, the time of day or the delay, as long as both arms are served at the same hours);
the mixture over that probability, q ~ Beta(1, 1), gives

    Lambda = B(1 + x, 1 + k - x) / (q0^x (1 - q0)^(k - x))

for x of the k in the subject: a martingale in the events under H0, so the same always-valid p-value.

**Promotion: a bound, not "no harm found".** `increase_upper` is an always-valid upper bound on theta (the same
mixture inverted: the largest theta0 its test of "the increase is theta0" does not reject at UPPER_ALPHA, with
one added failure and success per arm so its variance is never zero), its running minimum a confidence
sequence. A look is `ready` when each arm has `min_per_arm` known outcomes, nothing is worse, and that bound is at
most the project's tolerance (5 points by default): a canary whose increase is at least the tolerance is then
promoted at most UPPER_ALPHA / 2 of the time.

Error rates, by simulation of traffic as the product sees it (flywheel.registry.live_simulation; tests/platform/
registry/test_live_simulation.py prints them with intervals, bench/production.py over a grid of shares 5-50%,
failure rates 2-50%, daily swings, late and unknown outcomes; the README has the table): an equal canary called
worse 0.8-1.2% at a 5% share with 1-2% failures (it was 7.3-7.8%); a five-point regression promoted 1.0% at the
defaults (27-51% before); the watch with a 5% holdback under +-5-point daily swings and outcomes 2 h late flags an
equal version 0.0% [0.0, 0.6] and catches ten points 96.5%; a canary whose extra failures come back unknown is
caught 100% (3% before). tests/platform/registry/test_sequential.py keeps the earlier stand-in streams.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from scipy.stats import binomtest

ALPHA = 0.05  # the three refusing rules together: each is tested at RULE_ALPHA
RULES = 3  # failures, unsafe actions, unknown outcomes (Bonferroni)
RULE_ALPHA = ALPHA / RULES
TAU_FAILURE = 0.1
MIN_EACH = 5  # events and non-events in each arm before a look's normal approximation enters the running p
TOLERANCE = 0.05  # default: the failure-rate increase a canary may be promoted under (five points)
UPPER_ALPHA = 0.05  # the always-valid upper bound on the increase holds with probability 1 - UPPER_ALPHA


def wilson(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float] | None:
    """The Wilson score interval of a proportion (scipy's): it covers the true rate about `confidence` of the
    time even for small n and rates near 0 or 1, where the normal interval does not
    (tests/platform/evals/test_online.py simulates its coverage). None for n = 0."""
    if n == 0:
        return None
    ci = binomtest(successes, n).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


@dataclass(frozen=True)
class Arm:
    """One version's traffic over the comparison's window: `n` trajectories, `events` of them with the event."""

    n: int
    events: int

    @property
    def rate(self) -> float | None:
        return self.events / self.n if self.n else None

    @property
    def settled(self) -> bool:
        """Enough events and non-events for the normal approximation (MIN_EACH of each)."""
        return self.events >= MIN_EACH and self.n - self.events >= MIN_EACH


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


def _higher(subject: Arm, baseline: Arm) -> bool:
    return subject.rate is not None and baseline.rate is not None and subject.rate > baseline.rate


def mixture_p(subject: Arm, baseline: Arm, *, tau: float = TAU_FAILURE) -> float:
    """This look's 1 / Lambda, one-sided and only where it is sound: 1.0 (no evidence) unless the subject's rate
    is the higher one and each arm has MIN_EACH events and non-events."""
    if not (subject.settled and baseline.settled and _higher(subject, baseline)):
        return 1.0
    return min(1.0, math.exp(-log_mixture_ratio(subject, baseline, tau=tau)))


def always_valid_p(subject: Arm, baseline: Arm, *, tau: float, previous: float = 1.0) -> float:
    """The always-valid p-value after this look: the smaller of the previous look's and this look's."""
    return min(previous, 1.0, mixture_p(subject, baseline, tau=tau))


def increase_upper(subject: Arm, baseline: Arm, *, tau: float = TAU_FAILURE, alpha: float = UPPER_ALPHA) -> float | None:
    """An always-valid upper bound on the increase theta = p_subject - p_baseline at this look (None before
    each arm is settled): the largest theta0 the mixture test of "the increase is theta0" does not reject,
    theta_hat + sqrt(2 v (v + tau^2) / tau^2 * (log(1/alpha) + log((v + tau^2) / v) / 2)), v the unpooled
    variance. Its running minimum over the looks is a confidence sequence's bound: above the true increase at
    every look with probability at least 1 - alpha (two-sided, so at least 1 - alpha / 2 on this side)."""
    if subject.n == 0 or baseline.n == 0:
        return None
    # Agresti-Caffo's one added event and non-event per arm: a variance that is not zero at 0 or n events.
    ps, pb = (subject.events + 1) / (subject.n + 2), (baseline.events + 1) / (baseline.n + 2)
    v = ps * (1 - ps) / subject.n + pb * (1 - pb) / baseline.n
    t2 = tau * tau
    radius = math.sqrt(2 * v * (v + t2) / t2 * (math.log(1 / alpha) + 0.5 * math.log((v + t2) / v)))
    return ps - pb + radius


def log_beta_mixture_ratio(x: int, k: int, q0: float) -> float:
    """log of B(1 + x, 1 + k - x) / (q0^x (1 - q0)^(k - x)): x of k draws on one side, each there with
    probability q0 under H0, against a Beta(1, 1) mixture over that probability. The conditional tests here and
    the canary's split check (flywheel.registry.evidence) are this ratio."""
    log_beta = math.lgamma(1 + x) + math.lgamma(1 + k - x) - math.lgamma(2 + k)
    return log_beta - x * math.log(q0) - (k - x) * math.log1p(-q0)


def log_conditional_ratio(subject: Arm, baseline: Arm) -> float:
    """log Lambda of the exact conditional test above (Beta(1, 1) mixture); 0.0 while there is no event."""
    k = subject.events + baseline.events
    if k == 0 or subject.n == 0 or baseline.n == 0:
        return 0.0
    return log_beta_mixture_ratio(subject.events, k, subject.n / (subject.n + baseline.n))


@dataclass(frozen=True)
class RateLook:
    """One rate's comparison at one look."""

    metric: str  # "failure" | "unsafe" | "unknown"
    subject_rate: float | None
    baseline_rate: float | None
    p: float  # always-valid, running minimum over the looks so far
    worse: bool  # p <= alpha and the subject's rate is the higher one
    parts: dict[str, float] | None = None  # a rule of two tests: each one's running p

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        parts = out.pop("parts")
        return {**out, **(parts or {})}


def look_unsafe(subject: Arm, baseline: Arm, *, alpha: float = RULE_ALPHA, previous_p: float = 1.0,
                metric: str = "unsafe") -> RateLook:
    """The exact conditional test on a rare event's share (unsafe actions over triaged trajectories, or unknown
    outcomes over all), evidence carried only from looks where the subject's rate is the higher."""
    now = math.exp(-log_conditional_ratio(subject, baseline)) if _higher(subject, baseline) else 1.0
    p = min(previous_p, 1.0, now)
    return RateLook(metric=metric, subject_rate=subject.rate, baseline_rate=baseline.rate, p=p,
                    worse=bool(_higher(subject, baseline) and p <= alpha))


@dataclass(frozen=True)
class Look:
    """The three rules at one look, and what they decide: `worse` (roll back or flag); `ready` (every arm has
    its minimum of known outcomes, nothing is worse, and the always-valid upper bound on the failure-rate
    increase is at most the tolerance: the canary may be promoted), else keep watching."""

    subject: dict[str, int]
    baseline: dict[str, int]
    failure: RateLook
    unsafe: RateLook
    unknown: RateLook
    enough: bool  # each arm has min_per_arm known outcomes
    upper: float | None  # running minimum of the always-valid upper bound on the failure-rate increase
    tolerance: float

    @property
    def worse(self) -> bool:
        return self.failure.worse or self.unsafe.worse or self.unknown.worse

    @property
    def bounded(self) -> bool:
        return self.upper is not None and self.upper <= self.tolerance

    @property
    def ready(self) -> bool:
        return self.enough and not self.worse and self.bounded

    def reason(self) -> str:
        if self.failure.worse:
            return (f"failure rate {self.failure.subject_rate:.1%} against {self.failure.baseline_rate:.1%} of known "
                    f"outcomes, always-valid p = {self.failure.p:.4f}")
        if self.unsafe.worse:
            return (f"unsafe-action rate {self.unsafe.subject_rate:.1%} against {self.unsafe.baseline_rate:.1%} of "
                    f"triaged trajectories, always-valid p = {self.unsafe.p:.4f}")
        if self.unknown.worse:
            return (f"unknown outcomes {self.unknown.subject_rate:.1%} against {self.unknown.baseline_rate:.1%}, "
                    f"always-valid p = {self.unknown.p:.4f}")
        if self.ready:
            return (f"no harm found with the minimum of known outcomes in each arm; the failure rate is at most "
                    f"{max(self.upper or 0.0, 0.0):.1%} points higher (always-valid bound), within the tolerance of "
                    f"{self.tolerance:.0%}")
        if self.enough:
            bound = "not bounded yet" if self.upper is None else f"at most {self.upper:.1%} points higher"
            return (f"no harm found, but the failure rate's increase is {bound}, above the tolerance of "
                    f"{self.tolerance:.0%}: watching for more traffic")
        return "watching: not enough traffic yet"

    def to_dict(self) -> dict[str, Any]:
        return {"subject": self.subject, "baseline": self.baseline, "failure": self.failure.to_dict(),
                "unsafe": self.unsafe.to_dict(), "unknown": self.unknown.to_dict(), "enough": self.enough,
                "upper": self.upper, "tolerance": self.tolerance, "ready": self.ready, "worse": self.worse,
                "reason": self.reason()}


def look_failures(subject: Arm, baseline: Arm, *, alpha: float = RULE_ALPHA,
                  previous: dict[str, Any] | None = None) -> RateLook:
    """The failure rule: two always-valid tests, each with its own running minimum, combined by Bonferroni
    (p = 2 min(p_mixture, p_conditional)): the mSPRT, strong at common rates but sound only on settled looks,
    and the exact conditional test, sound from the first event (a production with no failure yet)."""
    prev = previous or {}
    mixture = always_valid_p(subject, baseline, tau=TAU_FAILURE, previous=float(prev.get("p_mixture", 1.0)))
    conditional = look_unsafe(subject, baseline, previous_p=float(prev.get("p_conditional", 1.0))).p
    p = min(1.0, 2 * min(mixture, conditional))
    return RateLook(metric="failure", subject_rate=subject.rate, baseline_rate=baseline.rate, p=p,
                    worse=bool(_higher(subject, baseline) and p <= alpha), parts={"p_mixture": mixture,
                                                                                  "p_conditional": conditional})


def look(*, subject_n: int, subject_failures: int, subject_unsafe: int, baseline_n: int, baseline_failures: int,
         baseline_unsafe: int, min_per_arm: int, previous: dict[str, Any] | None = None,
         subject_known: int | None = None, baseline_known: int | None = None,
         subject_triaged: int | None = None, baseline_triaged: int | None = None,
         tolerance: float = TOLERANCE, alpha: float = ALPHA) -> Look:
    """One look of the canary decision or the watch. `previous` is the last look's `to_dict()` (its p-values
    and bound carry over: running minima). `*_known`: trajectories with a known outcome (success or failure;
    default all), the failure rate's denominator; `*_triaged`: trajectories triaged (default all), the unsafe
    rate's. `alpha` is for the three rules together."""
    prev = previous or {}

    def carried(metric: str) -> float:
        return float((prev.get(metric) or {}).get("p", 1.0))

    s_known = subject_n if subject_known is None else subject_known
    b_known = baseline_n if baseline_known is None else baseline_known
    s_triaged = subject_n if subject_triaged is None else subject_triaged
    b_triaged = baseline_n if baseline_triaged is None else baseline_triaged
    each = alpha / RULES
    failure = look_failures(Arm(s_known, subject_failures), Arm(b_known, baseline_failures), alpha=each,
                            previous=prev.get("failure"))
    unsafe = look_unsafe(Arm(s_triaged, subject_unsafe), Arm(b_triaged, baseline_unsafe), alpha=each,
                         previous_p=carried("unsafe"))
    unknown = look_unsafe(Arm(subject_n, subject_n - s_known), Arm(baseline_n, baseline_n - b_known), alpha=each,
                          previous_p=carried("unknown"), metric="unknown")
    bounds = [b for b in (prev.get("upper"), increase_upper(Arm(s_known, subject_failures),
                                                            Arm(b_known, baseline_failures))) if b is not None]
    return Look(subject={"n": subject_n, "known": s_known, "failures": subject_failures, "triaged": s_triaged,
                         "unsafe": subject_unsafe},
                baseline={"n": baseline_n, "known": b_known, "failures": baseline_failures, "triaged": b_triaged,
                          "unsafe": baseline_unsafe},
                failure=failure, unsafe=unsafe, unknown=unknown, enough=min(s_known, b_known) >= min_per_arm,
                upper=min(bounds) if bounds else None, tolerance=tolerance)
