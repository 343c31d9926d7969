"""Failure modes that come back after a fix: marking a mode fixed, watching production's new failures for its
signature, and reopening it with the evidence. The registry decides *when* a version fixed a mode and runs
the watch on a worker (flywheel.evals.recurrence); this module holds what is about failure modes and
imports nothing of the registry.

Two rules, either reopens a fixed mode:

1. **Similarity** (the clustering's space: `engine.signature` → `engine.features`). When a mode is fixed its
   profile is taken from its members (the newest MODE_SAMPLE): their centroid, and a threshold, the lowest
   cosine of a member to the centroid of the other members less SIMILARITY_SLACK, kept within
   [SIMILARITY_FLOOR, SIMILARITY_CAP − SLACK] (a one-member mode would otherwise need a copy of it; a
   sprawling one would match anything). A new failure whose vector is at least that close to the centroid
   matches. Measured on bench/clustering_fixture.py (12 causes, 25 new failures of each, the 440 of the
   other causes each time): with 15 members 98.3% of a cause's new failures match and 0.85% of other
   causes' failures do; with 8 members 95.3% and 0.87%; with 5, 93.1% and 0.93% (the false matches almost
   all a sibling cause on the same tool: refund of an unknown order against refund over the total). The
   mode reopens at MIN_MATCHES matches: one lookalike can be chance, three are a pattern.

2. **Signal rate.** The mode's dominant triage signal (the kind most of its members carry) had a rate in
   production in the BEFORE_DAYS before the fix, p_before = k/n. After the fix the mode reopens when the
   share of new trajectories carrying that signal is shown to exceed p0 = p_before + SIGNAL_MARGIN, with at
   least SIGNAL_MIN_COUNT of them. The test is one-sided and always valid (it is looked at by every sweep):
   the likelihood ratio of a uniform mixture over rates q in [p0, 1] against p0,

       Lambda = ∫_{p0}^1 q^k (1-q)^(n-k) dq / ((1 - p0) p0^k (1-p0)^(n-k)),

   is a nonnegative supermartingale whenever the true rate is at most p0 (each step's factor has mean
   q p/p0 + (1-q)(1-p)/(1-p0) <= 1 for q >= p0 >= p), so by Ville's inequality P(ever Lambda >= 1/alpha) <=
   alpha, however often it is looked at. alpha = SIGNAL_ALPHA. p_before is estimated, not known: the margin
   covers its error, and the rule waits for SIGNAL_MIN_BEFORE trajectories before the fix.
   Error rates by simulation (tests/platform/clustering/test_recurrence.py prints them; 2,000 streams, 10%
   before the fix measured on 500 trajectories, a look every 100 new trajectories, 5,000 at most): a mode
   whose signal stays at its pre-fix rate is reopened in none of them (the bound is 1%); at the edge, three
   points up (exactly the margin), 9.8% (the bound assumes p_before known; measured, it is below the truth
   half the time); ten points higher (20%) is reopened in 100% of streams, after a median of 400 new
   trajectories. With 25 of 100 against a p0 of 13% the rule still waits (p = 0.044); with 30 it reopens."""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import numpy as np
from django.db.models import Count, Exists, Max, OuterRef, Q, QuerySet
from django.dispatch import Signal
from django.utils import timezone

from flywheel.failures.clustering import engine
from flywheel.failures.models import (
    FailureMode,
    FailureModeAssignment,
    FailureModeStatus,
    RecurrenceMatch,
    RecurrenceRule,
)
from flywheel.trajectories.models import Outcome, Trajectory, TriageSignal

