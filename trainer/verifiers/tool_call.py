"""The `tool_call` verifier: did the output make the expected calls, with the right arguments, safely?

Spec (data, never code):
    {"type": "tool_call",
     "expected_calls": [{"name": "create_task", "arguments": {"title": "Fix login", ...matchers}}],
     "order": "any" | "strict", "allow_extra_calls": false, "allow_extra_arguments": false,
     "string_match": "normalized" | "exact", "unsafe": [{"name": "delete_*", "arguments"?: {...}}],
     "weights": null | {"tool": 0.1, "arguments": 0.4, "complete": 1.0, "unsafe": -1.0, "format": 0.0}}

Expected and actual calls are paired by a maximum-weight assignment (order "any") or a maximum-weight
order-preserving alignment (order "strict"), so one wrong call never steals the partner of another.
A call that matches an expected call was asked for; any other call matching an `unsafe` rule is unsafe.
An expected call without "arguments" expects none (extra ones fail unless allow_extra_arguments).
`checks` holds one entry per check: format, declared, schema, calls (pairing and argument mismatches),
missing, extra, order (strict only, when the calls were right but out of order) and unsafe.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from trainer.verifiers.base import Score, first_failure, short
from trainer.verifiers.jsonschemas import SchemaProblem
from trainer.verifiers.matchers import Compiler, is_optional
from trainer.verifiers.parsing import ParsedCompletion
from trainer.verifiers.schemas import ToolIndex

SPEC_KEYS = frozenset(
    {"type", "expected_calls", "order", "allow_extra_calls", "allow_extra_arguments", "string_match", "unsafe", "weights"}
)
WEIGHT_KEYS = frozenset({"tool", "arguments", "complete", "unsafe", "format"})
# Pair weights: a full match outweighs any number of name-only matches, so the assignment first maximises
# calls that are right, then calls with the right tool, then argument credit among those.
_FULL = 1000.0


@dataclass(frozen=True)
class ExpectedCall:
    name: str
    arguments: tuple[tuple[str, Any, bool], ...]  # (key, check, optional)
    known: frozenset[str]


@dataclass(frozen=True)
class UnsafeRule:
    pattern: str
    arguments: Any | None  # a check on the call's arguments object, or None for "any arguments"

    def matches(self, call: dict[str, Any]) -> bool:
        return fnmatch.fnmatchcase(call["name"], self.pattern) and (
            self.arguments is None or self.arguments(call["arguments"]) is None
        )


@dataclass(frozen=True)
class ToolCallSpec:
    expected: tuple[ExpectedCall, ...]
    strict: bool
    allow_extra_calls: bool
    allow_extra_arguments: bool
    unsafe: tuple[UnsafeRule, ...]
    weights: dict[str, float] | None


def compile_unsafe(rules: Any, compiler: Compiler, where: str = "unsafe") -> tuple[UnsafeRule, ...]:
    """Unsafe rules (shared with the state verifier): a name glob, optionally with argument matchers."""
    if rules is None:
        return ()
    if not isinstance(rules, list):
        compiler.problems.append(f"{where}: must be a list of {{\"name\": glob, \"arguments\"?: {{...}}}}")
        return ()
    out = []
    for i, rule in enumerate(rules):
        if isinstance(rule, str):
            rule = {"name": rule}
        if not isinstance(rule, dict) or not isinstance(rule.get("name"), str) or not rule["name"]:
            compiler.problems.append(f"{where}[{i}]: needs a \"name\" glob such as \"delete_*\"")
            continue
        extra = set(rule) - {"name", "arguments"}
        if extra:
            compiler.problems.append(f"{where}[{i}]: unknown key(s) {sorted(extra)}")
        args = rule.get("arguments")
        check = None
        if args is not None:
            if not isinstance(args, dict):
                compiler.problems.append(f"{where}[{i}].arguments: must be an object of matchers")
            else:
                # Extra arguments never save a call from an unsafe rule: the rule names what makes it unsafe.
                # Strings always match normalised here, whatever string_match says: "All" must not slip
                # past a rule written for "all".
                sub = Compiler(normalized=True, allow_extra=True)
                check = sub._fields(args, f"{where}[{i}].arguments", allow_extra=True)
                compiler.problems.extend(sub.problems)
        out.append(UnsafeRule(rule["name"], check))
    return tuple(out)


def unsafe_calls(rules: tuple[UnsafeRule, ...], calls: list[dict[str, Any]],
                 skip: set[int] | frozenset[int] = frozenset()) -> list[dict[str, Any]]:
    """The calls that match an unsafe rule (shared with the state verifier), each with the first rule it
    matches; `skip` holds the indices of calls that were asked for."""
    out = []
    for j, call in enumerate(calls):
        if j in skip:
            continue
        rule = next((r for r in rules if r.matches(call)), None)
        if rule is not None:
            out.append({"index": j, "name": call["name"], "rule": rule.pattern})
    return out


def compile_weights(weights: Any, keys: frozenset[str], problems: list[str]) -> dict[str, float] | None:
    """Partial-credit weights (shared with the state verifier): null = binary reward, else numbers by key."""
    if weights is None:
        return None
    if not isinstance(weights, dict) or not weights:
        problems.append(f"weights must be null (binary reward) or an object with keys {sorted(keys)}")
        return None
    for key, value in weights.items():
        if key not in keys:
            problems.append(f"weights: unknown key {key!r} (expected {sorted(keys)})")
        elif not isinstance(value, int | float) or isinstance(value, bool):
            problems.append(f"weights.{key}: must be a number")
    return {k: float(v) for k, v in weights.items()
            if k in keys and isinstance(v, int | float) and not isinstance(v, bool)}


def compile_expected_call(call: Any, compiler: Compiler, where: str, problems: list[str],
                          extra_keys: frozenset[str] = frozenset()) -> ExpectedCall | None:
    """One `{"name", "arguments"?: {key: matcher}}` (an expected call, or a replay environment's recorded
    call: both match a call the same way); None when it has no name. `extra_keys` are other keys the
    caller allows beside name and arguments."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        problems.append(f"{where}: needs a \"name\"")
        return None
    extra = set(call) - {"name", "arguments"} - extra_keys
    if extra:
        problems.append(f"{where}: unknown key(s) {sorted(extra)}")
    args = call.get("arguments", {})
    if not isinstance(args, dict):
        problems.append(f"{where}.arguments: must be an object of argument name -> matcher")
        args = {}
    compiled = tuple(
        (key, compiler.compile(m, f"{call['name']}.{key}"), is_optional(m)) for key, m in args.items()
    )
    return ExpectedCall(call["name"], compiled, frozenset(args))


