"""The review queue: what it holds and in which order, claims with an expiry, completion, skip, and on
PostgreSQL, concurrent claims that never hand one item to two reviewers."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from django.core.exceptions import ValidationError
from django.db import connection, connections, transaction

from flywheel.failures import queue, services
from flywheel.failures.models import QueueClaim
from flywheel.trajectories.models import Trajectory
from flywheel.trajectories.selectors import TrajectoryFilters


@pytest.fixture
def queued(project, make_trajectories, add_signal):
    """Five trajectories: `low` and `high` flagged by triage (severity 1 and 3, the agent said success),
    `old` and `new` failed without signals, `fine` succeeded without signals (not in the queue)."""
    made = {}
    for name, outcome in (("old", "failure"), ("low", "success"), ("high", "success"), ("new", "failure"), ("fine", "success")):
        made[name] = make_trajectories(project, 1, prefix=name, outcome=outcome)[0]
    add_signal(made["low"], kind="loop", severity=1)
    add_signal(made["high"], kind="unsafe_action", severity=3)
    return made


def test_the_queue_holds_failed_or_flagged_unreviewed_by_severity_then_recency(project, user, make_user, queued):
    order = []
    for n in range(5):
        reviewer = make_user(f"r{n}")
        claim = queue.queue_claim_next(project=project, user=reviewer)
        if claim is None:
            break
        order.append(claim.trajectory.external_id)
    assert order == ["high-0", "low-0", "new-0", "old-0"]
    progress = queue.queue_progress(project=project)
    assert (progress.done, progress.remaining) == (0, 4)


def test_a_claim_is_kept_until_it_expires_then_another_reviewer_may_take_it(project, user, make_user, queued, settings):
    settings.FLYWHEEL_QUEUE_CLAIM_S = 600
    first = queue.queue_claim_next(project=project, user=user)
    assert first.expires_at - dt.timedelta(seconds=599) > first.trajectory.created_at
    # Claiming again renews the same item rather than taking a second one.
    assert queue.queue_claim_next(project=project, user=user).trajectory == first.trajectory
    other = make_user("other")
    assert queue.queue_claim_next(project=project, user=other).trajectory != first.trajectory
    QueueClaim.objects.filter(trajectory=first.trajectory).update(expires_at=first.expires_at - dt.timedelta(hours=1))
    third = make_user("third")
    assert queue.queue_claim_next(project=project, user=third).trajectory == first.trajectory


def test_completing_marks_reviewed_and_only_the_holder_may(project, user, make_user, queued):
    claim = queue.queue_claim_next(project=project, user=user)
    with pytest.raises(ValidationError, match="claimed by another"):
        queue.queue_complete(project=project, trajectory=claim.trajectory, user=make_user("intruder"))
    mode = services.failure_mode_create(project=project, name="Unsafe refund", category_key="unsafe_action", user=user)
    services.failure_mode_assign(failure_mode=mode, trajectories=[claim.trajectory], user=user)
    change = queue.queue_complete(project=project, trajectory=claim.trajectory, user=user)
    trajectory = Trajectory.objects.get(pk=claim.trajectory.pk)
    # The agent said success, but a reviewer named a failure mode: reviewed as a failure.
    assert trajectory.reviewed_outcome == "failure" and trajectory.reviewed_by == user
    assert (change.before, change.after) == ("", "failure")
    assert not QueueClaim.objects.filter(trajectory=trajectory).exists()
    assert queue.queue_progress(project=project).done == 1
    # Undo: the outcome goes back, and the item is in the queue again.
    services.review_change_revert(change=change, user=user)
    assert queue.queue_claim_next(project=project, user=user).trajectory == trajectory


def test_a_skipped_item_is_not_offered_to_the_same_reviewer_again(project, user, make_user, queued):
    first = queue.queue_claim_next(project=project, user=user).trajectory
    queue.queue_skip(project=project, trajectory=first, user=user)
    assert queue.queue_claim_next(project=project, user=user).trajectory != first
    assert queue.queue_claim_next(project=project, user=make_user("other")).trajectory == first
    queue.queue_release(project=project, user=make_user("x"))


def test_the_queue_takes_the_lists_filter(project, user, queued):
    filters = TrajectoryFilters.from_params({"signal": "loop"})
    assert queue.queue_claim_next(project=project, user=user, filters=filters).trajectory == queued["low"]
    queue.queue_complete(project=project, trajectory=queued["low"], user=user)
    assert queue.queue_claim_next(project=project, user=user, filters=filters) is None


# --- PostgreSQL: concurrent claims -------------------------------------------------------------------------


def _postgres(needs_service):
    needs_service(connection.vendor == "postgresql", f"needs PostgreSQL (DATABASE_URL points at {connection.vendor})")


def _claim(project, reviewer, barrier, got, errors) -> None:
    """One reviewer's claim, started with the others' by the barrier, in its own database connection."""
    try:
        barrier.wait(timeout=10)
        result = queue.queue_claim_next(project=project, user=reviewer)
        got[reviewer.username] = result.trajectory.pk if result else None
    except BaseException as exc:  # surfaced by the test: a thread's exception is otherwise lost
        errors.append(exc)
    finally:
        connections.close_all()


def test_two_concurrent_claims_never_get_the_same_item(transactional_db, needs_service, make_project, make_user, make_trajectories):
    """Rounds of two reviewers claiming at the same instant (a barrier), over a queue of one item, then of
    two: with one item exactly one of them wins it, with two each gets a different one."""
    _postgres(needs_service)
    project = make_project("race")
    reviewers = [make_user("ann"), make_user("bob")]
    for round_no, size in enumerate((1, 2, 1, 2, 1, 2)):
        trajectories = make_trajectories(project, size, prefix=f"r{round_no}")
        barrier = threading.Barrier(2)
        got: dict[str, int | None] = {}
        errors: list[BaseException] = []

        threads = [threading.Thread(target=_claim, args=(project, r, barrier, got, errors)) for r in reviewers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not errors, errors
        won = [pk for pk in got.values() if pk is not None]
        assert len(won) == size and len(set(won)) == size, (round_no, got)
        assert set(won) == {t.pk for t in trajectories}
        assert QueueClaim.objects.filter(trajectory_id__in=won).values("trajectory").distinct().count() == size
        for t in trajectories:  # empty the queue for the next round
            Trajectory.objects.filter(pk=t.pk).update(reviewed_outcome="failure")
        QueueClaim.objects.all().delete()


def test_a_claim_passes_over_an_item_another_claim_has_locked(transactional_db, needs_service, make_project, make_user, make_trajectories):
    """While one claim holds the first item's row lock (mid-claim, not committed), another claim does not
    wait for it (SKIP LOCKED): it takes the next item at once."""
    _postgres(needs_service)
    project = make_project("skiplocked")
    older, newer = make_trajectories(project, 2)
    locked = threading.Event()
    release = threading.Event()

    def hold_newest():
        try:
            with transaction.atomic():
                Trajectory.objects.select_for_update().get(pk=newer.pk)
                locked.set()
                release.wait(timeout=30)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold_newest)
    holder.start()
    try:
        assert locked.wait(timeout=10)
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '2s'")  # a claim that waited on the lock would fail here
        claim = queue.queue_claim_next(project=project, user=make_user("cy"))
        assert claim.trajectory.pk == older.pk
    finally:
        release.set()
        holder.join(timeout=30)
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")
