"""The one service that ingests trajectories: the REST API, JSONL uploads, OTLP, the `ingest` command and
the demo seeding all call `ingest_trajectories`.

Each record is validated on its own, so one bad record never costs the others; the valid ones are written
with a single upsert per chunk (INSERT ... ON CONFLICT (project_id, external_id) DO UPDATE), so a replay
updates and never duplicates, even when the same batch arrives twice at the same moment: the unique
constraint decides, not a check-then-insert. What reviewers added (reviewed outcome, tags, comments) lives
in columns and tables the upsert never touches, so it survives a replay.

A trajectory sent without `started_at` starts when it was first received (its `created_at`), so that the
date filters, which read `started_at` alone, find it; a replay without `started_at` keeps that time.

A record's evidence token (`metadata.flywheel_evidence`, the router's) is checked here (flywheel.trajectories.vouch)
and its verdict stored with who sent it, since each door passes its sender (`ingested_by`)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
from django.db import connection, transaction
from django.utils import timezone

from flywheel.accounts.models import Project
from flywheel.trajectories.models import Trajectory
from flywheel.trajectories.schemas import (
    JSON_FIELDS,
    TrajectoryIn,
    UnparsableRecord,
    printable,
    validate_record,
)
from flywheel.trajectories.vouch import Claim, token_of, vouch_claims

TITLE_MAX = 200
# Characters. Enough for a reviewer's text search; small because search_text carries a trigram index,
# whose upkeep is a large share of the cost of an insert.
SEARCH_TEXT_MAX = 8_000
UPSERT_CHUNK = 1_000  # rows per INSERT statement
JSONL_CHUNK = 1_000  # JSONL lines per ingest call when a file is streamed

# Columns the agent owns: set on insert and overwritten by a replay. The review columns are not here.
_REPLACED = (
    "agent",
    "model_version",
    "messages",
    "tools",
    "outcome",
    "feedback",
    "human_intervention",
    "latency_ms",
    "usage",
    "metadata",
    "started_at",
    "source",
    "message_count",
    "tool_call_count",
    "has_tool_error",
    "title",
    "search_text",
    "updated_at",
    "triage_version",  # 0: a replay is triaged again (flywheel.trajectories.triage)
    "vouch",  # checked again on every replay (flywheel.trajectories.vouch)
    "vouch_request",
    "ingested_by",  # who sent it last
)
_JSON_COLUMNS = JSON_FIELDS  # one jsonb column per JSON field of the contract
_EMPTY: dict[str, Any] = {"tools": [], "metadata": {}}  # what the contract defaults them to
_INSERTED = ("project_id", "external_id", *_REPLACED, "reviewed_outcome", "created_at")


@dataclass
class IngestResult:
    accepted: int = 0
    created: int = 0
    updated: int = 0
    # [{"index": i, "external_id": ..., "errors": [{"field": ..., "message": ...}]}]
    rejected: list[dict[str, Any]] = field(default_factory=list)
    # [{"index": i, "external_id": ..., "id": trajectory id}] for every accepted record, in the order sent
    records: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "accepted": self.accepted,
            "created": self.created,
            "updated": self.updated,
            "rejected": self.rejected,
            "records": self.records,
        }

    def merge(self, other: IngestResult, *, index_offset: int = 0) -> None:
        """Add `other`'s counts and rejections. Accepted records' ids are not kept: a long upload or
        `manage.py ingest` would hold one entry per line for an answer nobody reads."""
        self.accepted += other.accepted
        self.created += other.created
        self.updated += other.updated
        for item in other.rejected:
            self.rejected.append({**item, "index": item["index"] + index_offset})


def sender_of_key(api_key: Any) -> str:
    """`ingested_by` of what an API key sends."""
    return f"key:{api_key.pk}"


def sender_of_user(user_id: int | None) -> str:
    """`ingested_by` of what a person uploads ("" when nobody is known)."""
    return f"user:{user_id}" if user_id else ""


def rejection(index: int, record: Any, errors: list[dict[str, str]]) -> dict[str, Any]:
    external_id = record.get("external_id") if isinstance(record, dict) else None
    if isinstance(external_id, str):
        # Sent back and kept with an upload's errors: a lone surrogate or NUL there would break both.
        external_id = printable(external_id)
    elif isinstance(external_id, bool) or not isinstance(external_id, int | None):
        external_id = None
    return {"index": index, "external_id": external_id, "errors": errors}


# --- JSONL ----------------------------------------------------------------------------------------------


def jsonl_records(lines: Iterable[bytes]) -> Iterator[tuple[int, Any]]:
    """(line index from 0, record) for each non-blank line of JSONL, as a binary file iterates them.

    The API's NDJSON bodies, UI uploads and `manage.py ingest` all read JSONL here. A line that is not JSON
    becomes an `UnparsableRecord`, which ingestion rejects alone; blank lines are skipped but counted, so
    that the index is the line's."""
    for index, line in enumerate(lines):
        if index == 0:
            line = line.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark, as some editors write
        if not line.strip():
            continue
        try:
            yield index, json.loads(line)
        except (ValueError, RecursionError) as exc:
            # ValueError: also UnicodeDecodeError, and an integer of more digits than Python reads (4300).
            # The line is the record's index; where in the line JSON broke is in `exc`.
            yield index, UnparsableRecord(f"not valid JSON: {json_error_text(exc)}")


