"""Reads for the review pages: filtering, keyset pagination, capped counts, neighbours, the conversation.

Every query here is shaped to be answered from an index at a million rows (see migration 0003 and
`bench/pages.py`): lists page by id (`id < cursor ORDER BY id DESC`), never by OFFSET, and counts stop
at `COUNT_CAP` (and a time budget) instead of scanning every matching row on each page load."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlencode

from django.db import OperationalError, connection, transaction
from django.db.models import Exists, F, OuterRef, QuerySet, Value
from django.db.models.functions import Coalesce, NullIf

from flywheel.accounts.models import Project
from flywheel.trajectories.models import SOURCES, Outcome, SignalKind, Trajectory, TriageSignal

PAGE_SIZE = 50
# Counting stops here: past it the page says "10,000+". A count is then at most COUNT_CAP index entries
# per outcome, whatever the table holds. Exact counts at a million rows would read a million rows.
COUNT_CAP = 10_000
# A page whose filter matches at most this many rows is read from the filter's index, not the id walk.
SPARSE_MATCHES = 5_000
# Counting with filters no index narrows could still read many rows; past this it gives up (blank counts).
COUNT_BUDGET_MS = 60
OPTION_LIMIT = 200  # distinct agents / model versions offered in the filter form

# The outcome a reviewer set wins over the agent's own. Migration 0003 indexes exactly this expression
# (with project and id) on PostgreSQL and SQLite; keep the two in step.
EFFECTIVE_OUTCOME = Coalesce(NullIf(F("reviewed_outcome"), Value("")), F("outcome"))

# What a list row needs; the messages JSON (kilobytes, TOASTed) is never read for the list.
LIST_FIELDS = (
    "id",
    "external_id",
    "agent",
    "model_version",
    "outcome",
    "reviewed_outcome",
    "title",
    "message_count",
    "tool_call_count",
    "has_tool_error",
    "latency_ms",
    "started_at",
    "created_at",
    "suggested_category",
    "triage_severity",
)


# The longest text search either door takes: the page cuts a longer one (and says so), the API refuses it
# (422 naming the limit). A needle is a LIKE pattern, and SQLite refuses patterns past 50,000 bytes.
MAX_SEARCH_CHARS = 200
# agent and model_version are CharField(max_length=200): a longer filter value can match nothing.
MAX_NAME_CHARS = 200
# Cursors are trajectory ids, ASCII digits only (str.isdigit() also takes "²", which int() refuses).
_CURSOR = re.compile(r"[0-9]{1,19}")


def text_problem(value: str) -> str | None:
    """Why a filter value can never match stored text, or None. PostgreSQL's text cannot hold NUL, and its
    driver refuses a query carrying one (the page answered 500); SQLite follows the same rule, so that a
    link means the same on both."""
    return "it contains a NUL character" if "\x00" in value else None


@dataclass(frozen=True)
class TrajectoryFilters:
    """What a list of trajectories is filtered on: the one filter of the list page, the review queue, the
    failure modes' bulk actions and `GET /api/v1/trajectories`.

    The pages parse it from a query string (`from_params`): a value that cannot be used is left out, and
    `errors` says which and why (the page shows it), so a query string never makes a page fail. The API
    builds it from its validated query parameters (`trajectories.api.TrajectoryQuery.filters`), which
    refuse such a value with 422 instead, and adds the fields only it offers (after `mode`). A field at its
    default filters nothing; `None` is the default where "" is a value one can filter on (no agent)."""

    outcome: str = ""  # the outcome that wins: the reviewer's, else the agent's own
    agent: str | None = None
    model_version: str | None = None
    date_from: dt.date | None = None
    date_to: dt.date | None = None
    tool_error: bool | None = None
    q: str = ""
    signal: str = ""  # a SignalKind: trajectories with at least one signal of that kind
    reviewed: bool | None = None  # a reviewer set the outcome (or not)
    source: str | None = None  # one of SOURCES on the pages
    tag: str = ""  # a tag's name
    mode: int | None = None  # a failure mode's id (flywheel.failures): trajectories that carry it
    # The API's own: exact values of the agent's outcome and the reviewer's ("": not reviewed), one
    # trajectory by its external_id, and start times (after: inclusive, before: exclusive).
    agent_outcome: str | None = None
    reviewed_outcome: str | None = None
    external_id: str | None = None
    started_after: dt.datetime | None = None
    started_before: dt.datetime | None = None
    errors: tuple[str, ...] = field(default=(), compare=False)

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> TrajectoryFilters:
        errors: list[str] = []
        outcome = (params.get("outcome") or "").strip()
        if outcome and outcome not in Outcome.values:
            errors.append(f"Ignored outcome {outcome!r}: not one of {', '.join(Outcome.values)}.")
            outcome = ""
        dates: dict[str, dt.date | None] = {}
        for key, label in (("date_from", "From"), ("date_to", "To")):
            raw = (params.get(key) or "").strip()
            dates[key] = None
            if raw:
                try:
                    dates[key] = dt.date.fromisoformat(raw)
                except ValueError:
                    errors.append(f"Ignored {label} date {raw!r}: it is not a date (YYYY-MM-DD).")
        texts: dict[str, str] = {}
        for key, label in (("agent", "agent"), ("model_version", "model version"), ("q", "text search")):
            raw = (params.get(key) or "").strip()
            problem = text_problem(raw)
            if problem is None and key != "q" and len(raw) > MAX_NAME_CHARS:
                problem = f"it is longer than {MAX_NAME_CHARS} characters"
            if problem:
                errors.append(f"Ignored {label} {raw[:40]!r}: {problem}.")
                raw = ""
            elif key == "q" and len(raw) > MAX_SEARCH_CHARS:
                errors.append(f"The text search was cut to its first {MAX_SEARCH_CHARS} characters.")
                raw = raw[:MAX_SEARCH_CHARS]
            texts[key] = raw
        tool_error = {"yes": True, "no": False}.get((params.get("tool_error") or "").strip())
        reviewed = {"yes": True, "no": False}.get((params.get("reviewed") or "").strip())
        choices = {"signal": ("signal", SignalKind.values), "source": ("source", SOURCES)}
        picked: dict[str, str] = {}
        for key, (label, allowed) in choices.items():
            raw = (params.get(key) or "").strip()
            if raw and raw not in allowed:
                errors.append(f"Ignored {label} {raw[:40]!r}: not one of {', '.join(allowed)}.")
                raw = ""
            picked[key] = raw
        tag = (params.get("tag") or "").strip()
        if tag and (text_problem(tag) or len(tag) > 64):
            errors.append(f"Ignored tag {tag[:40]!r}: {text_problem(tag) or 'it is longer than 64 characters'}.")
            tag = ""
        raw_mode = (params.get("mode") or "").strip()
        mode = int(raw_mode) if _CURSOR.fullmatch(raw_mode) else None
        if raw_mode and mode is None:
            errors.append(f"Ignored failure mode {raw_mode[:40]!r}: it is not a failure mode's id.")
        return cls(
            outcome=outcome,
            agent=texts["agent"] or None,
            model_version=texts["model_version"] or None,
            date_from=dates["date_from"],
            date_to=dates["date_to"],
            tool_error=tool_error,
            q=texts["q"],
            signal=picked["signal"],
            reviewed=reviewed,
            source=picked["source"] or None,
            tag=tag,
            mode=mode,
            errors=tuple(errors),
        )

    def params(self) -> dict[str, str]:
        """The pages' non-empty filters as query parameters (what links carry to keep the filter)."""
        raw = {
            "outcome": self.outcome,
            "agent": self.agent,
            "model_version": self.model_version,
            "date_from": self.date_from.isoformat() if self.date_from else "",
            "date_to": self.date_to.isoformat() if self.date_to else "",
            "tool_error": {True: "yes", False: "no", None: ""}[self.tool_error],
            "q": self.q,
            "signal": self.signal,
            "reviewed": {True: "yes", False: "no", None: ""}[self.reviewed],
            "source": self.source,
            "tag": self.tag,
            "mode": str(self.mode) if self.mode is not None else "",
        }
        return {k: v for k, v in raw.items() if v}

    def querystring(self, **extra: str | int | None) -> str:
        params: dict[str, Any] = self.params()
        params.update({k: v for k, v in extra.items() if v not in (None, "")})
        return urlencode(params)

    def without_outcome(self) -> TrajectoryFilters:
        return replace(self, outcome="")

    @property
    def active(self) -> bool:
        return bool(self.params())


