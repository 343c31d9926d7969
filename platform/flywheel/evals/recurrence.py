"""Failure modes and the versions that fix them: a promotion marks fixed the modes whose eval cases the new
production passes, a sweep watches each fixed mode in production's traffic and reopens it when its signature
returns (the rules: flywheel.failures.recurrence), with a notification, and a mode's page shows its rate per
version beside its eval cases' pass rates.

It lives in evals, above registry and failures (it reads all three): the registry tells it of a production
move through `registry.signals.production_moved`, and the failures app, which imports neither, asks for the
production version through `production_version_asked` (both connected in EvalsConfig.ready) and loads the
per-version part of its page from this app's fragment."""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Sum

from flywheel import outbox
from flywheel.accounts.models import Project
from flywheel.evals.run_models import EvalCaseResult, EvalRun, EvalRunStatus
from flywheel.failures import recurrence
from flywheel.failures.models import FailureMode, FailureModeStatus
from flywheel.registry import live
from flywheel.registry import selectors as registry_selectors
from flywheel.registry.models import (
    Alias,
    AliasEvent,
    AliasEventKind,
    LiveRollup,
    ModelVersion,
)

logger = logging.getLogger(__name__)

SWEEP_LIMIT = 500  # fixed modes handed to workers per sweep


def production_number(*, project: Project) -> int | None:
    version = registry_selectors.production_of(project=project)
    return version.number if version is not None else None


def answer_production(sender: Any, *, project: Project, **kwargs: Any) -> int | None:
    """The receiver of `failures.recurrence.production_version_asked` (connected in RegistryConfig.ready)."""
    return production_number(project=project)


# --- the promotion hook ----------------------------------------------------------------------------------


def newest_runs(*, version: ModelVersion) -> list[EvalRun]:
    """The version's newest finished run on each suite: its current measurement there (a gate's measurement of
    a candidate is one, recorded from the job's files)."""
    newest: dict[int, EvalRun] = {}
    runs = (EvalRun.objects.filter(model_version=version, status=EvalRunStatus.SUCCEEDED)
            .select_related("suite_version").order_by("-finished_at", "-id"))
    for run in runs:
        newest.setdefault(run.suite_version.suite_id, run)
    return list(newest.values())


def mode_case_results(*, version: ModelVersion) -> dict[int, list[EvalCaseResult]]:
    """The version's results on the cases promoted from each failure mode, by mode id."""
    by_mode: dict[int, list[EvalCaseResult]] = defaultdict(list)
    rows = EvalCaseResult.objects.filter(run__in=newest_runs(version=version), failure_mode_id__isnull=False)
    for row in rows:
        by_mode[row.failure_mode_id].append(row)
    return by_mode


def after_production_move(sender: Any = None, *, event: AliasEvent, **kwargs: Any) -> list[FailureMode]:
    """A promotion to production fixes the modes whose eval cases the new production passes, every one of
    them (as its run judged each case over its samples); the receiver of `production_moved`, sent by
    `services.model_promote` in its transaction. A rollback fixes nothing. Returns the modes marked fixed."""
    if event.alias != Alias.PRODUCTION or event.kind != AliasEventKind.PROMOTE or event.to_version_id is None:
        return []
    version = event.to_version
    results = mode_case_results(version=version)
    if not results:
        return []
    fixed = []
    modes = FailureMode.objects.select_for_update().filter(project_id=event.project_id, pk__in=list(results)).exclude(
        status=FailureModeStatus.FIXED)
    for mode in modes.order_by("pk"):
        cases = results[mode.pk]
        if not all(c.passed for c in cases):
            continue
        evidence = {"event": event.pk, "cases": len(cases),
                    "pass_rate": round(sum(c.pass_rate for c in cases) / len(cases), 4),
                    "case_ids": sorted(c.case_id for c in cases)[:50]}
        recurrence.failure_mode_fixed_set(failure_mode=mode, version_number=version.number, by="promotion",
                                          evidence=evidence)
        fixed.append(mode)
    return fixed


# --- the watch -------------------------------------------------------------------------------------------


def recurrence_sweep() -> int:
    """The sweep (outbox.SWEEPS): hand each fixed mode to a worker for a scan. Cheap: one indexed query."""
    from flywheel.evals.tasks import recurrence_check_task

    sent = 0
    for pk in recurrence.fixed_modes_to_watch().order_by("pk").values_list("pk", flat=True)[:SWEEP_LIMIT]:
        try:
            outbox.send(recurrence_check_task, pk)
        except outbox.BrokerUnavailable:
            break
        sent += 1
    return sent


