"""What may move an alias by itself: the live evidence the platform vouched for, one sender's share of it capped,
and a check that the arms' split is the one the router was told.

The canary's and the watch's looks (flywheel.registry.canary) run their tests on all of an arm's traffic, and
those figures are what a person sees and what flags a check for a person. An automatic action (a rollback, a
promotion) needs the same verdict from the evidence the platform vouched for (`Trust.acts`):

- only trajectories the router vouched for at ingestion (`Trajectory.vouch`, flywheel.trajectories.vouch), each
  request id counted once (the first trajectory that carried it: two batches racing with one token count once);
- of those, one sender's (an API key's, a user's upload) count at most FLYWHEEL_EVIDENCE_KEY_SHARE of the arm's
  vouched trajectories, its first ones, once more than one sender sends them (`trusted_rows`). It bounds what
  one key's flood adds (at most that share of the arm's count), not its weight among what is left: a sender of
  90 of 100 still makes 50 of the 60 that count. A sender alone is not capped: there is no one to share with;
- and, for the canary and for a watch's holdback, a split of the vouched traffic that agrees with the weight the
  router applies (`split_check`): far from it, something other than the split chose the arms (pinning, a second
  router, a flood), and a person decides. A third arm served beside the two compared (a holdback beside a
  canary, a canary beside a holdback) takes its weight out of theirs: `split_periods` gives the expected share
  period by period.

A trajectory's failure is the effective outcome (a reviewer's label over the agent's), its unsafe action a
triage signal the platform computed. What a client reports on traffic nobody vouched for can flag a check for a
person, never act by itself; on vouched traffic it counts as the sender reported it, within its share (vouching
proves which version answered, not how it went).

**The split check.** Under correct routing each vouched trajectory lands on the canary with probability w, its
weight, independently of the others. Against the mixture q ~ Beta(1, 1) over the canary's real share, the
likelihood ratio after x canary trajectories of k is

    Lambda = B(1 + x, 1 + k - x) / (w^x (1 - w)^(k - x))

a nonnegative martingale with mean 1 under H0, so by Ville's inequality P(Lambda ever >= 1/alpha) <= alpha: the
always-valid p-value, the running minimum of 1/Lambda over the looks, flags an equal split at most alpha of the
time however often it is looked at. alpha = SPLIT_ALPHA = 0.001. Simulated (tests/platform/registry/
test_evidence.py prints the figures: 4,000 streams, a look every 20 canary trajectories to 1,000): a correct split
at w = 0.1 flagged 0.00% of the time (95% interval 0 to 0.10%), at w = 0.05 the same; at w = 0.1 a router that
sends 15% is flagged in 100% of streams (median 148 canary trajectories at the flag), 20% in 100% (median 71), 5%
in 100% (median 37). Beside a third arm the share tested is the arm's of the two compared, w / (1 - h) while a
holdback h runs beside a canary w (the same test, so the same rates); judged on w alone, correct routing of a 10%
canary beside a 5% holdback was flagged 4.5% of the time [3.9%, 5.2%], beside a 30% one 100% (3,000 canary
trajectories, the same simulation). Only trajectories that started between SPLIT_GRACE after the canary started (the router's next
read of the split) and SPLIT_SETTLE before the look (their conversations finished and sent) are counted, so
neither a router's refresh nor a slower arm's later trajectories lean the split. It assumes each trajectory's arm
is its own draw: a route key shared by many trajectories (a user id rather than a conversation's) makes the split
lumpier than binomial and flags more often than stated, which holds automatic actions for a person, never acts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, Exists, OuterRef, Q, QuerySet
from django.db.models.functions import Coalesce

from flywheel.accounts.models import Project
from flywheel.registry import sequential, serving
from flywheel.registry.models import ModelVersion, VersionName

SPLIT_ALPHA = 0.001


# --- which version a model_version names, for ingestion's check -------------------------------------------------


def version_numbers(project: Project, names: list[str]) -> dict[str, int]:
    """{name: version number} for the names that name one of the project's versions (its adapter name, or a
    name a maintainer mapped): what `flywheel.trajectories.vouch` compares a token's version with."""
    out: dict[str, int] = {}
    numbers = {name: serving.adapter_number(project.slug, name) for name in names}
    existing = set(ModelVersion.objects.filter(project=project, number__in=[n for n in numbers.values() if n])
                   .values_list("number", flat=True))
    for name, number in numbers.items():
        if number in existing:
            out[name] = number
    rest = [name for name in names if name not in out]
    if rest:
        out.update(VersionName.objects.filter(project=project, name__in=rest)
                   .values_list("name", "version__number"))
    return out


