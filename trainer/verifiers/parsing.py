"""Turn a model's output into tool calls: OpenAI assistant messages or text with Hermes/Qwen-style calls.

Every verifier and environment goes through `parse_completion`, so an output is read the same way whether
it is scored on a review page, in an eval run or in a GRPO step.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
# Where a call object embedded in prose may start. Bounded (`\s{0,20}`) so the scan stays linear.
# Single quotes are matched too: a Python-style dict is a broken call (invalid_format), not prose.
_EMBEDDED_CALL = re.compile(r"""\{\s{0,20}["']name["']\s{0,20}:""")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCompletion:
    """The calls found in an output, its remaining text, and why it could not be read (None when it could).

    Each call is `{"name": str, "arguments": dict}`. Text with no call at all is not an error: `calls` is
    empty and `error` None (a final answer). Call-shaped text that does not parse sets `error`.
    """

    calls: list[dict[str, Any]] = field(default_factory=list)
    content: str = ""
    error: str | None = None


def parse_completion(completion: str | dict | None) -> ParsedCompletion:
    """Read the tool calls out of an assistant message dict or a plain-text completion."""
    if completion is None:
        return ParsedCompletion()
    if isinstance(completion, dict):
        return _parse_message(completion)
    if isinstance(completion, str):
        return _parse_text(completion)
    return ParsedCompletion(error=f"completion must be a string or an assistant message, got {type(completion).__name__}")


def content_text(content: Any) -> str:
    # OpenAI allows content as a list of parts; only the text parts matter here.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
    return str(content)


def _parse_message(message: dict) -> ParsedCompletion:
    content = content_text(message.get("content"))
    raw_calls = message.get("tool_calls")
    if raw_calls is None and isinstance(message.get("function_call"), dict):
        raw_calls = [{"function": message["function_call"]}]  # the legacy single-call field
    if not raw_calls:
        # Some serving stacks leave Hermes-style calls in the content instead of parsing them out.
        return _parse_text(content)
    if not isinstance(raw_calls, list):
        return ParsedCompletion(content=content, error="tool_calls must be a list")
    calls = []
    for i, raw in enumerate(raw_calls):
        call, error = _normalise_call(raw, i)
        if error:
            return ParsedCompletion(content=content, error=error)
        calls.append(call)
    return ParsedCompletion(calls=calls, content=content.strip())


def _normalise_call(raw: Any, index: int) -> tuple[dict[str, Any], str | None]:
    """One call object in any of the shapes models emit -> {"name", "arguments": dict}."""
    if not isinstance(raw, dict):
        return {}, f"tool call {index}: expected an object, got {type(raw).__name__}"
    fn = raw.get("function") if isinstance(raw.get("function"), dict) else raw
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        return {}, f"tool call {index}: missing or empty \"name\""
    args = fn.get("arguments", fn.get("parameters", {}))
    if isinstance(args, str):
        if not args.strip():
            args = {}
        else:
            try:
                args = json.loads(args)
            except (ValueError, RecursionError) as exc:
                return {}, f"tool call {index} ({name}): arguments are not valid JSON: {exc}"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return {}, f"tool call {index} ({name}): arguments must be a JSON object, got {type(args).__name__}"
    return {"name": name, "arguments": args}, None


def strip_fence(text: str) -> str:
    # ```json ... ``` around a call is common from chat models; the fence is not part of the JSON.
    if text.startswith("```"):
        newline = text.find("\n")
        body = text[newline + 1 :] if newline != -1 else text[3:]
        end = body.rfind("```")
        return (body[:end] if end != -1 else body).strip()
    return text


def _calls_from_json(value: Any, start: int) -> tuple[list[dict[str, Any]], str | None] | None:
    """Calls in a decoded JSON value, or None when the value is not call-shaped (plain JSON content)."""
    if isinstance(value, dict):
        if "tool_calls" in value and isinstance(value["tool_calls"], list):
            parsed = _parse_message(value)
            return parsed.calls, parsed.error
        if "name" in value or "function" in value:
            call, error = _normalise_call(value, start)
            return ([call] if not error else []), error
        return None
    if isinstance(value, list) and value and all(isinstance(v, dict) and ("name" in v or "function" in v) for v in value):
        calls = []
        for i, item in enumerate(value):
            call, error = _normalise_call(item, start + i)
            if error:
                return [], error
            calls.append(call)
        return calls, None
    return None


def _parse_text(text: str) -> ParsedCompletion:
    if OPEN_TAG in text:
        return _parse_tagged(text)
    stripped = strip_fence(text.strip())
    if stripped[:1] in ("{", "["):
        try:
            value = json.loads(stripped)
        except (ValueError, RecursionError):
            # Not one JSON document: maybe several calls one after the other, maybe prose that starts
            # with a bracket. The embedded scan tells them apart (and fails on a broken call).
            return _parse_embedded(stripped)
        found = _calls_from_json(value, 0)
        if found is None:
            return ParsedCompletion(content=text.strip())
        calls, error = found
        return ParsedCompletion(calls=calls, content="", error=error)
    return _parse_embedded(text)


def _parse_tagged(text: str) -> ParsedCompletion:
    """`<tool_call>{...}</tool_call>` blocks; an unclosed last block is accepted (generation stopped at it)."""
    calls: list[dict[str, Any]] = []
    outside: list[str] = []
    pos = 0
    # str.find loops rather than a lazy regex: hostile text with many unclosed tags stays linear.
    while True:
        start = text.find(OPEN_TAG, pos)
        if start == -1:
            outside.append(text[pos:])
            break
        outside.append(text[pos:start])
        body_start = start + len(OPEN_TAG)
        end = text.find(CLOSE_TAG, body_start)
        body = text[body_start:end] if end != -1 else text[body_start:]
        pos = end + len(CLOSE_TAG) if end != -1 else len(text)
        body = strip_fence(body.strip())
        try:
            value = json.loads(body)
        except (ValueError, RecursionError) as exc:
            return ParsedCompletion(content=text.strip(), error=f"tool call {len(calls)} is not valid JSON: {exc}")
        found = _calls_from_json(value, len(calls))
        if found is None:
            return ParsedCompletion(content=text.strip(), error=f"tool call {len(calls)} has no \"name\"")
        more, error = found
        if error:
            return ParsedCompletion(content=text.strip(), error=error)
        calls.extend(more)
        if end == -1:
            break
    return ParsedCompletion(calls=calls, content="".join(outside).strip())


def _parse_embedded(text: str) -> ParsedCompletion:
    """Call objects inside prose ('Sure: {"name": ...}'); prose without one is a final answer."""
    calls: list[dict[str, Any]] = []
    outside: list[str] = []
    pos = 0
    while True:
        m = _EMBEDDED_CALL.search(text, pos)
        if m is None:
            outside.append(text[pos:])
            break
        try:
            value, end = _DECODER.raw_decode(text, m.start())
        except (ValueError, RecursionError) as exc:
            return ParsedCompletion(content=text.strip(), error=f"tool call {len(calls)} is not valid JSON: {exc}")
        call, error = _normalise_call(value, len(calls))
        if error:
            return ParsedCompletion(content=text.strip(), error=error)
        calls.append(call)
        outside.append(text[pos : m.start()])
        pos = end
    return ParsedCompletion(calls=calls, content="".join(outside).strip())