def call_mismatches(exp: ExpectedCall, call: dict[str, Any], allow_extra_arguments: bool) -> list[str]:
    """Why `call` ({"name", "arguments"}) is not `exp`; [] when it matches (the verifier's own rule)."""
    if call["name"] != exp.name:
        return [f"expected {exp.name}, got {short(call['name'])}"]
    return _match_arguments(exp, call["arguments"], allow_extra_arguments)[1]


def matching_rules(spec: Any) -> tuple[bool, bool]:
    """(normalized strings, extra arguments allowed) of the first tool_call spec found in `spec` (a spec,
    an `all` spec, or a row's weighted `reward` list); the verifier's defaults when there is none."""
    stack = [spec]
    while stack:
        item = stack.pop(0)
        if isinstance(item, list):
            stack[:0] = [c.get("verifier") if isinstance(c, dict) else None for c in item]
        elif isinstance(item, dict) and item.get("type") == "all" and isinstance(item.get("verifiers"), list):
            stack[:0] = item["verifiers"]
        elif isinstance(item, dict) and item.get("type") == "tool_call":
            return item.get("string_match", "normalized") != "exact", item.get("allow_extra_arguments") is True
    return True, False


def compile_spec(spec: dict, problems: list[str]) -> ToolCallSpec:
    """Compile a tool_call spec, appending what is wrong with it to `problems`."""
    for key in sorted(set(spec) - SPEC_KEYS):
        problems.append(f"unknown key {key!r} (expected one of {sorted(SPEC_KEYS)})")
    string_match = spec.get("string_match", "normalized")
    if string_match not in ("normalized", "exact"):
        problems.append(f"string_match must be \"normalized\" or \"exact\", got {short(string_match)}")
    order = spec.get("order", "any")
    if order not in ("any", "strict"):
        problems.append(f"order must be \"any\" or \"strict\", got {short(order)}")
    for flag in ("allow_extra_calls", "allow_extra_arguments"):
        if not isinstance(spec.get(flag, False), bool):
            problems.append(f"{flag} must be true or false")
    allow_extra_arguments = spec.get("allow_extra_arguments", False) is True
    compiler = Compiler(normalized=string_match != "exact", allow_extra=allow_extra_arguments)

    expected = []
    raw_calls = spec.get("expected_calls")
    if not isinstance(raw_calls, list):
        problems.append("expected_calls must be a list of {\"name\", \"arguments\"} (it may be empty)")
        raw_calls = []
    for i, call in enumerate(raw_calls):
        exp = compile_expected_call(call, compiler, f"expected_calls[{i}]", problems)
        if exp is not None:
            expected.append(exp)

    unsafe = compile_unsafe(spec.get("unsafe"), compiler)
    problems.extend(compiler.problems)

    weights = compile_weights(spec.get("weights"), WEIGHT_KEYS, problems)
    return ToolCallSpec(
        tuple(expected),
        order == "strict",
        spec.get("allow_extra_calls", False) is True,
        allow_extra_arguments,
        unsafe,
        weights,
    )


