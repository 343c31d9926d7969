"""OpenInference and OTel GenAI semantic conventions to OpenAI chat messages: what an LLM span asked and
answered (`llm_call`) and what a tool span ran (`tool_run`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from flywheel.trajectories.otlp.decode import STATUS_ERROR, Span, storable

LLM_OPERATIONS = frozenset({"chat", "text_completion", "generate_content", "completion"})


def _unflatten(attributes: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """`{prefix}0.message.role` style keys into a list of nested dicts, ordered by index."""
    tree: dict[str, Any] = {}
    for key, value in attributes.items():
        if not key.startswith(prefix):
            continue
        node = tree
        parts = key[len(prefix) :].split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        else:
            node[parts[-1]] = value
    return _as_lists(tree) if tree else []


def _as_lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    if node and all(k.isdigit() for k in node):
        return [_as_lists(node[k]) for k in sorted(node, key=int)]
    return {k: _as_lists(v) for k, v in node.items()}


def _json_or(value: Any, fixes: list[int] | None = None) -> Any:
    """A JSON-encoded attribute decoded (GenAI sends structures as JSON strings), or the value as it is.
    Python's json reads NaN and escaped lone surrogates: what it decodes is made storable (`storable`)."""
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except (ValueError, RecursionError):
            return value
        try:
            return storable(decoded, fixes if fixes is not None else [0])
        except RecursionError:
            return value
    return value


def _arguments(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value)


_ROLES = {"model": "assistant", "ai": "assistant", "human": "user", "function": "tool", "ipython": "tool"}


def _role(role: Any) -> str:
    """Roles some providers use, in OpenAI's words (Gemini says model, LangChain says human and ai)."""
    role = str(role).lower()
    return _ROLES.get(role, role)


def _openinference_message(node: Any) -> dict[str, Any] | None:
    if not isinstance(node, dict):
        return None
    m = node.get("message") if isinstance(node.get("message"), dict) else node
    role = m.get("role")
    if not role:
        return None
    content = m.get("content")
    if content is None and isinstance(m.get("contents"), list):
        texts = [c.get("message_content", {}).get("text") for c in m["contents"] if isinstance(c, dict)]
        content = "\n".join(t for t in texts if isinstance(t, str)) or None
    message: dict[str, Any] = {"role": _role(role), "content": content if content is None else str(content)}
    calls = []
    for item in m.get("tool_calls") or []:
        call = item.get("tool_call", item) if isinstance(item, dict) else {}
        function = call.get("function") or {}
        if function.get("name"):
            calls.append(
                {
                    "id": call.get("id"),
                    "type": "function",
                    "function": {
                        "name": function["name"],
                        "arguments": _arguments(function.get("arguments")),
                    },
                }
            )
    if calls:
        message["tool_calls"] = calls
    for extra in ("tool_call_id", "name"):
        if m.get(extra):
            message[extra] = m[extra]
    return message


def _indexed_genai_message(node: Any) -> dict[str, Any] | None:
    """OpenLLMetry's `gen_ai.prompt.N.{role,content,tool_calls.M.{id,name,arguments}}`."""
    role = node.get("role") if isinstance(node, dict) else None
    if not role:
        return None
    message: dict[str, Any] = {"role": _role(role), "content": node.get("content")}
    calls = [
        {
            "id": c.get("id"),
            "type": "function",
            "function": {"name": c["name"], "arguments": _arguments(c.get("arguments"))},
        }
        for c in node.get("tool_calls") or []
        if isinstance(c, dict) and c.get("name")
    ]
    if calls:
        message["tool_calls"] = calls
    if node.get("tool_call_id"):
        message["tool_call_id"] = node["tool_call_id"]
    return message


def _genai_parts_messages(items: Any, fixes: list[int]) -> list[dict[str, Any]]:
    """`gen_ai.input.messages` / `gen_ai.output.messages`: [{role, parts: [{type: text|tool_call|
    tool_call_response, ...}]}] into OpenAI chat messages (one tool message per tool_call_response)."""
    items = _json_or(items, fixes)
    if not isinstance(items, list):
        return []
    messages: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict) or not item.get("role"):
            continue
        texts, calls = [], []
        for part in item.get("parts") or []:
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind == "text" and isinstance(part.get("content"), str):
                texts.append(part["content"])
            elif kind == "tool_call" and part.get("name"):
                calls.append(
                    {
                        "id": part.get("id"),
                        "type": "function",
                        "function": {"name": part["name"], "arguments": _arguments(part.get("arguments"))},
                    }
                )
            elif kind == "tool_call_response":
                response = part.get("response")
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": part.get("id"),
                        "content": response if isinstance(response, str) else json.dumps(response),
                    }
                )
        role = _role(item["role"])
        if texts or calls:
            message: dict[str, Any] = {"role": role, "content": "\n".join(texts) if texts else None}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
    return messages


