"""Argument matchers: compile a matcher spec (plain JSON data) once, then check values against it quickly.

A matcher is a plain JSON value (equality) or an object whose keys are all matcher keywords:
`one_of`, `any`, `regex`, `range`, `fields`, `equals`, each optionally with `"optional": true`. Several
keywords in one object must all hold. An object with any other key is a plain value compared for equality;
`{"equals": {...}}` compares a literal object that happens to look like a matcher.

Regexes run on RE2 (linear time), so a hostile pattern or a hostile output cannot make scoring hang.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import re2

from trainer.verifiers.base import short

MATCHER_KINDS = ("one_of", "any", "regex", "range", "fields", "equals")
MATCHER_KEYS = frozenset((*MATCHER_KINDS, "optional"))
MAX_PATTERN_LENGTH = 2000
# RE2 memory budget for one compiled pattern: big enough for any sane verifier, small enough that a
# pathological pattern (a{1000}{1000}) is refused at compile time instead of eating memory.
_RE2_MAX_MEM = 8 << 20

# A check returns None when the value matches, else the reason it does not (for `checks`).
Check = Callable[[Any], "str | None"]

_NON_ALNUM = re.compile(r"[\W_]+")


def normalize_text(text: str) -> str:
    """Case, spaces and punctuation removed: "Fix login." == "fix-login" == " FIX LOGIN "."""
    if not text.isascii():
        text = unicodedata.normalize("NFKC", text)
    return _NON_ALNUM.sub("", text.casefold())


@lru_cache(maxsize=4096)
def compile_regex(pattern: str) -> Any:
    """An RE2 pattern, cached by its text; raises ValueError with a readable reason when refused."""
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise ValueError(f"pattern longer than {MAX_PATTERN_LENGTH} characters")
    options = re2.Options()
    options.max_mem = _RE2_MAX_MEM
    options.log_errors = False
    try:
        return re2.compile(pattern, options)
    except Exception as exc:  # re2.error; its message says which construct (e.g. a backreference) is unsupported
        reason = exc.args[0] if exc.args else exc
        if isinstance(reason, bytes):
            reason = reason.decode("utf-8", "replace")
        raise ValueError(f"unsupported or invalid regex {pattern!r}: {reason}") from None


def is_matcher(spec: Any) -> bool:
    """True when `spec` is a matcher object rather than a plain value to compare for equality."""
    return isinstance(spec, dict) and bool(spec) and spec.keys() <= MATCHER_KEYS


def is_optional(spec: Any) -> bool:
    return is_matcher(spec) and spec.get("optional") is True


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class Compiler:
    """Compiles matcher specs into checks, collecting problems instead of raising on the first one."""

    def __init__(self, *, normalized: bool, allow_extra: bool):
        self.normalized = normalized
        self.allow_extra = allow_extra
        self.problems: list[str] = []

    def compile(self, spec: Any, path: str) -> Check:
        if is_matcher(spec):
            return self._matcher(spec, path)
        return self.literal(spec, path)

    # Plain values -------------------------------------------------------------------------------------
    def literal(self, expected: Any, path: str) -> Check:
        if expected is None or isinstance(expected, bool):
            return lambda v: None if v is expected else f"{path}: expected {short(expected)}, got {short(v)}"
        if _is_number(expected):
            # An integer equals the same float (3 == 3.0), but a bool is never a number here.
            return lambda v: (
                None if _is_number(v) and v == expected else f"{path}: expected {short(expected)}, got {short(v)}"
            )
        if isinstance(expected, str):
            if self.normalized:
                want = normalize_text(expected)
                return lambda v: (
                    None
                    if isinstance(v, str) and (v == expected or normalize_text(v) == want)
                    else f"{path}: expected {short(expected)}, got {short(v)}"
                )
            return lambda v: None if v == expected else f"{path}: expected {short(expected)}, got {short(v)}"
        if isinstance(expected, list):
            items = [self.compile(item, f"{path}[{i}]") for i, item in enumerate(expected)]

            def check_list(v: Any) -> str | None:
                if not isinstance(v, list):
                    return f"{path}: expected a list, got {short(v)}"
                if len(v) != len(items):
                    return f"{path}: expected {len(items)} items, got {len(v)}"
                for item_check, item in zip(items, v, strict=True):
                    reason = item_check(item)
                    if reason:
                        return reason
                return None

            return check_list
        if isinstance(expected, dict):
            # A plain object is equality: every key, nothing more, whatever allow_extra says.
            return self._fields(expected, path, allow_extra=False)
        self.problems.append(f"{path}: unsupported value {short(expected)}")
        return lambda v: f"{path}: unsupported expected value"

    def _literal_only(self, expected: Any, path: str) -> Check:
        # `equals` compares exactly what it holds, matcher-looking objects included.
        sub = Compiler(normalized=self.normalized, allow_extra=False)
        sub.compile = sub.literal  # type: ignore[method-assign]
        check = sub.literal(expected, path)
        self.problems.extend(sub.problems)
        return check

    # Matcher objects ----------------------------------------------------------------------------------
    def _matcher(self, spec: dict, path: str) -> Check:
        if "optional" in spec and not isinstance(spec["optional"], bool):
            self.problems.append(f"{path}: \"optional\" must be true or false")
        checks: list[Check] = []
        if "one_of" in spec:
            checks.append(self._one_of(spec["one_of"], path))
        if "any" in spec:
            if spec["any"] is not True:
                self.problems.append(f"{path}: \"any\" must be true")
        if "regex" in spec:
            checks.append(self._regex(spec["regex"], path))
        if "range" in spec:
            checks.append(self._range(spec["range"], path))
        if "fields" in spec:
            if not isinstance(spec["fields"], dict):
                self.problems.append(f"{path}: \"fields\" must be an object of key -> matcher")
            else:
                checks.append(self._fields(spec["fields"], path, allow_extra=self.allow_extra))
        if "equals" in spec:
            checks.append(self._literal_only(spec["equals"], path))
        if not checks:
            return lambda v: None  # {"any": true} and {"optional": true} alone accept any value
        if len(checks) == 1:
            return checks[0]

        def check_all(v: Any) -> str | None:
            for c in checks:
                reason = c(v)
                if reason:
                    return reason
            return None

        return check_all

    def _one_of(self, options: Any, path: str) -> Check:
        if not isinstance(options, list) or not options:
            self.problems.append(f"{path}: \"one_of\" must be a non-empty list")
            return lambda v: f"{path}: bad one_of"
        items = [self.compile(o, f"{path}.one_of[{i}]") for i, o in enumerate(options)]
        label = short(options)

        def check_one_of(v: Any) -> str | None:
            for c in items:
                if c(v) is None:
                    return None
            return f"{path}: {short(v)} is not one of {label}"

        return check_one_of

    def _regex(self, pattern: Any, path: str) -> Check:
        if not isinstance(pattern, str):
            self.problems.append(f"{path}: \"regex\" must be a string")
            return lambda v: f"{path}: bad regex"
        try:
            compiled = compile_regex(pattern)
        except ValueError as exc:
            self.problems.append(f"{path}: {exc}")
            return lambda v: f"{path}: bad regex"

        def check_regex(v: Any) -> str | None:
            # Numbers are matched on their text so "^\d{3}$" works on 123; other types never match.
            text = v if isinstance(v, str) else str(v) if _is_number(v) else None
            if text is not None and compiled.search(text) is not None:
                return None
            return f"{path}: {short(v)} does not match /{short(pattern, 60)[1:-1]}/"

        return check_regex

    def _range(self, bounds: Any, path: str) -> Check:
        ok_shape = isinstance(bounds, list) and len(bounds) == 2
        lo, hi = (bounds if ok_shape else (None, None))
        kinds = {("num" if _is_number(b) else "str" if isinstance(b, str) else "bad") for b in (lo, hi) if b is not None}
        if not ok_shape or "bad" in kinds or len(kinds) > 1 or (lo is None and hi is None):
            self.problems.append(f"{path}: \"range\" must be [lo, hi] of two numbers or two strings (null = open)")
            return lambda v: f"{path}: bad range"
        if lo is not None and hi is not None and lo > hi:
            self.problems.append(f"{path}: range lower bound {short(lo)} is above upper bound {short(hi)}")
        numeric = kinds == {"num"}

        def check_range(v: Any) -> str | None:
            # Strings compare lexicographically, which is what ISO dates ("2026-03-01") need.
            if (_is_number(v) if numeric else isinstance(v, str)) and (lo is None or v >= lo) and (hi is None or v <= hi):
                return None
            return f"{path}: {short(v)} is outside [{short(lo)}, {short(hi)}]"

        return check_range

    def _fields(self, fields: dict, path: str, *, allow_extra: bool) -> Check:
        compiled = [(key, self.compile(m, f"{path}.{key}"), is_optional(m)) for key, m in fields.items()]
        known = set(fields)

        def check_fields(v: Any) -> str | None:
            if not isinstance(v, dict):
                return f"{path}: expected an object, got {short(v)}"
            for key, check, optional in compiled:
                if key not in v:
                    if optional:
                        continue
                    return f"{path}.{key}: missing"
                reason = check(v[key])
                if reason:
                    return reason
            if not allow_extra:
                extra = [k for k in v if k not in known]
                if extra:
                    return f"{path}: unexpected key(s) {short(extra)}"
            return None

        return check_fields
