"""The review history: every change to a trajectory's outcome, failure modes and tags, with who, when,
before and after. The review services (flywheel.failures.review, flywheel.failures.services) call
`review_change_record` in the same transaction as the change they make."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.contrib.auth.models import AbstractBaseUser

from flywheel.accounts.models import Project
from flywheel.failures.models import FailureModeAssignment, ReviewChange, ReviewField
from flywheel.trajectories.models import Trajectory

HISTORY_LIMIT = 100  # changes shown on a trajectory's page, newest first


def modes_of(*, trajectory_ids: Iterable[int]) -> dict[int, list[str]]:
    """{trajectory id: sorted names of its failure modes} for the given trajectories."""
    result: dict[int, list[str]] = {}
    ids = list(trajectory_ids)
    for start in range(0, len(ids), 5000):  # SQLite caps the parameters of one statement
        rows = FailureModeAssignment.objects.filter(trajectory_id__in=ids[start : start + 5000]).values_list(
            "trajectory_id", "failure_mode__name"
        )
        for trajectory_id, name in rows:
            result.setdefault(trajectory_id, []).append(name)
    return {k: sorted(v) for k, v in result.items()}


def tags_of(*, trajectory: Trajectory) -> list[str]:
    return sorted(trajectory.tags.values_list("name", flat=True))


def review_change_record(
    *, trajectory: Trajectory, user: AbstractBaseUser | None, field: str, before: Any, after: Any
) -> ReviewChange | None:
    """Record one change; a "change" that leaves the value as it was is not recorded."""
    if before == after:
        return None
    return ReviewChange.objects.create(
        project_id=trajectory.project_id,
        trajectory=trajectory,
        user=user if user is not None and user.is_authenticated else None,
        field=ReviewField(field),
        before=before,
        after=after,
    )


def review_changes_record(
    *, project: Project, user: AbstractBaseUser | None, field: str, changes: Iterable[tuple[int, Any, Any]]
) -> int:
    """Record many changes of one field at once: (trajectory id, before, after) each (bulk assignment)."""
    rows = [
        ReviewChange(
            project=project,
            trajectory_id=trajectory_id,
            user=user if user is not None and user.is_authenticated else None,
            field=ReviewField(field),
            before=before,
            after=after,
        )
        for trajectory_id, before, after in changes
        if before != after
    ]
    ReviewChange.objects.bulk_create(rows, batch_size=1000)
    return len(rows)


def review_history(*, trajectory: Trajectory, limit: int = HISTORY_LIMIT) -> list[ReviewChange]:
    return list(ReviewChange.objects.filter(trajectory=trajectory).select_related("user").order_by("-id")[:limit])