# --- the rows that count ---------------------------------------------------------------------------------------


def vouched_rows(rows: QuerySet) -> QuerySet:
    """`rows` narrowed to the vouched ones, each request id counted once (its first trajectory)."""
    from flywheel.trajectories.models import Trajectory, Vouch

    earlier = (Trajectory.objects.filter(project=OuterRef("project"), vouch_request=OuterRef("vouch_request"),
                                         vouch=Vouch.VOUCHED, pk__lt=OuterRef("pk"))
               .exclude(vouch_request=""))  # the partial index's own condition, so that it serves this lookup
    return rows.filter(vouch=Vouch.VOUCHED).exclude(Exists(earlier))


def trusted_rows(rows: QuerySet) -> tuple[QuerySet, dict[str, int]]:
    """`rows` (one arm's trajectories) narrowed to what may act by itself: vouched for, each request id once, and
    each sender's first trajectories up to FLYWHEEL_EVIDENCE_KEY_SHARE of the arm's vouched ones (only when more
    than one sender sent them). With it, `{vouched: the arm's vouched trajectories, senders: how many sent them}`."""
    vouched = vouched_rows(rows)
    per_sender = dict(vouched.order_by().values_list("ingested_by").annotate(n=Count("id")))
    total = sum(per_sender.values())
    info = {"vouched": total, "senders": len(per_sender)}
    share = float(settings.FLYWHEEL_EVIDENCE_KEY_SHARE)
    if len(per_sender) < 2 or share >= 1:
        return vouched, info
    limit = max(1, math.floor(share * total))
    beyond = Q()
    for sender, n in per_sender.items():
        if n > limit:
            last = vouched.filter(ingested_by=sender).order_by("id").values_list("id", flat=True)[limit - 1]
            beyond |= Q(ingested_by=sender, id__gt=last)
    return (vouched.exclude(beyond) if beyond else vouched), info


# --- the split -----------------------------------------------------------------------------------------------

# The split check counts the vouched trajectories that started after the router had time to read a new split
# (routers read it every 10 s by default) and long enough ago that their conversations have finished and been
# sent: a slower arm's trajectories arrive later, and counting the ones still arriving would lean the split.
SPLIT_GRACE = timedelta(minutes=2)
SPLIT_SETTLE = timedelta(minutes=15)


def split_periods(*, started_at: datetime, now: datetime, weight: float,
                  others: list[tuple[datetime, datetime | None, float]]) -> list[tuple[datetime, datetime, float]]:
    """The stretches of [started_at + SPLIT_GRACE, now - SPLIT_SETTLE) over which the weighted arm's share of the
    two arms compared is one number: `(start, end, share)`. `others` are the arms served beside the two at
    times (a holdback beside a canary, a canary beside a watch's holdback): `(from, until or None, weight)`.
    While others take o of the traffic, the weighted arm's share of the two is weight / (1 - o). The first
    SPLIT_GRACE after another arm starts or ends is left out, as after the check's own start: routers read the
    new split within it."""
    low, high = started_at + SPLIT_GRACE, now - SPLIT_SETTLE
    edges = sorted({t for start, until, _ in others for t in (start, until) if t is not None and low < t < high})
    periods = []
    for i, start in enumerate([low, *edges]):
        end = edges[i] if i < len(edges) else high
        begin = start if i == 0 else start + SPLIT_GRACE
        if begin >= end:
            continue
        taken = sum(w for since, until, w in others if since <= start and (until is None or until > start))
        if taken < 1:
            periods.append((begin, end, weight / (1 - taken)))
    return periods