@dataclass(frozen=True)
class PageCursor:
    """Where a list page starts, from `?after=ID` (older rows) or `?before=ID` (newer rows). A value that
    is not an id is left out and named in `errors`, as the filters do."""

    after: int | None = None
    before: int | None = None
    errors: tuple[str, ...] = field(default=(), compare=False)

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> PageCursor:
        values: dict[str, int | None] = {}
        errors: list[str] = []
        for key in ("after", "before"):
            raw = (params.get(key) or "").strip()
            values[key] = int(raw) if _CURSOR.fullmatch(raw) else None
            if raw and values[key] is None:
                errors.append(f"Ignored {key} {raw[:40]!r}: it is not a page cursor (a trajectory id).")
        return cls(after=values["after"], before=values["before"], errors=tuple(errors))

    def params(self) -> dict[str, int]:
        return {k: v for k, v in (("after", self.after), ("before", self.before)) if v is not None}


def trajectory_queryset(*, project: Project, filters: TrajectoryFilters) -> QuerySet[Trajectory]:
    """The project's trajectories matching `filters`, unordered."""
    qs = Trajectory.objects.filter(project=project)
    if filters.outcome:
        qs = qs.alias(effective=EFFECTIVE_OUTCOME).filter(effective=filters.outcome)
    exact = {
        "agent": filters.agent,
        "model_version": filters.model_version,
        "source": filters.source,
        "outcome": filters.agent_outcome,
        "reviewed_outcome": filters.reviewed_outcome,
        "external_id": filters.external_id,
    }
    qs = qs.filter(**{column: value for column, value in exact.items() if value is not None})
    if filters.date_from:
        qs = qs.filter(started_at__gte=_day_start(filters.date_from))
    if filters.date_to and filters.date_to < dt.date.max:  # up to the last day there is: no bound at all
        qs = qs.filter(started_at__lt=_day_start(filters.date_to + dt.timedelta(days=1)))
    if filters.started_after is not None:
        qs = qs.filter(started_at__gte=filters.started_after)
    if filters.started_before is not None:
        qs = qs.filter(started_at__lt=filters.started_before)
    if filters.tool_error is not None:
        qs = qs.filter(has_tool_error=filters.tool_error)
    if filters.q:
        # search_text is stored lower-cased, so a case-sensitive LIKE on a lower-cased needle is a
        # case-insensitive search that the pg_trgm GIN index answers (icontains would wrap UPPER()).
        qs = qs.filter(search_text__contains=filters.q.lower())
    if filters.signal:
        # EXISTS on the signal index (project, kind, trajectory): a probe per row when signals are common
        # (the id walk), the index range itself when they are rare (the filter-index path).
        signals = TriageSignal.objects.filter(project=project, kind=filters.signal, trajectory_id=OuterRef("pk"))
        qs = qs.filter(Exists(signals))
    if filters.reviewed is not None:
        qs = qs.exclude(reviewed_outcome="") if filters.reviewed else qs.filter(reviewed_outcome="")
    if filters.tag:
        links = Trajectory.tags.through.objects.filter(
            tag__project=project, tag__name=filters.tag, trajectory_id=OuterRef("pk")
        )
        qs = qs.filter(Exists(links))
    if filters.mode is not None:
        # Through the reverse relation the failures app declares (FailureModeAssignment.trajectory): this app
        # sits below failures and imports nothing of it (tests/platform/test_import_layers.py).
        carried = Trajectory.objects.filter(
            pk=OuterRef("pk"), failure_assignments__failure_mode_id=filters.mode,
            failure_assignments__failure_mode__project=project,
        )
        qs = qs.filter(Exists(carried))
    return qs


