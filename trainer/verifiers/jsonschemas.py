"""JSON schemas that come with data (a tool's parameters, a json_schema verifier), checked and validated
without reaching outside the document and without backtracking.

A schema here is written by whoever sent the trajectory or the spec, so it is hostile until checked:

- Nothing is retrieved. Validators are built with an empty `referencing.Registry()` (jsonschema's default
  would open a remote `$ref` with urlopen: SSRF, `file:` reads, a socket that never answers), and a `$ref`,
  `$dynamicRef` or `$recursiveRef` that is not a local `#…` pointer is refused when the schema is checked. A
  relative reference is refused too: under an `$id` of http://… it names that remote document.
- Every local reference a validator can meet is resolved when the schema is checked, with the validator's own
  resolver: one that points to nothing (`#/$defs/missing`), or to something that is not a schema, is refused
  then, naming the pointer, instead of raising in the middle of a validation. So is a loop of references that
  apply to the same value (`#/$defs/a` to `#/$defs/b` and back, `{"$ref": "#"}` at the root), which would
  recurse forever on any value (JSON Schema leaves its behaviour undefined). A recursive schema that reads
  deeper into the value each time (a tree whose children are `#/$defs/node`) is fine.
- What the check cannot rule out (a loop through `anyOf`, a value nested deeper than the stack) is turned
  into a SchemaProblem where a validator meets a value (`validating`), never an exception out of a verifier.
- Every pattern runs on RE2 (`compile_regex`): `pattern`, the keys of `patternProperties`, and the
  `additionalProperties` and `unevaluatedProperties` checks that depend on them. jsonschema runs them on
  Python's `re`, whose backtracking takes minutes on `^(a+)+$` against thirty a's and a "!". Every pattern is
  compiled when the schema is checked, so one RE2 refuses is a problem with the schema, never a crash later.
- `$schema` is read at the root only, to pick the draft. jsonschema hands a subschema that carries its own
  `$schema` to that draft's stock validator class, whose patterns run on `re` again, so a nested one is
  refused and the root's is left out of the document the validator holds.

`format` stays an annotation (no format checker is passed), so `format: regex` compiles nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jsonschema
import referencing
import referencing.jsonschema
from jsonschema.exceptions import SchemaError, ValidationError
from referencing.jsonschema import lookup_recursive_ref

from trainer.verifiers.base import short
from trainer.verifiers.matchers import compile_regex

__all__ = ["SchemaProblem", "draft_of", "schema_validator", "validating"]

# Nothing registered and nothing retrievable: a reference that leaves the document fails to resolve instead
# of being fetched (jsonschema adds the drafts' own metaschemas, which it ships).
_NOTHING = referencing.Registry()
_REFERENCES = ("$ref", "$dynamicRef", "$recursiveRef")
# Keywords that apply their subschemas to the very value their schema is applied to, whatever it is: a loop
# through them (or through `$ref`) never ends. `anyOf`, `oneOf` and `then` may stop first, so a loop through
# them is left to `validating`; `$dynamicRef` and `$recursiveRef` may land elsewhere at run time, likewise.
_IN_PLACE = ("allOf", "not", "if")
# Drafts where `$ref` replaces its siblings instead of joining them.
_REF_ALONE = (jsonschema.Draft3Validator, jsonschema.Draft4Validator, jsonschema.Draft6Validator,
              jsonschema.Draft7Validator)


class SchemaProblem(ValueError):
    """Why a schema cannot be used, in a sentence that names the keyword."""


def draft_of(schema: Any) -> type:
    """The jsonschema validator class of the schema's draft (its `$schema`), Draft 2020-12 when unsaid."""
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)


def schema_validator(schema: Any) -> Any:
    """A validator for `schema` (a dict or a bool) that fetches nothing and runs every pattern on RE2; raises
    SchemaProblem when the schema is invalid under its draft, refers outside itself, carries `$schema` below
    its root, or has a pattern RE2 refuses."""
    cls = draft_of(schema)
    if isinstance(schema, dict):
        _check_document(schema)
    try:
        cls.check_schema(schema)
    except SchemaError as exc:
        raise SchemaProblem(short(exc.message, 120)) from None
    except RecursionError:
        raise SchemaProblem("the schema is nested too deeply") from None
    if isinstance(schema, dict) and "$schema" in schema:
        # The draft is chosen: a `$ref: "#"` back to a root that still said `$schema` would be validated by
        # the stock class (see the module's docstring).
        schema = {key: value for key, value in schema.items() if key != "$schema"}
    validator = _re2_class(cls)(schema, registry=_NOTHING)
    if isinstance(schema, dict):
        _check_references(validator, cls)
    return validator