def _system_instructions(value: Any, fixes: list[int]) -> list[dict[str, Any]]:
    value = _json_or(value, fixes)
    if isinstance(value, str):
        return [{"role": "system", "content": value}]
    if isinstance(value, list):
        texts = [p.get("content") for p in value if isinstance(p, dict) and isinstance(p.get("content"), str)]
        if texts:
            return [{"role": "system", "content": "\n".join(texts)}]
    return []


def tool_schema(value: Any, fixes: list[int] | None = None) -> dict[str, Any] | None:
    value = _json_or(value, fixes)
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("function"), dict) and value["function"].get("name"):
        return {"type": "function", "function": value["function"]}
    if value.get("name"):  # the flat form GenAI uses: {type, name, description, parameters}
        function = {k: value[k] for k in ("name", "description", "parameters") if k in value}
        if isinstance(function.get("parameters"), str):
            function["parameters"] = _json_or(function["parameters"], fixes)
        return {"type": "function", "function": function}
    return None


@dataclass
class LlmCall:
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    model: str
    prompt_tokens: int
    completion_tokens: int
    replaced: int = 0  # values of JSON-encoded attributes made storable


def llm_call(span: Span) -> LlmCall | None:
    """The messages of an LLM span in whichever convention it uses, or None for a span that is not one."""
    a = span.attributes
    operation = a.get("gen_ai.operation.name")
    kind = a.get("openinference.span.kind")
    inputs: list[dict[str, Any]] = []
    outputs: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    fixes = [0]  # values of JSON-encoded attributes made storable
    if "gen_ai.input.messages" in a or "gen_ai.output.messages" in a:
        inputs = _system_instructions(a.get("gen_ai.system_instructions"), fixes) + _genai_parts_messages(
            a.get("gen_ai.input.messages"), fixes
        )
        outputs = _genai_parts_messages(a.get("gen_ai.output.messages"), fixes)
        definitions = _json_or(a.get("gen_ai.tool.definitions"), fixes)
        tools = [
            t
            for t in (tool_schema(d, fixes) for d in (definitions if isinstance(definitions, list) else []))
            if t
        ]
    elif kind == "LLM" or any(k.startswith(("llm.input_messages.", "llm.output_messages.")) for k in a):
        inputs = [m for m in map(_openinference_message, _unflatten(a, "llm.input_messages.")) if m]
        outputs = [m for m in map(_openinference_message, _unflatten(a, "llm.output_messages.")) if m]
        tools = [
            t
            for t in (
                tool_schema((n.get("tool") or {}).get("json_schema"), fixes)
                for n in _unflatten(a, "llm.tools.")
                if isinstance(n, dict) and isinstance(n.get("tool"), dict)
            )
            if t
        ]
    elif any(k.startswith(("gen_ai.prompt.", "gen_ai.completion.")) for k in a):
        inputs = [m for m in map(_indexed_genai_message, _unflatten(a, "gen_ai.prompt.")) if m]
        outputs = [m for m in map(_indexed_genai_message, _unflatten(a, "gen_ai.completion.")) if m]
        tools = [t for t in (tool_schema(f, fixes) for f in _unflatten(a, "llm.request.functions.")) if t]
    elif operation not in LLM_OPERATIONS:
        return None
    model = a.get("gen_ai.response.model") or a.get("gen_ai.request.model") or a.get("llm.model_name") or ""
    prompt = a.get(
        "gen_ai.usage.input_tokens", a.get("gen_ai.usage.prompt_tokens", a.get("llm.token_count.prompt", 0))
    )
    completion = a.get(
        "gen_ai.usage.output_tokens",
        a.get("gen_ai.usage.completion_tokens", a.get("llm.token_count.completion", 0)),
    )
    return LlmCall(inputs, outputs, tools, str(model), _int(prompt), _int(completion), fixes[0])


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an infinite double
        return 0


@dataclass
class ToolRun:
    name: str
    call_id: str | None
    arguments: str
    result: str
    error: bool


def tool_run(span: Span) -> ToolRun | None:
    a = span.attributes
    if a.get("gen_ai.operation.name") == "execute_tool":
        name = a.get("gen_ai.tool.name") or span.name.removeprefix("execute_tool ").strip()
        call_id = a.get("gen_ai.tool.call.id")
        arguments = a.get("gen_ai.tool.call.arguments")
        result = a.get("gen_ai.tool.call.result")
    elif a.get("openinference.span.kind") == "TOOL":
        name = a.get("tool.name") or span.name
        call_id = a.get("tool_call.id")
        arguments = a.get("input.value", a.get("tool.parameters"))
        result = a.get("output.value")
    else:
        return None
    error = span.status_code == STATUS_ERROR or bool(a.get("error.type"))
    if result is None:
        result = f"Error: {span.status_message or a.get('error.type') or 'the tool failed'}" if error else ""
    return ToolRun(
        name=str(name),
        call_id=str(call_id) if call_id else None,
        arguments=_arguments(arguments),
        result=result if isinstance(result, str) else json.dumps(result),
        error=error,
    )
