"""flywheel.api.text: the strings the API takes hold no NUL, and the schema says so."""

from __future__ import annotations

import re
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, Field, ValidationError

from flywheel.api.text import NON_BLANK, NUL_FREE, NulFree, NulFreeJson, Text, nul_inside


class Model(BaseModel):
    text: Text = ""
    name: Text = Field("x", max_length=5, pattern=NON_BLANK)
    texts: list[Text] = []
    spec: Annotated[dict[str, Any], NulFreeJson] = {}
    anything: Annotated[Any, NulFreeJson] = None


def _errors(**fields: Any) -> list[tuple[tuple, str, str]]:
    with pytest.raises(ValidationError) as caught:
        Model(**fields)
    return [(e["loc"], e["type"], e["msg"]) for e in caught.value.errors()]


@pytest.mark.parametrize(("fields", "loc", "where"), [
    ({"text": "a\x00b"}, ("text",), ""),
    ({"text": "\x00"}, ("text",), ""),
    # A NUL is named as such, not as a name too long or not matching its pattern.
    ({"name": "toolong\x00"}, ("name",), ""),
    ({"name": " \x00 "}, ("name",), ""),
    ({"texts": ["ok", "a\x00"]}, ("texts", 1), ""),
    ({"spec": {"type": "exact", "expected": ["x", "a\x00b"]}}, ("spec",), " (at ['expected'][1])"),
    ({"spec": {"arguments": {"k\x00": 1}}}, ("spec",), " (at ['arguments']['k\\x00'])"),
    ({"anything": "\x00"}, ("anything",), ""),
])
def test_a_nul_is_refused_naming_the_field_and_where_in_it(fields, loc, where):
    assert _errors(**fields) == [(loc, "nul_character", f"must not contain a NUL character{where}")]


def test_text_without_nul_passes_as_it_is():
    value = {"type": "exact", "expected": ["é\u2028\t", {"nested": [None, 1.5, True]}]}
    model = Model(text="any\ttext \u00e9\U0001f600", name=" a ", texts=["", "b"], spec=value, anything=[value])
    assert (model.text, model.name, model.spec, model.anything) == ("any\ttext \u00e9\U0001f600", " a ", value, [value])
    assert _errors(name="   ")[0][1] == "string_pattern_mismatch"  # a blank name is still refused


def test_the_schema_states_that_nul_is_refused():
    properties = Model.model_json_schema()["properties"]
    assert properties["text"]["pattern"] == NUL_FREE
    assert properties["name"]["pattern"] == NON_BLANK  # a field's own pattern, which refuses NUL itself
    assert properties["texts"]["items"]["pattern"] == NUL_FREE
    for pattern in (NUL_FREE, NON_BLANK):
        assert re.search(pattern, "a b") and not re.search(pattern, "a\x00b") and not re.search(pattern, "\x00")
    assert not re.search(NON_BLANK, " \t")


def test_nul_inside_walks_a_deep_body_without_recursion():
    deep: Any = "a\x00"
    for _ in range(100_000):
        deep = [deep]
    assert nul_inside(deep) == (0,) * 100_000
    assert nul_inside({"a": [1, {"b": "ok"}], "c": None}) is None


def test_a_length_on_an_optional_text_is_checked_as_a_string_length():
    class Optional(BaseModel):
        q: Annotated[str, Field(max_length=3), NulFree] | None = None

    for value, error in (("abcd", "string_too_long"), ("a\x00", "nul_character"), ("abcd\x00", "nul_character")):
        with pytest.raises(ValidationError) as caught:
            Optional(q=value)
        assert [e["type"] for e in caught.value.errors()] == [error]
    assert Optional.model_json_schema()["properties"]["q"]["anyOf"][0] == {
        "type": "string", "maxLength": 3, "pattern": NUL_FREE}
