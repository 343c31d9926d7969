"""The trajectory as a reviewer reads it: view-models the review templates render (the conversation with
each tool result linked to its call, pretty JSON, token usage). Reads live in `selectors`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from flywheel.trajectories.ingest import is_tool_error
from flywheel.trajectories.models import Comment, Trajectory, TriageSignal


@dataclass
class ToolCallView:
    anchor: str  # our own id for the element, never the agent's tool_call_id
    call_id: str
    name: str
    arguments: str  # pretty JSON when it parses, the raw string otherwise
    arguments_valid: bool
    known_tool: bool
    result_anchor: str | None = None


@dataclass
class MessageView:
    index: int
    role: str
    name: str
    text: str
    extra_parts: list[str]  # non-text content parts, as pretty JSON
    tool_calls: list[ToolCallView]
    tool_call_id: str = ""
    call_anchor: str | None = None  # the call this tool result answers
    call_name: str = ""
    is_error: bool = False
    details: str = ""  # latency, usage or other per-message fields, as pretty JSON
    comments: list[Comment] = field(default_factory=list)
    signals: list[TriageSignal] = field(default_factory=list)  # triage signals at this message


KNOWN_MESSAGE_KEYS = {"role", "content", "tool_calls", "tool_call_id", "name"}


def pretty_json(value: Any) -> str:
    """JSON indented for reading. Returns a plain str: templates escape it like any agent text."""
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False, default=str)


def _arguments(raw: Any) -> tuple[str, bool]:
    if isinstance(raw, str):
        try:
            return pretty_json(json.loads(raw)), True
        except (ValueError, RecursionError):  # arguments are kept as sent: show what cannot be parsed as text
            return raw, False
    if raw is None:
        return "", True
    return pretty_json(raw), True


def _content(content: Any) -> tuple[str, list[str]]:
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if isinstance(content, list):
        texts, others = [], []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                others.append(pretty_json(part))
        return "\n".join(texts), others
    return "", [pretty_json(content)]


def conversation_build(
    *, trajectory: Trajectory, comments: list[Comment] | None = None, signals: list[TriageSignal] | None = None
) -> list[MessageView]:
    """The messages as views: tool calls with pretty arguments, each tool result linked to its call."""
    declared = {
        (tool.get("function") or {}).get("name") if isinstance(tool, dict) else None
        for tool in (trajectory.tools or [])
    }
    declared.discard(None)
    calls_by_id: dict[str, ToolCallView] = {}
    views: list[MessageView] = []
    n_calls = 0
    messages = trajectory.messages if isinstance(trajectory.messages, list) else []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            views.append(MessageView(index, "invalid", "", "", [pretty_json(message)], []))
            continue
        text, extra = _content(message.get("content"))
        tool_calls = []
        for call in message.get("tool_calls") or []:
            if not isinstance(call, dict):
                continue
            n_calls += 1
            function = call.get("function") if isinstance(call.get("function"), dict) else {}
            arguments, valid = _arguments(function.get("arguments"))
            name = str(function.get("name") or "")
            view = ToolCallView(
                anchor=f"tc-{n_calls}",
                call_id=str(call.get("id") or ""),
                name=name,
                arguments=arguments,
                arguments_valid=valid,
                known_tool=not declared or name in declared,
            )
            if view.call_id:
                calls_by_id.setdefault(view.call_id, view)
            tool_calls.append(view)
        role = str(message.get("role") or "unknown")
        view = MessageView(
            index=index,
            role=role,
            name=str(message.get("name") or ""),
            text=text,
            extra_parts=extra,
            tool_calls=tool_calls,
            tool_call_id=str(message.get("tool_call_id") or ""),
        )
        if role == "tool":
            view.is_error = is_tool_error(message)  # the rule ingestion derives has_tool_error with
            call = calls_by_id.get(view.tool_call_id)
            if call is not None:
                view.call_anchor = call.anchor
                view.call_name = call.name
                call.result_anchor = f"m{index}"
        details = {k: v for k, v in message.items() if k not in KNOWN_MESSAGE_KEYS}
        if details:
            view.details = pretty_json(details)
        views.append(view)
    for comment in comments or []:
        if comment.message_index is not None and 0 <= comment.message_index < len(views):
            views[comment.message_index].comments.append(comment)
    for signal in signals or []:
        if signal.message_index is not None and 0 <= signal.message_index < len(views):
            views[signal.message_index].signals.append(signal)
    return views


def usage_summary(usage: Any) -> list[tuple[str, Any]]:
    """Token usage as (label, value) pairs, for the common OpenAI and OTel field names."""
    if not isinstance(usage, dict):
        return []
    labels = (
        ("prompt_tokens", "prompt"),
        ("input_tokens", "input"),
        ("completion_tokens", "completion"),
        ("output_tokens", "output"),
        ("total_tokens", "total"),
    )
    return [(label, usage[key]) for key, label in labels if key in usage]


def tool_schema_problems(tools: Any) -> list[tuple[str, str]]:
    """(tool, why) for each declared tool whose parameters schema cannot be used (a `$ref` that leaves the
    schema or points nowhere, a pattern RE2 refuses, an invalid schema): triage checks no call's arguments
    against it, and the page says so rather than leaving a reviewer to read silence as "the arguments fit"."""
    from trainer.verifiers.schemas import tool_index

    if not isinstance(tools, list):
        return []
    return [(name, info.schema_problem) for name, info in (tool_index(tools) or {}).items() if info.schema_problem]