def _day_start(day: dt.date) -> dt.datetime:
    return dt.datetime.combine(day, dt.time.min, tzinfo=dt.UTC)


def _attach_promoted(rows: list[Trajectory]) -> None:
    """What each of a page of rows was promoted into: "task" (a task set's row) and "eval case", so that a
    reviewer sees which failures are still only failures. Through the reverse relations the task sets' and
    the suites' foreign keys declare (those apps sit above this one), two queries a page."""
    ids = [row.id for row in rows]
    tasks: set[int] = set()
    cases: set[int] = set()
    if ids:
        tasks = set(Trajectory.objects.filter(id__in=ids, tasks__isnull=False).values_list("id", flat=True))
        cases = set(Trajectory.objects.filter(id__in=ids, eval_cases__isnull=False).values_list("id", flat=True))
    for row in rows:
        row.promoted = [name for name, held in (("task", row.id in tasks), ("eval case", row.id in cases)) if held]


@dataclass(frozen=True)
class TrajectoryPage:
    rows: list[Trajectory]
    next_cursor: int | None  # pass as ?after= for older rows
    prev_cursor: int | None  # pass as ?before= for newer rows


def trajectory_page(
    *,
    project: Project,
    filters: TrajectoryFilters,
    after: int | None = None,
    before: int | None = None,
    size: int = PAGE_SIZE,
    sparse: bool = False,
) -> TrajectoryPage:
    """One page of matching trajectories, newest first, by keyset on id.

    `after`: rows older than that id (the "next" page); `before`: rows newer than it (the "previous"
    page). One extra row is read to know whether another page follows.

    Dense matches are found fastest by walking the id index backwards and filtering. That walk is slow
    when matches are few (`sparse`: the caller counted them) or far back (an end date): then the ids are
    taken from the filter's own index and sorted, which costs the number of matches."""
    base = trajectory_queryset(project=project, filters=filters)
    ids, next_cursor, prev_cursor = _keyset_ids(
        base, after=after, before=before, size=size, by_filter_index=sparse or filters.date_to is not None
    )
    rows = list(Trajectory.objects.filter(id__in=ids).only(*LIST_FIELDS).order_by("-id")) if ids else []
    _attach_tags(rows)
    _attach_signal_kinds(rows)
    _attach_promoted(rows)
    return TrajectoryPage(rows=rows, next_cursor=next_cursor, prev_cursor=prev_cursor)


