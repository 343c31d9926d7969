"""A task row's reference: the output a reviewer stated as correct, what SFT imitates and what DPO prefers.

A row may carry it as `reference`: one assistant message, or a list of the assistant turns and tool messages
that follow the row's `messages` (a multi-turn correction, with the observations each call got). Rows
promoted before references were stored, and rows written by hand, get one derived from their verifier where
the verifier states the whole output: a `tool_call` verifier whose expected calls name literal arguments
(no matchers), or an `exact` verifier's expected text. Anything else has no reference.
"""

from __future__ import annotations

import json
from typing import Any

from trainer.verifiers.matchers import MATCHER_KEYS


def _literal(value: Any) -> bool:
    """A value the verifier compares as it is: not a matcher (an object whose keys are all matcher keywords;
    `equals` wraps a literal, which is left out too, rather than unwrapped)."""
    if isinstance(value, dict):
        return not (value and set(value) <= MATCHER_KEYS) and all(_literal(v) for v in value.values())
    if isinstance(value, list):
        return all(_literal(v) for v in value)
    return True


def _from_verifier(verifier: Any) -> list[dict[str, Any]] | None:
    if not isinstance(verifier, dict):
        return None
    if verifier.get("type") == "tool_call":
        expected = verifier.get("expected_calls")
        if not isinstance(expected, list) or not expected:
            return None
        calls = []
        for k, call in enumerate(expected):
            args = call.get("arguments", {}) if isinstance(call, dict) else None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(args, dict) \
                    or not _literal(args):
                return None
            calls.append({"id": f"call_ref_{k}", "type": "function",
                          "function": {"name": call["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
        return [{"role": "assistant", "content": "", "tool_calls": calls}]
    if verifier.get("type") == "exact" and isinstance(verifier.get("expected"), str):
        return [{"role": "assistant", "content": verifier["expected"]}]
    return None


def reference_messages(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The messages that complete `row["messages"]` correctly, or None when the row states none."""
    stated = row.get("reference")
    if isinstance(stated, dict):
        stated = [stated]
    if isinstance(stated, list) and stated and all(isinstance(m, dict) for m in stated):
        if any(m.get("role") == "assistant" for m in stated):
            return stated
        return None
    rules = row.get("verifier")
    if rules is None and isinstance(row.get("reward"), list) and len(row["reward"]) == 1:
        rules = row["reward"][0].get("verifier")
    return _from_verifier(rules)