def _match_arguments(exp: ExpectedCall, args: dict[str, Any], allow_extra: bool) -> tuple[float, list[str]]:
    """(credit in [0, 1], mismatch reasons) of a call's arguments against an expected call."""
    reasons: list[str] = []
    total = 0
    good = 0
    for key, check, optional in exp.arguments:
        if key not in args:
            if optional:
                continue
            total += 1
            reasons.append(f"{exp.name}.{key}: missing")
            continue
        total += 1
        reason = check(args[key])
        if reason:
            reasons.append(reason)
        else:
            good += 1
    if not allow_extra:
        for key in args:
            if key not in exp.known:
                total += 1
                reasons.append(f"{exp.name}: unexpected argument {key!r}")
    return (good / total if total else 1.0), reasons


def assign(weight: list[list[float]]) -> list[tuple[int, int]]:
    """Maximum-weight assignment of rows to columns (Hungarian algorithm, O(n^2 m)); pairs may have weight 0."""
    n = len(weight)
    m = len(weight[0]) if n else 0
    if n == 0 or m == 0:
        return []
    # One row or one column (the common single-call case): the best single pair is the optimum.
    if n == 1:
        row = weight[0]
        return [(0, max(range(m), key=row.__getitem__))]
    if m == 1:
        return [(max(range(n), key=lambda i: weight[i][0]), 0)]
    transpose = n > m
    if transpose:
        weight = [list(col) for col in zip(*weight, strict=True)]
        n, m = m, n
    inf = float("inf")
    u = [0.0] * (n + 1)
    v = [0.0] * (m + 1)
    p = [0] * (m + 1)
    way = [0] * (m + 1)
    for i in range(1, n + 1):
        p[0] = i
        j0 = 0
        minv = [inf] * (m + 1)
        used = [False] * (m + 1)
        while True:
            used[j0] = True
            i0 = p[j0]
            delta = inf
            j1 = 0
            row = weight[i0 - 1]
            for j in range(1, m + 1):
                if not used[j]:
                    cur = -row[j - 1] - u[i0] - v[j]
                    if cur < minv[j]:
                        minv[j] = cur
                        way[j] = j0
                    if minv[j] < delta:
                        delta = minv[j]
                        j1 = j
            for j in range(m + 1):
                if used[j]:
                    u[p[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if p[j0] == 0:
                break
        while True:
            j1 = way[j0]
            p[j0] = p[j1]
            j0 = j1
            if j0 == 0:
                break
    pairs = [(p[j] - 1, j - 1) for j in range(1, m + 1) if p[j] != 0]
    return [(b, a) for a, b in pairs] if transpose else pairs


def align(weight: list[list[float]]) -> list[tuple[int, int]]:
    """Maximum-weight order-preserving alignment (no two pairs cross), by dynamic programming."""
    n = len(weight)
    m = len(weight[0]) if n else 0
    dp = [[0.0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            dp[i][j] = max(dp[i - 1][j], dp[i][j - 1], dp[i - 1][j - 1] + weight[i - 1][j - 1])
    pairs = []
    i, j = n, m
    while i > 0 and j > 0:
        w = weight[i - 1][j - 1]
        if w > 0 and dp[i][j] == dp[i - 1][j - 1] + w:
            pairs.append((i - 1, j - 1))
            i -= 1
            j -= 1
        elif dp[i][j] == dp[i - 1][j]:
            i -= 1
        else:
            j -= 1
    return pairs[::-1]


def score_tool_call(spec: ToolCallSpec, parsed: ParsedCompletion, tools: ToolIndex | None) -> Score:
    weights = spec.weights
    if parsed.error is not None:
        return Score(0.0, False, {"format": {"ok": False, "reason": parsed.error}}, "invalid_format")
    calls = parsed.calls
    checks: dict[str, Any] = {"format": {"ok": True}}
    failures: list[str] = []

    # Static checks of each call on its own: is the tool declared, do its arguments fit the schema?
    schema_ok = [True] * len(calls)
    if tools is None:
        checks["declared"] = {"ok": True, "skipped": "no tools declared"}
    else:
        unknown = []
        schema_errors: list[str] = []
        skipped: list[str] = []
        for j, call in enumerate(calls):
            info = tools.get(call["name"])
            if info is None:
                unknown.append(call["name"])
                schema_ok[j] = False  # an undeclared tool can match nothing
                continue
            if info.schema_problem:
                skipped.append(info.schema_problem)
                continue
            try:
                errs = info.errors(call["arguments"], f"call {j} ({call['name']})")
            except SchemaProblem as exc:
                skipped.append(str(exc))  # the schema could not judge these arguments: as with schema_problem
                continue
            if errs:
                schema_ok[j] = False
                schema_errors.extend(errs)
        checks["declared"] = {"ok": False, "unknown": unknown} if unknown else {"ok": True}
        checks["schema"] = {"ok": not schema_errors}
        if schema_errors:
            checks["schema"]["errors"] = schema_errors
            failures.append("wrong_arguments")
        if skipped:
            checks["schema"]["skipped"] = skipped
        if unknown:
            failures.append("hallucinated_api")

    # Pair expected and actual calls.
    expected = spec.expected
    weight: list[list[float]] = []
    detail: dict[tuple[int, int], tuple[float, list[str]]] = {}
    for i, exp in enumerate(expected):
        row = []
        for j, call in enumerate(calls):
            if call["name"] != exp.name:
                row.append(0.0)
                continue
            credit, reasons = _match_arguments(exp, call["arguments"], spec.allow_extra_arguments)
            full = not reasons and schema_ok[j]
            if not schema_ok[j]:
                reasons = [*reasons, f"{exp.name}: arguments do not fit the tool's schema"]
                credit *= 0.5
            detail[(i, j)] = (credit, reasons)
            row.append(_FULL + 1.0 if full else 1.0 + credit * 0.5)
        weight.append(row)
    pairs = [(i, j) for i, j in (align(weight) if spec.strict else assign(weight)) if weight[i][j] > 0]

    paired_exp = {i for i, _ in pairs}
    paired_act = {j for _, j in pairs}
    call_checks = []
    full_matches: set[int] = set()
    tool_credit = 0.0
    arg_credit = 0.0
    for i, j in pairs:
        credit, reasons = detail[(i, j)]
        ok = not reasons
        if ok:
            full_matches.add(j)
        tool_credit += 1.0
        arg_credit += 1.0 if ok else credit
        entry: dict[str, Any] = {"expected": i, "name": expected[i].name, "actual": j, "tool": True, "arguments": {"ok": ok}}
        if reasons:
            entry["arguments"]["mismatches"] = reasons
            failures.append("wrong_arguments")
        call_checks.append(entry)
    missing = [i for i in range(len(expected)) if i not in paired_exp]
    unpaired = [j for j in range(len(calls)) if j not in paired_act]
    for i in missing:
        call_checks.append({"expected": i, "name": expected[i].name, "actual": None, "tool": False})
    checks["calls"] = call_checks
    if missing:
        checks["missing"] = [expected[i].name for i in missing]
        # An expected call left unmade while another tool was called instead is the wrong tool; with no
        # stray call to blame, it is simply missing.
        failures.append("wrong_tool" if unpaired else "missing_call")
    extra = [] if spec.allow_extra_calls else unpaired
    if unpaired:
        checks["extra"] = {"ok": spec.allow_extra_calls, "calls": [calls[j]["name"] for j in unpaired]}
        if not spec.allow_extra_calls and not missing:
            failures.append("extra_call")
    if spec.strict and (missing or unpaired):
        # Say so when the calls were all right but came in the wrong order.
        loose = [(i, j) for i, j in assign(weight) if weight[i][j] > _FULL]
        if len(loose) == len(expected) and (spec.allow_extra_calls or len(calls) == len(expected)):
            checks["order"] = {"ok": False, "reason": "the expected calls were made, but not in the expected order"}

    # Unsafe: a call matching a rule that no expected call asked for (a full match is asked for).
    unsafe = unsafe_calls(spec.unsafe, calls, skip=full_matches)
    checks["unsafe"] = {"ok": not unsafe, "calls": unsafe} if unsafe else {"ok": True}
    if unsafe:
        failures.append("unsafe_action")

    failure = first_failure(failures)
    passed = failure is None
    if weights is None:
        return Score(1.0 if passed else 0.0, passed, checks, failure)
    # Partial credit: extra calls that are not allowed dilute the per-call credit, so calling every tool
    # in sight earns less than calling the right one.
    denom = len(expected) + len(extra)
    reward = (
        weights.get("format", 0.0)
        + weights.get("tool", 0.0) * (tool_credit / denom if denom else 1.0)
        + weights.get("arguments", 0.0) * (arg_credit / denom if denom else 1.0)
        + (weights.get("complete", 0.0) if passed else 0.0)
        + (weights.get("unsafe", 0.0) if unsafe else 0.0)
    )
    return Score(round(reward, 6), passed, checks, failure)
