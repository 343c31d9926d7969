"""Reads for the flywheel dashboard: how far a project's trajectories travel round the loop (the funnel),
where a model version came from (its lineage), which versions a trajectory helped train, what each failure
mode has behind it (trajectories, eval cases, tasks, versions trained on it), and each mode's pass rate on
each model version, from the per-case results of eval runs (the gate's report is per rule, not per case).

Platform-level, above the apps: it reads every app's rows (trajectories, failures, suites, tasks, jobs,
versions), so it lives where it may import them all and no app imports it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Max, Q

from flywheel.accounts.models import Project
from flywheel.environments.models import Task, TaskSetVersion
from flywheel.evals.models import EvalCase, EvalCaseResult, EvalRun, SuiteKind
from flywheel.evals.rows import Origins, origins_of
from flywheel.evals.run_models import EvalRunStatus
from flywheel.failures.models import FailureMode, FailureModeAssignment
from flywheel.registry import live
from flywheel.registry.models import Alias, AliasEvent, AliasEventKind, GateDecision, ModelVersion
from flywheel.training.models import TrainingJob
from flywheel.trajectories.models import Outcome, Trajectory

# --- the funnel --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FunnelStage:
    """One step of the loop. `ratio` is the share of the step before it (in the same unit) that reached this
    step too: at most 1 (None for a first step or after an empty one). `base` is what the bar is drawn
    against (the first count in its unit)."""

    key: str
    label: str
    count: int
    unit: str
    base: int
    ratio: float | None
    detail: str = ""


def trained_task_set_versions(*, project: Project) -> list[TaskSetVersion]:
    """The task-set versions a job actually trained on (it started running), each once."""
    ids = (TrainingJob.objects.filter(project=project, started_at__isnull=False)
           .values_list("task_set_version_id", flat=True).distinct())
    return list(TaskSetVersion.objects.filter(pk__in=list(ids)).select_related("task_set"))


def promoted_versions(*, project: Project) -> list[ModelVersion]:
    """Versions a promotion (by hand or automatic) made production at some time."""
    ids = (AliasEvent.objects.filter(project=project, alias=Alias.PRODUCTION, kind=AliasEventKind.PROMOTE)
           .values_list("to_version_id", flat=True).distinct())
    return list(ModelVersion.objects.filter(pk__in=list(ids)))


def _version_origins(versions: Iterable[ModelVersion]) -> dict[int, Origins]:
    """Per version, the trajectories and failure modes behind it: from its job's task-set rows when the job is
    still there (complete; each task-set version read once, by `origins_of` as the stored lineage was), else from
