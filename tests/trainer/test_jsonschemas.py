"""Schemas that come with data: nothing they refer to is fetched or read, every pattern runs on RE2, and the RE2
keywords give jsonschema's answers on ordinary patterns (trainer.verifiers.jsonschemas)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import referencing

from tests.standin import StandIn, serving
from trainer.verifiers import jsonschemas as js
from trainer.verifiers import score, validate_spec
from trainer.verifiers.jsonschemas import SchemaProblem, schema_validator
from trainer.verifiers.schemas import caches_disabled, tool_info

HOSTILE_KEY = "a" * 30 + "!"  # ^(a+)+$ against this backtracks 2^30 times in Python's re: minutes
REDOS = "^(a+)+$"
SECRET = "s3cr3t-admin-password"


class Recorder(StandIn):
    """Answers any GET with a schema, and remembers that it was asked."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.requests.append(self.path)
        self.answer(200, {"type": "string", "enum": ["from-the-server"]})


@pytest.fixture
def server():
    with serving(Recorder, requests=[]) as srv:
        yield srv


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "local-login.json"
    path.write_text(json.dumps({"type": "string", "enum": [SECRET]}))
    return path


@pytest.fixture
def no_python_re(monkeypatch):
    """Python's re, where jsonschema's own keywords call it, fails the test if reached: every pattern that
    meets an instance must run on RE2. (The library is a boundary we do not own.)"""

    class Refuse:
        def __getattr__(self, name):
            raise AssertionError(f"jsonschema reached Python's re.{name}")

    for module in ("jsonschema._keywords", "jsonschema._utils", "jsonschema._legacy_keywords"):
        monkeypatch.setattr(f"{module}.re", Refuse())


def remote_schemas(url: str, file_url: str) -> list[dict]:
    base = url.rsplit("/", 1)[0]
    return [
        {"type": "object", "properties": {"a": {"$ref": url}}},
        {"type": "object", "properties": {"a": {"$ref": file_url}}},
        # Relative, under an $id of http://...: it names a document on that server.
        {"$id": f"{base}/root.json", "type": "object", "properties": {"a": {"$ref": "x.json"}}},
        {"$id": f"{base}/root.json", "type": "object", "properties": {"a": {"$ref": ""}}},
        {"type": "object", "properties": {"a": {"$dynamicRef": url}}},
        {"$schema": "https://json-schema.org/draft/2019-09/schema", "properties": {"a": {"$recursiveRef": url}}},
        {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"x": {"$ref": url}},
         "properties": {"a": {"$ref": "#/definitions/x"}}},
        # Reached only through a pointer into data: still refused.
        {"type": "object", "properties": {"a": {"$ref": "#/enum/0"}}, "enum": [{"$ref": url}]},
    ]


def test_a_ref_outside_the_schema_is_a_schema_problem_and_nothing_is_fetched_or_read(server, secret_file):
    for schema in remote_schemas(f"{server.url}/x.json", secret_file.as_uri()):
        info = tool_info("lookup", schema)
        assert info.validator is None and "points outside the schema" in info.schema_problem, schema
        assert info.errors({"a": "x"}, "lookup") == []
        assert SECRET not in info.schema_problem
        problems = validate_spec({"type": "json_schema", "schema": schema})
        assert problems and "points outside the schema" in problems[0], schema
    assert server.requests == []


def test_a_tool_call_against_such_a_schema_is_judged_on_the_rest_without_the_files_values(server, secret_file):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"a": {"$ref": secret_file.as_uri()}, "b": {"$ref": f"{server.url}/b"}}}}}]
    spec = {"type": "tool_call", "expected_calls": [{"name": "lookup", "arguments": {"a": "x", "b": "y"}}]}
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"a": "x", "b": "y"})}}]}
    result = score(spec, call, tools=tools)
    assert result.passed and "points outside the schema" in result.checks["schema"]["skipped"][0]
    assert SECRET not in json.dumps(result.checks) and "from-the-server" not in json.dumps(result.checks)
    assert server.requests == []


