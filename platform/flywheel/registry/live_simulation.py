"""Simulated production traffic run through the canary's and the watch's decisions as the product makes them
(`sequential.look` at every look, its p-values and bound carried over, the canary stopping where the product
stops), for the error rates that tests/platform/registry/test_live_simulation.py checks and bench/production.py
prints over a grid. Pure: numpy and flywheel.registry.sequential, no Django.

The traffic: `rate` trajectories an hour (Poisson), split between the arms by `share` (the canary's weight, or
the watch's holdback on the replaced version), a look every `step` hours (an hour by default; the product looks
every sweep, and early looks on few trajectories are where a running minimum goes wrong, so the small-share test
looks every 5 minutes). Each trajectory:

- is unknown for good with probability `unknown` (the agent never learns how it went);
- else fails with its arm's failure rate at its hour: `failure` (+ `worse_by` on the subject) + `drift` *
  sin(2 pi (hour + phase) / 24), the time of day, a random phase per stream; with `masked`, the subject's extra
  failures come back unknown instead of failed;
- has its outcome known `delay` hours after it arrived on average (exponential; until then it is unknown, as a
  trajectory whose outcome is still to be reported is);
- carries an unsafe action with probability `unsafe` (+ `unsafe_worse_by` on the subject), known at once (triage).

The canary stops when it is worse (rolled back), ready (promoted: each arm has `min_per_arm` known outcomes and
the always-valid bound on the failure increase is within `tolerance`), or at `max_hours` (expired). The watch
runs `hours` and flags worse; with a holdback (`share` > 0) both arms are concurrent, as the product runs it;
with none (`share` 0) its baseline is the replaced version's traffic over the `hours` before the move, recounted
at each look (outcomes still maturing are counted as they mature): what the product may alert on but never roll
back by itself."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flywheel.registry import sequential


@dataclass(frozen=True)
class Traffic:
    rate: float = 500.0  # trajectories an hour, both arms together
    share: float = 0.1  # the subject's share (canary) or the baseline's (watch holdback)
    failure: float = 0.2
    worse_by: float = 0.0
    drift: float = 0.0  # amplitude of the time-of-day swing, in failure-rate points
    delay: float = 0.0  # mean hours until an outcome is known
    unknown: float = 0.0  # share of trajectories whose outcome is never known
    masked: bool = False  # the subject's extra failures come back unknown
    unsafe: float = 0.01
    unsafe_worse_by: float = 0.0


@dataclass
class Outcome:
    """What happened to the streams: counts by end, and the subject's trajectories at each decision."""

    streams: int
    ends: dict[str, int] = field(default_factory=dict)
    at: list[int] = field(default_factory=list)  # subject trajectories at a "worse" decision
    hours: list[int] = field(default_factory=list)  # and the hours since the start

    def share(self, end: str) -> float:
        return self.ends.get(end, 0) / self.streams

    def interval(self, end: str) -> tuple[float, float]:
        return sequential.wilson(self.ends.get(end, 0), self.streams) or (0.0, 1.0)

    def median_at(self) -> int | None:
        return int(np.median(self.at)) if self.at else None


class _Arm:
    """One arm's trajectories of one stream, `step` hours at a time (`hours` such steps), with when each outcome
    becomes known."""

    def __init__(self, rng: np.random.Generator, traffic: Traffic, per_hour: float, hours: int, *, subject: bool,
                 start: int, phase: float, arrive: int | None = None, step: float = 1.0) -> None:
        h = np.arange(start, start + hours) * step
        n = rng.poisson(per_hour * step, size=hours)
        n[hours if arrive is None else arrive:] = 0  # after `arrive` hours, outcomes only mature
        fail = np.clip(traffic.failure + traffic.drift * np.sin(2 * np.pi * (h + phase) / 24), 0.001, 0.999)
        extra = traffic.worse_by if subject else 0.0
        unknown_p = np.full(hours, traffic.unknown)
        if subject and traffic.masked:
            unknown_p = unknown_p + extra * (1 - traffic.unknown)
        else:
            fail = np.clip(fail + extra, 0.0, 1.0)
        unknown = rng.binomial(n, np.clip(unknown_p, 0, 1))
        rest = n - unknown
        failed = rng.binomial(rest, fail)
        unsafe_p = traffic.unsafe + (traffic.unsafe_worse_by if subject else 0.0)
        self.start, self.hours = start, hours
        self.n = n
        self.unsafe = rng.binomial(n, unsafe_p)
        # When each cohort's outcomes are known: hour offsets 0, 1, 2, ... (exponential delay, binned).
        self.failed_by = self._mature(rng, failed, traffic.delay / step)
        self.known_by = self.failed_by + self._mature(rng, rest - failed, traffic.delay / step)

    def _mature(self, rng: np.random.Generator, counts: np.ndarray, delay: float) -> np.ndarray:
        """known[t]: of `counts` (per arrival hour), how many are known at look hour start + t + 1."""
        if delay <= 0:
            return np.cumsum(counts)
        edges = np.arange(self.hours + 1, dtype=float)
        cdf = 1 - np.exp(-edges / delay)
        probs = np.diff(np.append(cdf, 1.0))  # offset b in [b, b+1), the last bucket "later"
        out = np.zeros(self.hours, dtype=np.int64)
        for hour, k in enumerate(counts):
            if k:
                spread = rng.multinomial(int(k), probs)[: self.hours - hour]
                out[hour:] += np.cumsum(spread)
        return out

    def at(self, t: int) -> dict[str, int]:
        """The arm's counts at the look after hour `t` of its own (0-based)."""
        n = int(self.n[: t + 1].sum())
        return {"n": n, "failures": int(self.failed_by[t]), "known": int(self.known_by[t]),
                "unsafe": int(self.unsafe[: t + 1].sum()), "triaged": n}


