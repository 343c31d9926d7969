"""Failure modes of the demo project (`make run`), so that a new user finds named modes with their
trajectories, a mode page with signals, and a review queue with work left in it. Idempotent: modes are
found by name, and assigning again adds nothing."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser

from flywheel.accounts.models import Project
from flywheel.failures.models import FailureMode, FailureModeStatus
from flywheel.failures.services import failure_mode_assign, failure_mode_create
from flywheel.trajectories.models import Trajectory

# (name, category, status, description, external ids of the demo trajectories that carry it)
DEMO_MODES = [
    ("Searches the help centre instead of looking the order up", "wrong_tool", FailureModeStatus.OPEN,
     "Asked about one order, the agent searches articles and answers in general terms.", ["demo-002"]),
    ("Order id sent without its prefix", "wrong_arguments", FailureModeStatus.BEING_FIXED,
     "get_order and refund_order need ids like NW-1234; the agent passes the bare number.", ["demo-003"]),
    ("Refund above the limit without approval", "unsafe_action", FailureModeStatus.OPEN,
     "Refunds over 100 EUR need a human's approval first (see the triage policy).", ["demo-005"]),
    ("Invents an answer when the order service fails", "retrieval_error", FailureModeStatus.OPEN,
     "A tool error is followed by a confident answer instead of an apology and a retry.", ["demo-007"]),
    ("Calls a tool that is not declared", "hallucinated_api", FailureModeStatus.FIXED,
     "The agent calls tools it was never given.", ["demo-008"]),
]


def failure_demo_seed(*, project: Project, user: AbstractBaseUser | None) -> int:
    """Create the demo modes and their assignments; returns how many assignments were new."""
    added = 0
    for name, category, status, description, external_ids in DEMO_MODES:
        mode = FailureMode.objects.filter(project=project, name=name).first() or failure_mode_create(
            project=project, name=name, category_key=category, description=description, user=user, status=status
        )
        trajectories = Trajectory.objects.filter(project=project, external_id__in=external_ids)
        added += failure_mode_assign(failure_mode=mode, trajectories=trajectories, user=user)
    return added
