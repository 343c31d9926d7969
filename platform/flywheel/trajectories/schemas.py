"""The trajectory contract (ARCHITECTURE.md) as pydantic models, and the one check that turns a raw record
into a list of errors, each naming the field by its path (`messages[2].tool_calls[0].function.name`).

Records are validated but stored as sent: the models check shape and types; the message dicts themselves
are kept whole, extra keys included, because reviewers and verifiers want what the agent really produced
(a tool call whose arguments are not valid JSON is a failure to capture, not a record to refuse).

What is stored must also be storable, and readable back, on PostgreSQL (jsonb) and SQLite alike: numbers
are finite (no NaN or Infinity, which Python's JSON reader accepts), text is valid Unicode (no lone
surrogate such as "\\ud800", which a JSON escape can carry), nesting stays within MAX_JSON_DEPTH levels
(deeper documents break the API's serialiser and the review pages), and `started_at` stays within the
years 1 to 9999 once in UTC. A record that breaks one of these is rejected alone, naming each place."""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

MAX_INT32 = 2**31 - 1
ROLES = ("system", "developer", "user", "assistant", "tool")
# Levels of objects and arrays in one field (`metadata`, `messages`, ...), the field's own value being the
# first. pydantic's serialiser (the API's answers) stops near 255 levels and the review pages' indented
# JSON recurses in Python; 64 leaves room for tool schemas nested thirty objects deep.
MAX_JSON_DEPTH = 64
MAX_ERRORS_PER_RECORD = 20
# The JSON fields, in the order they are checked; each is one jsonb (or SQLite JSON) column.
JSON_FIELDS = ("messages", "tools", "feedback", "human_intervention", "usage", "metadata")


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=200)
    # OpenAI sends a JSON-encoded string; some agents send the object. Both are kept as sent, unparsed.
    arguments: str | dict[str, Any] = ""


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, a list of content parts ({"type": "text", "text": ...}), or null for an assistant turn
    # that only calls tools.
    content: Any = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(part, dict) for part in value):
            return value
        raise ValueError("content must be a string, a list of content parts (objects) or null")


class FunctionSchema(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=200)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSchema(BaseModel):
    """An OpenAI function schema: `{"type": "function", "function": {"name", "description", "parameters"}}`."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionSchema


class TrajectoryIn(BaseModel):
    """One trajectory as an agent sends it. `external_id` is unique per project: sending it again updates."""

    # A numeric external_id (or agent, model_version) is taken as its decimal string.
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True)

    external_id: str = Field(min_length=1, max_length=255)
    agent: str = Field("", max_length=200)
    model_version: str = Field("", max_length=200)
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSchema] = Field(default_factory=list)
    outcome: Literal["success", "failure", "unknown"] = "unknown"
    feedback: Any = None
    human_intervention: Any = None
    latency_ms: int | None = Field(None, ge=0, le=MAX_INT32)
    usage: dict[str, Any] | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    started_at: datetime | None = None

    # The JSON fields as the database stores them (compact text, NUL replaced), by field name. Checking that
    # a field is storable takes serialising it, so `validate_record` keeps the text for the upsert to send.
    _stored_json: dict[str, str | None] = PrivateAttr(default_factory=dict)

    @field_validator("started_at")
    @classmethod
    def _started_at_range(cls, value: datetime | None) -> datetime | None:
        # PostgreSQL would store 9999-12-31T23:00-05:00 (year 10000 in UTC), but no Python reader could
        # load it back; SQLite's adapter fails converting it to UTC on the way in.
        if value is not None and value.tzinfo is not None:
            try:
                value.astimezone(UTC)
            except OverflowError as exc:
                raise ValueError("must fall between the years 1 and 9999 once converted to UTC") from exc
        return value

    @property
    def stored_json(self) -> dict[str, str | None]:
        """Field name -> the JSON text the database stores for it (None for SQL NULL)."""
        return self._stored_json


_SURROGATES = re.compile("[\ud800-\udfff]")
_UNSTORABLE_CHARS = re.compile("[\x00\ud800-\udfff]")
KEY_SHOWN_MAX = 80  # characters of an object key shown in a field path


def printable(text: str) -> str:
    """`text` made safe to store and to send back: a lone surrogate or NUL shown as its escape
    (`\\ud800`), as a JSON writer would have written it. Answers, upload errors and logs carry it."""
    if text.isascii() and "\x00" not in text:
        return text
    return _UNSTORABLE_CHARS.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def format_loc(loc: tuple) -> str:
    """('messages', 2, 'tool_calls', 0, 'function', 'name') -> 'messages[2].tool_calls[0].function.name'.
    An object key is shown printable and cut at KEY_SHOWN_MAX characters."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            part = printable(str(part))
            if len(part) > KEY_SHOWN_MAX:
                part = part[:KEY_SHOWN_MAX] + "…"
            out += f".{part}" if out else part
    return out


