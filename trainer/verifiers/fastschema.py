"""A fast path for the small JSON schemas tool parameters use, with jsonschema as the authority.

jsonschema's validators are general and pay for it (resolvers, evolve, error objects): about 25 µs for
a three-property object, most of a score's budget. Tool schemas almost always use a handful of keywords
(type, properties, required, enum, items, bounds, pattern), so those compile here to plain Python checks
with jsonschema's semantics. Anything else returns None and the caller uses jsonschema. The fast path
only answers valid/invalid: error messages always come from jsonschema, and a disagreement is settled
in jsonschema's favour (tests compare the two on many instances).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainer.verifiers.matchers import compile_regex

FastCheck = Callable[[Any], bool]

# Keywords that never affect validity (format is an annotation unless a format checker is passed).
_ANNOTATIONS = frozenset(
    {"description", "title", "default", "examples", "$comment", "format", "deprecated", "readOnly", "writeOnly", "$schema"}
)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


# Draft 6+ semantics: bool is not a number, 1.0 is an integer.
_TYPES: dict[str, FastCheck] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": _is_num,
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def compile_fast(schema: Any) -> FastCheck | None:
    """A validity check equivalent to jsonschema (Draft 6 to 2020-12) for supported schemas, else None."""
    if schema is True:
        return lambda v: True
    if not isinstance(schema, dict):
        return None
    checks: list[FastCheck] = []
    properties = schema.get("properties", {})
    for key, val in schema.items():
        if key in _ANNOTATIONS:
            continue
        if key == "type":
            names = [val] if isinstance(val, str) else val
            if not isinstance(names, list) or not names or any(n not in _TYPES for n in names):
                return None
            if len(names) == 1:
                checks.append(_TYPES[names[0]])
            else:
                fns = [_TYPES[n] for n in names]
                checks.append(lambda v, fns=fns: any(f(v) for f in fns))
        elif key == "properties":
            if not isinstance(val, dict):
                return None
            subs = []
            for name, sub in val.items():
                fn = compile_fast(sub)
                if fn is None:
                    return None
                subs.append((name, fn))
            checks.append(lambda v, subs=subs: not isinstance(v, dict) or all(f(v[k]) for k, f in subs if k in v))
        elif key == "required":
            if not isinstance(val, list) or not all(isinstance(k, str) for k in val):
                return None
            required = tuple(val)
            checks.append(lambda v, r=required: not isinstance(v, dict) or all(k in v for k in r))
        elif key == "additionalProperties":
            if "patternProperties" in schema or not isinstance(properties, dict):
                return None
            known = frozenset(properties)
            if val is True:
                continue
            if val is False:
                checks.append(lambda v, known=known: not isinstance(v, dict) or all(k in known for k in v))
                continue
            fn = compile_fast(val)
            if fn is None:
                return None
            checks.append(
                lambda v, known=known, fn=fn: not isinstance(v, dict) or all(fn(x) for k, x in v.items() if k not in known)
            )
        elif key == "enum":
            # Only string enums: jsonschema's equality has subtleties for numbers and bools (1 vs True).
            if not isinstance(val, list) or not val or not all(isinstance(x, str) for x in val):
                return None
            allowed = frozenset(val)
            checks.append(lambda v, a=allowed: isinstance(v, str) and v in a)
        elif key == "items":
            fn = compile_fast(val)
            if fn is None:
                return None
            checks.append(lambda v, fn=fn: not isinstance(v, list) or all(fn(x) for x in v))
        elif key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if not _is_num(val):
                return None
            op = {
                "minimum": lambda v, b=val: v >= b,
                "maximum": lambda v, b=val: v <= b,
                "exclusiveMinimum": lambda v, b=val: v > b,
                "exclusiveMaximum": lambda v, b=val: v < b,
            }[key]
            checks.append(lambda v, op=op: not _is_num(v) or op(v))
        elif key in ("minLength", "maxLength", "minItems", "maxItems"):
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                return None
            kind = str if key.endswith("Length") else list
            if key.startswith("min"):
                checks.append(lambda v, n=val, kind=kind: not isinstance(v, kind) or len(v) >= n)
            else:
                checks.append(lambda v, n=val, kind=kind: not isinstance(v, kind) or len(v) <= n)
        elif key == "pattern":
            if not isinstance(val, str):
                return None
            try:
                compiled = compile_regex(val)  # RE2, as the full validator runs it (schemas.py)
            except ValueError:
                return None
            checks.append(lambda v, p=compiled: not isinstance(v, str) or p.search(v) is not None)
        else:
            return None
    if not checks:
        return lambda v: True
    if len(checks) == 1:
        return checks[0]
    if len(checks) == 2:
        a, b = checks
        return lambda v: a(v) and b(v)
    if len(checks) == 3:
        a, b, c = checks
        return lambda v: a(v) and b(v) and c(v)
    return lambda v: all(f(v) for f in checks)