@contextmanager
def validating() -> Iterator[None]:
    """Around a validator meeting a value: a reference that does not resolve or a recursion without end
    becomes a SchemaProblem (what the caller reports as the schema's problem), never a crash."""
    try:
        yield
    except referencing.exceptions.Unresolvable as exc:
        raise SchemaProblem(f"a reference does not resolve: {short(str(exc), 120)}") from None
    except RecursionError:
        raise SchemaProblem("validation never ended: a reference loops back to the same value, or the value "
                            "is nested too deeply") from None


def _check_document(schema: dict) -> None:
    """Refuse what would reach outside the document or escape RE2, wherever it sits. Every object in the
    document is looked at, not only the keywords where a schema belongs: a local pointer may lead anywhere
    (`{"$ref": "#/enum/0"}`), so whatever it can reach is a schema as far as the validator goes."""
    stack: list[tuple[Any, bool]] = [(schema, True)]
    while stack:
        node, root = stack.pop()
        if isinstance(node, dict):
            for keyword in _REFERENCES:
                ref = node.get(keyword)
                if isinstance(ref, str) and not ref.startswith("#"):
                    raise SchemaProblem(
                        f"{keyword} {short(ref, 80)} points outside the schema: only local references "
                        "(\"#/$defs/...\") are resolved, nothing is fetched"
                    )
            if not root and isinstance(node.get("$schema"), str):
                raise SchemaProblem("$schema is read at the schema's root only, not inside it")
            _compile(node.get("pattern"))
            properties = node.get("patternProperties")
            if isinstance(properties, dict):
                for pattern in properties:
                    _compile(pattern)
            stack.extend((value, False) for value in node.values())
        elif isinstance(node, list):
            stack.extend((value, False) for value in node)


def _check_references(validator: Any, cls: type) -> None:
    """Resolve every local reference the validator can meet, as it would (its resolver, its draft's notion of
    `$id` and of where subschemas sit), following each to what it points at; refuse one that resolves to
    nothing or to no schema, and a loop of references that apply to the same value (see `_IN_PLACE`)."""
    specification = referencing.jsonschema.specification_with(
        dialect_id=cls.ID_OF(cls.META_SCHEMA) or "urn:unknown-dialect", default=referencing.Specification.OPAQUE)
    keywords = [keyword for keyword in _REFERENCES if keyword in cls.VALIDATORS]
    in_place = [keyword for keyword in _IN_PLACE if keyword in cls.VALIDATORS]
    # A node is a schema and the base its `#…` pointers resolve against; edges join nodes applied in place.
    edges: dict[tuple[int, str], list[tuple[tuple[int, str], str]]] = {}
    todo = [(specification.create_resource(validator.schema), validator._resolver)]
    while todo:
        resource, resolver = todo.pop()
        node = resource.contents
        key = (id(node), resolver._base_uri)
        if not isinstance(node, dict) or key in edges:
            continue
        edges[key] = []
        for keyword in keywords:
            ref = node.get(keyword)
            if not isinstance(ref, str):
                continue
            target = _lookup(resolver, keyword, ref)
            todo.append((specification.create_resource(target.contents), target.resolver))
            if keyword == "$ref":
                edges[key].append(((id(target.contents), target.resolver._base_uri), f"$ref {short(ref, 80)}"))
        if not (cls in _REF_ALONE and "$ref" in node):
            for keyword in in_place:
                value = node.get(keyword)
                for sub in value if keyword == "allOf" and isinstance(value, list) else [value]:
                    if isinstance(sub, dict):
                        inner = resolver.in_subresource(specification.create_resource(sub))
                        edges[key].append(((id(sub), inner._base_uri), keyword))
        for sub in resource.subresources():
            todo.append((sub, resolver.in_subresource(sub)))
    _refuse_loops(edges)