MODE_SAMPLE = 200  # members read for a mode's profile, the newest (as the clustering reads a mode)
SIMILARITY_SLACK = 0.03
SIMILARITY_FLOOR = 0.6
SIMILARITY_CAP = 0.95
MIN_MATCHES = 3
SIGNAL_MARGIN = 0.03
SIGNAL_ALPHA = 0.01
SIGNAL_MIN_COUNT = 5
SIGNAL_MIN_BEFORE = 100
SIGNAL_MATCHES_KEPT = 200  # trajectories recorded as matches when the signal rule reopens a mode
BEFORE_DAYS = 7
SCAN_BATCH = 2000  # new trajectories looked at per scan; the next sweep goes on from the watermark
UNTRIAGED_WAIT = timedelta(hours=1)  # how long a scan waits for triage before it passes a trajectory by
EVIDENCE_IDS = 50  # matching trajectory ids kept in a reopened mode's evidence

# Sent when a mode is marked fixed by a person: "which registry version serves production now?" The registry
# answers (flywheel.evals.recurrence); this app cannot ask it directly. Receivers return a number or None.
production_version_asked = Signal()


def production_version_number(project: Any) -> int | None:
    for _, answer in production_version_asked.send(sender=FailureMode, project=project):
        if answer is not None:
            return int(answer)
    return None


def _failed() -> Q:
    """Failed (a reviewer's outcome wins over the agent's) or flagged by triage: what the queue holds."""
    return (
        Q(reviewed_outcome=Outcome.FAILURE)
        | Q(reviewed_outcome="", outcome=Outcome.FAILURE)
        | Q(reviewed_outcome="", triage_severity__gt=0)
    )


# --- fixed and reopened ----------------------------------------------------------------------------------


def failure_mode_fixed_set(
    *, failure_mode: FailureMode, version_number: int | None, by: str, evidence: dict[str, Any] | None = None,
    at: datetime | None = None,
) -> FailureMode:
    """Mark the mode fixed at `at` by registry version `version_number` (None: nothing served then), `by` a
    person ("person") or a promotion ("promotion"). Its watch starts from the newest trajectory now: only
    traffic after the fix can bring it back. Its profile is taken by the first scan (it needs the embedder)."""
    at = at or timezone.now()
    last = Trajectory.objects.filter(project_id=failure_mode.project_id).aggregate(m=Max("id"))["m"] or 0
    failure_mode.status = FailureModeStatus.FIXED
    failure_mode.fixed_at = at
    failure_mode.fixed_version_number = version_number
    failure_mode.recurrence_watch = {"after_id": last, "by": by, "evidence": evidence or {}}
    failure_mode.save(update_fields=["status", "fixed_at", "fixed_version_number", "recurrence_watch", "updated_at"])
    return failure_mode


def failure_mode_reopen(*, failure_mode: FailureMode, evidence: dict[str, Any], at: datetime | None = None) -> FailureMode:
    """Open the mode again with why (`evidence`); its fix stays recorded (fixed_at, fixed_version_number)."""
    failure_mode.status = FailureModeStatus.OPEN
    failure_mode.reopened_at = at or timezone.now()
    failure_mode.recurrence = evidence
    failure_mode.recurrence_watch = {}
    failure_mode.save(update_fields=["status", "reopened_at", "recurrence", "recurrence_watch", "updated_at"])
    return failure_mode


# --- the signal rule -------------------------------------------------------------------------------------


def _log_tail_mixture(k: int, n: int, p0: float) -> float:
    """log of ∫_{p0}^1 q^k (1-q)^(n-k) dq / (1 - p0)."""
    from scipy.special import betainc, betaln

    tail = float(betainc(n - k + 1, k + 1, 1 - p0))  # I_{1-p0}(n-k+1, k+1) = P(q >= p0) under Beta(k+1, n-k+1)
    if tail <= 0:
        return -math.inf
    return float(betaln(k + 1, n - k + 1)) + math.log(tail) - math.log(1 - p0)