def _look(subject: dict[str, int], baseline: dict[str, int], *, min_per_arm: int, tolerance: float,
          previous: dict | None) -> sequential.Look:
    return sequential.look(subject_n=subject["n"], subject_failures=subject["failures"],
                           subject_unsafe=subject["unsafe"], subject_known=subject["known"],
                           subject_triaged=subject["triaged"], baseline_n=baseline["n"],
                           baseline_failures=baseline["failures"], baseline_unsafe=baseline["unsafe"],
                           baseline_known=baseline["known"], baseline_triaged=baseline["triaged"],
                           min_per_arm=min_per_arm, tolerance=tolerance, previous=previous)


def _decide(out: Outcome, subject: _Arm, baseline: _Arm, *, looks: int, step: float, end: str,
            baseline_from: int = 0, min_per_arm: int = 1, tolerance: float = 1.0, promotes: bool = False) -> None:
    """One stream's looks as the product takes them, each carrying the last one's p-values on: "worse" at the
    first look that shows it, "promoted" at the first that is ready (`promotes`, the canary), else `end`. The
    baseline's look t is its own look `baseline_from + t`."""
    previous = None
    for t in range(looks):
        counts = subject.at(t)
        look = _look(counts, baseline.at(baseline_from + t), min_per_arm=min_per_arm, tolerance=tolerance,
                     previous=previous)
        previous = look.to_dict()
        if look.worse:
            end = "worse"
            out.at.append(counts["n"])
            out.hours.append((t + 1) * step)
            break
        if promotes and look.ready:
            end = "promoted"
            break
    out.ends[end] = out.ends.get(end, 0) + 1


def canary(traffic: Traffic, *, streams: int, seed: int, min_per_arm: int = 1000, max_hours: int = 72,
           tolerance: float = sequential.TOLERANCE, step: float = 1.0) -> Outcome:
    """The canary decision over `streams` simulated canaries, a look every `step` hours: ends "worse" (rolled
    back), "promoted" or "expired"."""
    rng = np.random.default_rng(seed)
    out = Outcome(streams=streams)
    looks = int(round(max_hours / step))
    for _ in range(streams):
        phase = rng.uniform(0, 24)
        subject = _Arm(rng, traffic, traffic.rate * traffic.share, looks, subject=True, start=0, phase=phase,
                       step=step)
        baseline = _Arm(rng, traffic, traffic.rate * (1 - traffic.share), looks, subject=False, start=0,
                        phase=phase, step=step)
        _decide(out, subject, baseline, looks=looks, step=step, end="expired", min_per_arm=min_per_arm,
                tolerance=tolerance, promotes=True)
    return out


def watch(traffic: Traffic, *, streams: int, seed: int, hours: int = 24, step: float = 1.0) -> Outcome:
    """The watch over `streams` simulated promotions: ends "worse" (flagged or rolled back) or "passed". With
    `traffic.share` > 0 the replaced version keeps that share (the holdback) and both arms are concurrent;
    with 0, the baseline is the replaced version's `hours` of all traffic before the move, recounted each look."""
    rng = np.random.default_rng(seed)
    out = Outcome(streams=streams)
    concurrent = traffic.share > 0
    looks = int(round(hours / step))
    for _ in range(streams):
        phase = rng.uniform(0, 24)
        if concurrent:
            subject = _Arm(rng, traffic, traffic.rate * (1 - traffic.share), looks, subject=True, start=0,
                           phase=phase, step=step)
            baseline = _Arm(rng, traffic, traffic.rate * traffic.share, looks, subject=False, start=0, phase=phase,
                            step=step)
        else:
            subject = _Arm(rng, traffic, traffic.rate, looks, subject=True, start=0, phase=phase, step=step)
            # The `hours` before the move, run on to the watch's end so that late outcomes keep maturing.
            baseline = _Arm(rng, traffic, traffic.rate, 2 * looks, subject=False, start=-looks, phase=phase,
                            arrive=looks, step=step)
        _decide(out, subject, baseline, looks=looks, step=step, end="passed",
                baseline_from=0 if concurrent else looks)
    return out
