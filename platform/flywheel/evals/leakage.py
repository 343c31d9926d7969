"""The leakage guard: what a model is measured on never trains it.

Rules, checked when a row is added (promotion, variants) and again when a version is frozen:
- a trajectory behind an eval case never becomes a training task, and one behind a task never becomes an
  eval case (variants carry their parent's trajectory, so they inherit this);
- a row whose prompt is a near duplicate of a row on the other side is refused: the same normalised last user
  request (`rows.prompt_digest`), or the same request reworded (`similar_request`);
- the other side is what it holds now and what it ever held in a frozen version: a removed task that fed a
  frozen task-set version (or that a model version lists in its lineage, production included) has trained a
  model, and a removed case of a frozen eval-suite version has measured one, so both stay on their side.

Each rule is a function in `NEAR_DUPLICATE_FINDERS` and applies everywhere the guard runs: promotion, variants,
freezing, and a job's task set against its suites (`rows_conflicts`). Writers take `accounts.services.project_lock` before they
read the other side and hold it until their row is saved, so two promotions of one trajectory to opposite
sides cannot both pass.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from flywheel.accounts.models import Project
from flywheel.evals import rows as row_shape
from flywheel.evals.kinds import train_side

SIDES = ("eval", "train")


@dataclass(frozen=True)
class Candidate:
    """A row about to join one side: where it comes from and what it asks."""

    label: str  # how the conflict list names it: "trajectory #12", "case-4", ...
    trajectory_id: int | None
    prompt_digest: str
    prompt_text: str


@dataclass(frozen=True)
class Conflict:
    rule: str  # "trajectory" | "prompt" | "similar" | a finder's own name
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
    return Candidate(
        label=str(row.get("id")),
        trajectory_id=row_shape.origin_of(row).trajectory_id,
        prompt_digest=row_shape.prompt_digest(row.get("messages")),
        prompt_text=row_shape.last_user_request(row.get("messages")),
    )


# --- what each side holds ----------------------------------------------------------------------------------


def _side_models(side: str) -> tuple[Any, Any, str, str]:
    """(item model, version model, the owner's field name, what the owner is called) of one side."""
    if side == "train":
        return train_side().item, train_side().version, "task_set", "task set"
    from flywheel.evals.models import EvalCase, EvalSuiteVersion

    return EvalCase, EvalSuiteVersion, "suite", "eval suite"


def rows_on_side(*, project: Project, side: str) -> list[Candidate]:
    """Every row on `side` ("eval" or "train"), labelled with where it lives: the current rows, the rows of
    the side's frozen versions that are no longer current, and (training side) the trajectories in the
    lineage of the project's model versions."""
    from flywheel.evals.models import StoredRow

    if side not in SIDES:
        raise ValueError(f"side is one of {SIDES}, not {side!r}")
    item, version_model, owner, where = _side_models(side)
    current = item.objects.filter(**{f"{owner}__project": project}).values_list(
        "pk", "trajectory_id", "prompt_digest", "prompt_text", f"{owner}__name").order_by("pk")
    out = [Candidate(f"{item.ROW_PREFIX}-{pk} in {where} '{name}'", trajectory_id, digest, text)
           for pk, trajectory_id, digest, text, name in current]
    # A frozen row that is still current (same id, origin and request) is listed once, as the current row.
    seen = {(c.label.split(" ", 1)[0], c.trajectory_id, c.prompt_digest) for c in out}
    frozen = version_model.objects.filter(**{f"{owner}__project": project, "frozen_at__isnull": False}).values_list(
        "number", "row_digests", f"{owner}__name").order_by("pk")
    first_seen: dict[str, str] = {}  # stored row digest -> the first frozen version that holds it
    for number, digests, name in frozen:
        for digest in digests or []:
            first_seen.setdefault(digest, f"{where} '{name}' v{number} (frozen)")
    stored = StoredRow.objects.in_bulk(list(first_seen))
    for digest, place in first_seen.items():
        if digest not in stored:
            continue
        c = candidate_from_row(stored[digest].data)
        if (c.label, c.trajectory_id, c.prompt_digest) not in seen:
            seen.add((c.label, c.trajectory_id, c.prompt_digest))
            out.append(Candidate(f"{c.label} of {place}", c.trajectory_id, c.prompt_digest, c.prompt_text))
    if side == "train":
        from flywheel.registry.models import ModelVersion

        listed = {c.trajectory_id for c in out}
        versions = ModelVersion.objects.filter(project=project).values_list("number", "lineage").order_by("number")
        for number, lineage in versions:
            trajectories = lineage.get("trajectories") if isinstance(lineage, dict) else None
            for trajectory_id in trajectories if isinstance(trajectories, list) else []:
                if isinstance(trajectory_id, int) and trajectory_id not in listed:
                    listed.add(trajectory_id)
                    out.append(Candidate(f"trajectory #{trajectory_id} in the lineage of model v{number}",
                                         trajectory_id, "", ""))
    return out


def _opposite(side: str) -> str:
    if side not in SIDES:
        raise ValueError(f"side is one of {SIDES}, not {side!r}")
    return "train" if side == "eval" else "eval"


# --- the rules ---------------------------------------------------------------------------------------------


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


# Tuned on the labeled pairs of tests/platform/evals/test_leakage_similar.py (requests reworded vs different
# requests sharing most words): with the literal check, 0.90 finds 23 of 30 rewordings and wrongly flags 4 of
# 32 different requests (precision 0.85, recall 0.77); the design's 0.95 finds 17 (precision 0.89, recall 0.57).
SIMILAR_COSINE = 0.90
_TOKEN = re.compile(r"[\w@.+:/#-]+")
_TRIM = ".:/#-+"
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_SENTENCE_START = re.compile(r"(?:^|[.!?:;]\s*)$")


def _canonical(token: str) -> str:
    """One spelling per value: "50.00" is "50", "C-17" is "c17"."""
    token = token.lower()
    if _NUMBER.fullmatch(token):
        return token.rstrip("0").rstrip(".") if "." in token else token
    return token.replace("-", "").replace("_", "")


def request_literals(text: str) -> tuple[set[str], set[str]]:
    """(the request's literal values, all its words), canonical. A literal is what a request is about rather
    than how it is put: a token with a digit (an id, an amount, a date), an email or a URL, and a capitalised
    word that does not start a sentence (a name: "Maria", "Berlin")."""
    text = _THOUSANDS.sub("", text)
    literals: set[str] = set()
    words: set[str] = set()
    for match in _TOKEN.finditer(text):
        token = match.group().strip(_TRIM)
        if not token:
            continue
        words.add(_canonical(token))
        if (any(ch.isdigit() for ch in token) or "@" in token or "://" in token
                or (len(token) > 1 and token[0].isupper() and not _SENTENCE_START.search(text[:match.start()]))):
            literals.add(_canonical(token))
    return literals, words


def same_literals(a: str, b: str) -> bool:
    """Each request's literal values appear among the other's words: "C-17" and "C17" agree, "C-17" and
    "C-71" do not, and neither do a request and the same request with an order id added."""
    literals_a, words_a = request_literals(a)
    literals_b, words_b = request_literals(b)
    return literals_a <= words_b and literals_b <= words_a


_vector_cache: OrderedDict[tuple[str, ...], np.ndarray] = OrderedDict()
_vector_lock = threading.Lock()
_VECTOR_CACHE_SIZE = 4  # a bulk promotion compares each draft with one list of other rows: keep its vectors


def _vectors(texts: tuple[str, ...], *, keep: bool = False) -> np.ndarray:
    """Unit-length sentence vectors of `texts`, by the clustering's embedder (the packaged MiniLM, offline);
    `keep`: remember them for the next call with the same texts (the other side, read once for a batch)."""
    with _vector_lock:
        cached = _vector_cache.get(texts)
        if cached is not None:
            _vector_cache.move_to_end(texts)
            return cached
    from flywheel.failures.clustering.embedding import shared_embedder

    vectors = shared_embedder().encode(list(texts))
    if keep:
        with _vector_lock:
            _vector_cache[texts] = vectors
            while len(_vector_cache) > _VECTOR_CACHE_SIZE:
                _vector_cache.popitem(last=False)
    return vectors


def similar_request(candidates: list[Candidate], others: list[Candidate]) -> list[Conflict]:
    """Rows asking the same thing in other words: the requests' sentence embeddings (the clustering model's,
    `flywheel.failures.clustering.embedding`) have a cosine of at least SIMILAR_COSINE, and they name the same
    literal values (`same_literals`).

    The embedding alone cannot tell two requests that differ only in an id or an amount apart: it weighs
    digits and punctuation little, so "Look up customer C-17" and "... C-71" have a cosine of 0.998. Those
    values are what makes them different requests, so they are compared exactly. Word order is not seen
    ("from checking to savings" is "from savings to checking"): in doubt, the guard refuses. Pairs with the
    same normalised request are `same_normalised_request`'s, and not listed twice."""
    candidates = [c for c in candidates if c.prompt_text.strip()]
    others = [o for o in others if o.prompt_text.strip()]
    if not candidates or not others:
        return []
    other_vectors = _vectors(tuple(o.prompt_text for o in others), keep=True)
    conflicts = []
    for start in range(0, len(candidates), 256):  # bounded memory for a version of many rows
        chunk = candidates[start:start + 256]
        cosines = _vectors(tuple(c.prompt_text for c in chunk)) @ other_vectors.T
        for i, j in zip(*np.nonzero(cosines >= SIMILAR_COSINE), strict=True):
            c, o = chunk[i], others[j]
            if c.prompt_digest and c.prompt_digest == o.prompt_digest:
                continue
            if same_literals(c.prompt_text, o.prompt_text):
                conflicts.append(Conflict(
                    "similar", c.label, o.label,
                    f"reworded request of a row on the other side (cosine {cosines[i, j]:.2f}, the same ids and "
                    f"values): {c.prompt_text[:120]!r} ~ {o.prompt_text[:120]!r}"))
    return conflicts


# (rows joining one side, rows of the other side) -> conflicts. Each rule decides what "the same" means.
NEAR_DUPLICATE_FINDERS: list[Callable[[list[Candidate], list[Candidate]], list[Conflict]]] = [
    same_trajectory, same_normalised_request, similar_request,
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
    """The rows a row joining `side` is compared with (`rows_on_side` of the opposite side); read once for
    a batch (bulk promotion, variants), under `accounts.services.project_lock`."""
    return rows_on_side(project=project, side=_opposite(side))


def leakage_conflicts(*, project: Project, side: str, candidates: Iterable[Candidate],
                      others: list[Candidate] | None = None) -> list[Conflict]:
    """Every conflict of rows about to join `side` ("eval" or "train") with the project's other side
    (`others`, when the caller already read it with `other_side`)."""
    candidates = list(candidates)
    if not candidates:
        return []
    return conflicts_between(candidates, other_side(project=project, side=side) if others is None else others)


def leakage_check(*, project: Project, side: str, candidates: Iterable[Candidate]) -> None:
    """Raise LeakageError listing every conflict, if there is any."""
    conflicts = leakage_conflicts(project=project, side=side, candidates=candidates)
    if conflicts:
        raise LeakageError(conflicts)