def test_even_past_the_check_the_validators_registry_retrieves_nothing(server):
    """The empty registry is the guarantee; the check before it only makes the refusal readable."""
    schema = {"type": "object", "properties": {"a": {"$ref": f"{server.url}/x.json"}}}
    validator = js._re2_class(jsonschema.Draft202012Validator)(schema, registry=js._NOTHING)
    with pytest.raises(referencing.exceptions.Unresolvable):
        validator.is_valid({"a": "x"})
    assert server.requests == []


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "object", "$defs": {"s": {"type": "string"}}, "properties": {"a": {"$ref": "#/$defs/s"}}},
     {"a": "x"}, {"a": 1}),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"s": {"type": "integer"}},
      "properties": {"a": {"$ref": "#/definitions/s"}}}, {"a": 1}, {"a": "1"}),
    ({"type": "object", "$defs": {"s": {"$anchor": "name", "type": "string", "minLength": 2}},
      "properties": {"a": {"$ref": "#name"}}}, {"a": "xy"}, {"a": "x"}),
    # A tree: `#` is the root again, under an $id of http://... (resolved in the document, never fetched).
    ({"$id": "http://127.0.0.1:9/root.json", "type": "object", "additionalProperties": False,
      "properties": {"name": {"type": "string"}, "child": {"$ref": "#"}}},
     {"name": "x", "child": {"name": "y"}}, {"child": {"other": 1}}),
])
def test_local_references_keep_working(schema, good, bad):
    info = tool_info("f", schema)
    assert info.schema_problem is None
    assert info.errors(good, "f") == []
    assert info.errors(bad, "f")


TREE = {"type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"],
        "$defs": {"node": {"type": "object", "required": ["value"], "additionalProperties": False, "properties": {
            "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}}


def test_a_recursive_schema_that_reads_deeper_each_time_validates_as_before():
    """A reference cycle on its own is legal: a tree's node refers to itself through its children."""
    info = tool_info("plant", TREE)
    assert info.schema_problem is None
    good = {"root": {"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}, {"value": 4}]}}
    assert info.errors(good, "plant") == []
    bad = {"root": {"value": 1, "children": [{"value": 2, "children": [{"value": "three", "leaf": True}]}]}}
    errors = info.errors(bad, "plant")
    assert any("'three' is not of type 'integer'" in e and "root/children/0/children/0/value" in e for e in errors)
    assert any("'leaf' was unexpected" in e for e in errors)
    assert validate_spec({"type": "json_schema", "schema": TREE}) == []
    assert score({"type": "json_schema", "schema": TREE}, json.dumps(good)).passed
    assert not score({"type": "json_schema", "schema": TREE}, json.dumps(bad)).passed


# Each raised from inside a validation before: jsonschema resolves a `$ref` only when a value reaches it.
DANGLING = [
    ({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, "$ref \"#/nope\" points to nothing"),
    ({"type": "object", "$defs": {"s": {"type": "string"}}, "properties": {"a": {"$ref": "#/$defs/missing"}}},
     "$ref \"#/$defs/missing\" points to nothing"),
    ({"type": "object", "properties": {"a": {"$ref": "#missing-anchor"}}}, "$ref \"#missing-anchor\" points to nothing"),
    ({"type": "object", "properties": {"a": {"$dynamicRef": "#nope"}}}, "$dynamicRef \"#nope\" points to nothing"),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {},
      "properties": {"a": {"$ref": "#/definitions/gone"}}}, "$ref \"#/definitions/gone\" points to nothing"),
    # Through a list with a segment that is no index (ValueError), through a string (TypeError).
    ({"type": "object", "enum": [{}], "properties": {"a": {"$ref": "#/enum/first"}}}, "points to nothing"),
    ({"type": "object", "title": "t", "properties": {"a": {"$ref": "#/title/x"}}}, "points to nothing"),
    # Somewhere, but not a schema: jsonschema would call .items() on the string.
    ({"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#/required/0"}}}, "points to a str"),
    # Only met past a pointer that resolves: the target is checked as the validator would read it.
    ({"type": "object", "$defs": {"s": {"$ref": "#/$defs/t"}}, "properties": {"a": {"$ref": "#/$defs/s"}}},
     "$ref \"#/$defs/t\" points to nothing"),
]
LOOPS = [
    ({"type": "object", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
      "properties": {"x": {"$ref": "#/$defs/a"}}}, "$ref \"#/$defs/"),
    ({"$ref": "#"}, "$ref \"#\" loops back"),
    ({"type": "object", "properties": {"x": {"$ref": "#"}}, "allOf": [{"$ref": "#"}]}, "$ref \"#\" loops back"),
    ({"type": "object", "not": {"$ref": "#/$defs/n"}, "$defs": {"n": {"allOf": [{"$ref": "#"}]}}}, "loops back"),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"a": {"$ref": "#/definitions/a"}},
      "properties": {"x": {"$ref": "#/definitions/a"}}}, "$ref \"#/definitions/a\" loops back"),
]


@pytest.mark.parametrize(("schema", "said"), DANGLING + LOOPS)
def test_a_local_ref_that_points_nowhere_or_loops_is_a_schema_problem_naming_it(schema, said):
    info = tool_info("lookup", schema)
    assert info.validator is None and said in info.schema_problem, info.schema_problem
    assert info.schema_problem.startswith("tool 'lookup' has an invalid parameters schema: ")
    assert info.errors({"x": 1, "a": "y"}, "lookup") == []
    problems = validate_spec({"type": "json_schema", "schema": schema})
    assert problems and said in problems[0], problems


