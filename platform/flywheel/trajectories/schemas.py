"""The trajectory contract (ARCHITECTURE.md) as pydantic models, and the one check that turns a raw record
into a list of errors, each naming the field by its path (`messages[2].tool_calls[0].function.name`).

Records are validated but stored as sent: the models check shape and types; the message dicts themselves
are kept whole, extra keys included, because reviewers and verifiers want what the agent really produced
(a tool call whose arguments are not valid JSON is a failure to capture, not a record to refuse)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_INT32 = 2**31 - 1
ROLES = ("system", "developer", "user", "assistant", "tool")


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


def format_loc(loc: tuple) -> str:
    """('messages', 2, 'tool_calls', 0, 'function', 'name') -> 'messages[2].tool_calls[0].function.name'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
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


class UnparsableRecord:
    """Stands in a batch for a line that was not JSON, so that it keeps its index and is rejected alone."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def validate_record(record: Any) -> tuple[TrajectoryIn | None, list[dict[str, str]]]:
    """The validated trajectory and no errors, or None and every error found, each with its field path."""
    if isinstance(record, UnparsableRecord):
        return None, [{"field": "", "message": record.message}]
    if not isinstance(record, dict):
        return None, [
            {"field": "", "message": f"a trajectory must be a JSON object, not {type(record).__name__}"}
        ]
    try:
        parsed = TrajectoryIn.model_validate(record)
    except ValidationError as exc:
        return None, _pydantic_errors(exc)
    errors = _contract_errors(record, parsed)
    if errors:
        return None, errors
    return parsed, []
