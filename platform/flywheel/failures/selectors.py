"""Reads for the failure-mode pages: the taxonomy, the modes with their counts, one mode's weekly counts and
signals, and a trajectory's modes. A mode's trajectories are read through the list's own filter
(`TrajectoryFilters(mode=…)`) and its keyset pages, so there is one way to select trajectories."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.db.models import Count, Q
from django.db.models.functions import Coalesce, TruncWeek
from django.utils import timezone

from flywheel.accounts.models import Project
from flywheel.failures.models import FailureMode, FailureModeAssignment, TaxonomyCategory
from flywheel.trajectories.models import SignalKind, Trajectory, TriageSignal

WEEKS_SHOWN = 12


def taxonomy(*, project: Project) -> list[TaxonomyCategory]:
    """The project's categories in order, each with `mode_count` (how many modes use it)."""
    return list(
        TaxonomyCategory.objects.filter(project=project).annotate(mode_count=Count("failure_modes")).order_by("position", "id")
    )


def failure_modes(*, project: Project, status: str = "") -> list[FailureMode]:
    """The project's modes, each with `trajectory_count`, most carried first."""
    qs = FailureMode.objects.filter(project=project).select_related("category", "created_by")
    if status:
        qs = qs.filter(status=status)
    return list(qs.annotate(trajectory_count=Count("assignments")).order_by("-trajectory_count", "name"))


def failure_mode_get(*, project: Project, mode_id: int) -> FailureMode | None:
    return (
        FailureMode.objects.select_related("category", "created_by")
        .annotate(trajectory_count=Count("assignments"))
        .filter(project=project, pk=mode_id)
        .first()
    )


@dataclass(frozen=True)
class WeekCount:
    week: dt.date  # the Monday the week starts on
    count: int
    height: int = 0  # bar height in the page's SVG, 0-100

    @property
    def y(self) -> int:
        """Where the bar starts in the SVG (its bars stand on y=110, the tallest is 100 high)."""
        return 110 - self.height


def failure_mode_weeks(*, failure_mode: FailureMode, weeks: int = WEEKS_SHOWN) -> list[WeekCount]:
    """Trajectories carrying the mode per week (by when each started, else when it arrived), the last
    `weeks` weeks up to this one, empty weeks included."""
    today = timezone.now().date()
    this_monday = today - dt.timedelta(days=today.weekday())
    first = this_monday - dt.timedelta(weeks=weeks - 1)
    since = dt.datetime.combine(first, dt.time.min, tzinfo=dt.UTC)
    rows = (
        FailureModeAssignment.objects.filter(failure_mode=failure_mode)
        .annotate(when=Coalesce("trajectory__started_at", "trajectory__created_at"))
        .filter(when__gte=since)
        .annotate(week=TruncWeek("when", tzinfo=dt.UTC))
        .values("week")
        .annotate(n=Count("id"))
    )
    counts = {_as_date(row["week"]): row["n"] for row in rows}
    top = max(counts.values(), default=0)
    result = []
    for i in range(weeks):
        week = first + dt.timedelta(weeks=i)
        n = counts.get(week, 0)
        result.append(WeekCount(week=week, count=n, height=round(100 * n / top) if top else 0))
    return result


def _as_date(value: dt.date | dt.datetime | str) -> dt.date:
    if isinstance(value, dt.datetime):
        return value.date()
    if isinstance(value, str):  # SQLite may hand the truncated value back as text
        return dt.date.fromisoformat(value[:10])
    return value


@dataclass(frozen=True)
class SignalCount:
    kind: str
    label: str
    signals: int  # signals of that kind over the mode's trajectories
    trajectories: int  # trajectories with at least one


def failure_mode_signals(*, failure_mode: FailureMode) -> list[SignalCount]:
    """The triage signals of the mode's trajectories, counted by kind, most common first."""
    rows = (
        TriageSignal.objects.filter(project_id=failure_mode.project_id, trajectory__failure_assignments__failure_mode=failure_mode)
        .values("kind")
        .annotate(n=Count("id"), t=Count("trajectory", distinct=True))
        .order_by("-n", "kind")
    )
    labels = dict(SignalKind.choices)
    return [SignalCount(kind=r["kind"], label=labels.get(r["kind"], r["kind"]), signals=r["n"], trajectories=r["t"]) for r in rows]


def trajectory_assignments(*, trajectory: Trajectory) -> list[FailureModeAssignment]:
    """The modes a trajectory carries, with who assigned each and when, newest first."""
    return list(
        FailureModeAssignment.objects.filter(trajectory=trajectory)
        .select_related("failure_mode", "failure_mode__category", "assigned_by")
        .order_by("-assigned_at", "-id")
    )


def assignable_modes(*, project: Project, limit: int = 200) -> list[FailureMode]:
    """Modes offered for assignment: not-yet-fixed first, then the most carried."""
    return list(
        FailureMode.objects.filter(project=project)
        .select_related("category")
        .annotate(trajectory_count=Count("assignments"), fixed=Count("id", filter=Q(status="fixed")))
        .order_by("fixed", "-trajectory_count", "name")[:limit]
    )


def queue_keyed_modes(*, project: Project, limit: int) -> list[FailureMode]:
    """The modes the review queue puts under the keys 1-9: the project's modes in the order they were made.
    Not by use, as `assignable_modes` is: an assignment would re-order them, and the key a reviewer just
    pressed would mean another mode on the next trajectory. A new mode takes the next free number."""
    return list(FailureMode.objects.filter(project=project).select_related("category").order_by("created_at", "id")[:limit])


@dataclass(frozen=True)
class PromotedItems:
    """A mode's eval cases or environment tasks: promoted from the mode itself or from one of its
    trajectories. `installed` is False while the app that holds them is not installed."""

    installed: bool
    items: list
    total: int = 0


PROMOTED_SHOWN = 20


def failure_mode_origins(*, failure_mode: FailureMode) -> dict[str, PromotedItems]:
    """{"cases": eval cases, "tasks": environment tasks} promoted from the mode or its trajectories."""
    from django.apps import apps

    found = {}
    for key, app, model, parent in (("cases", "evals", "EvalCase", "suite"), ("tasks", "environments", "Task", "task_set")):
        if not apps.is_installed(f"flywheel.{app}"):
            found[key] = PromotedItems(installed=False, items=[])
            continue
        Model = apps.get_model(app, model)
        carried = FailureModeAssignment.objects.filter(failure_mode=failure_mode).values("trajectory_id")
        qs = Model.objects.filter(Q(failure_mode=failure_mode) | Q(trajectory_id__in=carried)).select_related(parent)
        found[key] = PromotedItems(installed=True, items=list(qs.order_by("-id")[:PROMOTED_SHOWN]), total=qs.count())
    return found