def test_a_call_to_such_a_tool_is_judged_on_the_rest_and_its_unsafe_action_is_found():
    for schema, said in DANGLING + LOOPS:
        tools = [{"type": "function", "function": {"name": "delete_account", "parameters": schema}}]
        call = {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {
            "name": "delete_account", "arguments": json.dumps({"a": "x"})}}]}
        spec = {"type": "tool_call", "expected_calls": [], "allow_extra_calls": True, "unsafe": [{"name": "delete_*"}]}
        result = score(spec, call, tools=tools)
        assert said in result.checks["schema"]["skipped"][0] and result.checks["schema"]["ok"]
        assert result.checks["unsafe"]["ok"] is False and result.failure == "unsafe_action"


# What the check leaves to the validation: a loop through anyOf ends for a string, never for an object.
ANY_OF_LOOP = {"anyOf": [{"type": "string"}, {"$ref": "#"}]}


def test_a_validation_that_cannot_end_is_a_schema_problem_never_an_exception():
    info = tool_info("f", ANY_OF_LOOP)
    assert info.schema_problem is None
    with pytest.raises(SchemaProblem, match="tool 'f': its parameters schema could not be applied: validation never"):
        info.errors({"a": 1}, "f")
    tools = [{"type": "function", "function": {"name": "f", "parameters": ANY_OF_LOOP}}]
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a": 1})}}]}
    result = score({"type": "tool_call", "expected_calls": [{"name": "f", "arguments": {"a": 1}}]}, call, tools=tools)
    assert result.passed and "could not be applied" in result.checks["schema"]["skipped"][0]
    # The json_schema verifier cannot say the answer fits: it fails, saying why, and raises nothing.
    answer = score({"type": "json_schema", "schema": ANY_OF_LOOP}, '{"a": 1}')
    assert not answer.passed and "the schema could not be applied" in answer.checks["schema"]["errors"][0]
    assert score({"type": "json_schema", "schema": ANY_OF_LOOP}, '"text"').passed
    # A tree nested deeper than the stack goes the same way (json.loads reads it; the validator recurses more).
    deep: dict = {"value": 0}
    for depth in range(1, 300):
        deep = {"value": depth, "children": [deep]}
    with pytest.raises(SchemaProblem, match="nested too deeply"):
        tool_info("plant", TREE).errors({"root": deep}, "plant")
    assert not score({"type": "json_schema", "schema": TREE}, json.dumps({"root": deep})).passed


PATTERN_SCHEMAS = {
    "patternProperties": {"type": "object", "patternProperties": {REDOS: {"type": "string"}}},
    "additionalProperties false": {"type": "object", "patternProperties": {REDOS: {}}, "additionalProperties": False},
    "additionalProperties schema": {"type": "object", "patternProperties": {REDOS: {}},
                                    "additionalProperties": {"type": "string"}},
    "unevaluatedProperties": {"type": "object", "patternProperties": {REDOS: {}}, "unevaluatedProperties": False},
    "unevaluatedProperties 2019-09": {"$schema": "https://json-schema.org/draft/2019-09/schema", "type": "object",
                                      "patternProperties": {REDOS: {}}, "unevaluatedProperties": False},
    "unevaluatedProperties through allOf": {"type": "object", "allOf": [{"patternProperties": {REDOS: {}}}],
                                            "unevaluatedProperties": False},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": REDOS}},
    "draft 4": {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
                "patternProperties": {REDOS: {}}, "additionalProperties": False},
}


@pytest.mark.parametrize("name", PATTERN_SCHEMAS)
def test_every_keyword_that_matches_a_pattern_runs_on_re2(name, no_python_re):
    schema = PATTERN_SCHEMAS[name]
    with caches_disabled():  # the full validator, not the fast path
        info = tool_info("f", schema)
    assert info.schema_problem is None and info.fast is None
    # The answer is computed: the hostile key matches no pattern (it ends in "!"), an honest one does.
    assert info.errors({"aaaa": "x"}, "f") == []
    errors = info.errors({HOSTILE_KEY: 1}, "f")
    assert bool(errors) == (name != "patternProperties"), errors


def test_the_json_schema_verifier_runs_its_patterns_on_re2(no_python_re):
    spec = {"type": "json_schema", "schema": {"type": "object", "properties": {"name": {"pattern": REDOS}},
                                              "patternProperties": {REDOS: {"type": "integer"}},
                                              "additionalProperties": False}}
    bad = score(spec, json.dumps({"name": HOSTILE_KEY, HOSTILE_KEY: "x"}))
    errors = bad.checks["schema"]["errors"]
    assert not bad.passed and any("does not match" in e for e in errors) and any("regexes" in e for e in errors)
    assert score(spec, json.dumps({"name": "aaa", "aa": 3})).passed


