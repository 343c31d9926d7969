"""The leakage guard: what a model is measured on never trains it.

Rules, checked when a row is added (promotion, variants) and again when a version is frozen:
- a trajectory behind an eval case never becomes a training task, and one behind a task never becomes an
  eval case (variants carry their parent's trajectory, so they inherit this);
- a row whose prompt is a near duplicate of a row on the other side is refused: the same normalised last user
  request (`rows.prompt_digest`), or the same request reworded (`similar_request`); where the guard is unsure
  that two requests are one, a person decides (promotion asks for a reason and records it);
- the other side is what it holds now and what it ever held in a frozen version: a removed task that fed a
  frozen task-set version (or that a model version lists in its lineage, production included) has trained a
  model, and a removed case of a frozen eval-suite version has measured one, so both stay on their side.

Each rule is a function in `NEAR_DUPLICATE_FINDERS` and applies everywhere the guard runs: promotion, variants,
freezing, and a job's task set against its suites (`rows_conflicts`). Writers take `accounts.services.project_lock` before they
read the other side and hold it until their row is saved, so two promotions of one trajectory to opposite
sides cannot both pass.
"""

from __future__ import annotations

import hashlib
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
    rule: str  # "trajectory" | "prompt" | "similar" | "unsure" | a finder's own name
    candidate: str
    other: str  # "task-7 in task set 'Refunds'"
    detail: str
    # The guard is unsure: a person may let the row in by stating why the two are different requests.
    confirmable: bool = False

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


_vector_cache: OrderedDict[str, np.ndarray] = OrderedDict()
_vector_lock = threading.Lock()
_VECTOR_CACHE_SIZE = 20_000  # requests (1.5 KB each): a project's two sides, kept between checks
DIM = 384


def _vectors(texts: tuple[str, ...]) -> np.ndarray:
    """Unit-length sentence vectors of `texts` by the whole sentence model (the packaged MiniLM, offline,
    loaded once per process: `embedding.shared_model`). A request is run through the model once: its vector
    is kept in the database (`RequestVector`) and, for the process, in memory."""
    if not texts:
        return np.zeros((0, DIM), dtype=np.float32)
    with _vector_lock:
        known = {t: _vector_cache[t] for t in set(texts) if t in _vector_cache}
        for text in known:
            _vector_cache.move_to_end(text)
    missing = set(texts) - known.keys()
    if missing:
        found = _stored_vectors(missing)
        made = {}
        if missing - found.keys():
            from flywheel.failures.clustering.embedding import shared_model

            todo = sorted(missing - found.keys())
            made = dict(zip(todo, shared_model().encode(todo), strict=True))
            _store_vectors(made)
        known |= found | made
        with _vector_lock:
            _vector_cache.update(found | made)
            while len(_vector_cache) > _VECTOR_CACHE_SIZE:
                _vector_cache.popitem(last=False)
    return np.stack([known[t] for t in texts])


def _vector_key(text: str) -> str:
    from flywheel.failures.clustering.embedding import whole_model_name

    return hashlib.sha256(f"{whole_model_name()}\n{text}".encode()).hexdigest()


def _stored_vectors(texts: set[str]) -> dict[str, np.ndarray]:
    from flywheel.evals.models import RequestVector

    keys = {_vector_key(t): t for t in texts}
    out = {}
    for start in range(0, len(keys), 900):  # SQLite allows 999 parameters a query
        chunk = list(keys)[start:start + 900]
        for digest, vector in RequestVector.objects.filter(digest__in=chunk).values_list("digest", "vector"):
            out[keys[digest]] = np.frombuffer(bytes(vector), dtype=np.float32)
    return out


def _store_vectors(vectors: dict[str, np.ndarray]) -> None:
    from flywheel.evals.models import RequestVector

    RequestVector.objects.bulk_create(
        [RequestVector(digest=_vector_key(t), vector=v.astype(np.float32).tobytes()) for t, v in vectors.items()],
        ignore_conflicts=True, batch_size=500)


def request_vectors_fill(*, projects: Iterable[Project] | None = None, batch: int = 256) -> int:
    """Run the model over every request on either side of `projects` (all by default) whose vector is not
    kept yet: rows that came in before the guard kept vectors would otherwise be run through the model by
    the next check, in a reviewer's request (minutes for thousands of rows). Returns how many were run."""
    texts = sorted({c.prompt_text for project in (projects if projects is not None else Project.objects.all())
                    for side in SIDES for c in rows_on_side(project=project, side=side) if c.prompt_text.strip()})
    missing = sorted(set(texts) - _stored_vectors(set(texts)).keys())
    for start in range(0, len(missing), batch):
        _vectors(tuple(missing[start:start + batch]))
    return len(missing)