the ids its lineage kept (cut at 200)."""
    versions = list(versions)
    job_ids = {v.lineage.get("job") for v in versions if isinstance(v.lineage, dict)}
    jobs = {j.pk: j for j in TrainingJob.objects.filter(pk__in=[i for i in job_ids if isinstance(i, int)])
            .select_related("task_set_version")}
    by_task_set: dict[int, Origins] = {}
    out: dict[int, Origins] = {}
    for version in versions:
        lineage = version.lineage if isinstance(version.lineage, dict) else {}
        job = jobs.get(lineage.get("job"))
        if job is not None and job.project_id == version.project_id:
            if job.task_set_version_id not in by_task_set:
                by_task_set[job.task_set_version_id] = origins_of(job.task_set_version.rows)
            out[version.pk] = by_task_set[job.task_set_version_id]
        else:
            out[version.pk] = Origins(
                frozenset(t for t in lineage.get("trajectories") or [] if isinstance(t, int)),
                frozenset(m for m in lineage.get("failure_modes") or [] if isinstance(m, int)))
    return out


def _trained_versions(project: Project) -> list[ModelVersion]:
    """Versions a job made (the base models registered by path have no job), newest first."""
    return [v for v in ModelVersion.objects.filter(project=project).order_by("-number")
            if isinstance(v.lineage, dict) and v.lineage.get("job")]


def funnel(*, project: Project) -> list[FunnelStage]:
    """Counts of trajectories at each step of the loop, then of versions promoted.

    Each step is counted on its own (a trajectory promoted to a suite without a failure mode still counts as
    promoted), so a step may count more than the one before. Its ratio is not the quotient of the two counts
    (that gave "2500%" where tasks were promoted from failures nobody had put in a mode): it is the share of
    the step before's trajectories that reached this step too, so it never passes 100%."""
    trajectories = Trajectory.objects.filter(project=project)
    ingested = trajectories.count()
    failed = trajectories.filter(Q(reviewed_outcome=Outcome.FAILURE)
                                 | Q(reviewed_outcome="", outcome=Outcome.FAILURE)).count()
    reviewed = trajectories.filter(reviewed_outcome=Outcome.FAILURE).count()  # all of them failed
    mode_ids = set(FailureModeAssignment.objects.filter(failure_mode__project=project)
                   .values_list("trajectory_id", flat=True).distinct())
    reviewed_in_modes = trajectories.filter(reviewed_outcome=Outcome.FAILURE, pk__in=mode_ids).count()
    case_ids = set(EvalCase.objects.filter(suite__project=project, trajectory__isnull=False)
                   .values_list("trajectory_id", flat=True))
    task_ids = set(Task.objects.filter(task_set__project=project, trajectory__isnull=False)
                   .values_list("trajectory_id", flat=True))
    promoted_ids = case_ids | task_ids
    trained_versions = trained_task_set_versions(project=project)
    trained_rows = [row for v in trained_versions for row in v.rows]
    trained = origins_of(trained_rows).trajectories
    promoted = promoted_versions(project=project)
    behind_promoted = set().union(*(o.trajectories for o in _version_origins(promoted).values()))
    made_ids = {v.pk for v in _trained_versions(project)}
    made = len(made_ids)

    # (key, label, count, how many of the step before reached this one, what counts)
    steps = [
        ("ingested", "Ingested", ingested, None, ""),
        ("failed", "Failed", failed, failed, "the agent's or a reviewer's outcome is failure"),
        ("reviewed", "Reviewed", reviewed, reviewed, "a reviewer confirmed the failure"),
        ("in_modes", "In failure modes", len(mode_ids), reviewed_in_modes, "carry at least one failure mode"),
        ("promoted", "Promoted to evals and tasks", len(promoted_ids), len(promoted_ids & mode_ids),
         f"{len(case_ids)} behind eval cases, {len(task_ids)} behind tasks"),
        ("trained", "Trained on", len(trained), len(trained & promoted_ids),
         f"{len(trained_rows)} task rows in {len(trained_versions)} task-set version"
         f"{'' if len(trained_versions) == 1 else 's'} a job trained on"),
        ("shipped", "Behind a promoted version", len(behind_promoted), len(behind_promoted & trained),
         "trained a version that went to production"),
    ]
    stages: list[FunnelStage] = []
    previous: int | None = None
    for key, label, count, reached, detail in steps:
        ratio = reached / previous if previous and reached is not None else None
        stages.append(FunnelStage(key, label, count, "trajectories", ingested, ratio, detail))
        previous = count
    promoted_made = len({v.pk for v in promoted} & made_ids)
    stages.append(FunnelStage("versions", "Versions promoted", len(promoted), "versions", made,
                              promoted_made / made if made else None,
                              f"of {made} version{'' if made == 1 else 's'} trained by jobs"))
    return stages


# --- lineage -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProductionStint:
    """A version's last time in production: from `start` until `end` (None: it serves now), when production
    left it by `end_kind` (a rollback or a promotion) for `end_to`."""

    start: AliasEvent
    end: AliasEvent | None = None

    @property
    def rolled_back(self) -> bool:
        return self.end is not None and self.end.kind == AliasEventKind.ROLLBACK


def production_stint(*, project: Project, version: ModelVersion) -> ProductionStint | None:
    """When `version` last served in production and how that ended (None: it never served)."""
    moves = AliasEvent.objects.filter(project=project, alias=Alias.PRODUCTION).select_related("to_version", "user")
    start = moves.filter(to_version=version).first()  # newest first
    if start is None:
        return None
    end = (moves.filter(Q(at__gt=start.at) | Q(at=start.at, id__gt=start.id)).exclude(to_version=version)
           .order_by("at", "id").first())
    return ProductionStint(start=start, end=end)


@dataclass
class Lineage:
    """Where a version came from. `trajectories` is the first page of them; `trajectory_count` all of them."""

    version: ModelVersion
    job: TrainingJob | None = None
    failure_modes: list[FailureMode] = field(default_factory=list)
    trajectories: list[Trajectory] = field(default_factory=list)
    trajectory_count: int = 0
    served: bool = False
    stint: ProductionStint | None = None  # its last time in production


def version_lineage(*, project: Project, version: ModelVersion, limit: int = 50) -> Lineage:
    """Back from a version to its job, the task-set version it trained on, its failure modes and trajectories.
    Only rows of `project` are read: ids in a lineage never reach another project's rows."""
    lineage = version.lineage if isinstance(version.lineage, dict) else {}
    job_id = lineage.get("job")
    job = (TrainingJob.objects.filter(project=project, pk=job_id)
           .select_related("task_set_version__task_set", "holdout_version__suite", "regression_version__suite")
           .first() if isinstance(job_id, int) else None)
    origins = _version_origins([version])[version.pk]
    trajectories = Trajectory.objects.filter(project=project, pk__in=origins.trajectories)
    stint = production_stint(project=project, version=version)
    return Lineage(
        version=version,
        job=job,
        failure_modes=list(FailureMode.objects.filter(project=project, pk__in=origins.failure_modes)
                           .select_related("category")),
        trajectories=list(trajectories.order_by("-id").only("id", "external_id", "title", "outcome",
                                                            "reviewed_outcome")[:limit]),
        trajectory_count=trajectories.count(),
        served=stint is not None,
        stint=stint,
    )