def _lookup(resolver: Any, keyword: str, ref: str) -> Any:
    try:
        target = resolver.lookup(ref)
    except (referencing.exceptions.Unresolvable, LookupError, TypeError, ValueError):
        # A pointer through a list with a segment that is no index raises ValueError, through a string TypeError.
        raise SchemaProblem(f"{keyword} {short(ref, 80)} points to nothing inside the schema") from None
    if not isinstance(target.contents, dict | bool):
        raise SchemaProblem(f"{keyword} {short(ref, 80)} points to a {type(target.contents).__name__}, "
                            "not to a schema") from None
    return target


def _refuse_loops(edges: dict[Any, list[tuple[Any, str]]]) -> None:
    """Refuse the first cycle among the in-place edges, naming the references along it (a depth-first search
    that remembers the path it is on)."""
    done: set[Any] = set()
    for start in edges:
        if start in done:
            continue
        path: list[tuple[Any, str]] = [(start, "")]
        on_path = {start: 0}
        branches = [iter(edges[start])]
        while branches:
            step = next(branches[-1], None)
            if step is None:
                branches.pop()
                node, _ = path.pop()
                del on_path[node]
                done.add(node)
                continue
            target, label = step
            if target in on_path:
                labels = [each for _, each in path[on_path[target] + 1:]] + [label]
                chain = " -> ".join(labels[:5]) + (" -> ..." if len(labels) > 5 else "")
                raise SchemaProblem(f"{chain} loops back to where it started without reading into the value: "
                                    "validating would never end")
            if target in done or target not in edges:
                continue
            on_path[target] = len(path)
            path.append((target, label))
            branches.append(iter(edges[target]))


def _compile(pattern: Any) -> None:
    if isinstance(pattern, str):
        try:
            compile_regex(pattern)
        except ValueError as exc:
            raise SchemaProblem(short(str(exc), 160)) from None


# --- the keywords that match patterns, on RE2 ---------------------------------------------------------------
# Each has jsonschema 4.26's behaviour (its _keywords, _utils and _legacy_keywords), with `re.search` replaced
# by RE2's search; the patterns were compiled when the schema was checked, so compile_regex hits its cache.