def _keyset_ids(
    base: QuerySet[Trajectory], *, after: int | None, before: int | None, size: int, by_filter_index: bool
) -> tuple[list[int], int | None, int | None]:
    """(ids of the page newest first, next cursor, previous cursor) of `base`, by keyset on id.

    `by_filter_index`: read the ids from the filter's own index and sort them (few or old matches)
    instead of walking the id index backwards (many recent matches)."""
    # `id + 0` is the same order, but no index provides it, so the planner leaves the id index alone.
    key = F("id") + 0 if by_filter_index else F("id")
    # Two steps: the ids first (an index-only scan for most filters, e.g. a date range on
    # traj_project_started_id), then the page's rows by primary key.
    if before is not None:
        ids = list(base.filter(id__gt=before).order_by(key.asc()).values_list("id", flat=True)[: size + 1])
        has_newer = len(ids) > size
        ids = ids[:size][::-1]
        prev_cursor = ids[0] if ids and has_newer else None
        next_cursor = ids[-1] if ids else None  # `before` itself is older, so there is a next page
    else:
        qs = base.filter(id__lt=after) if after is not None else base
        ids = list(qs.order_by(key.desc()).values_list("id", flat=True)[: size + 1])
        next_cursor = ids[size - 1] if len(ids) > size else None
        ids = ids[:size]
        prev_cursor = None
        # Ordered, so that the probe is one step on an index (EXISTS may plan a sequential scan).
        if after is not None and ids and base.filter(id__gt=ids[0]).order_by("id").values("id")[:1]:
            prev_cursor = ids[0]
    return ids, next_cursor, prev_cursor


def _few_matches(qs: QuerySet[Trajectory]) -> bool:
    """Whether at most SPARSE_MATCHES rows match, counted within the time budget (a count that runs out
    of it says no: the matches were then not few enough to be cheap to count)."""
    try:
        with _time_budget(COUNT_BUDGET_MS):
            return qs.order_by().values("id")[: SPARSE_MATCHES + 1].count() <= SPARSE_MATCHES
    except OperationalError as exc:
        if not _cancelled(exc):
            raise
        return False


def trajectory_api_page(
    *, project: Project, filters: TrajectoryFilters, fields: Sequence[str], after: int | None = None,
    size: int = PAGE_SIZE,
) -> tuple[list[dict[str, Any]], int | None]:
    """(`fields` of a page of matching trajectories newest first, next cursor) for `GET /api/v1/trajectories`.

    The list page's filter and paging: a walk of the id index when matches are many, the filter's own index
    when they are few (a capped count says which) or end before a time."""
    qs = trajectory_queryset(project=project, filters=filters)
    page = qs.filter(id__lt=after) if after is not None else qs
    by_filter_index = (
        filters.started_before is not None
        or filters.date_to is not None
        or (filters != TrajectoryFilters() and _few_matches(page))
    )
    ids, next_cursor, _ = _keyset_ids(qs, after=after, before=None, size=size, by_filter_index=by_filter_index)
    rows = list(Trajectory.objects.filter(id__in=ids).order_by("-id").values(*fields)) if ids else []
    return rows, next_cursor