def _pydantic_errors(exc: ValidationError) -> list[dict[str, str]]:
    errors = []
    for err in exc.errors(include_url=False, include_input=False, include_context=False):
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown field (the trajectory contract has no such field)"
        elif message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        errors.append({"field": format_loc(tuple(err["loc"])), "message": message})
    return errors


def _contract_errors(record: dict[str, Any], parsed: TrajectoryIn) -> list[dict[str, str]]:
    """What the types alone do not say: which roles carry which fields. Runs on a structurally valid record."""
    errors = []
    for i, message in enumerate(record["messages"]):
        role = message["role"]
        tool_calls = message.get("tool_calls")
        if tool_calls and role != "assistant":
            errors.append(
                {
                    "field": f"messages[{i}].tool_calls",
                    "message": f"only assistant messages carry tool_calls, not {role}",
                }
            )
        if role == "tool":
            if not message.get("tool_call_id") and not message.get("name"):
                errors.append(
                    {
                        "field": f"messages[{i}].tool_call_id",
                        "message": "a tool message needs tool_call_id (or at least name)",
                    }
                )
        elif message.get("content") is None and not (role == "assistant" and tool_calls):
            errors.append({"field": f"messages[{i}].content", "message": f"a {role} message needs content"})
    if "\x00" in parsed.external_id:
        errors.append({"field": "external_id", "message": "must not contain a NUL character"})
    return errors


# --- storable JSON ---------------------------------------------------------------------------------------


def strip_nul(value: Any) -> Any:
    """PostgreSQL cannot store U+0000 in text or jsonb; agents do emit it. Replace it, keep the rest."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, list):
        return [strip_nul(v) for v in value]
    if isinstance(value, dict):
        return {strip_nul(k): strip_nul(v) for k, v in value.items()}
    return value


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


_NESTING = frozenset({dict, list, tuple})


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether objects and arrays nest more than `limit` levels in `value` (itself the first level).

    Level by level rather than recursively: a list comprehension per level costs a third of a recursive
    walk, which matters on long conversations (a 110-message one: ~30 us against ~90 us to serialise it)."""
    if type(value) not in _NESTING:
        return False
    level = [value]
    for _ in range(limit):
        level = [
            child
            for container in level
            for child in (container.values() if type(container) is dict else container)
            if type(child) in _NESTING
        ]
        if not level:
            return False
    return True


def _json_problems(value: Any, loc: tuple, depth: int, out: list[tuple[tuple, str]]) -> None:
    """Append (path, message) for each place of `value` that the database cannot store. The slow walk: it
    runs only on a field whose fast check failed, to name the places."""
    if len(out) >= MAX_ERRORS_PER_RECORD:
        return
    if isinstance(value, str):
        if not value.isascii() and _SURROGATES.search(value):
            out.append((loc, "contains a lone UTF-16 surrogate (e.g. \\ud800), which is not valid Unicode"))
    elif isinstance(value, float):
        if not math.isfinite(value):
            out.append((loc, f"must be a finite number, not {value!r} (JSON has no NaN or Infinity)"))
    elif value is None or isinstance(value, bool | int):
        return
    elif isinstance(value, dict | list | tuple):
        if depth > MAX_JSON_DEPTH:
            out.append((loc, f"nests objects and arrays more than {MAX_JSON_DEPTH} levels deep"))
            return
        if isinstance(value, dict):
            for key, child in value.items():
                if isinstance(key, str):
                    _json_problems(key, (*loc, key), depth, out)  # names the key itself
                elif not (key is None or isinstance(key, int | float)):
                    out.append(((*loc, str(key)), f"an object key must be a string, not {type(key).__name__}"))
                _json_problems(child, (*loc, str(key)), depth + 1, out)
        else:
            for i, child in enumerate(value):
                _json_problems(child, (*loc, i), depth + 1, out)
    else:
        out.append((loc, f"is not a JSON value ({type(value).__name__})"))