def _search(pattern: str, text: str) -> bool:
    return compile_regex(pattern).search(text) is not None


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{short(instance, 60)!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: dict, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional(instance: dict, schema: dict) -> list[str]:
    """The instance's keys that neither `properties` nor `patternProperties` covers."""
    properties = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    return [key for key in instance if key not in properties and not any(_search(p, key) for p in patterns)]


def _additional_properties(validator: Any, extra: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    extras = set(_additional(instance, schema))
    if validator.is_type(extra, "object"):
        for key in extras:
            yield from validator.descend(instance[key], extra, path=key)
    elif not extra and extras:
        if "patternProperties" in schema:
            verb = "does" if len(extras) == 1 else "do"
            joined = ", ".join(repr(each) for each in sorted(extras))
            patterns = ", ".join(repr(each) for each in sorted(schema["patternProperties"]))
            yield ValidationError(f"{joined} {verb} not match any of the regexes: {patterns}")
        else:
            yield ValidationError(f"Additional properties are not allowed ({_extras_msg(sorted(extras, key=str))} unexpected)")


def _extras_msg(extras: list[Any]) -> str:
    verb = "was" if len(extras) == 1 else "were"
    return ", ".join(repr(extra) for extra in extras) + " " + verb


def _valid(errors: Iterator[ValidationError]) -> bool:
    return next(errors, None) is None


def _evaluated_keys(validator: Any, instance: dict, schema: Any) -> list[str]:
    """Draft 2020-12: the keys some keyword evaluated (jsonschema's find_evaluated_property_keys_by_schema)."""
    if validator.is_type(schema, "boolean"):
        return []
    keys: list[str] = []
    for keyword in ("$ref", "$dynamicRef"):
        ref = schema.get(keyword)
        if ref is not None:
            resolved = validator._resolver.lookup(ref)
            keys += _evaluated_keys(validator.evolve(schema=resolved.contents, _resolver=resolved.resolver),
                                    instance, resolved.contents)
    properties = schema.get("properties")
    if validator.is_type(properties, "object"):
        keys += properties.keys() & instance.keys()
    for keyword in ("additionalProperties", "unevaluatedProperties"):
        if (subschema := schema.get(keyword)) is not None:
            keys += (key for key, value in instance.items() if _valid(validator.descend(value, subschema)))
    keys += _pattern_keys(instance, schema)
    return keys + _applied_keys(validator, instance, schema, _evaluated_keys)


def _evaluated_keys_2019(validator: Any, instance: dict, schema: Any) -> list[str]:
    """Draft 2019-09: the same, with that draft's `$recursiveRef` (jsonschema's legacy version)."""
    if validator.is_type(schema, "boolean"):
        return []
    keys: list[str] = []
    resolved_refs = []
    if schema.get("$ref") is not None:
        resolved_refs.append(validator._resolver.lookup(schema["$ref"]))
    if "$recursiveRef" in schema:
        resolved_refs.append(lookup_recursive_ref(validator._resolver))
    for resolved in resolved_refs:
        keys += _evaluated_keys_2019(validator.evolve(schema=resolved.contents, _resolver=resolved.resolver),
                                     instance, resolved.contents)
    for keyword in ("properties", "additionalProperties", "unevaluatedProperties"):
        if keyword in schema:
            value = schema[keyword]
            if validator.is_type(value, "boolean") and value:
                keys += instance.keys()
            elif validator.is_type(value, "object"):
                keys += (key for key in value if key in instance)
    keys += _pattern_keys(instance, schema)
    return keys + _applied_keys(validator, instance, schema, _evaluated_keys_2019)


def _pattern_keys(instance: dict, schema: dict) -> list[str]:
    # One entry per matching pattern, as jsonschema counts them.
    return [key for key in instance for pattern in schema.get("patternProperties", ()) if _search(pattern, key)]


def _applied_keys(validator: Any, instance: dict, schema: dict, evaluated: Any) -> list[str]:
    """The keys evaluated through dependentSchemas, allOf/anyOf/oneOf and if/then/else."""
    keys: list[str] = []
    for key, subschema in schema.get("dependentSchemas", {}).items():
        if key in instance:
            keys += evaluated(validator, instance, subschema)
    for keyword in ("allOf", "oneOf", "anyOf"):
        for subschema in schema.get(keyword, []):
            if _valid(validator.descend(instance, subschema)):
                keys += evaluated(validator, instance, subschema)
    if "if" in schema:
        if validator.evolve(schema=schema["if"]).is_valid(instance):
            keys += evaluated(validator, instance, schema["if"])
            if "then" in schema:
                keys += evaluated(validator, instance, schema["then"])
        elif "else" in schema:
            keys += evaluated(validator, instance, schema["else"])
    return keys


def _unevaluated(evaluated: Any) -> Any:
    def unevaluated_properties(validator: Any, unevaluated: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
        if not validator.is_type(instance, "object"):
            return
        seen = evaluated(validator, instance, schema)
        invalid = [key for key in instance if key not in seen
                   and not _valid(validator.descend(instance[key], unevaluated, path=key, schema_path=key))]
        if invalid:
            if unevaluated is False:
                yield ValidationError(
                    f"Unevaluated properties are not allowed ({_extras_msg(sorted(invalid, key=str))} unexpected)")
            else:
                yield ValidationError("Unevaluated properties are not valid under the given schema "
                                      f"({_extras_msg(invalid)} unevaluated and invalid)")

    return unevaluated_properties


_RE2_KEYWORDS = {
    "pattern": _pattern,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional_properties,
}
_UNEVALUATED = {
    jsonschema.Draft201909Validator: _unevaluated(_evaluated_keys_2019),
    jsonschema.Draft202012Validator: _unevaluated(_evaluated_keys),
}
_RE2_CLASSES: dict[type, type] = {}


def _re2_class(cls: type) -> type:
    """The draft's validator class with every keyword that matches a pattern on RE2."""
    if cls not in _RE2_CLASSES:
        keywords = {k: v for k, v in _RE2_KEYWORDS.items() if k in cls.VALIDATORS}
        if "unevaluatedProperties" in cls.VALIDATORS:
            keywords["unevaluatedProperties"] = _UNEVALUATED[cls]
        _RE2_CLASSES[cls] = jsonschema.validators.extend(cls, keywords)
    return _RE2_CLASSES[cls]