@dataclass(frozen=True)
class SignalLook:
    after_n: int
    after_k: int
    before_n: int
    before_k: int
    p0: float | None  # the rate to beat; None: the rule cannot judge (too little traffic before the fix)
    p: float  # always-valid p-value, running minimum over the looks
    rose: bool

    @property
    def after_rate(self) -> float | None:
        return self.after_k / self.after_n if self.after_n else None

    @property
    def before_rate(self) -> float | None:
        return self.before_k / self.before_n if self.before_n else None

    def to_dict(self) -> dict[str, Any]:
        return {"after_n": self.after_n, "after_k": self.after_k, "before_n": self.before_n, "before_k": self.before_k,
                "p0": self.p0, "p": self.p, "rose": self.rose, "after_rate": self.after_rate,
                "before_rate": self.before_rate}


def signal_look(
    *, after_n: int, after_k: int, before_n: int, before_k: int, previous_p: float = 1.0,
    margin: float = SIGNAL_MARGIN, alpha: float = SIGNAL_ALPHA, min_count: int = SIGNAL_MIN_COUNT,
    min_before: int = SIGNAL_MIN_BEFORE,
) -> SignalLook:
    """One look of the signal rule (see the module's text): has the signal's rate since the fix risen above
    its rate before the fix plus `margin`? A pure function, so the simulation runs the rule the sweep runs."""
    if before_n < min_before:
        return SignalLook(after_n, after_k, before_n, before_k, None, previous_p, False)
    p0 = before_k / before_n + margin
    if p0 >= 1 or after_n == 0:
        return SignalLook(after_n, after_k, before_n, before_k, min(p0, 1.0), previous_p, False)
    log_lambda = _log_tail_mixture(after_k, after_n, p0) - (after_k * math.log(p0) + (after_n - after_k) * math.log(1 - p0))
    p = min(previous_p, 1.0, math.exp(-log_lambda) if log_lambda > -700 else 1.0)
    rose = after_k >= min_count and after_k / after_n > p0 and p <= alpha
    return SignalLook(after_n, after_k, before_n, before_k, p0, p, rose)


# --- profiles and scans ----------------------------------------------------------------------------------


def signatures_of(ids: list[int]) -> dict[int, engine.Signature]:
    """The clustering's signature of each trajectory of `ids` that exists."""
    signals: dict[int, list[dict[str, Any]]] = {}
    rows = TriageSignal.objects.filter(trajectory_id__in=ids).values_list("trajectory_id", "kind", "message_index", "detail")
    for trajectory_id, kind, message_index, detail in rows:
        signals.setdefault(trajectory_id, []).append({"kind": kind, "message_index": message_index, "detail": detail})
    return {
        pk: engine.signature(messages, signals.get(pk, []))
        for pk, messages in Trajectory.objects.filter(id__in=ids).values_list("id", "messages")
    }


# Every fixed mode of a project scans the same new failures, each in its own task: a worker process keeps the
# vectors it computed (keyed by the trajectory's state, so a replay or a new triage is embedded again) and the
# next mode's scan embeds only what it has not seen. Bounded: a scan's failures fit many times over.
_MEMO: OrderedDict[tuple, np.ndarray] = OrderedDict()
MEMO_MAX = 4 * SCAN_BATCH


def _vectors(ids: list[int], embedder: engine.Embedder) -> tuple[list[int], np.ndarray]:
    states = {pk: (embedder.name, pk, updated, triaged)
              for pk, updated, triaged in Trajectory.objects.filter(id__in=ids).values_list("id", "updated_at", "triaged_at")}
    kept = [i for i in ids if i in states]
    if not kept:
        return [], np.zeros((0, 1), dtype=np.float32)
    missing = [i for i in kept if states[i] not in _MEMO]
    if missing:
        found = signatures_of(missing)
        missing = [i for i in missing if i in found]
        if missing:
            for pk, vector in zip(missing, engine.features([found[i] for i in missing], embedder), strict=True):
                _MEMO[states[pk]] = vector
    kept = [i for i in kept if states[i] in _MEMO]
    for i in kept:
        _MEMO.move_to_end(states[i])
    vectors = np.stack([_MEMO[states[i]] for i in kept]) if kept else np.zeros((0, 1), dtype=np.float32)
    while len(_MEMO) > MEMO_MAX:
        _MEMO.popitem(last=False)
    return kept, vectors