def json_error_text(exc: Exception) -> str:
    """Why `json.loads` refused, for the client: a depth error says so; Python's advice on its integer
    digit limit (`sys.set_int_max_str_digits`) is cut."""
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc).split(";")[0]


def jsonl_chunks(lines: Iterable[bytes], size: int = JSONL_CHUNK) -> Iterator[tuple[list[int], list[Any]]]:
    """`jsonl_records` `size` at a time, as (line indexes, records): what `ingest_trajectories` takes."""
    numbered = jsonl_records(lines)
    while chunk := list(itertools.islice(numbered, size)):
        yield [index for index, _ in chunk], [record for _, record in chunk]


# --- derived fields --------------------------------------------------------------------------------------

_ERROR_PREFIXES = ("error", "exception", "traceback", "failed", "fatal")


def content_text(content: Any) -> str:
    """The text of a message's content: the string itself, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            text = part.get("text") if isinstance(part, dict) else None
            if isinstance(text, str):
                texts.append(text)
        return "\n".join(texts)
    return ""


def is_tool_error(message: dict[str, Any]) -> bool:
    """Whether a tool message reports an error: an explicit flag, a JSON object with an `error`, or text
    that starts like one ("Error: ...", "Traceback ...")."""
    if message.get("is_error") is True or message.get("status") == "error" or message.get("error"):
        return True
    text = content_text(message.get("content")).lstrip()
    if not text:
        return False
    if text[0] == "{":
        if '"error"' not in text and '"is_error"' not in text and '"status"' not in text:
            return False  # most results: no need to parse them
        try:
            payload = json.loads(text)
        except (ValueError, RecursionError):  # a result nested past Python's limit is text, not an error
            return False
        return isinstance(payload, dict) and bool(
            payload.get("error") or payload.get("is_error") is True or payload.get("status") == "error"
        )
    return text[:16].lower().startswith(_ERROR_PREFIXES)


def derive(messages: list[dict[str, Any]], metadata: dict[str, Any]) -> dict[str, Any]:
    """message_count, tool_call_count, has_tool_error, title and search_text, in one pass over the messages.

    search_text is the lower-cased text of the user and assistant messages and of the tool calls (name and
    arguments), then of the tool results with what room is left, cut at SEARCH_TEXT_MAX characters: one
    large tool result early on must not push the rest of the conversation out of the search."""
    tool_calls = 0
    tool_error = bool(metadata.get("has_tool_error") or metadata.get("tool_error"))
    title = ""
    said: list[str] = []  # user and assistant text, tool calls
    said_size = 0
    results: list[str] = []  # tool results
    results_size = 0
    for message in messages:
        role = message.get("role")
        text = content_text(message.get("content"))
        calls = message.get("tool_calls") or ()
        tool_calls += len(calls)
        if role == "tool":
            if not tool_error:
                tool_error = is_tool_error(message)
            if text and results_size < SEARCH_TEXT_MAX:
                results.append(text)
                results_size += len(text) + 1
            continue
        if role == "user" and not title and text.strip():
            title = " ".join(text.split())[:TITLE_MAX]
        # System prompts are left out: they are the same on every trajectory of an agent, so they would
        # match every search and crowd the conversation out of the capped text.
        if said_size < SEARCH_TEXT_MAX and role not in ("system", "developer"):
            if text:
                said.append(text)
                said_size += len(text) + 1
            for call in calls:
                function = call.get("function") or {}
                arguments = function.get("arguments")
                piece = f"{function.get('name', '')} {arguments if isinstance(arguments, str) else json.dumps(arguments)}"
                said.append(piece)
                said_size += len(piece) + 1
    search_text = "\n".join(said + results)[:SEARCH_TEXT_MAX].lower()
    return {
        "message_count": len(messages),
        "tool_call_count": tool_calls,
        "has_tool_error": tool_error,
        "title": title.replace("\x00", "\ufffd"),
        "search_text": search_text.replace("\x00", "\ufffd"),
    }


# --- rows ------------------------------------------------------------------------------------------------


def _aware(value: datetime | None) -> datetime | None:
    if value is not None and timezone.is_naive(value):
        return value.replace(tzinfo=UTC)
    return value


def _row(
    project: Project,
    record: dict[str, Any],
    parsed: TrajectoryIn,
    source: str,
    now: datetime,
    *,
    json_as_text: bool,
) -> dict[str, Any]:
    """The columns of one trajectory. The JSON columns hold what `validate_record` serialised (as sent,
    extra keys included, NUL replaced): the text when `json_as_text` (PostgreSQL sends it), else values
    for Django's JSONField, read back from the text where a NUL was replaced, so that SQLite stores what
    PostgreSQL would."""
    stored = parsed.stored_json
    row = {
        "project_id": project.pk,
        "external_id": parsed.external_id,
        "agent": parsed.agent.replace("\x00", "\ufffd"),
        "model_version": parsed.model_version.replace("\x00", "\ufffd"),
        "outcome": parsed.outcome,
        "latency_ms": parsed.latency_ms,
        "started_at": _aware(parsed.started_at),  # None: not sent; the upsert decides (see the module doc)
        "source": source,
        "reviewed_outcome": "",
        "triage_version": 0,
        "created_at": now,
        "updated_at": now,
    }
    for column in _JSON_COLUMNS:
        text = stored[column]
        if json_as_text or text is None:
            row[column] = text
        elif "\ufffd" in text:  # perhaps a NUL replaced (rare)
            row[column] = json.loads(text)
        else:
            value = record.get(column)
            row[column] = _EMPTY[column] if value is None else value  # text not None: a default or a value
    row.update(derive(record["messages"], parsed.metadata))
    return row


# --- the service -----------------------------------------------------------------------------------------


def ingest_trajectories(
    *, project: Project, records: list[Any], source: str = "api", indexes: Sequence[int] | None = None,
    ingested_by: str = "",
) -> IngestResult:
    """Validate each record and upsert the valid ones into `project`; say what became of every record.

    `rejected[i].index` is the record's position in `records`, or `indexes[position]` when given (a JSONL
    record's line). A record whose external_id appears again later in the same batch is superseded by the
    later one (counted as an update). `ingested_by` names the sender (`sender_of_key`, `sender_of_user`; ""
    for the command line and the demo): one sender's share of a canary's evidence is capped by it."""
    result = IngestResult()
    now = timezone.now()
    rows: dict[str, dict[str, Any]] = {}  # external_id -> row; the last record with an id wins
    accepted: list[tuple[int, str]] = []  # (index, external_id) of each accepted record
    claims: list[Claim] = []  # the evidence each accepted record claims, in order
    postgresql = connection.vendor == "postgresql"
    for position, record in enumerate(records):
        parsed, errors = validate_record(record)
        index = indexes[position] if indexes is not None else position
        if errors:
            result.rejected.append(rejection(index, record, errors))
            continue
        result.accepted += 1
        accepted.append((index, parsed.external_id))
        if parsed.external_id in rows:
            result.updated += 1
        rows[parsed.external_id] = _row(project, record, parsed, source, now, json_as_text=postgresql)
        claims.append(Claim(parsed.external_id, rows[parsed.external_id]["model_version"], token_of(parsed.metadata)))
    if not rows:
        return result
    vouched = vouch_claims(project=project, claims=claims, ingested_by=ingested_by, now=now)
    for external_id, row in rows.items():
        row["vouch"], row["vouch_request"] = vouched.get(external_id, ("", ""))
        row["ingested_by"] = ingested_by

    # One lock order for every writer (sorted keys), so two batches with the same ids never deadlock.
    ordered = [rows[key] for key in sorted(rows)]
    if postgresql:
        created, ids = _upsert_postgresql(ordered)
    else:
        created, ids = _upsert_portable(project, ordered)
    result.created += created
    result.updated += len(ordered) - created
    result.records = [{"index": index, "external_id": external_id, "id": ids[external_id]}
                      for index, external_id in accepted]
    from flywheel.trajectories.triage import triage_request  # triage imports this module

    triage_request(project_id=project.pk)  # a worker triages them once this commits
    return result


_PG_TYPES = {
    "project_id": "bigint",
    "latency_ms": "integer",
    "message_count": "integer",
    "tool_call_count": "integer",
    "triage_version": "integer",
    "has_tool_error": "boolean",
    "started_at": "timestamptz",
    "created_at": "timestamptz",
    "updated_at": "timestamptz",
}
_lz4: bool | None = None  # whether this PostgreSQL server can compress with lz4 (asked once per process)


def _upsert_postgresql(rows: list[dict[str, Any]]) -> tuple[int, dict[str, int]]:
    """INSERT ... SELECT FROM unnest(one array per column) ON CONFLICT DO UPDATE ... RETURNING (xmax = 0),
    with each row's id: (how many were created, external_id -> id).

    One array parameter per column rather than one parameter per value: with VALUES (%s, ...) x 500 rows
    the driver spends more time splitting the 10,000-placeholder statement than PostgreSQL spends
    running it. The arrays travel in binary (`%b`) on a server-side-binding cursor: Django's client-side
    binding would quote every JSON document into an array literal with a regex. xmax is 0 only on a
    freshly inserted tuple, which counts created against updated."""
    global _lz4
    table = connection.ops.quote_name(Trajectory._meta.db_table)
    quote = connection.ops.quote_name
    columns = ", ".join(quote(c) for c in _INSERTED)
    arrays = ", ".join(
        f"%b::{'jsonb' if c in _JSON_COLUMNS else _PG_TYPES.get(c, 'text')}[]" for c in _INSERTED
    )
    updates = ", ".join(f"{quote(c)} = EXCLUDED.{quote(c)}" for c in _REPLACED if c != "started_at")
    # A record sent without started_at is inserted with started_at = created_at, the time of this
    # request (the same value on every row of it). On a replay that equality says "not sent": keep the
    # time the trajectory already has. EXCLUDED carries only table columns, so there is no room for a flag.
    started = quote("started_at")
    updates += (
        f", {started} = CASE WHEN EXCLUDED.{started} = EXCLUDED.{quote('created_at')}"
        f" THEN COALESCE({table}.{started}, EXCLUDED.{started}) ELSE EXCLUDED.{started} END"
    )
    sql = (
        f"INSERT INTO {table} ({columns}) SELECT * FROM unnest({arrays}) "
        f"ON CONFLICT (project_id, external_id) DO UPDATE SET {updates} RETURNING (xmax = 0), id, {quote('external_id')}"
    )
    created = 0
    ids: dict[str, int] = {}
    with transaction.atomic():
        connection.ensure_connection()
        cursor = psycopg.Cursor(connection.connection)
        if _lz4 is None:
            cursor.execute(
                "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'"
            )
            found = cursor.fetchone()
            _lz4 = bool(found and found[0])
        if _lz4:
            # Messages are TOASTed; lz4 compresses them several times faster than the default pglz.
            cursor.execute("SET LOCAL default_toast_compression = lz4")
        for start in range(0, len(rows), UPSERT_CHUNK):
            chunk = rows[start : start + UPSERT_CHUNK]
            params = [[row[column] for row in chunk] for column in _INSERTED]
            started_at = _INSERTED.index("started_at")
            params[started_at] = [row["started_at"] or row["created_at"] for row in chunk]
            cursor.execute(sql, params)
            for inserted, pk, external_id in cursor.fetchall():
                created += bool(inserted)
                ids[external_id] = pk
        cursor.close()
    return created, ids


def _upsert_portable(project: Project, rows: list[dict[str, Any]]) -> tuple[int, dict[str, int]]:
    """SQLite (`make run`): Django's bulk upsert. SQLite runs one writer at a time, so what is read of the
    existing rows inside the same write transaction (which ids exist, when they started, the ids written) is
    exact. (how many were created, external_id -> id)"""
    objects = [Trajectory(**row) for row in rows]
    ids = [r["external_id"] for r in rows]
    with transaction.atomic():
        existing: dict[str, datetime | None] = {}  # external_id -> started_at
        for start in range(0, len(ids), UPSERT_CHUNK):  # within SQLite's bound on query parameters
            existing.update(
                Trajectory.objects.filter(
                    project=project, external_id__in=ids[start : start + UPSERT_CHUNK]
                ).values_list("external_id", "started_at")
            )
        for obj in objects:
            if obj.started_at is None:  # not sent: first received, or kept from the first time
                obj.started_at = existing.get(obj.external_id) or obj.created_at
        Trajectory.objects.bulk_create(
            objects,
            batch_size=UPSERT_CHUNK,
            update_conflicts=True,
            unique_fields=["project", "external_id"],
            update_fields=list(_REPLACED),
        )
        written: dict[str, int] = {}
        for start in range(0, len(ids), UPSERT_CHUNK):
            written.update(
                Trajectory.objects.filter(
                    project=project, external_id__in=ids[start : start + UPSERT_CHUNK]
                ).values_list("external_id", "id")
            )
    return len(rows) - len(existing), written
