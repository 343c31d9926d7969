"""Verifiers: one code path that scores an output for triage, evals and GRPO rewards.

A spec is data (`{"type": "tool_call", ...}`), never code: nothing in a spec is evaluated, executed or
imported. `score()` compiles a spec once (cached) and returns a `Score`; `validate_spec()` lists what is
wrong with a spec without scoring anything; `summarize()` turns scores into the gate's suite metrics.

Spec types (details in each module):
    tool_call    expected_calls, order, allow_extra_calls, allow_extra_arguments, string_match, unsafe, weights
    json_schema  {"schema": {...}}: the answer text is JSON that validates
    exact        {"expected": "Paris" | <JSON value>, "string_match": "exact" | "normalized"}
    regex        {"pattern": "...", "ignore_case"?: bool, "full_match"?: bool} on the answer text (RE2)
    state        {"expected": {key: value}, "ignore_keys"?: [...], "unsafe"?: [...], "weights"?: {...}}
                 against `state=` (lists compare as multisets, only the keys named are compared)
    all          {"verifiers": [spec, ...]}: every one must pass; the reward is the lowest
    llm_judge    {"rubric": "...", "threshold"?: 0.5}: off unless configured (see llm_judge.py)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainer.verifiers import schemas as _schemas
from trainer.verifiers import text as _text
from trainer.verifiers.base import (
    FAILURE_PRECEDENCE,
    FAILURES,
    Score,
    SpecError,
    component_means,
    first_failure,
)
from trainer.verifiers.llm_judge import LLMJudgeDisabled, compile_judge, configure_llm_judge, score_judge
from trainer.verifiers.matchers import normalize_text
from trainer.verifiers.parsing import ParsedCompletion, parse_completion
from trainer.verifiers.schemas import caches_disabled, tool_index
from trainer.verifiers.tool_call import compile_spec as _compile_tool_call
from trainer.verifiers.tool_call import score_tool_call as _score_tool_call

__all__ = [
    "FAILURES",
    "FAILURE_PRECEDENCE",
    "LLMJudgeDisabled",
    "ParsedCompletion",
    "Score",
    "SpecError",
    "VERIFIER_TYPES",
    "caches_disabled",
    "compile_spec",
    "component_means",
    "configure_llm_judge",
    "first_failure",
    "normalize_text",
    "parse_completion",
    "score",
    "summarize",
    "validate_spec",
]

_MAX_CACHED = 4096


class Compiled:
    """A compiled spec: `run(completion, parsed, tools, state)` scores one output."""

    __slots__ = ("kind", "data", "children")

    def __init__(self, kind: str, data: Any, children: list[Compiled] | None = None):
        self.kind = kind
        self.data = data
        self.children = children or []


def _compile_all(spec: dict, problems: list[str]) -> list[Compiled]:
    for key in sorted(set(spec) - {"type", "verifiers"}):
        problems.append(f"unknown key {key!r} (expected verifiers)")
    subs = spec.get("verifiers")
    if not isinstance(subs, list) or not subs:
        problems.append("all needs \"verifiers\": a non-empty list of verifier specs")
        return []
    children = []
    for i, sub in enumerate(subs):
        sub_problems: list[str] = []
        children.append(_compile(sub, sub_problems))
        problems.extend(f"verifiers[{i}]: {p}" for p in sub_problems)
    return children


_COMPILERS: dict[str, Callable[[dict, list[str]], Any]] = {
    "tool_call": _compile_tool_call,
    "json_schema": _text.compile_json_schema,
    "exact": _text.compile_exact,
    "regex": _text.compile_regex_spec,
    "state": _text.compile_state,
    "llm_judge": compile_judge,
    "all": _compile_all,
}
VERIFIER_TYPES: tuple[str, ...] = tuple(_COMPILERS)


def _compile(spec: Any, problems: list[str]) -> Compiled:
    if not isinstance(spec, dict):
        problems.append(f"a verifier spec must be an object, got {type(spec).__name__}")
        return Compiled("invalid", None)
    kind = spec.get("type")
    compiler = _COMPILERS.get(kind) if isinstance(kind, str) else None
    if compiler is None:
        problems.append(f"unknown verifier type {kind!r} (expected one of {list(VERIFIER_TYPES)})")
        return Compiled("invalid", None)
    data = compiler(spec, problems)
    return Compiled(kind, None, data) if kind == "all" else Compiled(kind, data)


def validate_spec(spec: dict) -> list[str]:
    """Human-readable problems with a verifier spec (unknown type, bad regex, bad matcher...); [] if fine."""
    problems: list[str] = []
    _compile(spec, problems)
    return problems


_cache: dict[int, tuple[Any, Compiled]] = {}


def compile_spec(spec: dict) -> Compiled:
    """Compile a spec once; raises SpecError listing every problem.

    Cached by the spec object's identity (the cache holds a reference, so an id is never reused while
    cached): a spec is treated as immutable once scored. Build a new dict rather than editing one in place.
    """
    hit = _cache.get(id(spec))
    # The cache keeps the spec alive, so its id is not reused while cached. Specs are treated as immutable.
    if hit is not None and hit[0] is spec:
        return hit[1]
    problems: list[str] = []
    compiled = _compile(spec, problems)
    if problems:
        raise SpecError(problems)
    if not _schemas.caching_enabled():
        return compiled
    if len(_cache) >= _MAX_CACHED:
        _cache.clear()
    _cache[id(spec)] = (spec, compiled)
    return compiled


def _run(c: Compiled, completion: Any, parsed: ParsedCompletion, tools: Any, state: dict | None) -> Score:
    kind = c.kind
    if kind == "tool_call":
        return _score_tool_call(c.data, parsed, tool_index(tools))
    if kind == "all":
        return _text.combine([_run(child, completion, parsed, tools, state) for child in c.children])
    if kind == "state":
        if parsed.error is not None:
            return Score(0.0, False, {"format": {"ok": False, "reason": parsed.error}}, "invalid_format")
        return _text.score_state(c.data, parsed, state)
    answer = _text.answer_text(completion, parsed)
    if kind == "json_schema":
        return _text.score_json_schema(c.data, answer)
    if kind == "exact":
        return _text.score_exact(c.data, answer)
    if kind == "regex":
        return _text.score_regex(c.data, answer)
    if kind == "llm_judge":
        return score_judge(c.data, answer, parsed.calls)
    raise AssertionError(kind)


def score(spec: dict, completion: str | dict, *, tools: list[dict] | None = None, state: dict | None = None) -> Score:
    """Score one output against a verifier spec.

    `completion` is an OpenAI assistant message or plain text; `tools` the declared OpenAI function schemas
    (None skips the declared-tool and schema checks); `state` the environment's final state (state specs).
    Specs and tools lists are cached by identity, so neither should be edited in place after use.
    Raises SpecError for a malformed spec, LLMJudgeDisabled for an llm_judge spec with no judge configured.
    """
    compiled = compile_spec(spec)
    return _run(compiled, completion, parse_completion(completion), tools, state)


def summarize(scores: list[Score]) -> dict[str, Any]:
    """Suite metrics: {"n", "success_rate", "invalid_output_rate", "unsafe_action_rate", "mean_reward", "failures"},
    and "reward/<name>" per reward component when rows have weighted rewards."""
    n = len(scores)
    failures: dict[str, int] = {}
    for s in scores:
        if s.failure:
            failures[s.failure] = failures.get(s.failure, 0) + 1
    if n == 0:
        return {"n": 0, "success_rate": 0.0, "invalid_output_rate": 0.0, "unsafe_action_rate": 0.0, "mean_reward": 0.0, "failures": {}}
    return {
        "n": n,
        "success_rate": sum(s.passed for s in scores) / n,
        "invalid_output_rate": sum(s.invalid for s in scores) / n,
        "unsafe_action_rate": sum(s.unsafe for s in scores) / n,
        "mean_reward": sum(s.reward for s in scores) / n,
        "failures": failures,
        **component_means(scores),  # a row with weighted rewards: each one's mean, "reward/<name>"
    }