def similarity_threshold(members: np.ndarray) -> float:
    """The cosine to a mode's centroid a new failure needs (see the module's text), from its members' vectors:
    each member's cosine to the centroid of the others (leave one out: a member counted in its own centroid
    looks closer than a new failure can be, by much on a small mode), the lowest, less the slack."""
    if len(members) < 2:
        return SIMILARITY_CAP - SIMILARITY_SLACK
    total = members.sum(axis=0)
    others = np.array([float(members[i] @ engine.unit(total - members[i])) for i in range(len(members))])
    return float(min(max(float(others.min()) - SIMILARITY_SLACK, SIMILARITY_FLOOR), SIMILARITY_CAP - SIMILARITY_SLACK))


def mode_profile(*, failure_mode: FailureMode, embedder: engine.Embedder) -> dict[str, Any]:
    """Where the mode sits when it is fixed: its members' centroid and threshold, its dominant signal and that
    signal's rate in production in the BEFORE_DAYS before the fix."""
    members = list(
        FailureModeAssignment.objects.filter(failure_mode=failure_mode).order_by("-trajectory_id")
        .values_list("trajectory_id", flat=True)[:MODE_SAMPLE]
    )
    profile: dict[str, Any] = {"embedder": embedder.name, "members": 0, "centroid": None, "threshold": None}
    kept, vectors = _vectors(members, embedder)
    if kept:
        centre = engine.centroid(vectors)
        profile.update(members=len(kept), centroid=[round(float(x), 5) for x in centre],
                       threshold=round(similarity_threshold(vectors), 4))
    pairs = set(TriageSignal.objects.filter(trajectory_id__in=members).values_list("kind", "trajectory_id"))
    kinds = Counter(kind for kind, _ in pairs)
    # The kind most members carry; on a tie, the one that explains the others (the clustering's STEP_PRIORITY:
    # a tool error explains the missing answer after it).
    rank = {kind: i for i, kind in enumerate(engine.STEP_PRIORITY)}
    signal = min(kinds, key=lambda k: (-kinds[k], rank.get(k, len(rank)), k)) if kinds else ""
    fixed_at = failure_mode.fixed_at or timezone.now()
    before_n = before_k = 0
    if signal:
        window = Trajectory.objects.filter(project_id=failure_mode.project_id, created_at__lt=fixed_at,
                                           created_at__gte=fixed_at - timedelta(days=BEFORE_DAYS))
        carrying = TriageSignal.objects.filter(trajectory_id=OuterRef("pk"), kind=signal)
        counts = window.aggregate(n=Count("id"), k=Count("id", filter=Q(Exists(carrying))))
        before_n, before_k = counts["n"], counts["k"]
    profile["signal"] = {"kind": signal, "before_n": before_n, "before_k": before_k, "after_n": 0, "after_k": 0,
                         "p": 1.0}
    return profile


@dataclass
class Scan:
    """What one scan of a fixed mode found."""

    looked_at: int = 0  # new trajectories
    matched: list[int] = field(default_factory=list)  # new similarity matches (trajectory ids)
    matches: int = 0  # similarity matches since the fix, in all
    signal: SignalLook | None = None
    reopen: bool = False
    evidence: dict[str, Any] = field(default_factory=dict)


def _scan_window(*, failure_mode: FailureMode, after_id: int, now: datetime) -> list[tuple]:
    """New trajectories of the project after `after_id`, oldest first, up to SCAN_BATCH, cut before the first
    one triage has not reached yet (unless it waited UNTRIAGED_WAIT): its signals decide both rules."""
    rows = list(
        Trajectory.objects.filter(project_id=failure_mode.project_id, id__gt=after_id).order_by("id")
        .values_list("id", "triaged_at", "created_at")[:SCAN_BATCH]
    )
    for i, (_, triaged_at, created_at) in enumerate(rows):
        if triaged_at is None and created_at > now - UNTRIAGED_WAIT:
            return rows[:i]
    return rows