def split_counts(*, project: Project, canary_names: list[str], production_names: list[str], after_id: int,
                 periods: list[tuple[datetime, datetime, float]]) -> list[tuple[int, int, float]]:
    """(weighted arm, other arm, share) of each period: the vouched trajectories of each arm that started in it."""
    from flywheel.trajectories.models import Trajectory

    rows = vouched_rows(Trajectory.objects.filter(project=project, pk__gt=after_id)
                        .annotate(at=Coalesce("started_at", "created_at")))
    counts = []
    for start, end, share in periods:
        stretch = rows.filter(at__gte=start, at__lt=end)
        counts.append((stretch.filter(model_version__in=canary_names).count(),
                       stretch.filter(model_version__in=production_names).count(), share))
    return counts



def split_log_ratio(canary_n: int, production_n: int, weight: float) -> float:
    """log Lambda of the split check above; 0.0 (no evidence) while there is no traffic."""
    k = canary_n + production_n
    if k == 0 or not 0 < weight < 1:
        return 0.0
    return sequential.log_beta_mixture_ratio(canary_n, k, weight)


def split_check(counts: list[tuple[int, int, float]], previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """The split check at this look over `counts`, (weighted arm, other arm, share) a period of one share:
    {canary, production, weight, share, p, imbalanced}, `weight` the share expected over all of them. The
    periods' ratios multiply: each is a martingale with mean 1 under correct routing, run one after the other,
    so their product is one too and Ville's bound holds as for one. `previous` is the last look's (its p carries
    over: a running minimum)."""
    log_ratio = sum(split_log_ratio(x, y, share) for x, y, share in counts)
    p = min(float((previous or {}).get("p", 1.0)), 1.0, math.exp(-log_ratio))
    canary_n, production_n = sum(x for x, _, _ in counts), sum(y for _, y, _ in counts)
    k = canary_n + production_n
    expected = sum((x + y) * share for x, y, share in counts) / k if k else (counts[0][2] if counts else None)
    return {"canary": canary_n, "production": production_n, "weight": expected,
            "share": canary_n / k if k else None, "p": p, "imbalanced": p <= SPLIT_ALPHA}


# --- what acts -------------------------------------------------------------------------------------------------


@dataclass
class Trust:
    """The look on vouched evidence alone beside its counts and (for the canary) the split check: whether an
    automatic action may rest on it."""

    look: sequential.Look
    subject: dict[str, int]
    baseline: dict[str, int]
    split: dict[str, Any] | None = None
    baseline_fixed: bool = False

    @property
    def imbalanced(self) -> bool:
        return bool(self.split and self.split["imbalanced"])

    @property
    def any_vouched(self) -> bool:
        return self.subject.get("vouched", 0) + self.baseline.get("vouched", 0) > 0

    def acts(self, verdict: str, *, subject: str, baseline: str, min_per_arm: int) -> tuple[bool, str]:
        """(whether the `verdict` ("worse" or "ready") may be acted on by itself, and when not, why), the arms
        named `subject` and `baseline` in that why."""
        if self.imbalanced:
            split = self.split or {}
            return False, (f"the split of the vouched traffic is far from the weight ({split['share']:.1%} on "
                           f"{split.get('on') or subject} where {split['weight']:.1%} was expected, always-valid "
                           f"p = {split['p']:.2g}): something other than the router's split chose the arms")
        counted = f"{self.subject['n']} vouched trajectories counted on {subject} and {self.baseline['n']} on {baseline}"
        if verdict == "worse":
            if self.look.worse:
                return True, ""
            return False, f"the traffic the router vouched for does not show it ({counted})"
        if self.look.ready:
            return True, ""
        if self.look.enough and not self.look.worse:
            return False, (f"on the traffic the router vouched for ({counted}) the failure rate's increase is not "
                           f"yet bounded within the tolerance of {self.look.tolerance:.0%}")
        return False, f"too little of the traffic was vouched for by the router ({counted}, {min_per_arm} needed in each)"

    def to_dict(self) -> dict[str, Any]:
        return {"look": self.look.to_dict(), "subject": self.subject, "baseline": self.baseline,
                "split": self.split, **({"baseline_before_move": True} if self.baseline_fixed else {})}
