"""The strings the API takes: none may hold a NUL (U+0000), which PostgreSQL's text and jsonb cannot store (SQLite
can, so the write that failed there with a 500 passed in development).

`Text` is a string without NUL (`NulFree` the check, to combine with a length), and the schema says so with a
pattern; `NulFreeJson` marks a field of free JSON (a verifier spec, a recipe, a state) in which no string, key
or value, at any depth holds one. Every body and query field the API reads is typed with them, so a NUL is a
422 naming the field (and, inside JSON, where in it), refused by validation before any query. Ingestion is the exception: its contract stores a NUL in an
agent's text as U+FFFD (flywheel.trajectories.schemas)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic_core import PydanticCustomError, core_schema

# What the schema states of every string a request carries (ECMA-262, as JSON Schema reads patterns).
NUL_FREE = "^[^\\x00]*$"
# A name: at least one character that is neither blank nor NUL, and no NUL anywhere.
NON_BLANK = "^[^\\x00]*[^\\s\\x00][^\\x00]*$"


def _nul_error(where: str = "") -> PydanticCustomError:
    return PydanticCustomError("nul_character", "must not contain a NUL character{where}", {"where": where})


def _refuse_nul(value: Any) -> Any:
    # Before the string's own checks (length, pattern), so a NUL is named as such whatever else is wrong.
    if isinstance(value, str) and "\x00" in value:
        raise _nul_error()
    return value


class _NulFree:
    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_before_validator_function(_refuse_nul, handler(source))

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler) -> Any:
        json_schema = handler(schema)
        json_schema.setdefault("pattern", NUL_FREE)  # a field's own pattern (NON_BLANK) refuses NUL itself
        return json_schema


NulFree = _NulFree()
Text = Annotated[str, NulFree]
# A length on a string that may be null goes before the check, `Annotated[str, Field(max_length=n), NulFree] |
# None`: set on the whole `Text | None`, it cannot reach the string inside the check, and pydantic would check
# it generically ("at most n items" where "at most n characters" is meant).


def nul_inside(value: Any, path: tuple[str | int, ...] = ()) -> tuple[str | int, ...] | None:
    """The path to the first string (a key or a value) in `value` that holds a NUL, or None. Iterative: a
    body nested as deep as the parser allows must not exhaust the stack here."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return where
        elif isinstance(item, dict):
            for key, sub in reversed(item.items()):
                if isinstance(key, str) and "\x00" in key:
                    return (*where, key)
                stack.append((sub, (*where, key)))
        elif isinstance(item, list | tuple):
            stack.extend((sub, (*where, i)) for i, sub in reversed(list(enumerate(item))))
    return None


def _refuse_nul_inside(value: Any) -> Any:
    path = nul_inside(value)
    if path is not None:
        raise _nul_error(f" (at {''.join(f'[{step!r}]' for step in path)})" if path else "")
    return value


# Annotated[dict[str, Any], NulFreeJson], Annotated[Any, NulFreeJson]: free JSON with no NUL in any string.
NulFreeJson = AfterValidator(_refuse_nul_inside)