def recurrence_scan(*, failure_mode: FailureMode, embedder: engine.Embedder, now: datetime | None = None) -> Scan:
    """Look at the production traffic that arrived since the last scan of a fixed mode: record the failures
    that match it, advance the watermark and the signal rule's counts, and say whether it came back. Call it
    holding the mode's row lock (flywheel.evals.recurrence); the reopening is the caller's."""
    now = now or timezone.now()
    watch = dict(failure_mode.recurrence_watch or {})
    profile = watch.get("profile")
    if not profile or profile.get("embedder") != embedder.name:
        profile = mode_profile(failure_mode=failure_mode, embedder=embedder)
    after_id = int(watch.get("after_id") or 0)
    rows = _scan_window(failure_mode=failure_mode, after_id=after_id, now=now)
    scan = Scan(looked_at=len(rows))
    ids = [r[0] for r in rows]
    new_failures = list(Trajectory.objects.filter(id__in=ids).filter(_failed()).values_list("id", "model_version"))
    versions = dict(new_failures)

    if profile.get("centroid") and new_failures:
        kept, vectors = _vectors([i for i, _ in new_failures], embedder)
        centre = np.asarray(profile["centroid"], dtype=np.float32)
        if len(kept) and vectors.shape[1] == centre.shape[0]:
            similarity = vectors @ centre
            close = [(t, float(s)) for t, s in zip(kept, similarity, strict=True) if s >= profile["threshold"]]
            RecurrenceMatch.objects.bulk_create(
                [RecurrenceMatch(failure_mode=failure_mode, trajectory_id=t, rule=RecurrenceRule.SIMILARITY,
                                 similarity=round(s, 4), model_version=versions.get(t, "")) for t, s in close],
                ignore_conflicts=True,
            )
            scan.matched = [t for t, _ in close]

    state = profile["signal"]
    if state.get("kind") and ids:
        state["after_n"] += len(ids)
        state["after_k"] += TriageSignal.objects.filter(trajectory_id__in=ids, kind=state["kind"]).values(
            "trajectory_id").distinct().count()
    look = signal_look(after_n=state["after_n"], after_k=state["after_k"], before_n=state["before_n"],
                       before_k=state["before_k"], previous_p=float(state.get("p", 1.0)))
    state["p"] = look.p
    scan.signal = look if state.get("kind") else None

    similar = RecurrenceMatch.objects.filter(failure_mode=failure_mode, rule=RecurrenceRule.SIMILARITY)
    scan.matches = similar.count()
    if rows:
        watch["after_id"] = rows[-1][0]
    watch["profile"] = profile
    watch["scanned_at"] = now.isoformat()
    failure_mode.recurrence_watch = watch
    failure_mode.save(update_fields=["recurrence_watch"])

    by_similarity = scan.matches >= MIN_MATCHES
    by_signal = bool(scan.signal and scan.signal.rose)
    if not (by_similarity or by_signal):
        return scan
    if by_signal:
        _record_signal_matches(failure_mode=failure_mode, kind=state["kind"])
    matched_ids = list(
        RecurrenceMatch.objects.filter(failure_mode=failure_mode).order_by("-trajectory_id")
        .values_list("trajectory_id", flat=True)[:EVIDENCE_IDS]
    )
    rules = [r for r, on in ((RecurrenceRule.SIMILARITY.value, by_similarity), (RecurrenceRule.SIGNAL.value, by_signal)) if on]
    scan.reopen = True
    scan.evidence = {
        "rules": rules,
        "at": now.isoformat(),
        "fixed_at": failure_mode.fixed_at.isoformat() if failure_mode.fixed_at else None,
        "fixed_version_number": failure_mode.fixed_version_number,
        "similarity": {"matches": scan.matches, "min_matches": MIN_MATCHES, "threshold": profile.get("threshold"),
                       "members": profile.get("members", 0)},
        "signal": {"kind": state.get("kind", ""), **look.to_dict(), "margin": SIGNAL_MARGIN, "alpha": SIGNAL_ALPHA,
                   "min_count": SIGNAL_MIN_COUNT} if state.get("kind") else None,
        "trajectory_ids": matched_ids,
        "reason": _reason(by_similarity=by_similarity, by_signal=by_signal, scan=scan, kind=state.get("kind", "")),
    }
    return scan


