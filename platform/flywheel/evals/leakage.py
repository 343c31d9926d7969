"""The leakage guard: what a model is measured on never trains it.

Rules, checked when a row is added (promotion, variants) and again when a version is frozen:
- a trajectory behind an eval case never becomes a training task, and one behind a task never becomes an
  eval case (variants carry their parent's trajectory, so they inherit this);
- a row whose prompt is a near duplicate of a row on the other side is refused. Today "near duplicate" is
  the same normalised last user request (`rows.prompt_digest`). More rules plug into
  `NEAR_DUPLICATE_FINDERS`: an embedding rule (cosine >= 0.95 by the clustering model's sentence embeddings)
  is a function with the same signature as `same_normalised_request`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from django.db.models import Q, QuerySet

from flywheel.accounts.models import Project
from flywheel.evals import rows as row_shape


@dataclass(frozen=True)
class Candidate:
    """A row about to join one side: where it comes from and what it asks."""

    label: str  # how the conflict list names it: "trajectory #12", "case-4", ...
    trajectory_id: int | None
    prompt_digest: str
    prompt_text: str


@dataclass(frozen=True)
class Conflict:
    rule: str  # "trajectory" | "prompt" | a finder's own name
    candidate: str
    other: str  # "task-7 in task set 'Refunds'"
    detail: str

    def __str__(self) -> str:
        return f"{self.candidate}: {self.detail} ({self.other})"


class LeakageError(Exception):
    def __init__(self, conflicts: list[Conflict]):
        self.conflicts = conflicts
        super().__init__("; ".join(map(str, conflicts)))


def candidate_from_row(row: dict[str, Any]) -> Candidate:
    origin = row.get("origin") if isinstance(row.get("origin"), dict) else {}
    trajectory_id = origin.get("trajectory_id")
    return Candidate(
        label=str(row.get("id")),
        trajectory_id=trajectory_id if isinstance(trajectory_id, int) else None,
        prompt_digest=row_shape.prompt_digest(row.get("messages")),
        prompt_text=row_shape.last_user_request(row.get("messages")),
    )


def _other_side(project: Project, side: str) -> QuerySet:
    """The rows a candidate of `side` must not leak into: every current row on the other side."""
    if side == "eval":
        from flywheel.environments.models import Task

        return Task.objects.filter(task_set__project=project).select_related("task_set")
    from flywheel.evals.models import EvalCase

    return EvalCase.objects.filter(suite__project=project).select_related("suite")


def _describe(item: Any) -> str:
    collection = getattr(item, "suite", None) or getattr(item, "task_set", None)
    return f"{item.row_id} in {collection.LABEL} '{collection.name}'"


def same_normalised_request(candidates: list[Candidate], others: QuerySet) -> list[Conflict]:
    """Rows asking the same thing once case, spaces and punctuation are gone."""
    digests = {c.prompt_digest for c in candidates if c.prompt_digest}
    if not digests:
        return []
    hits: dict[str, list[Any]] = {}
    for item in others.filter(prompt_digest__in=digests).order_by("pk"):
        hits.setdefault(item.prompt_digest, []).append(item)
    return [
        Conflict("prompt", c.label, _describe(item), f"same request as a row on the other side: {c.prompt_text[:120]!r}")
        for c in candidates
        for item in hits.get(c.prompt_digest, [])
    ]


# (candidates, rows of the other side) -> conflicts. Each finder decides what "near" means.
NEAR_DUPLICATE_FINDERS: list[Callable[[list[Candidate], QuerySet], list[Conflict]]] = [same_normalised_request]


def leakage_conflicts(*, project: Project, side: str, candidates: Iterable[Candidate]) -> list[Conflict]:
    """Every conflict of rows about to join `side` ("eval" or "train") with the project's other side."""
    candidates = list(candidates)
    if not candidates:
        return []
    others = _other_side(project, side)
    conflicts: list[Conflict] = []
    trajectory_ids = {c.trajectory_id for c in candidates if c.trajectory_id is not None}
    if trajectory_ids:
        by_trajectory: dict[int, list[Any]] = {}
        for item in others.filter(Q(trajectory_id__in=trajectory_ids)).order_by("pk"):
            by_trajectory.setdefault(item.trajectory_id, []).append(item)
        what = "is already behind a training task" if side == "eval" else "is already behind an eval case"
        for c in candidates:
            for item in by_trajectory.get(c.trajectory_id, []):
                conflicts.append(Conflict("trajectory", c.label, _describe(item), f"trajectory #{c.trajectory_id} {what}"))
    for finder in NEAR_DUPLICATE_FINDERS:
        conflicts.extend(finder(candidates, others))
    return conflicts


def leakage_check(*, project: Project, side: str, candidates: Iterable[Candidate]) -> None:
    """Raise LeakageError listing every conflict, if there is any."""
    conflicts = leakage_conflicts(project=project, side=side, candidates=candidates)
    if conflicts:
        raise LeakageError(conflicts)