def versions_by_trajectory(*, project: Project, trajectory_ids: Iterable[int] | None = None
                           ) -> dict[int, list[ModelVersion]]:
    """Forward: for each trajectory (all, or those in `trajectory_ids`), the versions it helped train,
    newest first."""
    wanted = set(trajectory_ids) if trajectory_ids is not None else None
    versions = _trained_versions(project)
    origins = _version_origins(versions)
    out: dict[int, list[ModelVersion]] = defaultdict(list)
    for version in versions:
        ids = origins[version.pk].trajectories
        for trajectory_id in ids if wanted is None else ids & wanted:
            out[trajectory_id].append(version)
    return dict(out)


@dataclass(frozen=True)
class TrajectoryForward:
    trajectory: Trajectory
    versions: list[ModelVersion]


def recent_trajectories_forward(*, project: Project, limit: int = 15) -> list[TrajectoryForward]:
    """The newest trajectories that helped train a version, with those versions."""
    forward = versions_by_trajectory(project=project)
    trajectories = (Trajectory.objects.filter(project=project, pk__in=sorted(forward, reverse=True)[: limit * 4])
                    .order_by("-id").only("id", "external_id", "title")[:limit])
    return [TrajectoryForward(t, forward[t.pk]) for t in trajectories]


# --- failure modes -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModeCoverage:
    mode: FailureMode
    trajectories: int
    holdout_cases: int
    regression_cases: int
    tasks: int
    versions: list[int]  # numbers of the versions trained on tasks of this mode


def mode_coverage(*, project: Project) -> list[ModeCoverage]:
    """Per failure mode: trajectories carrying it, eval cases by suite kind, tasks, and versions trained on it."""
    modes = list(FailureMode.objects.filter(project=project).select_related("category")
                 .annotate(n=Count("assignments")).order_by("-n", "name"))
    cases: dict[tuple[int, str], int] = {
        (row["failure_mode_id"], row["suite__kind"]): row["n"]
        for row in EvalCase.objects.filter(suite__project=project, failure_mode__isnull=False)
        .values("failure_mode_id", "suite__kind").annotate(n=Count("id"))
    }
    tasks = dict(Task.objects.filter(task_set__project=project, failure_mode__isnull=False)
                 .values_list("failure_mode_id").annotate(n=Count("id")))
    trained: dict[int, list[int]] = defaultdict(list)
    versions = _trained_versions(project)
    origins = _version_origins(versions)
    for version in reversed(versions):
        for mode_id in origins[version.pk].failure_modes:
            trained[mode_id].append(version.number)
    return [ModeCoverage(mode, mode.n, cases.get((mode.pk, SuiteKind.HOLDOUT), 0),
                         cases.get((mode.pk, SuiteKind.REGRESSION), 0), tasks.get(mode.pk, 0), trained.get(mode.pk, []))
            for mode in modes]


@dataclass(frozen=True)
class PassRate:
    passed: int
    total: int

    @property
    def rate(self) -> float:
        return self.passed / self.total if self.total else 0.0


@dataclass(frozen=True)
class ModePassRates:
    """Did version N fix mode X: per mode, its cases' pass rate on each version (None: not measured)."""

    versions: list[int]  # version numbers with at least one measured case of a mode, oldest first
    rows: list[tuple[FailureMode, list[PassRate | None]]]  # one cell per entry of `versions`


def mode_pass_rates(*, project: Project) -> ModePassRates:
    """Each failure mode's cases, passed and counted per model version, from the latest finished eval run of
    each (version, suite version). The counts are shown with the rate: versions measured on different suite
    versions saw different cases."""
    latest = list(EvalRun.objects.filter(project=project, status=EvalRunStatus.SUCCEEDED)
                  .values("model_version_id", "suite_version_id").annotate(last=Max("id"))
                  .values_list("last", flat=True))
    cells: dict[tuple[int, int], PassRate] = {}
    for row in (EvalCaseResult.objects.filter(run_id__in=latest, failure_mode_id__isnull=False)
                .values("failure_mode_id", "run__model_version__number")
                .annotate(total=Count("id"), passed=Count("id", filter=Q(passed=True)))):
        key = (row["failure_mode_id"], row["run__model_version__number"])
        before = cells.get(key, PassRate(0, 0))
        cells[key] = PassRate(before.passed + row["passed"], before.total + row["total"])
    numbers = sorted({number for _, number in cells})
    modes = FailureMode.objects.filter(project=project, pk__in={mode_id for mode_id, _ in cells}).order_by("name")
    return ModePassRates(numbers, [(mode, [cells.get((mode.pk, n)) for n in numbers]) for mode in modes])