def recurrence_check(*, mode_id: int, embedder: Any = None, now: datetime | None = None) -> str:
    """Scan one fixed mode's new production traffic; reopen it and notify when it came back. Answers the
    mode's status after it. Two workers on one mode: the second finds the row locked and leaves it."""
    if embedder is None:
        from flywheel.failures.clustering.embedding import shared_embedder

        embedder = shared_embedder()
    with transaction.atomic():
        mode = (FailureMode.objects.select_for_update(skip_locked=True).select_related("project")
                .filter(pk=mode_id).first())
        if mode is None:  # another worker holds it, or it was deleted
            return "busy" if FailureMode.objects.filter(pk=mode_id).exists() else "gone"
        if mode.status != FailureModeStatus.FIXED:
            return mode.status
        scan = recurrence.recurrence_scan(failure_mode=mode, embedder=embedder, now=now)
        if not scan.reopen:
            return mode.status
        recurrence.failure_mode_reopen(failure_mode=mode, evidence=scan.evidence, at=now)
        _announce(mode, scan.evidence)
    return mode.status


def _announce(mode: FailureMode, evidence: dict[str, Any]) -> None:
    from flywheel.registry.notify import notify

    fixed_by = f" (fixed by v{mode.fixed_version_number})" if mode.fixed_version_number else ""
    notify(
        project=mode.project, event_type="failure_mode.reopened",
        subject=f"Failure mode reopened: {mode.name}"[:200],
        text=f"«{mode.name}»{fixed_by} is back in production: {evidence.get('reason', '')}.",
        payload={"failure_mode": {"id": mode.pk, "name": mode.name, "fixed_at": evidence.get("fixed_at"),
                                  "fixed_version_number": mode.fixed_version_number,
                                  "reopened_at": mode.reopened_at.isoformat() if mode.reopened_at else None},
                 "recurrence": {k: evidence.get(k) for k in ("rules", "reason", "similarity", "signal",
                                                             "trajectory_ids")}},
    )


# --- the mode's rate per version -------------------------------------------------------------------------


@dataclass(frozen=True)
class VersionRate:
    """One version's traffic and how much of it shows the mode, beside its eval cases' results."""

    number: int | None  # None: strings mapped to no version
    names: tuple[str, ...]  # the model_version strings counted
    trajectories: int
    failures: int
    matching: int
    cases: int  # eval cases of the mode it was measured on (newest run per suite)
    cases_passed: int
    pass_rate: float | None  # mean over those cases of their pass rate over samples
    fixed_here: bool

    @property
    def share_of_failures(self) -> float | None:
        return self.matching / self.failures if self.failures else None

    @property
    def share_of_trajectories(self) -> float | None:
        return self.matching / self.trajectories if self.trajectories else None


def _traffic(*, project: Project, names: list[str]) -> dict[str, tuple[int, int]]:
    """Trajectories and failures per model_version string, from the live rollups (no scan of trajectories)."""
    rows = (LiveRollup.objects.filter(project=project, model_version__in=names).values("model_version")
            .annotate(t=Sum("trajectories"), f=Sum("failures")).order_by())
    return {r["model_version"]: (r["t"] or 0, r["f"] or 0) for r in rows}


def mode_version_rates(*, failure_mode: FailureMode) -> list[VersionRate]:
    """Per version, the share of its production traffic that matches the mode (members and recurrence
    matches, by the model_version they carry; denominators from the live rollups) and its results on the
    mode's eval cases: "v5 fixed it" measured on real traffic beside the eval cases. Newest version first."""
    project = failure_mode.project
    matching = recurrence.matching_counts_by_model_version(failure_mode=failure_mode)
    traffic_names = list(LiveRollup.objects.filter(project=project).values_list("model_version", flat=True).distinct()[:500])
    names = sorted(set(matching) | set(traffic_names))
    known = live.name_map(project=project)  # one way to read a model_version string (flywheel.registry.live)
    mapped = {name: known[name].number for name in names if name in known}
    traffic = _traffic(project=project, names=names)
    grouped: dict[int | None, list[str]] = defaultdict(list)
    for name in names:
        grouped[mapped.get(name)].append(name)
    cases: dict[int, list[EvalCaseResult]] = defaultdict(list)
    runs = EvalRun.objects.filter(project=project, status=EvalRunStatus.SUCCEEDED).select_related("model_version")
    newest: dict[tuple[int, int], int] = {}
    for run_id, number, suite_id in runs.order_by("finished_at", "id").values_list(
            "id", "model_version__number", "suite_version__suite_id"):
        newest[(number, suite_id)] = run_id
    run_version = {run_id: number for (number, _), run_id in newest.items()}
    for row in EvalCaseResult.objects.filter(run_id__in=list(run_version), failure_mode_id=failure_mode.pk):
        cases[run_version[row.run_id]].append(row)
    numbers = sorted({n for n in grouped if n is not None} | set(cases), reverse=True)
    out = []
    for number in [*numbers, None]:
        strings = grouped.get(number, [])
        if number is None and not strings:
            continue
        results = cases.get(number, []) if number is not None else []
        out.append(VersionRate(
            number=number, names=tuple(strings),
            trajectories=sum(traffic.get(s, (0, 0))[0] for s in strings),
            failures=sum(traffic.get(s, (0, 0))[1] for s in strings),
            matching=sum(matching.get(s, 0) for s in strings),
            cases=len(results), cases_passed=sum(1 for r in results if r.passed),
            pass_rate=sum(r.pass_rate for r in results) / len(results) if results else None,
            fixed_here=number is not None and number == failure_mode.fixed_version_number,
        ))
    return out
