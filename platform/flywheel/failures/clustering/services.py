"""Clustering runs and reviewers' decisions on their suggestions: one function per domain action, called by
the page, the API, the task and the tests alike. Permission checks live in the views and the API.

A run (`clustering_run_start`) is queued after its commit (flywheel.outbox) and processed on a worker
(`clustering_run_process`): read the chosen failures and their triage signals, make each one's signature,
embed them, cluster them with HDBSCAN together with a sample of each existing mode's members (failures that
fall in with a mode's members are suggested for that mode), drop the groups a reviewer dismissed before, and
save the suggestions, writing its stage and progress as it goes. A failure is recorded on the run with the stage it happened in; a retry runs it again
from the stored filter and replaces whatever suggestions it had saved."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import numpy as np
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from flywheel import fields, outbox, runs, timelimits
from flywheel.accounts.models import Project
from flywheel.failures.clustering import engine, naming
from flywheel.failures.clustering.models import (
    ClusteringRun,
    ClusterSuggestion,
    Decision,
    DismissedGroup,
    RunStage,
    RunStatus,
)
from flywheel.failures.models import FailureMode, FailureModeAssignment
from flywheel.failures.services import failure_mode_assign, failure_mode_create
from flywheel.supervise import Refused
from flywheel.trajectories.models import FailureCategory, Outcome, SignalKind, Trajectory, TriageSignal

logger = logging.getLogger(__name__)

# A run's cost grows with its failures through reading and embedding them (HDBSCAN sees a sample: engine.SAMPLE).
MAX_FAILURES = 100_000
CHUNK = 1000  # trajectories read per query, and the progress step
EXAMPLE_CHARS = 160  # of each part of a representative shown on the page
MODE_SAMPLE = 200  # members of an existing mode read to know where it sits


class ClusteringRefused(Refused):
    """The action cannot be taken now (a run is already on its way, a decision was already made)."""


# --- the chosen set --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunFilter:
    """Which failures a run clusters. Defaults: failed, assigned to no mode, from the last 30 days, the newest
    100,000."""

    days: int = 30
    limit: int = MAX_FAILURES
    outcome: str = Outcome.FAILURE  # "" for any outcome
    unassigned: bool = True
    agent: str = ""
    signal: str = ""  # only failures with this signal kind

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_filter_parse(data: dict[str, Any] | None) -> RunFilter:
    """A RunFilter from a form or a JSON body; ValidationError naming each bad field."""
    data = dict(data or {})
    errors: dict[str, str] = {}
    unknown = sorted(set(data) - set(RunFilter.__dataclass_fields__))
    if unknown:
        errors["filter"] = f"Unknown field(s): {', '.join(map(str, unknown))[:200]}."

    days = fields.whole(data, "days", errors, low=1, high=3650, default=30, label="days")
    limit = fields.whole(data, "limit", errors, low=2, high=MAX_FAILURES, default=MAX_FAILURES, label="limit")
    outcome = str(data.get("outcome", Outcome.FAILURE) or "")
    if outcome and outcome not in Outcome.values:
        errors["outcome"] = f"outcome must be one of {', '.join(Outcome.values)} or empty; not {outcome[:40]!r}."
    unassigned = fields.flag(data, "unassigned", errors, default=True, label="unassigned")
    signal = str(data.get("signal", "") or "")
    if signal and signal not in SignalKind.values:
        errors["signal"] = f"signal must be one of {', '.join(SignalKind.values)} or empty; not {signal[:40]!r}."
    agent = str(data.get("agent", "") or "")
    if len(agent) > 200:
        errors["agent"] = "agent is at most 200 characters."
    if errors:
        raise ValidationError(errors)
    return RunFilter(days=days, limit=limit, outcome=outcome, unassigned=bool(unassigned), agent=agent, signal=signal)


def failures_selected(*, project: Project, run_filter: RunFilter) -> QuerySet[Trajectory]:
    """The failures a run with `run_filter` clusters, newest first (not yet cut at its limit)."""
    qs = Trajectory.objects.filter(project=project)
    if run_filter.outcome:
        # The reviewer's outcome wins over the agent's.
        qs = qs.filter(Q(reviewed_outcome=run_filter.outcome) | Q(reviewed_outcome="", outcome=run_filter.outcome))
    since = timezone.now() - timedelta(days=run_filter.days)
    qs = qs.filter(Q(started_at__gte=since) | Q(started_at__isnull=True, created_at__gte=since))
    if run_filter.unassigned:
        qs = qs.filter(~Exists(FailureModeAssignment.objects.filter(trajectory=OuterRef("pk"))))
    if run_filter.agent:
        qs = qs.filter(agent=run_filter.agent)
    if run_filter.signal:
        qs = qs.filter(Exists(TriageSignal.objects.filter(trajectory=OuterRef("pk"), kind=run_filter.signal)))
    return qs.order_by("-id")


# --- starting, retrying, the sweep -----------------------------------------------------------------------


def _queue(run: ClusteringRun) -> None:
    from flywheel.failures.clustering.tasks import clustering_run_task  # tasks import this module

    outbox.send_on_commit(clustering_run_task, run.pk)


def clustering_run_start(
    *,
    project: Project,
    user: AbstractBaseUser | None,
    run_filter: RunFilter | None = None,
    parent: ClusterSuggestion | None = None,
) -> ClusteringRun:
    """Queue a clustering of the project's failures chosen by `run_filter` (or, for a split, of `parent`'s
    members). One run at a time per project: ClusteringRefused while one is queued or running."""
    run_filter = run_filter or RunFilter()
    try:
        with transaction.atomic():
            run = ClusteringRun.objects.create(
                project=project,
                created_by=user,
                filter=run_filter.as_dict(),
                parent=parent,
                queued_at=timezone.now(),
            )
            _queue(run)
    except IntegrityError:
        raise ClusteringRefused("A clustering of this project is already on its way; wait for it to finish.") from None
    return run


def clustering_run_retry(*, run: ClusteringRun) -> ClusteringRun:
    """Queue a failed run again, from its stored filter."""
    from flywheel.failures.clustering.tasks import clustering_run_task  # tasks import this module

    return runs.run_retry(run, task=clustering_run_task)


def clustering_sweep() -> int:
    """Send again the runs that wait too long (flywheel.outbox): queued past FLYWHEEL_REQUEUE_AFTER_S, or
    running with a worker that stopped writing (which fails once it has lost LOST_WORKER_ATTEMPTS workers).
    Returns how many were sent."""
    from flywheel.failures.clustering.tasks import clustering_run_task

    return runs.run_sweep(ClusteringRun, task=clustering_run_task)


# --- the work --------------------------------------------------------------------------------------------


def _progress(run_id: int, **fields: Any) -> None:
    ClusteringRun.objects.filter(pk=run_id).update(heartbeat_at=timezone.now(), **fields)


@dataclass
class _Failures:
    ids: list[int]
    signatures: list[engine.Signature]
    categories: list[str]


def _read(ids: list[int], on_chunk: Any = None) -> _Failures:
    """Signatures of trajectories `ids` (in that order), CHUNK at a time."""
    out = _Failures(ids=[], signatures=[], categories=[])
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        signals: dict[int, list[dict[str, Any]]] = {}
        rows = TriageSignal.objects.filter(trajectory_id__in=chunk).values_list(
            "trajectory_id", "kind", "message_index", "detail"
        )
        for trajectory_id, kind, message_index, detail in rows:
            signals.setdefault(trajectory_id, []).append({"kind": kind, "message_index": message_index, "detail": detail})
        found = dict(
            (row[0], row[1:])
            for row in Trajectory.objects.filter(id__in=chunk).values_list("id", "messages", "suggested_category")
        )
        for trajectory_id in chunk:
            if trajectory_id not in found:
                continue  # deleted meanwhile
            messages, category = found[trajectory_id]
            out.ids.append(trajectory_id)
            out.signatures.append(engine.signature(messages, signals.get(trajectory_id, [])))
            out.categories.append(category)
        if on_chunk:
            on_chunk(len(out.ids))
    return out


def _example(trajectory_id: int, signature: engine.Signature) -> dict[str, Any]:
    def cut(text: str) -> str:
        text = " ".join(text.split())
        return text if len(text) <= EXAMPLE_CHARS else text[: EXAMPLE_CHARS - 1] + "…"

    return {"id": trajectory_id, "request": cut(signature.request), "step": cut(signature.step), "result": cut(signature.result)}


def _usual_category(categories: list[str]) -> str:
    counted = Counter(c for c in categories if c)
    return counted.most_common(1)[0][0] if counted else FailureCategory.OTHER


def clustering_run_process(*, run_id: int, embedder: engine.Embedder | None = None) -> ClusteringRun | None:
    """Run a queued clustering to its end, writing its stage and progress. A run that is not queued (a
    duplicate message, or one running elsewhere) is left alone. A failure is recorded on the run, for the page."""
    claimed = runs.run_claim(ClusteringRun, run_id, done=0)
    run = ClusteringRun.objects.select_related("project", "parent").filter(pk=run_id).first()
    if not claimed or run is None:
        return run
    stage = RunStage.LOADING
    try:
        _progress(run_id, stage=stage)
        project = run.project
        if run.parent is not None:
            ids = list(
                Trajectory.objects.filter(project=project, id__in=run.parent.trajectory_ids).order_by("-id").values_list("id", flat=True)
            )
        else:
            run_filter = run_filter_parse(run.filter)
            ids = list(failures_selected(project=project, run_filter=run_filter).values_list("id", flat=True)[: run_filter.limit])
        _progress(run_id, total=len(ids))
        failures = _read(ids, lambda n: _progress(run_id, done=n))

        # Where existing modes sit: a sample of each one's members, read and embedded in this run's space.
        mode_members: dict[int, list[int]] = {}
        if run.parent is None:
            for mode_id in FailureMode.objects.filter(project=project).values_list("id", flat=True):
                # Its newest members: one index range each (assignment_mode_traj).
                newest = FailureModeAssignment.objects.filter(failure_mode_id=mode_id).order_by("-trajectory_id")
                members = list(newest.values_list("trajectory_id", flat=True)[:MODE_SAMPLE])
                if members:
                    mode_members[mode_id] = members
        mode_ids = sorted({t for members in mode_members.values() for t in members})
        known = _read(mode_ids)

        stage = RunStage.EMBEDDING
        _progress(run_id, stage=stage, done=0)
        if embedder is None:
            from flywheel.failures.clustering.embedding import shared_embedder

            embedder = shared_embedder()
        vectors = np.zeros((0, 1), dtype=np.float32)
        parts = []
        for start in range(0, len(failures.signatures), 5 * CHUNK):
            parts.append(engine.features(failures.signatures[start : start + 5 * CHUNK], embedder))
            _progress(run_id, done=start + len(parts[-1]))
        if parts:
            vectors = np.vstack(parts)
        known_vectors = engine.features(known.signatures, embedder) if known.signatures else None
        _progress(run_id, embedder=embedder.name[:64])

        stage = RunStage.CLUSTERING
        _progress(run_id, stage=stage, done=0)
        modes: dict[int, np.ndarray] = {}
        if known_vectors is not None:
            row_of = {t: i for i, t in enumerate(known.ids)}
            modes = {m: known_vectors[[row_of[t] for t in members if t in row_of]] for m, members in mode_members.items()}
        labels, attached = engine.cluster_with_modes(vectors, modes) if len(vectors) else (np.zeros(0, dtype=np.int64), {})
        clusters = engine.describe(failures.signatures, vectors, np.where(labels >= 0, labels, -1))
        dismissed = [
            engine.DismissedGroup(
                centroid=np.asarray(g.centroid, dtype=np.float32) if g.centroid and g.embedder == embedder.name else None,
                members=frozenset(g.trajectory_ids),
            )
            for g in DismissedGroup.objects.filter(project=project)
        ]

        stage = RunStage.SAVING
        _progress(run_id, stage=stage, done=0)
        suggestions: list[ClusterSuggestion] = []
        skipped = 0

        def suggestion(group: engine.Cluster, target: FailureMode | None = None) -> ClusterSuggestion:
            members = [failures.ids[i] for i in group.members]
            label = f"Like «{target.name}» · {group.label}"[:200] if target is not None else group.label
            return ClusterSuggestion(
                run=run,
                project=project,
                size=len(members),
                label=label,
                terms=group.terms,
                tool=group.tool[:80],
                signal=group.signal[:32],
                suggested_category=_usual_category([failures.categories[i] for i in group.members]),
                trajectory_ids=members,
                representative_ids=[failures.ids[i] for i in group.representatives],
                examples=[_example(failures.ids[i], failures.signatures[i]) for i in group.representatives],
                signals=group.signals,
                centroid=[round(float(x), 5) for x in group.centroid],
                target_mode=target,
            )

        targets = FailureMode.objects.in_bulk(list(attached))
        for mode_id, rows in attached.items():
            one = np.full(len(failures.ids), -1, dtype=np.int64)
            one[rows] = 0
            (group,) = engine.describe(failures.signatures, vectors, one)
            suggestions.append(suggestion(group, targets[mode_id]))
        for group in clusters:
            if engine.matches_dismissed(group.centroid, [failures.ids[i] for i in group.members], dismissed):
                skipped += 1
                continue
            item = suggestion(group)
            name = naming.cluster_name(label=item.label, examples=item.examples)
            if name:
                item.label = name[:200]
            suggestions.append(item)
        with transaction.atomic():
            # A retry replaces what an earlier attempt saved.
            ClusterSuggestion.objects.filter(run_id=run_id, decision=Decision.PENDING).delete()
            for position, item in enumerate(suggestions):
                item.position = position
            ClusterSuggestion.objects.bulk_create(suggestions, batch_size=500)
            ClusteringRun.objects.filter(pk=run_id, status=RunStatus.RUNNING).update(
                status=RunStatus.DONE,
                stage=RunStage.DONE,
                done=len(failures.ids),
                total=len(failures.ids),
                clusters=sum(1 for s in suggestions if s.target_mode is None),
                attached=sum(s.size for s in suggestions if s.target_mode is not None),
                noise=int((labels == -1).sum()),
                skipped_dismissed=skipped,
                finished_at=timezone.now(),
                heartbeat_at=timezone.now(),
            )
    except Exception as exc:
        logger.exception("clustering run %s failed while %s", run_id, stage)
        ClusteringRun.objects.filter(pk=run_id).update(
            status=RunStatus.FAILED,
            finished_at=timezone.now(),
            error=f"Failed while {RunStage(stage).label.lower()}: {timelimits.stopped_reason(exc)}"[:2000],
        )
    return ClusteringRun.objects.get(pk=run_id)


# --- decisions -------------------------------------------------------------------------------------------


def _pending(suggestion: ClusterSuggestion) -> None:
    if suggestion.decision != Decision.PENDING:
        raise ClusteringRefused(f"This suggestion was already decided ({suggestion.get_decision_display().lower()}).")


def _decide(suggestion: ClusterSuggestion, *, decision: str, user: AbstractBaseUser | None, mode: FailureMode | None = None) -> None:
    """Record the decision, once: of two reviewers deciding at once, the second is refused."""
    updated = ClusterSuggestion.objects.filter(pk=suggestion.pk, decision=Decision.PENDING).update(
        decision=decision, decided_by=user, decided_at=timezone.now(), failure_mode=mode
    )
    if not updated:
        raise ClusteringRefused("This suggestion was already decided.")
    suggestion.refresh_from_db()


def suggestion_accept(
    *,
    suggestion: ClusterSuggestion,
    user: AbstractBaseUser | None,
    name: str = "",
    category_key: str = "",
    description: str = "",
) -> FailureMode:
    """Accept the suggestion as a new failure mode (named after its label unless `name` is given, in its
    members' usual category unless `category_key` is) and assign its members to it. A suggestion attached
    to an existing mode is merged into that mode instead."""
    _pending(suggestion)
    if suggestion.target_mode_id is not None and not name:
        suggestion_merge(suggestion=suggestion, failure_mode=suggestion.target_mode, user=user)
        return suggestion.target_mode
    with transaction.atomic():
        mode = failure_mode_create(
            project=suggestion.project,
            name=(name or suggestion.label).strip(),
            category_key=category_key or suggestion.suggested_category or FailureCategory.OTHER,
            description=description or f"From a clustering suggestion: {suggestion.label}",
            user=user,
        )
        failure_mode_assign(failure_mode=mode, trajectories=suggestion.trajectory_ids, user=user)
        _decide(suggestion, decision=Decision.ACCEPTED, user=user, mode=mode)
    return mode


def suggestion_merge(*, suggestion: ClusterSuggestion, failure_mode: FailureMode, user: AbstractBaseUser | None) -> int:
    """Assign the suggestion's members to an existing mode of the same project; how many were new to it."""
    _pending(suggestion)
    if failure_mode.project_id != suggestion.project_id:
        raise ValidationError({"failure_mode": "That failure mode belongs to another project."})
    with transaction.atomic():
        added = failure_mode_assign(failure_mode=failure_mode, trajectories=suggestion.trajectory_ids, user=user)
        _decide(suggestion, decision=Decision.MERGED, user=user, mode=failure_mode)
    return added


def suggestion_split(*, suggestion: ClusterSuggestion, user: AbstractBaseUser | None) -> ClusteringRun:
    """Cluster the suggestion's members again, on their own (a run of its own, with its own suggestions)."""
    _pending(suggestion)
    if suggestion.size < 2 * engine.min_cluster_size_for(suggestion.size):
        raise ClusteringRefused(f"{suggestion.size} failures are too few to split.")
    with transaction.atomic():
        _decide(suggestion, decision=Decision.SPLIT, user=user)
        return clustering_run_start(project=suggestion.project, user=user, parent=suggestion)


def suggestion_dismiss(*, suggestion: ClusterSuggestion, user: AbstractBaseUser | None) -> DismissedGroup:
    """Dismiss the suggestion: it is remembered, and later runs do not suggest the same group again."""
    _pending(suggestion)
    with transaction.atomic():
        _decide(suggestion, decision=Decision.DISMISSED, user=user)
        return DismissedGroup.objects.create(
            project_id=suggestion.project_id,
            suggestion=suggestion,
            label=suggestion.label,
            embedder=suggestion.run.embedder,
            centroid=suggestion.centroid,
            trajectory_ids=suggestion.trajectory_ids,
            dismissed_by=user,
        )