def stored_json(value: Any, name: str) -> tuple[str | None, list[dict[str, str]]]:
    """(the JSON text the database stores for field `name`, no errors), or (None, every error found).

    The fast path serialises once, which the upsert needs anyway: `allow_nan=False` refuses NaN and
    Infinity, encoding to UTF-8 refuses lone surrogates, and a document with fewer brackets than the
    depth limit cannot nest deeper. Only on a failure does the slow walk find the places."""
    if value is None:
        return None, []
    try:
        text = _dumps(value)
        if not text.isascii():
            text.encode("utf-8")  # UnicodeEncodeError on a lone surrogate, which JSON escapes let through
        if text.count("{") + text.count("[") > MAX_JSON_DEPTH and _deeper_than(value, MAX_JSON_DEPTH):
            raise ValueError("too deep")
    except (ValueError, TypeError, RecursionError) as exc:
        found: list[tuple[tuple, str]] = []
        try:
            _json_problems(value, (name,), 1, found)
        except RecursionError:  # pragma: no cover - the walk stops at MAX_JSON_DEPTH
            pass
        if not found:  # what the walk does not know (e.g. an int of more digits than Python writes)
            found = [((name,), f"cannot be stored as JSON: {str(exc).split(';')[0]}")]
        return None, [{"field": format_loc(loc), "message": message} for loc, message in found]
    if "\\u0000" in text:  # rare: re-dump without NUL (a text replace could split an escaped backslash)
        text = _dumps(strip_nul(value))
    return text, []


def _storage_errors(record: dict[str, Any]) -> tuple[dict[str, str | None], list[dict[str, str]]]:
    """The stored text of each JSON field of `record`, and what makes any of them unstorable."""
    texts: dict[str, str | None] = {}
    errors: list[dict[str, str]] = []
    for name in JSON_FIELDS:
        value = record.get(name)
        if value is None and name in ("tools", "metadata"):
            value = [] if name == "tools" else {}  # what the model defaults them to
        texts[name], found = stored_json(value, name)
        errors.extend(found)
    return texts, errors


class UnparsableRecord:
    """Stands in a batch for a line that was not JSON, so that it keeps its index and is rejected alone."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def validate_record(record: Any) -> tuple[TrajectoryIn | None, list[dict[str, str]]]:
    """The validated trajectory and no errors, or None and the errors found (at most
    MAX_ERRORS_PER_RECORD), each with its field path. Valid means storable too (see the module doc); the
    stored text of the JSON fields comes with the trajectory (`stored_json`)."""
    if isinstance(record, UnparsableRecord):
        return None, [{"field": "", "message": record.message}]
    if not isinstance(record, dict):
        return None, [
            {"field": "", "message": f"a trajectory must be a JSON object, not {type(record).__name__}"}
        ]
    texts, storage_errors = _storage_errors(record)
    try:
        parsed = TrajectoryIn.model_validate(record)
    except ValidationError as exc:
        return None, _merged(_pydantic_errors(exc), storage_errors)
    errors = _merged(_contract_errors(record, parsed), storage_errors)
    if errors:
        return None, errors
    parsed._stored_json = texts
    return parsed, []


def _merged(first: list[dict[str, str]], then: list[dict[str, str]]) -> list[dict[str, str]]:
    """Both lists of errors, one error per field (the first list's), at most MAX_ERRORS_PER_RECORD."""
    seen = {e["field"] for e in first}
    return [*first, *(e for e in then if e["field"] not in seen)][:MAX_ERRORS_PER_RECORD]
