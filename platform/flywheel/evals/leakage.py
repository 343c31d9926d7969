"""The leakage guard: what a model is measured on never trains it.

Rules, checked when a row is added (promotion, variants) and again when a version is frozen:
- a trajectory behind an eval case never becomes a training task, and one behind a task never becomes an
  eval case (variants carry their parent's trajectory, so they inherit this);
- a row whose prompt is a near duplicate of a row on the other side is refused. Today "near duplicate" is
  the same normalised last user request (`rows.prompt_digest`). More rules plug into
  `NEAR_DUPLICATE_FINDERS`: an embedding rule (cosine >= 0.95 by the clustering model's sentence embeddings)
  is a function with the same signature as `same_normalised_request`, and then applies everywhere the guard
  runs: promotion, variants, freezing, and a job's task set against its suites (`rows_conflicts`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

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


def _other_side(project: Project, side: str) -> list[Candidate]:
    """Every current row on the other side of `side`, as candidates labelled with where they live."""
    if side == "eval":
        from flywheel.environments.models import Task

        prefix, where = Task.ROW_PREFIX, "task set"
        rows = Task.objects.filter(task_set__project=project).values_list(
            "pk", "trajectory_id", "prompt_digest", "prompt_text", "task_set__name")
    else:
        from flywheel.evals.models import EvalCase

        prefix, where = EvalCase.ROW_PREFIX, "eval suite"
        rows = EvalCase.objects.filter(suite__project=project).values_list(
            "pk", "trajectory_id", "prompt_digest", "prompt_text", "suite__name")
    return [Candidate(f"{prefix}-{pk} in {where} '{name}'", trajectory_id, digest, text)
            for pk, trajectory_id, digest, text, name in rows.order_by("pk")]


def same_trajectory(candidates: list[Candidate], others: list[Candidate]) -> list[Conflict]:
    """Rows made from the same production trajectory."""
    by_trajectory: dict[int, list[Candidate]] = {}
    for other in others:
        if other.trajectory_id is not None:
            by_trajectory.setdefault(other.trajectory_id, []).append(other)
    return [Conflict("trajectory", c.label, other.label, f"trajectory #{c.trajectory_id} is behind a row on the other side")
            for c in candidates if c.trajectory_id is not None for other in by_trajectory.get(c.trajectory_id, [])]


def same_normalised_request(candidates: list[Candidate], others: list[Candidate]) -> list[Conflict]:
    """Rows asking the same thing once case, spaces and punctuation are gone."""
    by_digest: dict[str, list[Candidate]] = {}
    for other in others:
        if other.prompt_digest:
            by_digest.setdefault(other.prompt_digest, []).append(other)
    return [Conflict("prompt", c.label, other.label, f"same request as a row on the other side: {c.prompt_text[:120]!r}")
            for c in candidates if c.prompt_digest for other in by_digest.get(c.prompt_digest, [])]


# (rows joining one side, rows of the other side) -> conflicts. Each rule decides what "the same" means;
# an embedding rule (cosine >= 0.95) is appended here with the same signature.
NEAR_DUPLICATE_FINDERS: list[Callable[[list[Candidate], list[Candidate]], list[Conflict]]] = [
    same_trajectory, same_normalised_request,
]


def conflicts_between(candidates: Iterable[Candidate], others: Iterable[Candidate]) -> list[Conflict]:
    """Every rule's conflicts between two sides given as candidates (e.g. two frozen versions' rows)."""
    candidates, others = list(candidates), list(others)
    if not candidates or not others:
        return []
    return [conflict for finder in NEAR_DUPLICATE_FINDERS for conflict in finder(candidates, others)]


def rows_conflicts(*, rows: Iterable[dict[str, Any]], other_rows: Iterable[dict[str, Any]], other_label: str = "") -> list[Conflict]:
    """Conflicts between the rows of two versions (a task set's and a suite's), by the same rules."""
    others = [candidate_from_row(row) for row in other_rows]
    if other_label:
        others = [Candidate(f"{c.label} in {other_label}", c.trajectory_id, c.prompt_digest, c.prompt_text) for c in others]
    return conflicts_between((candidate_from_row(row) for row in rows), others)


def other_side(*, project: Project, side: str) -> list[Candidate]:
    """The rows a row joining `side` is compared with; read once for a batch (bulk promotion)."""
    return _other_side(project, side)


def leakage_conflicts(*, project: Project, side: str, candidates: Iterable[Candidate],
                      others: list[Candidate] | None = None) -> list[Conflict]:
    """Every conflict of rows about to join `side` ("eval" or "train") with the project's other side
    (`others`, when the caller already read it with `other_side`)."""
    candidates = list(candidates)
    if not candidates:
        return []
    return conflicts_between(candidates, _other_side(project, side) if others is None else others)


def leakage_check(*, project: Project, side: str, candidates: Iterable[Candidate]) -> None:
    """Raise LeakageError listing every conflict, if there is any."""
    conflicts = leakage_conflicts(project=project, side=side, candidates=candidates)
    if conflicts:
        raise LeakageError(conflicts)