# --- what each promotion cost and bought --------------------------------------------------------------------------

# The live traffic a promotion's before and after compare: this long on each side of the move, at most (the
# after is shorter while it is recent, and the before when the replaced version served less).
PROMOTION_WINDOW = timedelta(hours=24)


@dataclass(frozen=True)
class PromotionCost:
    """One promotion to production: what it cost (the job's device time, the online judge's tokens over the
    turn of the loop that led to it: from the move before it to it) and what it bought (the gate's holdout gain,
    the change of live failure rate and cost from the replaced version's last `PROMOTION_WINDOW` to the promoted
    one's first)."""

    event: AliasEvent
    job: TrainingJob | None
    eval_device_hours: float  # the eval runs people started on the promoted version
    judge: dict[str, int]
    since: datetime | None  # the turn's start: the move of production before this one
    decision: GateDecision | None
    holdout_before: float | None
    holdout_after: float | None
    before: dict[str, Any] | None  # live_between of the replaced version
    after: dict[str, Any]

    @property
    def holdout_gain(self) -> float | None:
        if self.holdout_before is None or self.holdout_after is None:
            return None
        return self.holdout_after - self.holdout_before

    @property
    def live_change(self) -> float | None:
        """The promoted version's live failure rate less the replaced one's (negative: fewer failures)."""
        if self.before is None:
            return None
        a, b = self.after["metrics"]["failure_rate"], self.before["metrics"]["failure_rate"]
        return None if a is None or b is None else a - b

    @property
    def cost_change(self) -> float | None:
        """The change of tokens' cost per 1,000 requests, promoted less replaced."""
        if self.before is None:
            return None
        a, b = self.after["cost"]["token_cost_per_1k"], self.before["cost"]["token_cost_per_1k"]
        return None if a is None or b is None else a - b


def promotion_costs(*, project: Project, limit: int = 10, now: datetime | None = None) -> list[PromotionCost]:
    """The project's latest promotions to production, newest first, each with what it cost and bought."""
    from django.db.models import Sum
    from django.utils import timezone

    from flywheel.evals.online import judge_spend

    now = now or timezone.now()
    events = list(AliasEvent.objects.filter(project=project, alias=Alias.PRODUCTION, kind=AliasEventKind.PROMOTE)
                  .select_related("to_version__base", "from_version__base").order_by("-at", "-id")[:limit])
    job_ids = [e.to_version.lineage.get("job") for e in events if isinstance(e.to_version.lineage, dict)]
    jobs = {j.pk: j for j in TrainingJob.objects.filter(project=project, pk__in=[i for i in job_ids
                                                                                  if isinstance(i, int)])}
    out = []
    for event in events:
        version = event.to_version
        previous = (AliasEvent.objects.filter(project=project, alias=Alias.PRODUCTION, at__lt=event.at)
                    .order_by("-at", "-id").values_list("at", flat=True).first())
        following = (AliasEvent.objects.filter(project=project, alias=Alias.PRODUCTION, at__gt=event.at)
                     .order_by("at", "id").values_list("at", flat=True).first())
        decision = (GateDecision.objects.filter(candidate=version).order_by("-decided_at", "-id").first())
        success = next((r for r in (decision.report.get("rules", []) if decision else [])
                        if r.get("name") == "holdout success"), {})
        after_end = min(event.at + PROMOTION_WINDOW, following or now, now)
        before = None
        if event.from_version is not None:
            before = live.live_between(project=project, version=event.from_version,
                                       start=max(event.at - PROMOTION_WINDOW, previous or event.at - PROMOTION_WINDOW),
                                       end=event.at)
        evals = (EvalRun.objects.filter(model_version=version, source="manual")
                 .aggregate(s=Sum("device_seconds"))["s"] or 0.0)
        lineage = version.lineage if isinstance(version.lineage, dict) else {}
        out.append(PromotionCost(
            event=event, job=jobs.get(lineage.get("job")), eval_device_hours=evals / 3600,
            judge=judge_spend(project=project, start=previous, end=event.at), since=previous,
            decision=decision, holdout_before=success.get("production"), holdout_after=success.get("candidate"),
            before=before, after=live.live_between(project=project, version=version, start=event.at, end=after_end)))
    return out