@pytest.mark.parametrize("schema", [
    {"type": "object", "patternProperties": {r"(a)\1": {}}},  # a backreference
    {"type": "object", "patternProperties": {"(?<=a)b": {}}},  # lookbehind
    {"type": "object", "properties": {"x": {"patternProperties": {"a" * 3000: {}}}}},  # too long
])
def test_a_pattern_property_re2_refuses_is_a_schema_problem(schema):
    info = tool_info("f", schema)
    assert info.validator is None and "invalid parameters schema" in info.schema_problem
    assert "regex" in info.schema_problem or "pattern" in info.schema_problem


def test_schema_is_read_at_the_root_only(no_python_re):
    """jsonschema hands a subschema with its own $schema (or a $ref back to a root that says one) to the
    draft's stock class, whose patterns run on re: refused inside, left out of the document at the root."""
    d7 = "http://json-schema.org/draft-07/schema#"
    nested = {"type": "object", "properties": {"x": {"$schema": d7, "patternProperties": {REDOS: {}}}}}
    with pytest.raises(SchemaProblem, match="root only"):
        schema_validator(nested)
    root = {"$schema": d7, "type": "object", "patternProperties": {REDOS: {}}, "additionalProperties": False,
            "properties": {"x": {"$ref": "#"}}}
    validator = schema_validator(root)
    assert type(validator).META_SCHEMA == jsonschema.Draft7Validator.META_SCHEMA  # the root's draft
    assert not validator.is_valid({"x": {HOSTILE_KEY: 1}})  # on RE2: no_python_re fails the test on re


# On ordinary patterns the RE2 keywords answer as jsonschema's own ------------------------------------------
AGREEMENT = [
    {"type": "object", "patternProperties": {"^x-": {"type": "integer"}, "_id$": {"type": "string"}},
     "properties": {"name": {"type": "string"}}, "additionalProperties": False},
    {"type": "object", "patternProperties": {"^[a-c]+$": {"minimum": 0}}, "additionalProperties": {"type": "string"}},
    {"type": "object", "properties": {"name": {}}, "patternProperties": {"^x-": {}}, "unevaluatedProperties": False},
    {"type": "object", "allOf": [{"patternProperties": {"^x-": {"type": "integer"}}}, {"properties": {"a": {}}}],
     "unevaluatedProperties": {"type": "boolean"}},
    {"type": "object", "if": {"required": ["a"]}, "then": {"patternProperties": {"^b": {}}},
     "else": {"properties": {"c": {}}}, "unevaluatedProperties": False},
    {"type": "object", "$defs": {"d": {"patternProperties": {"_id$": {"type": "string"}}}}, "$ref": "#/$defs/d",
     "unevaluatedProperties": False},
    {"type": "object", "dependentSchemas": {"a": {"patternProperties": {"^b": {}}}}, "unevaluatedProperties": False},
    {"type": "object", "propertyNames": {"pattern": "^[a-z_-]+$"}, "properties": {"s": {"pattern": "^[0-9]{2}$"}}},
]
DRAFTS = [jsonschema.Draft7Validator, jsonschema.Draft201909Validator, jsonschema.Draft202012Validator]
KEYS = ["a", "b", "bb", "c", "name", "x-1", "x-", "user_id", "abc", "Z", "s"]
VALUES = [None, True, 0, -1, 2, "", "x", "12", "abc", [], {}]


@pytest.mark.parametrize("draft", DRAFTS, ids=lambda d: d.__name__)
def test_the_re2_keywords_agree_with_jsonschema(draft):
    rng = random.Random(0)
    for schema in AGREEMENT:
        if draft is jsonschema.Draft7Validator and ("unevaluatedProperties" in schema or "dependentSchemas" in schema):
            continue  # not keywords of draft 7
        ours = js._re2_class(draft)(schema, registry=js._NOTHING)
        theirs = draft(schema, registry=referencing.Registry())
        for _ in range(150):
            instance = {k: rng.choice(VALUES) for k in rng.sample(KEYS, rng.randint(0, 5))}
            assert ours.is_valid(instance) == theirs.is_valid(instance), (schema, instance)
            ours_errors = sorted((e.validator, list(e.path)) for e in ours.iter_errors(instance))
            theirs_errors = sorted((e.validator, list(e.path)) for e in theirs.iter_errors(instance))
            assert ours_errors == theirs_errors, (schema, instance)
