"""The review queue: a project's failed or flagged trajectories that no reviewer has reviewed yet, most
severe signals first, then newest. A reviewer claims the next item for FLYWHEEL_QUEUE_CLAIM_S seconds;
two reviewers never hold the same item.

How claims stay exclusive: a claim is written only while its trajectory's row is locked. On PostgreSQL the
next item is picked with `SELECT … FOR UPDATE SKIP LOCKED`, so concurrent claimers pass over each other's
candidates instead of queueing on them, and the claim row is read again after the lock (a new statement,
so it sees a claim committed meanwhile). On SQLite every transaction takes the write lock when it begins
(settings: transaction_mode IMMEDIATE), so claims run one after another."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from flywheel.accounts.models import Project
from flywheel.failures.models import FailureModeAssignment, QueueClaim, QueueSkip, ReviewChange
from flywheel.failures.recurrence import recurring
from flywheel.failures.review import trajectory_outcome_set
from flywheel.trajectories.models import Outcome, Trajectory
from flywheel.trajectories.selectors import COUNT_CAP, TrajectoryFilters, trajectory_queryset

CLAIM_ATTEMPTS = 20  # candidates tried before giving up when each was taken between the pick and the lock

# What else puts an unreviewed trajectory in the queue, registered by the apps above this one (which this app
# never imports): each a function returning a condition on Trajectory, e.g. online evaluation's low scores.
_REASONS: list[Callable[[], Q]] = []


def queue_reason_register(reason: Callable[[], Q]) -> None:
    if reason not in _REASONS:
        _REASONS.append(reason)


def _flagged() -> Q:
    """Why a trajectory is in the queue: it failed by the agent's own outcome, triage flagged it, or a
    registered reason holds."""
    flagged = Q(outcome=Outcome.FAILURE) | Q(triage_severity__gt=0)
    for reason in _REASONS:
        flagged |= reason()
    return flagged


def claim_duration() -> dt.timedelta:
    return dt.timedelta(seconds=settings.FLYWHEEL_QUEUE_CLAIM_S)


def queue_queryset(*, project: Project, filters: TrajectoryFilters | None = None) -> QuerySet[Trajectory]:
    """What the queue holds (claimed or not): failed (by the agent's own outcome, none set by a reviewer)
    or flagged by triage or by a registered reason (`_flagged`), and not reviewed; narrowed by the list's own
    filter when one is given."""
    qs = trajectory_queryset(project=project, filters=filters or TrajectoryFilters())
    return qs.filter(reviewed_outcome="").filter(_flagged())


def _open_for(*, qs: QuerySet[Trajectory], user: AbstractBaseUser, now: dt.datetime) -> QuerySet[Trajectory]:
    """`qs` without the items someone else holds and the items `user` skipped."""
    held = QueueClaim.objects.filter(trajectory_id=OuterRef("pk"), expires_at__gt=now).exclude(user=user)
    skipped = QueueSkip.objects.filter(trajectory_id=OuterRef("pk"), user=user)
    return qs.exclude(Exists(held)).exclude(Exists(skipped))


def queue_current(*, project: Project, user: AbstractBaseUser) -> Trajectory | None:
    """The item `user` holds now (an unexpired claim on a trajectory still in the queue), if any."""
    claim = (
        QueueClaim.objects.filter(project=project, user=user, expires_at__gt=timezone.now())
        .select_related("trajectory")
        .order_by("-claimed_at")
        .first()
    )
    if claim is None or claim.trajectory.reviewed_outcome:
        return None
    return claim.trajectory


@dataclass(frozen=True)
class Claim:
    trajectory: Trajectory
    expires_at: dt.datetime


def queue_claim_next(
    *, project: Project, user: AbstractBaseUser, filters: TrajectoryFilters | None = None
) -> Claim | None:
    """Claim the next item for `user` (or renew the one they hold); None when the queue has nothing left
    for them."""
    now = timezone.now()
    with transaction.atomic():
        current = queue_current(project=project, user=user)
        if current is not None:
            return _claim(project=project, trajectory=current, user=user, now=now)
        candidates = _open_for(qs=queue_queryset(project=project, filters=filters), user=user, now=now)
        tried: list[int] = []
        for _ in range(CLAIM_ATTEMPTS):
            pick = None
            # Failures of a mode that came back after its fix first (flywheel.failures.recurrence), then the
            # rest: two picks, so the usual one stays a walk down its index.
            for qs in (candidates.filter(recurring()), candidates):
                pick = (
                    qs.exclude(pk__in=tried)
                    .order_by("-triage_severity", "-id")
                    .select_for_update(skip_locked=True, of=("self",))
                    .only("id", "project_id", "reviewed_outcome")
                    .first()
                )
                if pick is not None:
                    break
            if pick is None:
                return None
            # The row is ours now; read its claim and review again (statements after the lock see what
            # committed before it): another reviewer may have claimed or completed it since the pick began.
            taken = QueueClaim.objects.filter(trajectory=pick, expires_at__gt=now).exclude(user=user).exists()
            reviewed = Trajectory.objects.filter(pk=pick.pk).exclude(reviewed_outcome="").exists()
            if taken or reviewed:
                tried.append(pick.pk)
                continue
            return _claim(project=project, trajectory=pick, user=user, now=now)
    return None


def _claim(*, project: Project, trajectory: Trajectory, user: AbstractBaseUser, now: dt.datetime) -> Claim:
    expires_at = now + claim_duration()
    QueueClaim.objects.update_or_create(
        trajectory=trajectory,
        defaults={"project": project, "user": user, "claimed_at": now, "expires_at": expires_at},
    )
    return Claim(trajectory=Trajectory.objects.get(pk=trajectory.pk), expires_at=expires_at)


def queue_claim(*, project: Project, trajectory: Trajectory, user: AbstractBaseUser) -> Claim:
    """Claim one named item (undo of a completion takes its item back); refused while another holds it."""
    now = timezone.now()
    with transaction.atomic():
        Trajectory.objects.select_for_update().filter(pk=trajectory.pk, project=project).first()
        holder = QueueClaim.objects.filter(trajectory=trajectory, expires_at__gt=now).exclude(user=user).first()
        if holder is not None:
            raise ValidationError({"trajectory": f"Trajectory {trajectory.pk} is claimed by another reviewer."})
        return _claim(project=project, trajectory=trajectory, user=user, now=now)


def _held_by(*, trajectory: Trajectory, user: AbstractBaseUser) -> bool:
    return QueueClaim.objects.filter(trajectory=trajectory, user=user, expires_at__gt=timezone.now()).exists()


def queue_complete(
    *, project: Project, trajectory: Trajectory, user: AbstractBaseUser, outcome: str = ""
) -> ReviewChange | None:
    """Mark the item reviewed and release it. The outcome is `outcome` if given, else failure when it
    carries a failure mode or the agent said so, else what the agent reported. Refused when another reviewer
    holds it. Returns the history entry of the outcome change (what undo reverts)."""
    with transaction.atomic():
        trajectory = Trajectory.objects.select_for_update().get(pk=trajectory.pk, project=project)
        holder = QueueClaim.objects.filter(trajectory=trajectory, expires_at__gt=timezone.now()).exclude(user=user)
        if holder.exists():
            raise ValidationError({"trajectory": f"Trajectory {trajectory.pk} is claimed by another reviewer."})
        if not outcome:
            has_mode = FailureModeAssignment.objects.filter(trajectory=trajectory).exists()
            outcome = Outcome.FAILURE if has_mode or trajectory.outcome == Outcome.FAILURE else trajectory.outcome
        last = ReviewChange.objects.filter(trajectory=trajectory).order_by("-id").values_list("id", flat=True).first()
        trajectory_outcome_set(trajectory=trajectory, outcome=outcome, user=user)
        QueueClaim.objects.filter(trajectory=trajectory).delete()
        return ReviewChange.objects.filter(trajectory=trajectory, id__gt=last or 0, field="outcome").order_by("-id").first()


def queue_skip(*, project: Project, trajectory: Trajectory, user: AbstractBaseUser) -> QueueSkip:
    """Pass an item by: released, and not offered to `user` again (others still get it)."""
    with transaction.atomic():
        QueueClaim.objects.filter(trajectory=trajectory, user=user).delete()
        skip, _ = QueueSkip.objects.get_or_create(project=project, trajectory=trajectory, user=user)
    return skip


def queue_skip_undo(*, project: Project, trajectory: Trajectory, user: AbstractBaseUser) -> Claim:
    """Take a skipped item back: not skipped any more, and claimed again by `user`."""
    with transaction.atomic():
        QueueSkip.objects.filter(project=project, trajectory=trajectory, user=user).delete()
        return queue_claim(project=project, trajectory=trajectory, user=user)


def queue_release(*, project: Project, user: AbstractBaseUser) -> int:
    """Give back whatever `user` holds in the project (leaving the queue)."""
    return QueueClaim.objects.filter(project=project, user=user).delete()[0]


@dataclass(frozen=True)
class QueueProgress:
    done: int  # queue items reviewed (failed or flagged, with a reviewer's outcome)
    remaining: int  # still to review, claimed or not
    capped: bool  # `remaining` stopped counting at COUNT_CAP

    @property
    def remaining_display(self) -> str:
        return f"{self.remaining:,}+" if self.capped else f"{self.remaining:,}"


def queue_progress(*, project: Project, filters: TrajectoryFilters | None = None) -> QueueProgress:
    """Done / remaining counts of the queue, each stopping at COUNT_CAP (see trajectories.selectors)."""
    base = trajectory_queryset(project=project, filters=filters or TrajectoryFilters())
    flagged = _flagged()
    remaining = base.filter(reviewed_outcome="").filter(flagged).values("id")[: COUNT_CAP + 1].count()
    done = base.exclude(reviewed_outcome="").filter(flagged).values("id")[: COUNT_CAP + 1].count()
    return QueueProgress(done=min(done, COUNT_CAP), remaining=min(remaining, COUNT_CAP), capped=remaining > COUNT_CAP)


def queue_held(*, trajectory: Trajectory, user: AbstractBaseUser) -> bool:
    """Whether `user` holds `trajectory` now (the queue page's writes check it)."""
    return _held_by(trajectory=trajectory, user=user)