def similar_request(candidates: list[Candidate], others: list[Candidate]) -> list[Conflict]:
    """Rows asking the same thing in other words, as `flywheel.evals.rewording.judge` decides from the requests'
    words (literal values, action, direction, what they ask for) and the cosine of their whole-model sentence
    vectors. A pair it is unsure of is an "unsure" conflict: a person confirms it is no leak, with a reason
    (`Conflict.confirmable`), or the row stays out.

    Measured on the hand-written pairs of tests/platform/evals/data/leakage_pairs.jsonl (132 requests
    reworded as people word them, 181 different requests that share most words or the same literal values:
    another id, amount, date or name, the opposite action, another object, another action, the other
    direction, another question about the same thing), over workplace, support, travel, banking, IT, HR and
    household requests, in English, one or two sentences, with Wilson 95% intervals:
    - reworded requests refused 124/132 = 0.94 (0.89-0.97); refused or put to a person 0.96 (0.91-0.98);
    - different requests refused 10/181 = 0.055 (0.030-0.099); put to a person 0.050 (0.026-0.092);
    - on the held-out half alone (the threshold was chosen on the other): 0.92 (0.83-0.97) and 0.067
      (0.031-0.139). The distilled embedding at 0.90 that this replaces: 0.12 and 0.18 on the same pairs.
    `bench/leakage.py` prints every figure and the cost. Outside these conditions the figures are not known:
    long multi-part requests (the model reads 256 tokens, and one changed word barely moves a long
    request's vector), other languages, synonyms the model does not know ("PTO" for "vacation days"), and
    two requests that differ only in a lowercase name ("alice" / "bob"), which only the model tells apart.

    Cost: the model runs once per request ever (`_vectors` keeps the vector); a check against 2,000 stored
    rows takes about 1.5 s on two busy cores, and the first check of a process loads the model (~10 s).

    Pairs with the same normalised request are `same_normalised_request`'s, and not listed twice."""
    from flywheel.evals import rewording

    candidates = [c for c in candidates if c.prompt_text.strip()]
    others = [o for o in others if o.prompt_text.strip()]
    if not candidates or not others:
        return []
    other_vectors = _vectors(tuple(o.prompt_text for o in others))
    floor = min(rewording.REWORDED_COSINE, rewording.OBJECT_COSINE) - rewording.UNSURE_BAND
    conflicts = []
    for start in range(0, len(candidates), 256):  # bounded memory for a version of many rows
        chunk = candidates[start:start + 256]
        cosines = _vectors(tuple(c.prompt_text for c in chunk)) @ other_vectors.T
        for i, j in zip(*np.nonzero(cosines >= floor), strict=True):
            c, o = chunk[i], others[j]
            if c.prompt_digest and c.prompt_digest == o.prompt_digest:
                continue
            judgement = rewording.judge(rewording.facts(c.prompt_text), rewording.facts(o.prompt_text),
                                        float(cosines[i, j]))
            pair = f"{c.prompt_text[:120]!r} ~ {o.prompt_text[:120]!r}"
            if judgement.verdict == rewording.SAME:
                conflicts.append(Conflict("similar", c.label, o.label, f"reworded request of a row on the other "
                                                                       f"side ({judgement.reason}): {pair}"))
            elif judgement.verdict == rewording.UNSURE:
                conflicts.append(Conflict("unsure", c.label, o.label, f"perhaps a reworded request of a row on the "
                                                                      f"other side ({judgement.reason}): {pair}",
                                          confirmable=True))
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


def certain(conflicts: Iterable[Conflict]) -> list[Conflict]:
    """The conflicts no person can wave through. Where the rows were let in one by one (promotion asked a
    person about every unsure pair; variants and bulk promotion refuse them), a pair the guard is unsure
    of was decided then, and freezing or a job's start checks again only these."""
    return [c for c in conflicts if not c.confirmable]


def leakage_check(*, project: Project, side: str, candidates: Iterable[Candidate]) -> None:
    """Raise LeakageError listing every conflict that is certain (`certain`), if there is any."""
    conflicts = certain(leakage_conflicts(project=project, side=side, candidates=candidates))
    if conflicts:
        raise LeakageError(conflicts)
