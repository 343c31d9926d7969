"""Live metrics per model version: which version answered a trajectory, the hourly rollup of production
traffic, and the metrics the Models page, a version's page and the API read from it.

Which version answered: a trajectory's `model_version` string. The adapter names the platform gives vLLM
(`serving.adapter_name`: `<slug>-v<n>`) map to version n by themselves; any other string maps through the
project's `VersionName` table, which maintainers edit; the rest are unmapped and listed with their counts
(from the rollup, never a scan) so that someone maps them.

The rollup (`LiveRollup`): one row per (project, raw model_version string, hour of coalesce(started_at,
created_at)), with its trajectories, failures (the effective outcome: a reviewer's over the agent's),
triaged trajectories and the triage signals among them, tokens (in all, and input and output apart: what a price
applies to, flywheel.registry.cost), the GPU time serving reported, and latency. The mapping to versions is
applied when read, so mapping a string counts its past traffic at once.

It is kept up to date by `rollup_refresh`, run by a worker that `rollup_sweep` (flywheel.outbox.SWEEPS) sends
when something changed: the trajectories whose `updated_at` (ingest, replay, review) or `triaged_at` (triage)
passed the durable watermark (`LiveRollupState`) are read again, and each whose state is newer than what was
counted has its old contribution (`LiveRollupMember`: its bucket and counts) subtracted and its new one
added: on PostgreSQL in one statement, in the database (`refresh_statement`), elsewhere in Python. The work follows the changed trajectories, never the size of a bucket or of the table: a replay that
moves a trajectory to another string or hour, a review, a new triage are each one subtraction and one
addition. A trajectory is counted once stored; its signals once it is triaged (rollups follow triage: its
`triaged_at` brings it back). Not followed: a deleted trajectory stays counted until `rollup_refresh(full=True)`
rebuilds everything."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.db.models import BigIntegerField, Exists, F, Max, Min, OuterRef, Q, Sum
from django.db.models.expressions import RawSQL
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from flywheel.accounts.models import Project
from flywheel.registry import cost, serving
from flywheel.registry.models import (
    Alias,
    AliasAssignment,
    LiveRollup,
    LiveRollupMember,
    LiveRollupState,
    ModelVersion,
    VersionName,
)

# --- which version answered ------------------------------------------------------------------------------


def name_map(*, project: Project) -> dict[str, ModelVersion]:
    """Every `model_version` string that names one of the project's versions: each version's adapter name
    and the names maintainers mapped. A mapped name never overrides an adapter name (refused when saved)."""
    versions = list(ModelVersion.objects.filter(project=project).select_related("base"))
    by_id = {v.pk: v for v in versions}
    mapping = {serving.adapter_name(project.slug, v.number): v for v in versions}
    for name, version_id in VersionName.objects.filter(project=project).values_list("name", "version_id"):
        mapping.setdefault(name, by_id[version_id])
    return mapping


def names_of(*, project: Project, version: ModelVersion) -> list[str]:
    """The strings production traffic of `version` carries: its adapter name and the names mapped to it."""
    names = {serving.adapter_name(project.slug, version.number)}
    names.update(VersionName.objects.filter(project=project, version=version).values_list("name", flat=True))
    return sorted(names)


def version_of(*, project: Project, name: str) -> ModelVersion | None:
    """The version a `model_version` string names in this project, or None (unmapped)."""
    number = serving.adapter_number(project.slug, name)
    if number is not None:
        version = ModelVersion.objects.filter(project=project, number=number).first()
        if version is not None:
            return version
    row = VersionName.objects.filter(project=project, name=name).select_related("version").first()
    return row.version if row else None


NAME_MAX = VersionName._meta.get_field("name").max_length


def version_name_set(*, project: Project, name: str, version_number: Any, user: Any = None) -> VersionName:
    """Map `name` (a `model_version` string production traffic carries) to the project's version
    `version_number`; a name already mapped is moved to it. ValidationError naming the field at fault."""
    errors: dict[str, str] = {}
    name = (name or "").strip() if isinstance(name, str) else ""
    if not name:
        errors["name"] = "The model_version string the traffic carries is required."
    elif len(name) > NAME_MAX:
        errors["name"] = f"At most {NAME_MAX} characters (a trajectory's model_version is no longer)."
    elif "\x00" in name:
        errors["name"] = "Must not contain a NUL character."
    elif serving.adapter_number(project.slug, name) is not None:
        errors["name"] = (f"“{name}” is an adapter name the platform gives a version (<project>-v<n>): it maps to "
                          "that version by itself.")
    version = None
    text = str(version_number).strip().lstrip("v") if version_number is not None else ""
    if not text.isascii() or not text.isdigit():
        errors["version"] = "Choose one of the project's versions (its number, e.g. 3)."
    else:
        version = ModelVersion.objects.filter(project=project, number=int(text)).first()
        if version is None:
            errors["version"] = f"The project has no version {int(text)}."
    if errors:
        raise ValidationError(errors)
    row, _ = VersionName.objects.update_or_create(project=project, name=name,
                                                  defaults={"version": version, "created_by": user})
    return row


def version_name_remove(*, project: Project, name: str) -> bool:
    """Unmap `name`; False when it was not mapped. Its traffic is unmapped again (the rollup keeps it)."""
    deleted, _ = VersionName.objects.filter(project=project, name=name).delete()
    return bool(deleted)


def version_names(*, project: Project) -> list[VersionName]:
    return list(VersionName.objects.filter(project=project).select_related("version", "created_by"))


# --- the rollup ------------------------------------------------------------------------------------------

# A writer stamps its rows (ingest's `now`, triage's `triaged_at`) before it commits, so a row may become
# visible after a refresh that ran past its stamp. The next refresh therefore starts from a watermark no later
# than the start of the oldest transaction still open when this one ran (PostgreSQL says which: every stamp of
# a transaction not yet committed is at or after its start), less CLOCK_SKEW between the app's clock and the
# database's. SQLite has one writer at a time and says nothing of it: there the watermark is held back by
# OVERLAP. Reading a trajectory again is cheap (passed over in SQL when nothing newer); missing one is not.
OVERLAP = timedelta(minutes=2)
CLOCK_SKEW = timedelta(seconds=2)
HOUR = timedelta(hours=1)
# Tokens above this on one trajectory are taken for garbage (agent data is untrusted), not summed.
TOKENS_MAX = 10**9


def _number_sql(vendor: str, key: str) -> tuple[str, str]:
    """(is it a number, its value) of usage's `key`, as SQL over the trajectory table's `usage` column."""
    if vendor == "postgresql":
        col = 'trajectories_trajectory."usage"'
        return f"jsonb_typeof({col}->'{key}') = 'number'", f"({col}->>'{key}')::numeric"
    col = 'trajectories_trajectory."usage"'
    return (f"json_type({col}, '$.{key}') IN ('integer', 'real')", f"json_extract({col}, '$.{key}')")


def tokens_sql(vendor: str) -> str:
    """A trajectory's tokens: usage's total_tokens, else prompt + completion tokens (OpenAI's names), else
    input + output tokens (OTel's and Anthropic's); NULL when none is there as numbers in [0, TOKENS_MAX]."""
    parts = {key: _number_sql(vendor, key) for key in ("total_tokens", "prompt_tokens", "completion_tokens",
                                                          "input_tokens", "output_tokens")}

    def both(a: str, b: str) -> tuple[str, str]:
        return f"{parts[a][0]} AND {parts[b][0]}", f"({parts[a][1]} + {parts[b][1]})"

    cases = [parts["total_tokens"], both("prompt_tokens", "completion_tokens"), both("input_tokens", "output_tokens")]
    value = "CASE " + " ".join(f"WHEN {test} THEN {v}" for test, v in cases) + " END"
    integer = "bigint" if vendor == "postgresql" else "integer"
    return f"CASE WHEN ({value}) BETWEEN 0 AND {TOKENS_MAX} THEN CAST(ROUND({value}) AS {integer}) END"


# GPU-seconds above this on one trajectory (a day) are taken for garbage, as tokens above TOKENS_MAX.
GPU_SECONDS_MAX = 86_400


def split_sql(vendor: str) -> tuple[str, str]:
    """A trajectory's input and output tokens apart, what a price applies to: usage's prompt + completion
    tokens (OpenAI's names), else input + output tokens (OTel's and Anthropic's); both NULL unless both are
    numbers in [0, TOKENS_MAX]."""
    integer = "bigint" if vendor == "postgresql" else "integer"
    pairs = [(_number_sql(vendor, a), _number_sql(vendor, b))
             for a, b in (("prompt_tokens", "completion_tokens"), ("input_tokens", "output_tokens"))]

    def ok(part: tuple[str, str]) -> str:
        return f"({part[0]} AND {part[1]} BETWEEN 0 AND {TOKENS_MAX})"

    def side(index: int) -> str:
        cases = " ".join(f"WHEN {ok(a)} AND {ok(b)} THEN CAST(ROUND({(a, b)[index][1]}) AS {integer})"
                         for a, b in pairs)
        return f"CASE {cases} END"

    return side(0), side(1)


def gpu_ms_sql(vendor: str) -> str:
    """The GPU time the serving reported for a trajectory, in whole ms: usage's `gpu_seconds` (see
    flywheel.registry.cost), NULL unless a number in [0, GPU_SECONDS_MAX]."""
    test, value = _number_sql(vendor, "gpu_seconds")
    integer = "bigint" if vendor == "postgresql" else "integer"
    return f"CASE WHEN {test} AND {value} BETWEEN 0 AND {GPU_SECONDS_MAX} THEN CAST(ROUND({value} * 1000) AS {integer}) END"


@dataclass
class RollupWork:
    """What one refresh did: the bench divides `ms` by `trajectories` for the cost per trajectory."""

    skipped: bool = False  # another refresh held the watermark
    trajectories: int = 0  # dirty trajectories read
    changed: int = 0  # of them, those whose counted contribution changed (new ones included)
    moved: int = 0  # of those, counted before: their old contribution was subtracted
    buckets: int = 0  # buckets that changed
    written: int = 0  # rollup rows written (deleted ones included)
    ms: float = 0.0
    steps: dict[str, float] = field(default_factory=dict)  # milliseconds per step

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _safe_watermark(until: datetime) -> datetime:
    """Where the next refresh starts reading: `until`, or the start of the oldest other transaction on the
    database if earlier, less the clock skew (PostgreSQL); `until` less OVERLAP elsewhere."""
    if connection.vendor != "postgresql":
        return until - OVERLAP
    with connection.cursor() as cursor:
        # Sessions of the platform's own role: every process of it connects with DATABASE_URL's.
        cursor.execute("SELECT min(xact_start) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND xact_start IS NOT NULL AND pid <> pg_backend_pid()")
        oldest = cursor.fetchone()[0]
    return (min(until, oldest) if oldest is not None else until) - CLOCK_SKEW


def _state() -> LiveRollupState:
    state = LiveRollupState.objects.order_by("pk").first()
    return state or LiveRollupState.objects.create()


def _dirty(since: datetime | None):
    from flywheel.trajectories.models import Trajectory

    rows = Trajectory.objects.all()
    return rows if since is None else rows.filter(Q(updated_at__gt=since) | Q(triaged_at__gt=since))


def _hour(value: datetime) -> datetime:
    value = value.astimezone(UTC)
    return value.replace(minute=0, second=0, microsecond=0)


CHUNK = 2000  # dirty trajectories read at a time
# What a refresh reads of each dirty trajectory (`at` and `tokens` are annotations), in `_contribution`'s order.
_ROW_FIELDS = ("id", "project_id", "model_version", "hour_s", "outcome", "reviewed_outcome", "triage_version",
               "latency_ms", "tokens", "tokens_in", "tokens_out", "gpu_ms", "state_at")
_MEMBER_FIELDS = ("trajectory_id", "project_id", "model_version", "hour", "failed", "triaged", "signals", "tokens",
                  "latency", "tokens_in", "tokens_out", "gpu_ms", "seen_at")


def _hour_epoch_sql(vendor: str, column: str) -> str:
    """SQL for the start of `column`'s hour in whole seconds since the epoch: an integer, computed by the
    database, so the rollup neither parses nor truncates a datetime per trajectory in Python."""
    if vendor == "postgresql":
        return f"CAST(EXTRACT(EPOCH FROM date_trunc('hour', {column})) AS bigint)"
    return f"(CAST(strftime('%%s', {column}) AS INTEGER) / 3600 * 3600)"  # %% : the query's params follow


def _from_epoch(seconds: int) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


class Contribution(NamedTuple):
    """What one trajectory adds to its bucket: a `LiveRollupMember` row, as plain values (`hour` in seconds
    since the epoch)."""

    trajectory_id: int
    project_id: int
    model_version: str
    hour: int
    failed: bool
    triaged: bool
    signals: tuple[str, ...]
    tokens: int | None
    latency: int | None
    tokens_in: int | None
    tokens_out: int | None
    gpu_ms: int | None
    seen_at: datetime

    @property
    def key(self) -> tuple[int, str, int]:
        return self.project_id, self.model_version, self.hour

    def counted(self) -> tuple:
        return self[1:12]


@dataclass
class _Counts:
    trajectories: int = 0
    failures: int = 0
    triaged: int = 0
    signals: dict[str, int] = field(default_factory=dict)
    tokens_sum: int = 0
    tokens_n: int = 0
    latency_sum: int = 0
    latency_n: int = 0
    tokens_in_sum: int = 0
    tokens_out_sum: int = 0
    split_n: int = 0
    gpu_ms_sum: int = 0
    gpu_n: int = 0

    def add(self, c: Contribution, sign: int) -> None:
        self.trajectories += sign
        self.failures += sign * c.failed
        self.triaged += sign * c.triaged
        for kind in c.signals:
            self.signals[kind] = self.signals.get(kind, 0) + sign
        if c.tokens is not None:
            self.tokens_sum += sign * c.tokens
            self.tokens_n += sign
        if c.latency is not None:
            self.latency_sum += sign * c.latency
            self.latency_n += sign
        if c.tokens_in is not None and c.tokens_out is not None:
            self.tokens_in_sum += sign * c.tokens_in
            self.tokens_out_sum += sign * c.tokens_out
            self.split_n += sign
        if c.gpu_ms is not None:
            self.gpu_ms_sum += sign * c.gpu_ms
            self.gpu_n += sign


def _contribution(row: tuple, kinds: set[str]) -> Contribution:
    (pk, project_id, model_version, hour, outcome, reviewed, triage_version, latency, tokens, tokens_in, tokens_out,
     gpu_ms, state_at) = row
    triaged = triage_version > 0
    return Contribution(pk, project_id, model_version, hour, (reviewed or outcome) == "failure", triaged,
                        tuple(sorted(kinds)) if triaged else (), tokens,
                        latency if latency is not None and latency >= 0 else None, tokens_in, tokens_out, gpu_ms,
                        state_at)


def _around(model, field: str, ids: list[int]):
    """`model` rows whose `field` is one of the sorted `ids`: a range when they are dense (new trajectories,
    the common case; the few extra rows are dropped by the caller), else the list."""
    if ids[-1] - ids[0] < 4 * len(ids):
        return model.objects.filter(**{f"{field}__gte": ids[0], f"{field}__lte": ids[-1]})
    return model.objects.filter(**{f"{field}__in": ids})


def _members_old(ids: list[int]) -> dict[int, Contribution]:
    wanted = set(ids)
    table = connection.ops.quote_name(LiveRollupMember._meta.db_table)
    hour = RawSQL(_hour_epoch_sql(connection.vendor, f"{table}.hour"), [], output_field=BigIntegerField())
    rows = (_around(LiveRollupMember, "trajectory_id", ids).annotate(hour_s=hour)
            .values_list(*("hour_s" if f == "hour" else f for f in _MEMBER_FIELDS)))
    return {r[0]: Contribution(*r[:6], tuple(r[6] or ()), *r[7:]) for r in rows if r[0] in wanted}


def _members_write(members: list[Contribution]) -> None:
    """Upsert the members in one statement a chunk (the ORM's bulk_create spent ~70 µs a row preparing them)."""
    if not members:
        return
    table = connection.ops.quote_name(LiveRollupMember._meta.db_table)
    columns = ", ".join(_MEMBER_FIELDS)
    updates = ", ".join(f"{f} = excluded.{f}" for f in _MEMBER_FIELDS[1:])
    with connection.cursor() as cursor:
        for first in range(0, len(members), CHUNK):
            part = members[first:first + CHUNK]
            if connection.vendor == "postgresql":
                # One JSON document a chunk, taken apart by the server: psycopg's adaptation of ten arrays cost
                # more than the INSERT itself (it scans every string for quoting).
                rows = json.dumps([[m.trajectory_id, m.project_id, m.model_version, m.hour, m.failed, m.triaged,
                                    list(m.signals), m.tokens, m.latency, m.tokens_in, m.tokens_out, m.gpu_ms,
                                    m.seen_at.isoformat()] for m in part])
                cursor.execute(
                    f"INSERT INTO {table} ({columns}) SELECT (r->>0)::bigint, (r->>1)::bigint, r->>2, "
                    f"to_timestamp((r->>3)::bigint), (r->>4)::bool, (r->>5)::bool, r->6, (r->>7)::bigint, "
                    f"(r->>8)::bigint, (r->>9)::bigint, (r->>10)::bigint, (r->>11)::bigint, (r->>12)::timestamptz "
                    f"FROM jsonb_array_elements(%s::jsonb) AS r "
                    f"ON CONFLICT (trajectory_id) DO UPDATE SET {updates}", [rows])
            else:
                values = [[m.trajectory_id for m in part], [m.project_id for m in part], [m.model_version for m in part],
                          [_from_epoch(m.hour) for m in part], [m.failed for m in part], [m.triaged for m in part],
                          [json.dumps(list(m.signals)) for m in part], [m.tokens for m in part],
                          [m.latency for m in part], [m.tokens_in for m in part], [m.tokens_out for m in part],
                          [m.gpu_ms for m in part], [m.seen_at for m in part]]
                cursor.executemany(
                    f"INSERT INTO {table} ({columns}) VALUES ({', '.join(['%s'] * len(_MEMBER_FIELDS))}) "
                    f"ON CONFLICT (trajectory_id) DO UPDATE SET {updates}", list(zip(*values, strict=True)))


def _chunk_deltas(rows: list[tuple], deltas: dict[tuple, _Counts], members_out: list[Contribution],
                  work: RollupWork) -> None:
    """One chunk of dirty trajectories (their `_ROW_FIELDS`, sorted by id): add each changed one's delta to
    `deltas` and its new contribution to `members_out`."""
    from flywheel.trajectories.models import TriageSignal

    ids = [row[0] for row in rows]
    old = _members_old(ids)
    wanted = set(ids)
    kinds: dict[int, set[str]] = defaultdict(set)
    for trajectory_id, kind in _around(TriageSignal, "trajectory_id", ids).values_list("trajectory_id", "kind"):
        if trajectory_id in wanted:
            kinds[trajectory_id].add(kind)
    for row in rows:
        new = _contribution(row, kinds.get(row[0], set()))
        before = old.get(new.trajectory_id)
        if before is not None and before.counted() == new.counted():
            members_out.append(new)  # nothing counted changed (a note, a tag): remember it was seen
            continue
        if before is not None:
            deltas.setdefault(before.key, _Counts()).add(before, -1)
            work.moved += 1
        deltas.setdefault(new.key, _Counts()).add(new, +1)
        members_out.append(new)
        work.changed += 1


def _apply(deltas: dict[tuple, _Counts]) -> int:
    """Add the deltas to their buckets; a bucket left with no trajectory goes. Returns rows written."""
    by_string: dict[tuple[int, str], list[datetime]] = defaultdict(list)
    for project_id, model_version, hour in deltas:
        by_string[(project_id, model_version)].append(_from_epoch(hour))
    current: dict[tuple, LiveRollup] = {}
    for (project_id, model_version), hours in by_string.items():
        for row in LiveRollup.objects.filter(project_id=project_id, model_version=model_version, hour__in=hours):
            current[(row.project_id, row.model_version, int(row.hour.timestamp()))] = row
    fresh, emptied = [], []
    for key, delta in deltas.items():
        row = current.get(key) or LiveRollup(project_id=key[0], model_version=key[1], hour=_from_epoch(key[2]))
        row.trajectories += delta.trajectories
        row.failures += delta.failures
        row.triaged += delta.triaged
        signals = dict(row.signals or {})
        for kind, n in delta.signals.items():
            signals[kind] = signals.get(kind, 0) + n
        row.signals = {kind: n for kind, n in sorted(signals.items()) if n}
        row.tokens_sum += delta.tokens_sum
        row.tokens_n += delta.tokens_n
        row.latency_sum += delta.latency_sum
        row.latency_n += delta.latency_n
        for name in _COST_SUMMED:
            setattr(row, name, getattr(row, name) + getattr(delta, name))
        if row.trajectories <= 0:
            if row.pk:
                emptied.append(row.pk)
        else:
            fresh.append(row)
    LiveRollup.objects.filter(pk__in=emptied).delete()
    LiveRollup.objects.bulk_create(
        fresh, batch_size=500, update_conflicts=True, unique_fields=["project", "model_version", "hour"],
        update_fields=["trajectories", "failures", "triaged", "signals", "tokens_sum", "tokens_n",
                       "latency_sum", "latency_n", *_COST_SUMMED, "updated_at"])
    return len(fresh) + len(emptied)


# On PostgreSQL one statement does a refresh's work in the database (`_refresh_sql`): the changed trajectories'
# new contributions beside their counted ones, the signed deltas per bucket, the buckets' upsert and the
# members'. Elsewhere (SQLite) Python does it a chunk at a time (`_chunk_deltas`, `_apply`, `_members_write`),
# the same arithmetic, which the tests hold the SQL to. Reading every changed row into Python cost more than
# ingesting it through the API spends on the rollup's budget (~12 µs a row of conversion alone).
IN_SQL = True

# The rollup's sums that price a version's traffic (flywheel.registry.cost).
_COST_SUMMED = ("tokens_in_sum", "tokens_out_sum", "split_n", "gpu_ms_sum", "gpu_n")

_MEMBER_COUNTED = ("project_id", "model_version", "hour", "failed", "triaged", "signals", "tokens", "latency",
                   "tokens_in", "tokens_out", "gpu_ms")


# Without a watermark (the first refresh, a rebuild) every trajectory is read: a statement per id range of this
# size keeps each one's working set in memory at millions of trajectories.
REBUILD_IDS = 50_000


def _refresh_sql(since: datetime | None, work: RollupWork) -> None:
    """The whole refresh as SQL, on PostgreSQL: `work` gets what it found; buckets left with no trajectory go."""
    from flywheel.trajectories.models import Trajectory

    if since is not None:
        ranges: list[tuple[int, int] | None] = [None]
    else:
        low, high = Trajectory.objects.aggregate(low=Min("id"), high=Max("id")).values()
        ranges = [(first, first + REBUILD_IDS - 1) for first in range(low, high + 1, REBUILD_IDS)] if low else []
    with connection.cursor() as cursor:
        # The planner's estimates for a statement this size cross the JIT threshold, and compiling it cost
        # three times what running it does (70 ms against 25 ms for 1,000 trajectories).
        cursor.execute("SET LOCAL jit = off")
        for ids in ranges:
            cursor.execute(refresh_statement(since=since is not None, ids=ids is not None),
                           {"since": since, "first": ids and ids[0], "last": ids and ids[1]})
            trajectories, changed, moved, buckets, emptied, _ = cursor.fetchone()
            work.trajectories += trajectories
            work.changed += changed
            work.moved += moved
            work.buckets += buckets
            if emptied:  # a statement cannot change a row its own upsert wrote: the empty buckets go after it
                cursor.execute(f"DELETE FROM {connection.ops.quote_name(LiveRollup._meta.db_table)} "
                               "WHERE id = ANY(%s) AND trajectories <= 0", [emptied])
    work.written = work.buckets


def refresh_statement(*, since: bool, ids: bool = False) -> str:
    """The refresh's one statement (PostgreSQL), reading the trajectories changed after `%(since)s` when
    `since`, those with ids from `%(first)s` to `%(last)s` when `ids`."""
    from flywheel.trajectories.models import Trajectory, TriageSignal

    q = connection.ops.quote_name
    t, member, rollup = (q(m._meta.db_table) for m in (Trajectory, LiveRollupMember, LiveRollup))
    signal = q(TriageSignal._meta.db_table)
    state_at = f"GREATEST({t}.updated_at, COALESCE({t}.triaged_at, {t}.updated_at))"
    changed_since = f"({t}.updated_at > %(since)s OR {t}.triaged_at > %(since)s) AND " if since else ""
    if ids:
        changed_since += f"{t}.id BETWEEN %(first)s AND %(last)s AND "
    new = ", ".join(f"d.{c}" for c in _MEMBER_COUNTED)
    old = ", ".join(f"d.o_{c}" for c in _MEMBER_COUNTED)
    columns = ", ".join(_MEMBER_FIELDS)
    member_updates = ", ".join(f"{f} = excluded.{f}" for f in _MEMBER_FIELDS[1:])
    added = ("trajectories", "failures", "triaged", "tokens_sum", "tokens_n", "latency_sum", "latency_n",
             *_COST_SUMMED)
    tokens_in, tokens_out = split_sql("postgresql")
    rollup_updates = ", ".join(f"{c} = r.{c} + d.{c}" for c in added)
    return f"""
    WITH dirty AS MATERIALIZED (
        SELECT {t}.id AS trajectory_id, {t}.project_id, {t}.model_version,
               date_trunc('hour', COALESCE({t}.started_at, {t}.created_at)) AS hour,
               COALESCE(NULLIF({t}.reviewed_outcome, ''), {t}.outcome) = 'failure' AS failed,
               {t}.triage_version > 0 AS triaged,
               CASE WHEN {t}.triage_version > 0 THEN COALESCE(
                   (SELECT jsonb_agg(DISTINCT s.kind COLLATE "C" ORDER BY s.kind COLLATE "C") FROM {signal} s
                    WHERE s.trajectory_id = {t}.id), '[]'::jsonb) ELSE '[]'::jsonb END AS signals,
               {tokens_sql("postgresql")} AS tokens,
               CASE WHEN {t}.latency_ms >= 0 THEN {t}.latency_ms END AS latency,
               {tokens_in} AS tokens_in, {tokens_out} AS tokens_out, {gpu_ms_sql("postgresql")} AS gpu_ms,
               {state_at} AS seen_at,
               o.trajectory_id IS NOT NULL AS had,
               {", ".join(f"o.{c} AS o_{c}" for c in _MEMBER_COUNTED)}
        FROM {t} LEFT JOIN {member} o ON o.trajectory_id = {t}.id
        -- Only what changed since it was counted: a row read again within the overlap is passed over here.
        WHERE {changed_since}(o.trajectory_id IS NULL OR o.seen_at < {state_at})
    ), changed AS (
        SELECT * FROM dirty d WHERE NOT d.had OR ({old}) IS DISTINCT FROM ({new})
    ), signed AS (
        SELECT {new}, 1 AS sign FROM changed d
        UNION ALL
        SELECT {old}, -1 FROM changed d WHERE d.had
    ), kinds AS (
        SELECT project_id, model_version, hour, jsonb_object_agg(kind, n) AS signals FROM (
            SELECT project_id, model_version, hour, k.kind, sum(sign) AS n
            FROM signed CROSS JOIN LATERAL jsonb_array_elements_text(signed.signals) AS k(kind)
            GROUP BY 1, 2, 3, 4 HAVING sum(sign) <> 0) AS per_kind
        GROUP BY 1, 2, 3
    ), sums AS (
        SELECT project_id, model_version, hour, sum(sign) AS trajectories,
               sum(CASE WHEN failed THEN sign ELSE 0 END) AS failures,
               sum(CASE WHEN triaged THEN sign ELSE 0 END) AS triaged,
               COALESCE(sum(sign * tokens), 0) AS tokens_sum,
               sum(CASE WHEN tokens IS NOT NULL THEN sign ELSE 0 END) AS tokens_n,
               COALESCE(sum(sign * latency), 0) AS latency_sum,
               sum(CASE WHEN latency IS NOT NULL THEN sign ELSE 0 END) AS latency_n,
               COALESCE(sum(sign * tokens_in), 0) AS tokens_in_sum,
               COALESCE(sum(sign * tokens_out), 0) AS tokens_out_sum,
               sum(CASE WHEN tokens_in IS NOT NULL THEN sign ELSE 0 END) AS split_n,
               COALESCE(sum(sign * gpu_ms), 0) AS gpu_ms_sum,
               sum(CASE WHEN gpu_ms IS NOT NULL THEN sign ELSE 0 END) AS gpu_n
        FROM signed GROUP BY 1, 2, 3
    ), deltas AS (
        SELECT s.*, COALESCE(k.signals, '{{}}'::jsonb) AS signals
        FROM sums s LEFT JOIN kinds k USING (project_id, model_version, hour)
    ), up AS (
        -- Buckets counted before take their deltas; an INSERT .. ON CONFLICT cannot, since PostgreSQL checks the
        -- proposed row (a negative delta) against the columns' CHECK before it finds the conflict.
        UPDATE {rollup} r SET {rollup_updates}, updated_at = now(),
            signals = COALESCE((SELECT jsonb_object_agg(e.kind, e.n) FROM (
                SELECT kind, sum(n::bigint) AS n FROM (
                    SELECT * FROM jsonb_each_text(r.signals) UNION ALL SELECT * FROM jsonb_each_text(d.signals)
                ) AS both_(kind, n) GROUP BY kind HAVING sum(n::bigint) <> 0) AS e), '{{}}'::jsonb)
        FROM deltas d
        WHERE r.project_id = d.project_id AND r.model_version = d.model_version AND r.hour = d.hour
        RETURNING r.id, r.trajectories
    ), fresh AS (
        -- New buckets (one refresh at a time: no other writer makes them meanwhile).
        INSERT INTO {rollup} (project_id, model_version, hour, {", ".join(added)}, signals, updated_at)
        SELECT d.project_id, d.model_version, d.hour, {", ".join(f"d.{c}" for c in added)}, d.signals, now()
        FROM deltas d WHERE d.trajectories > 0 AND NOT EXISTS (
            SELECT 1 FROM {rollup} r
            WHERE r.project_id = d.project_id AND r.model_version = d.model_version AND r.hour = d.hour)
        RETURNING 1
    ), members AS (
        INSERT INTO {member} ({columns}) SELECT {columns} FROM dirty
        ON CONFLICT (trajectory_id) DO UPDATE SET {member_updates}
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM dirty), (SELECT count(*) FROM changed), (SELECT count(*) FROM changed WHERE had),
           (SELECT count(*) FROM up) + (SELECT count(*) FROM fresh),
           (SELECT array_agg(id) FROM up WHERE trajectories <= 0),
           (SELECT count(*) FROM members)
    """


def rollup_refresh(*, full: bool = False) -> RollupWork:
    """Bring the rollup up to date with the trajectories changed since the watermark (or rebuild it from every
    trajectory, `full`), then move the watermark. One refresh at a time: a second one finds the watermark held
    and returns at once (`skipped`). What the sweep's task, the bench and the tests call."""
    work = RollupWork()
    t_start = time.perf_counter()
    _state()  # the one row exists before it is locked
    with transaction.atomic():
        state = LiveRollupState.objects.select_for_update(skip_locked=True).order_by("pk").first()
        if state is None:
            work.skipped = True
            return work
        until = timezone.now()
        if full:
            LiveRollup.objects.all().delete()
            LiveRollupMember.objects.all().delete()
        since = None if full else state.watermark
        if IN_SQL and connection.vendor == "postgresql":
            t0 = time.perf_counter()
            _refresh_sql(since, work)
            work.steps["sql"] = (time.perf_counter() - t0) * 1000
            return _finish(state, until, work, t_start)
        # Only what changed since it was counted: a row read again within the overlap with nothing newer is
        # passed over in SQL (one probe of the member table's primary key).
        counted = LiveRollupMember.objects.filter(trajectory_id=OuterRef("id"), seen_at__gte=OuterRef("state_at"))
        tokens = RawSQL(tokens_sql(connection.vendor), [], output_field=BigIntegerField())
        tokens_in, tokens_out = (RawSQL(sql, [], output_field=BigIntegerField()) for sql in split_sql(connection.vendor))
        gpu_ms = RawSQL(gpu_ms_sql(connection.vendor), [], output_field=BigIntegerField())
        trajectories = connection.ops.quote_name("trajectories_trajectory")
        hour = RawSQL(_hour_epoch_sql(connection.vendor, f"COALESCE({trajectories}.started_at, {trajectories}.created_at)"),
                      [], output_field=BigIntegerField())
        dirty = _dirty(since).annotate(state_at=Greatest(F("updated_at"), Coalesce(F("triaged_at"), F("updated_at"))))
        if since is not None:  # with no watermark every trajectory is read, and no member is there to compare
            dirty = dirty.filter(~Exists(counted))
        dirty = dirty.annotate(hour_s=hour, tokens=tokens, tokens_in=tokens_in, tokens_out=tokens_out,
                               gpu_ms=gpu_ms).order_by("id").values_list(*_ROW_FIELDS)

        t0 = time.perf_counter()
        deltas: dict[tuple, _Counts] = {}
        members: list[Contribution] = []
        after = 0
        while True:
            rows = list(dirty.filter(id__gt=after)[:CHUNK])
            if not rows:
                break
            work.trajectories += len(rows)
            after = rows[-1][0]
            _chunk_deltas(rows, deltas, members, work)
        work.steps["read"] = (time.perf_counter() - t0) * 1000

        t0 = time.perf_counter()
        work.buckets = len(deltas)
        work.written = _apply(deltas)
        _members_write(members)
        work.steps["write"] = (time.perf_counter() - t0) * 1000

        return _finish(state, until, work, t_start)


def _finish(state: LiveRollupState, until: datetime, work: RollupWork, t_start: float) -> RollupWork:
    """Move the watermark and record what the refresh did, in its transaction."""
    work.ms = (time.perf_counter() - t_start) * 1000
    state.watermark, state.ran_at = _safe_watermark(until), timezone.now()
    state.last_trajectories, state.last_buckets, state.last_ms = work.trajectories, work.buckets, round(work.ms)
    state.save()
    return work


def rollup_sweep() -> int:
    """flywheel.outbox.SWEEPS: hand a worker the refresh when trajectories changed past the watermark (a late
    commit included: the watermark is held back for it). Cheap: one probe on the updated_at and triaged_at
    indexes. Returns how many messages were sent (0 or 1)."""
    from flywheel import outbox
    from flywheel.registry.tasks import live_rollup_task

    state = LiveRollupState.objects.order_by("pk").first()
    watermark = state.watermark if state else None
    if not _dirty(watermark).exists():
        return 0
    try:
        outbox.send(live_rollup_task)
    except outbox.BrokerUnavailable:
        return 0
    return 1


# --- reading it ------------------------------------------------------------------------------------------

# The windows a page or the API may ask for: (length, series step). The hours that overlap the window are
# read, so a window covers up to an hour more than it says (the current hour is partial).
WINDOWS: dict[str, tuple[timedelta, str]] = {
    "1h": (timedelta(hours=1), "hour"),
    "24h": (timedelta(hours=24), "hour"),
    "7d": (timedelta(days=7), "hour"),
    "30d": (timedelta(days=30), "day"),
}
DEFAULT_WINDOW = "24h"


class WindowError(ValueError):
    pass


def window_bounds(window: str, now: datetime | None = None) -> tuple[datetime, datetime, str]:
    """(first hour, last hour, step) of a window; WindowError naming the windows for another value."""
    if window not in WINDOWS:
        raise WindowError(f"window must be one of {', '.join(WINDOWS)}, not {window[:20]!r}.")
    length, step = WINDOWS[window]
    now = now or timezone.now()
    last = _hour(now)
    first = _hour(now - length)
    if step == "day":
        first = first.replace(hour=0)
    return first, last, step


def _signal_kinds() -> list[tuple[str, str]]:
    from flywheel.trajectories.models import SignalKind

    return list(SignalKind.choices)


def _empty() -> dict[str, Any]:
    return {"trajectories": 0, "failures": 0, "triaged": 0, "signals": defaultdict(int), "tokens_sum": 0,
            "tokens_n": 0, "latency_sum": 0, "latency_n": 0, **dict.fromkeys(_COST_SUMMED, 0)}


def _add(total: dict[str, Any], row: dict[str, Any]) -> None:
    for key in _SUMMED:
        total[key] += row[key]
    for kind, n in (row["signals"] or {}).items():
        total["signals"][kind] += n


def _rate(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def metrics_of(total: dict[str, Any]) -> dict[str, Any]:
    """The metrics of summed rollup rows: a flat dict, so that another source (live verifier scores) adds its
    own keys beside these."""
    return {
        "trajectories": total["trajectories"],
        "failures": total["failures"],
        "failure_rate": _rate(total["failures"], total["trajectories"]),
        "triaged": total["triaged"],
        "tokens_per_trajectory": _rate(total["tokens_sum"], total["tokens_n"]),
        "tokens_n": total["tokens_n"],
        "latency_ms_per_trajectory": _rate(total["latency_sum"], total["latency_n"]),
        "latency_n": total["latency_n"],
        "input_tokens_per_trajectory": _rate(total["tokens_in_sum"], total["split_n"]),
        "output_tokens_per_trajectory": _rate(total["tokens_out_sum"], total["split_n"]),
        "split_n": total["split_n"],
        "gpu_seconds_per_trajectory": _rate(total["gpu_ms_sum"], 1000 * total["gpu_n"]),
        "gpu_n": total["gpu_n"],
    }


def signals_of(total: dict[str, Any]) -> list[dict[str, Any]]:
    """Each triage signal's count and rate among the triaged trajectories, in SignalKind's order."""
    return [{"kind": kind, "label": str(label), "trajectories": total["signals"].get(kind, 0),
             "rate": _rate(total["signals"].get(kind, 0), total["triaged"])} for kind, label in _signal_kinds()]


_SUMMED = ("trajectories", "failures", "triaged", "tokens_sum", "tokens_n", "latency_sum", "latency_n", *_COST_SUMMED)


def _rows(project: Project, first: datetime, last: datetime, step: str, names: list[str] | None = None):
    """The window's rollup rows summed per string and step (hour, or day) in the database, each signal kind's
    count from its key of `signals`: a month of a string is 31 rows to the page, not 720 JSON documents."""
    from django.db.models.fields.json import KT
    from django.db.models.functions import Cast, TruncDay

    rows = LiveRollup.objects.filter(project=project, hour__gte=first, hour__lte=last)
    if names is not None:
        rows = rows.filter(model_version__in=names)
    slot = TruncDay("hour") if step == "day" else F("hour")
    sums = {k: Sum(k) for k in _SUMMED}
    sums.update({f"signal_{kind}": Sum(Cast(KT(f"signals__{kind}"), BigIntegerField())) for kind, _ in _signal_kinds()})
    for row in rows.annotate(slot=slot).values("model_version", "slot").order_by().annotate(**sums):
        signals = {kind: row.pop(f"signal_{kind}") or 0 for kind, _ in _signal_kinds()}
        yield {**row, **{k: row[k] or 0 for k in _SUMMED}, "signals": signals}


def _steps(first: datetime, last: datetime, step: str) -> list[datetime]:
    out, at, delta = [], first, (HOUR if step == "hour" else timedelta(days=1))
    while at <= last:
        out.append(at)
        at += delta
    return out


def _slot(at: datetime) -> datetime:
    return at.astimezone(UTC)


def _series(per_slot: dict[datetime, dict[str, Any]], slots: list[datetime], step: str) -> dict[str, Any]:
    rows = [per_slot.get(s) or _empty() for s in slots]
    return {"step": step, "t": [int(s.timestamp()) for s in slots],
            "trajectories": [r["trajectories"] for r in rows],
            "failures": [r["failures"] for r in rows],
            "failure_rate": [_rate(r["failures"], r["trajectories"]) for r in rows]}


# Other live measures of a version, from apps above this one (online evaluation's verifier scores, registered
# in EvalsConfig.ready): functions `(project=, version=, start=, end=) -> dict` whose keys join `metrics`
# ([start, end): the window's whole hours).
METRIC_SOURCES: list[Callable[..., dict[str, Any]]] = []


def metric_source_register(source: Callable[..., dict[str, Any]]) -> None:
    if source not in METRIC_SOURCES:
        METRIC_SOURCES.append(source)


def _extra_metrics(project: Project, version: ModelVersion, first: datetime, last: datetime) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    for source in METRIC_SOURCES:
        extra.update(source(project=project, version=version, start=first, end=last + HOUR))
    return extra


def live_metrics(*, project: Project, version: ModelVersion, window: str = DEFAULT_WINDOW,
                 now: datetime | None = None) -> dict[str, Any]:
    """A version's live metrics over `window` (WINDOWS), summed from the rollup rows of the strings that name
    it: `metrics` (flat, extensible), `signals` (each kind's rate among triaged trajectories), `series` (per
    hour, per day for 30d: trajectories, failures, failure rate) and `names` (the strings counted)."""
    first, last, step = window_bounds(window, now)
    names = names_of(project=project, version=version)
    total, per_slot = _empty(), defaultdict(_empty)
    for row in _rows(project, first, last, step, names):
        _add(total, row)
        _add(per_slot[_slot(row["slot"])], row)
    metrics = metrics_of(total)
    return {"version": version.number, "window": window, "from": first, "to": last + HOUR, "names": names,
            "metrics": {**metrics, **_extra_metrics(project, version, first, last)},
            "cost": cost.cost_of(metrics, cost.price_of(version)),
            "signals": signals_of(total),
            "series": _series(per_slot, _steps(first, last, step), step)}


def live_summary(*, project: Project, window: str = DEFAULT_WINDOW, now: datetime | None = None) -> dict[str, Any]:
    """The Models page's panel: every version with traffic in the window (production, then the canary, then
    by number, newest first) with its metrics and series, and the unmapped strings with their counts. One
    read of the window's rollup rows."""
    first, last, step = window_bounds(window, now)
    mapping = name_map(project=project)
    slots = _steps(first, last, step)
    totals: dict[int, dict[str, Any]] = defaultdict(_empty)
    per_slot: dict[int, dict[datetime, dict[str, Any]]] = defaultdict(lambda: defaultdict(_empty))
    unmapped: dict[str, int] = defaultdict(int)
    versions: dict[int, ModelVersion] = {}
    for row in _rows(project, first, last, step):
        version = mapping.get(row["model_version"])
        if version is None:
            unmapped[row["model_version"]] += row["trajectories"]
            continue
        versions[version.pk] = version
        _add(totals[version.pk], row)
        _add(per_slot[version.pk][_slot(row["slot"])], row)
    aliases = {a.version_id: a for a in AliasAssignment.objects.filter(
        project=project, alias__in=[Alias.PRODUCTION, Alias.CANARY])}

    def order(version: ModelVersion) -> tuple[int, int]:
        alias = aliases.get(version.pk)
        rank = 0 if alias and alias.alias == Alias.PRODUCTION else 1 if alias else 2
        return rank, -version.number

    rows = []
    for version in sorted(versions.values(), key=order):
        alias = aliases.get(version.pk)
        total = totals[version.pk]
        unsafe = next(s for s in signals_of(total) if s["kind"] == "unsafe_action")
        metrics = metrics_of(total)
        rows.append({"version": version, "number": version.number,
                     "alias": alias.alias if alias else "", "weight": alias.weight if alias else None,
                     "metrics": metrics, "cost": cost.cost_of(metrics, cost.price_of(version)), "unsafe": unsafe,
                     "series": _series(per_slot[version.pk], slots, step)})
    return {"window": window, "windows": list(WINDOWS), "from": first, "to": last + HOUR, "rows": rows,
            "unmapped": sorted(({"name": n, "trajectories": c} for n, c in unmapped.items()),
                               key=lambda u: (-u["trajectories"], u["name"]))}


def rollup_state() -> LiveRollupState | None:
    return LiveRollupState.objects.order_by("pk").first()


def live_between(*, project: Project, version: ModelVersion, start: datetime, end: datetime) -> dict[str, Any]:
    """A version's metrics (`metrics_of`) and cost (flywheel.registry.cost.cost_of) over the whole hours within
    [start, end): what a promotion's before and after compare (the hour that holds the move counts on neither
    side)."""
    first, last = _hour(start), _hour(end) - HOUR
    if first < start:
        first += HOUR
    total = _empty()
    if last >= first:
        for row in _rows(project, first, last, "hour", names_of(project=project, version=version)):
            _add(total, row)
    metrics = metrics_of(total)
    return {"metrics": metrics, "cost": cost.cost_of(metrics, cost.price_of(version)), "from": first,
            "to": last + HOUR}
