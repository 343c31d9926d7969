"""Declared tools and their argument validators, compiled once and cached.

A tool's parameters schema comes with the trajectory, so it is checked and validated by
`trainer.verifiers.jsonschemas`: nothing it refers to is fetched, and its patterns run on RE2. Building a
validator (and checking the schema itself) costs far more than validating one small call with it, so
validators are cached: first by the identity of the tools list (the same eval case or
task scored again and again), then by the schema's content (the same tools read afresh from JSONL).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema

from trainer.verifiers.base import short
from trainer.verifiers.fastschema import FastCheck, compile_fast
from trainer.verifiers.jsonschemas import SchemaProblem, draft_of, schema_validator, validating

_MAX_CACHED = 4096
_MAX_ERRORS = 5


@dataclass(frozen=True)
class ToolInfo:
    """One declared tool: its name and how to check a call's arguments against its parameters."""

    name: str
    validator: Any | None  # a jsonschema validator, None when the tool declares no usable schema
    properties: frozenset[str] | None  # known argument names when unknown ones are not allowed, else None
    schema_problem: str | None = None
    fast: FastCheck | None = None  # jsonschema-equivalent validity check for simple schemas (see fastschema)

    def errors(self, arguments: dict[str, Any], label: str) -> list[str]:
        """Why `arguments` do not fit this tool (schema violations, missing required, unknown), [] if they do.
        Raises SchemaProblem, naming the tool, when its schema cannot be applied to these arguments (see
        `jsonschemas.validating`): like `schema_problem`, the schema's fault, never the call's."""
        errors: list[str] = []
        try:
            with validating():
                found = self._violations(arguments)
        except SchemaProblem as exc:
            raise SchemaProblem(f"tool {self.name!r}: its parameters schema could not be applied: {exc}") from None
        for i, err in enumerate(found):
            if i == _MAX_ERRORS:
                errors.append(f"{label}: ...")
                break
            where = "/".join(str(p) for p in err.path)
            errors.append(f"{label}: {short(err.message, 120)}" + (f" (at {where})" if where else ""))
        if self.properties is not None:
            unknown = [k for k in arguments if k not in self.properties]
            if unknown:
                errors.append(f"{label}: unexpected argument(s) {short(unknown)} (not in the tool's schema)")
        return errors

    def _violations(self, arguments: dict[str, Any]) -> list[Any]:
        """The validator's errors, sorted by where they are; the validity check first, so the common passing
        case never builds error objects."""
        if self.validator is None or (self.fast(arguments) if self.fast is not None else self.validator.is_valid(arguments)):
            return []
        return sorted(self.validator.iter_errors(arguments), key=lambda e: list(e.path))


ToolIndex = dict[str, ToolInfo]

_by_identity: dict[int, tuple[Any, ToolIndex]] = {}
_by_content: dict[str, ToolInfo] = {}
_validators_enabled = True
# Drafts whose semantics the fast path implements (Draft 4 differs: 1.0 is not an integer there).
_FAST_DRAFTS = (
    jsonschema.Draft6Validator,
    jsonschema.Draft7Validator,
    jsonschema.Draft201909Validator,
    jsonschema.Draft202012Validator,
)


def tool_index(tools: list[dict] | None) -> ToolIndex | None:
    """name -> ToolInfo for a list of OpenAI function schemas (or flat {"name", "parameters"}); None for None."""
    if tools is None:
        return None
    hit = _by_identity.get(id(tools))
    # The cache holds a reference to the list, so its id cannot be reused by another object while cached.
    if hit is not None and hit[0] is tools and _validators_enabled:
        return hit[1]
    index: ToolIndex = {}
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        name = fn.get("name")
        if isinstance(name, str) and name:
            index[name] = tool_info(name, fn.get("parameters"))
    if _validators_enabled:
        if len(_by_identity) >= _MAX_CACHED:
            _by_identity.clear()
        _by_identity[id(tools)] = (tools, index)
    return index


def tool_info(name: str, parameters: Any) -> ToolInfo:
    """A ToolInfo for one tool's parameters schema, built once per distinct (name, schema)."""
    key = name + "\0" + json.dumps(parameters, sort_keys=True, default=str)
    hit = _by_content.get(key) if _validators_enabled else None
    if hit is not None:
        return hit
    info = _build(name, parameters)
    if _validators_enabled:
        if len(_by_content) >= _MAX_CACHED:
            _by_content.clear()
        _by_content[key] = info
    return info


def _build(name: str, parameters: Any) -> ToolInfo:
    if parameters is None:
        return ToolInfo(name, None, None)
    if not isinstance(parameters, dict):
        return ToolInfo(name, None, None, f"tool {name!r}: parameters must be a JSON schema object")
    try:
        validator = schema_validator(parameters)
    except SchemaProblem as exc:
        # Not the model's fault: the output is still judged on everything else, and checks say why.
        return ToolInfo(name, None, None, f"tool {name!r} has an invalid parameters schema: {exc}")
    # OpenAI tool schemas rarely say additionalProperties; an argument the tool does not declare would still
    # be a TypeError in the real function, so unknown arguments fail unless the schema explicitly allows them.
    extra = parameters.get("additionalProperties")
    open_schema = extra not in (None, False) or "patternProperties" in parameters
    properties = None
    if extra is None and not open_schema and isinstance(parameters.get("properties"), dict):
        properties = frozenset(parameters["properties"])
    fast = compile_fast(parameters) if draft_of(parameters) in _FAST_DRAFTS and _validators_enabled else None
    return ToolInfo(name, validator, properties, None, fast)


def caching_enabled() -> bool:
    return _validators_enabled


class caches_disabled:
    """Context manager that turns spec and validator caching off (the benchmark's uncached baseline)."""

    def __enter__(self) -> None:
        global _validators_enabled
        _validators_enabled = False

    def __exit__(self, *exc: object) -> None:
        global _validators_enabled
        _validators_enabled = True