def _attach_tags(rows: list[Trajectory]) -> None:
    """Tags for a page of rows in one query (prefetch_related would re-read the rows' ids)."""
    through = Trajectory.tags.through
    by_id: dict[int, list[str]] = {row.id: [] for row in rows}
    if by_id:
        links = (
            through.objects.filter(trajectory_id__in=by_id)
            .order_by("tag__name")
            .values_list("trajectory_id", "tag__name")
        )
        for trajectory_id, name in links:
            by_id[trajectory_id].append(name)
    for row in rows:
        row.tag_names = by_id[row.id]


def _attach_signal_kinds(rows: list[Trajectory]) -> None:
    """The distinct signal kinds of a page of rows, in one query on the signals' trajectory index."""
    by_id: dict[int, set[str]] = {row.id: set() for row in rows}
    if by_id:
        for trajectory_id, kind in TriageSignal.objects.filter(trajectory_id__in=by_id).values_list(
            "trajectory_id", "kind"
        ):
            by_id[trajectory_id].add(kind)
    for row in rows:
        row.signal_kinds = sorted(by_id[row.id])


@dataclass(frozen=True)
class OutcomeCount:
    outcome: str
    label: str
    count: int | None  # None: not counted, the count ran out of its time budget
    capped: bool = False  # the true count is above `count`

    @property
    def exact(self) -> int | None:
        return self.count if self.count is not None and not self.capped else None

    @property
    def display(self) -> str:
        if self.count is None:
            return ""
        return f"{self.count:,}+" if self.capped else f"{self.count:,}"


def trajectory_outcome_counts(
    *, project: Project, filters: TrajectoryFilters, cap: int = COUNT_CAP, budget_ms: int = COUNT_BUDGET_MS
) -> list[OutcomeCount]:
    """Matching trajectories per effective outcome (ignoring the outcome filter), "All" first.

    Bounded work on any table size:
    - no other filter: one capped count per outcome, each an index-only scan of at most `cap + 1` entries
      of the effective-outcome index; exact below the cap, "10,000+" above it;
    - other filters: one query grouping `cap + 1` matches by outcome; exact when fewer match, otherwise
      lower bounds ("n+");
    - on PostgreSQL the counting gets `budget_ms`; a filter no index narrows (say two columns that are
      each common) then leaves the counts blank instead of slowing the page."""
    others = filters.without_outcome()
    base = trajectory_queryset(project=project, filters=others)
    try:
        with _time_budget(budget_ms):
            if others.active:
                per_outcome = _grouped_sample(base, cap)
                capped_total = sum(per_outcome.values()) > cap
                capped = dict.fromkeys(Outcome.values, capped_total)  # absent from a capped sample: unknown
            else:
                per_outcome, capped = {}, {}
                for value in Outcome.values:
                    n = base.alias(effective=EFFECTIVE_OUTCOME).filter(effective=value).values("id")[: cap + 1].count()
                    per_outcome[value], capped[value] = min(n, cap), n > cap
    except OperationalError as exc:
        if not _cancelled(exc):
            raise
        return [OutcomeCount("", "All", None)] + [OutcomeCount(v, label, None) for v, label in Outcome.choices]
    counts = [OutcomeCount(v, label, per_outcome.get(v, 0), capped.get(v, False)) for v, label in Outcome.choices]
    total = sum(c.count for c in counts)
    all_capped = any(c.capped for c in counts)
    return [OutcomeCount("", "All", min(total, cap) if others.active else total, all_capped), *counts]


def _grouped_sample(base: QuerySet[Trajectory], cap: int) -> dict[str, int]:
    """{effective outcome: n} over `cap + 1` matching rows of `base`: exact when fewer match, lower bounds
    otherwise. There is no ORDER BY, so the scan stops after `cap + 1` matches on whichever index finds
    them first (a date range walks the date index, a rare word the trigram index)."""
    sample = base.order_by().values("reviewed_outcome", "outcome")[: cap + 1]
    sql, params = sample.query.sql_with_params()
    grouped = f"SELECT COALESCE(NULLIF(s.reviewed_outcome, ''), s.outcome), COUNT(*) FROM ({sql}) s GROUP BY 1"
    with connection.cursor() as cursor:
        cursor.execute(grouped, params)
        return dict(cursor.fetchall())