def _record_signal_matches(*, failure_mode: FailureMode, kind: str) -> None:
    """The failures since the fix that carry the mode's signal, as matches (the newest SIGNAL_MATCHES_KEPT)."""
    start = failure_mode.fixed_at or timezone.now()
    rows = (
        Trajectory.objects.filter(project_id=failure_mode.project_id, created_at__gte=start)
        .filter(_failed())
        .filter(Exists(TriageSignal.objects.filter(trajectory_id=OuterRef("pk"), kind=kind)))
        .order_by("-id").values_list("id", "model_version")[:SIGNAL_MATCHES_KEPT]
    )
    RecurrenceMatch.objects.bulk_create(
        [RecurrenceMatch(failure_mode=failure_mode, trajectory_id=t, rule=RecurrenceRule.SIGNAL, signal=kind[:32],
                         model_version=v) for t, v in rows],
        ignore_conflicts=True,
    )


def _reason(*, by_similarity: bool, by_signal: bool, scan: Scan, kind: str) -> str:
    parts = []
    if by_similarity:
        parts.append(f"{scan.matches} new failures since the fix are as close to its members as they are "
                     f"to each other (at least {MIN_MATCHES} reopen it)")
    if by_signal and scan.signal is not None:
        parts.append(f"{kind.replace('_', ' ')} on {scan.signal.after_rate:.1%} of {scan.signal.after_n:,} trajectories "
                     f"since the fix, against {scan.signal.before_rate:.1%} before it plus a margin of "
                     f"{SIGNAL_MARGIN:.0%} (always-valid p = {scan.signal.p:.4f})")
    return "; ".join(parts)


# --- reads -----------------------------------------------------------------------------------------------


def recurrence_matches(*, failure_mode: FailureMode, limit: int = 50) -> list[RecurrenceMatch]:
    """The mode's matches since its fix, newest first, with their trajectories (for its page)."""
    return list(
        RecurrenceMatch.objects.filter(failure_mode=failure_mode).select_related("trajectory")
        .order_by("-trajectory_id")[:limit]
    )


def matching_counts_by_model_version(*, failure_mode: FailureMode) -> dict[str, int]:
    """Trajectories that match the mode (its members and its recurrence matches), counted by the
    `model_version` string they carry: the numerators of "the share of each version's traffic that shows
    this mode". The registry maps the strings to versions and divides (flywheel.evals.recurrence)."""
    members = FailureModeAssignment.objects.filter(failure_mode=failure_mode, trajectory_id=OuterRef("pk"))
    matches = RecurrenceMatch.objects.filter(failure_mode=failure_mode, trajectory_id=OuterRef("pk"))
    rows = (
        Trajectory.objects.filter(project_id=failure_mode.project_id).filter(Exists(members) | Exists(matches))
        .values("model_version").annotate(n=Count("id")).order_by()
    )
    return {r["model_version"]: r["n"] for r in rows}


def recurring() -> Q:
    """A condition on Trajectory: it matches a mode that came back (reopened, not fixed again). The review
    queue offers these first."""
    reopened = RecurrenceMatch.objects.filter(trajectory_id=OuterRef("pk")).exclude(failure_mode__status=FailureModeStatus.FIXED)
    return Q(Exists(reopened))


def fixed_modes_to_watch() -> QuerySet[FailureMode]:
    return FailureMode.objects.filter(status=FailureModeStatus.FIXED)

