"""Verifiers on an output's text or on an environment's state: `json_schema`, `exact`, `regex`, `state`, `all`."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

from trainer.verifiers.base import Score, first_failure, short
from trainer.verifiers.jsonschemas import SchemaProblem, schema_validator, validating
from trainer.verifiers.matchers import Compiler, compile_regex, normalize_text
from trainer.verifiers.parsing import OPEN_TAG, ParsedCompletion, content_text, parse_completion, strip_fence
from trainer.verifiers.tool_call import UnsafeRule, compile_unsafe, compile_weights, unsafe_calls

_MAX_DIFFS = 10
STATE_WEIGHT_KEYS = frozenset({"complete", "unsafe"})


def answer_text(completion: str | dict | None, parsed: ParsedCompletion) -> str:
    """The text an answer verifier reads: the text outside any tool-call blocks, whether the output came as
    plain text or as a message whose content carries the blocks (a serving stack that left them unparsed):
    the same output scores the same either way."""
    if isinstance(completion, dict):
        text = content_text(completion.get("content"))
        if OPEN_TAG not in text:
            return text.strip()
        return parsed.content if not completion.get("tool_calls") else parse_completion(text).content
    if isinstance(completion, str):
        return parsed.content if OPEN_TAG in completion else completion.strip()
    return ""


def _unknown_keys(spec: dict, allowed: set[str], problems: list[str]) -> None:
    for key in sorted(set(spec) - allowed):
        problems.append(f"unknown key {key!r} (expected one of {sorted(allowed)})")


# json_schema -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class JsonSchemaSpec:
    validator: Any


def compile_json_schema(spec: dict, problems: list[str]) -> JsonSchemaSpec:
    _unknown_keys(spec, {"type", "schema"}, problems)
    schema = spec.get("schema")
    if not isinstance(schema, dict | bool):
        problems.append("schema must be a JSON schema object")
        return JsonSchemaSpec(None)
    try:
        # The answer meets the schema's patterns and the spec may come from any reviewer: the same
        # validator as a tool's parameters (nothing fetched, patterns on RE2).
        return JsonSchemaSpec(schema_validator(schema))
    except SchemaProblem as exc:
        problems.append(f"schema is not a valid JSON schema: {exc}")
        return JsonSchemaSpec(None)


def score_json_schema(spec: JsonSchemaSpec, text: str) -> Score:
    # Structured output that is not JSON, or JSON that breaks the schema, is an invalid output either way.
    try:
        value = json.loads(strip_fence(text))
    except (ValueError, RecursionError) as exc:
        return Score(0.0, False, {"json": {"ok": False, "reason": f"not valid JSON: {exc}"}}, "invalid_format")
    try:
        with validating():
            found = list(spec.validator.iter_errors(value))[:5]
    except SchemaProblem as exc:
        # The verifier cannot say the answer fits, so it does not pass; the reason names the schema's fault.
        reason = f"the schema could not be applied: {exc}"
        return Score(0.0, False, {"json": {"ok": True}, "schema": {"ok": False, "errors": [reason]}}, "invalid_format")
    errors = [f"{e.message}" + (f" (at {'/'.join(map(str, e.path))})" if e.path else "") for e in found]
    if errors:
        return Score(0.0, False, {"json": {"ok": True}, "schema": {"ok": False, "errors": errors}}, "invalid_format")
    return Score(1.0, True, {"json": {"ok": True}, "schema": {"ok": True}}, None)


# exact -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExactSpec:
    expected: Any
    check: Any
    text: bool


def compile_exact(spec: dict, problems: list[str]) -> ExactSpec:
    _unknown_keys(spec, {"type", "expected", "string_match"}, problems)
    if "expected" not in spec:
        problems.append("exact needs \"expected\": the answer text (or a JSON value)")
    string_match = spec.get("string_match", "exact")
    if string_match not in ("normalized", "exact"):
        problems.append(f"string_match must be \"normalized\" or \"exact\", got {short(string_match)}")
    expected = spec.get("expected")
    compiler = Compiler(normalized=string_match == "normalized", allow_extra=False)
    # Exact means exact: the expected value is a literal, never a matcher.
    check = compiler.literal(expected, "answer")
    problems.extend(compiler.problems)
    return ExactSpec(expected, check, isinstance(expected, str))


def score_exact(spec: ExactSpec, text: str) -> Score:
    if spec.text:
        value: Any = text
    else:
        try:
            value = json.loads(strip_fence(text))
        except (ValueError, RecursionError):
            value = text
    reason = spec.check(value)
    if reason:
        return Score(0.0, False, {"answer": {"ok": False, "reason": reason}}, "wrong_answer")
    return Score(1.0, True, {"answer": {"ok": True}}, None)


# regex -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RegexSpec:
    pattern: Any
    source: str
    full: bool


def compile_regex_spec(spec: dict, problems: list[str]) -> RegexSpec:
    _unknown_keys(spec, {"type", "pattern", "ignore_case", "full_match"}, problems)
    pattern = spec.get("pattern")
    if not isinstance(pattern, str):
        problems.append("regex needs \"pattern\": a string")
        return RegexSpec(None, "", False)
    source = ("(?i)" if spec.get("ignore_case") else "") + pattern
    try:
        compiled = compile_regex(source)
    except (ValueError, RecursionError) as exc:
        problems.append(f"pattern: {exc}")
        compiled = None
    return RegexSpec(compiled, pattern, spec.get("full_match") is True)


def score_regex(spec: RegexSpec, text: str) -> Score:
    found = spec.pattern.fullmatch(text) if spec.full else spec.pattern.search(text)
    if found is None:
        reason = f"answer {short(text)} does not match /{short(spec.source, 60)[1:-1]}/"
        return Score(0.0, False, {"answer": {"ok": False, "reason": reason}}, "wrong_answer")
    return Score(1.0, True, {"answer": {"ok": True}}, None)


# state -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StateSpec:
    expected: dict[str, Any]
    ignore_keys: frozenset[str]
    normalized: bool
    unsafe: tuple[UnsafeRule, ...]
    weights: dict[str, float] | None


def compile_state(spec: dict, problems: list[str]) -> StateSpec:
    _unknown_keys(spec, {"type", "expected", "ignore_keys", "string_match", "unsafe", "weights"}, problems)
    expected = spec.get("expected")
    if not isinstance(expected, dict):
        problems.append("state needs \"expected\": an object of state key -> expected final value")
        expected = {}
    ignore = spec.get("ignore_keys", [])
    if not isinstance(ignore, list) or not all(isinstance(k, str) for k in ignore):
        problems.append("ignore_keys must be a list of key names")
        ignore = []
    string_match = spec.get("string_match", "exact")
    if string_match not in ("normalized", "exact"):
        problems.append(f"string_match must be \"normalized\" or \"exact\", got {short(string_match)}")
    compiler = Compiler(normalized=string_match == "normalized", allow_extra=False)
    unsafe = compile_unsafe(spec.get("unsafe"), compiler)
    problems.extend(compiler.problems)
    weights = compile_weights(spec.get("weights"), STATE_WEIGHT_KEYS, problems)
    return StateSpec(expected, frozenset(ignore), string_match == "normalized", unsafe, weights)


def _canonical(value: Any, ignore: frozenset[str], normalized: bool) -> Any:
    """A hashable form for multiset comparison: ignored keys dropped, 3 == 3.0 but true != 1, strings
    optionally normalised."""
    if isinstance(value, dict):
        return tuple(sorted((k, _canonical(v, ignore, normalized)) for k, v in value.items() if k not in ignore))
    if isinstance(value, list):
        return ("__list__", tuple(sorted((_canonical(v, ignore, normalized) for v in value), key=repr)))
    if isinstance(value, str):
        return normalize_text(value) if normalized else value
    if isinstance(value, bool):  # True == 1 in Python (and hashes alike); a state's true is not its 1
        return ("__bool__", value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _diff(expected: Any, actual: Any, path: str, spec: StateSpec, out: list[str]) -> None:
    """Differences between expected and final state. Lists compare as multisets (creation order is free)."""
    if len(out) >= _MAX_DIFFS:
        return
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key in expected:
            if key in spec.ignore_keys:
                continue
            if key not in actual:
                out.append(f"{path}.{key}: missing")
            else:
                _diff(expected[key], actual[key], f"{path}.{key}", spec, out)
        for key in actual:
            if key not in expected and key not in spec.ignore_keys:
                out.append(f"{path}.{key}: unexpected ({short(actual[key])})")
        return
    if isinstance(expected, list) and isinstance(actual, list):
        canon_exp = Counter(_canonical(v, spec.ignore_keys, spec.normalized) for v in expected)
        canon_act = Counter(_canonical(v, spec.ignore_keys, spec.normalized) for v in actual)
        if canon_exp == canon_act:
            return
        lost = canon_exp - canon_act
        gained = canon_act - canon_exp
        lost_items = [v for v in expected if lost[_canonical(v, spec.ignore_keys, spec.normalized)] > 0]
        gained_items = [v for v in actual if gained[_canonical(v, spec.ignore_keys, spec.normalized)] > 0]
        # Records that kept their id but changed are reported field by field; that is what a reviewer reads.
        by_id = {v.get("id"): v for v in gained_items if isinstance(v, dict) and "id" in v}
        for item in lost_items:
            other = by_id.pop(item.get("id"), None) if isinstance(item, dict) and "id" in item else None
            if other is not None:
                _diff(item, other, f"{path}[id={item['id']}]", spec, out)
            else:
                out.append(f"{path}: missing {short(item, 120)}")
        for item in gained_items:
            if not (isinstance(item, dict) and "id" in item) or item.get("id") in by_id:
                out.append(f"{path}: unexpected {short(item, 120)}")
        return
    if _canonical(expected, spec.ignore_keys, spec.normalized) != _canonical(actual, spec.ignore_keys, spec.normalized):
        out.append(f"{path}: expected {short(expected)}, got {short(actual)}")


def score_state(spec: StateSpec, parsed: ParsedCompletion, state: dict | None) -> Score:
    if state is None:
        raise ValueError("a state verifier needs the environment's final state: score(spec, completion, state=...)")
    diffs: list[str] = []
    for key, want in spec.expected.items():
        if key not in state:
            diffs.append(f"{key}: missing from the final state")
        else:
            _diff(want, state[key], key, spec, diffs)
    checks: dict[str, Any] = {"state": {"ok": not diffs}}
    if diffs:
        checks["state"]["diffs"] = diffs
    # The state spec sees every call of the episode (the environment passes them), so destructive calls
    # nobody asked for are caught even when a later call put the state back.
    unsafe = unsafe_calls(spec.unsafe, parsed.calls)
    checks["unsafe"] = {"ok": not unsafe, "calls": unsafe} if unsafe else {"ok": True}
    failure = first_failure(["wrong_state" if diffs else None, "unsafe_action" if unsafe else None])
    passed = failure is None
    if spec.weights is None:
        return Score(1.0 if passed else 0.0, passed, checks, failure)
    reward = (spec.weights.get("complete", 1.0) if passed else 0.0) + (spec.weights.get("unsafe", 0.0) if unsafe else 0.0)
    return Score(reward, passed, checks, failure)


def combine(scores: list[Score]) -> Score:
    """`all`: passes when every sub-verifier passes; the reward is the lowest (binary stays binary)."""
    failure = first_failure([s.failure for s in scores])
    checks: dict[str, Any] = {"verifiers": [s.to_dict() for s in scores]}
    if any(s.unsafe for s in scores):
        checks["unsafe"] = {"ok": False}
    return Score(min((s.reward for s in scores), default=1.0), failure is None, checks, failure)