def _cancelled(exc: OperationalError) -> bool:
    """Whether the database cancelled the statement (statement_timeout), not some other failure."""
    return getattr(exc.__cause__, "sqlstate", None) == "57014"  # query_canceled


@contextmanager
def _time_budget(ms: int) -> Iterator[None]:
    """Cancel the statements inside after `ms` milliseconds, and keep them off sequential scans (a LIMIT
    without ORDER BY tempts the planner into one). PostgreSQL only; elsewhere a no-op.

    Both settings are transaction-local inside a savepoint: restored explicitly when the block succeeds,
    rolled back with it when it is cancelled."""
    if connection.vendor != "postgresql":
        yield
        return
    settings = {"statement_timeout": f"{int(ms)}ms", "enable_seqscan": "off"}
    with transaction.atomic():
        with connection.cursor() as cursor:
            previous = {}
            for name, value in settings.items():
                cursor.execute("SELECT current_setting(%s), set_config(%s, %s, true)", [name, name, value])
                previous[name] = cursor.fetchone()[0]
        yield
        with connection.cursor() as cursor:
            for name, value in previous.items():
                cursor.execute("SELECT set_config(%s, %s, true)", [name, value])


def trajectory_neighbours(
    *, project: Project, filters: TrajectoryFilters, trajectory_id: int
) -> tuple[int | None, int | None]:
    """(newer id, older id) next to `trajectory_id` within `filters`: what k and j open.

    Each is first looked for by walking the id index, which is one step when matches are dense; when
    they are sparse that walk could cross most of the table, so past the budget the neighbour is taken
    from the filter's own index instead (costing the number of matches on that side)."""
    qs = trajectory_queryset(project=project, filters=filters).values_list("id", flat=True)
    sides = (qs.filter(id__gt=trajectory_id), True), (qs.filter(id__lt=trajectory_id), False)
    found: list[int | None] = []
    for side, ascending in sides:
        try:
            with _time_budget(COUNT_BUDGET_MS):
                found.append(side.order_by("id" if ascending else "-id").first())
        except OperationalError as exc:
            if not _cancelled(exc):
                raise
            key = F("id") + 0
            found.append(side.order_by(key.asc() if ascending else key.desc()).first())
    return found[0], found[1]


def trajectory_filter_options(*, project: Project, column: str, limit: int = OPTION_LIMIT) -> list[str]:
    """Distinct non-empty values of `column` ("agent" or "model_version") in the project.

    A loose index scan (a recursive CTE hopping from one value to the next on the (project, column, id)
    index) reads one index entry per distinct value instead of every row, which SELECT DISTINCT would."""
    if column not in ("agent", "model_version"):
        raise ValueError(f"not a filter column: {column}")
    table = connection.ops.quote_name(Trajectory._meta.db_table)
    col = connection.ops.quote_name(column)
    sql = f"""
        WITH RECURSIVE vals(v) AS (
            SELECT (SELECT MIN({col}) FROM {table} WHERE project_id = %s AND {col} > '')
            UNION ALL
            SELECT (SELECT MIN({col}) FROM {table} WHERE project_id = %s AND {col} > vals.v)
            FROM vals WHERE vals.v IS NOT NULL
        )
        SELECT v FROM vals WHERE v IS NOT NULL LIMIT %s
    """
    with connection.cursor() as cursor:
        cursor.execute(sql, [project.id, project.id, limit])
        return [row[0] for row in cursor.fetchall()]


def trajectory_get(*, project: Project, trajectory_id: int) -> Trajectory | None:
    return (
        Trajectory.objects.select_related("reviewed_by")
        .prefetch_related("tags")
        .filter(project=project, pk=trajectory_id)
        .first()
    )


def project_tag_names(*, project: Project) -> list[str]:
    return list(project.tags.order_by("name").values_list("name", flat=True)[:OPTION_LIMIT])


def trajectory_signals(*, trajectory: Trajectory) -> list[TriageSignal]:
    """The trajectory's triage signals, most severe first."""
    return list(TriageSignal.objects.filter(trajectory=trajectory).order_by("-severity", "message_index", "id"))
