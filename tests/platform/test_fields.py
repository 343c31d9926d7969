"""flywheel.fields: the one reader of numbers and yes/no values that the settings forms and filters share (the
canary's and the watch's rules, online evaluation's settings, a clustering run's filter)."""

from __future__ import annotations

import math

import pytest

from flywheel import fields


@pytest.mark.parametrize(("raw", "value"), [("12", 12), (" 7 ", 7), (5, 5), (3.0, 3), ("-1", None), (True, None),
                                            (2.5, None), ("1e3", None), (math.inf, None), ("x", None), ("9" * 40, None)])
def test_a_whole_number_is_whole_finite_in_its_range_and_not_a_boolean(raw, value):
    errors: dict[str, str] = {}
    assert fields.whole({"n": raw}, "n", errors, low=0, high=100) == value
    assert ("n" in errors) == (value is None)
    if value is None:
        assert errors["n"].startswith("A whole number from 0 to 100, not ")


@pytest.mark.parametrize(("raw", "value"), [("0.25", 0.25), (1, 1.0), ("0", None), (math.nan, None), ("inf", None),
                                            (False, None), ("2", None), ("a lot", None)])
def test_a_number_is_finite_and_in_its_range_with_an_open_low_end_where_asked(raw, value):
    errors: dict[str, str] = {}
    got = fields.number({"w": raw}, "w", errors, low=0.0, high=1.0, low_open=True, example="0.1", label="weight")
    assert got == value and ("w" in errors) == (value is None)
    if value is None:
        assert errors["w"].startswith("weight: a number above 0 and up to 1, like 0.1; not ")


def test_left_out_or_blank_is_the_default_or_an_error_when_required():
    errors: dict[str, str] = {}
    assert fields.whole({}, "a", errors, low=1, high=9, default=4) == 4
    assert fields.number({"b": "  "}, "b", errors, low=0, high=1) is None and not errors
    assert fields.whole({}, "c", errors, low=1, high=9, required=True, label="c") is None
    assert fields.number({"d": ""}, "d", errors, low=0, high=1, required=True) is None
    assert errors == {"c": "c: a whole number from 1 to 9 is needed.", "d": "A number from 0 to 1 is needed."}


@pytest.mark.parametrize(("raw", "value"), [(True, True), ("on", True), ("Yes", True), ("0", False), ("off", False),
                                            (None, "default"), ("", "default"), ("maybe", None), (1, None)])
def test_a_flag_is_a_boolean_or_a_forms_yes_and_no(raw, value):
    errors: dict[str, str] = {}
    got = fields.flag({"f": raw}, "f", errors, default=True)
    assert got == (True if value == "default" else value)
    assert ("f" in errors) == (value is None)
    if value is None:
        assert errors["f"].startswith("True or false, not ")


def test_a_share_of_traffic_leaves_out_both_ends_as_a_canary_started_with_its_own_weight_does():
    errors: dict[str, str] = {}
    assert fields.number({"w": "0.995"}, "w", errors, low=0.0, high=1.0, low_open=True, high_open=True) == 0.995
    assert fields.number({"w": "1"}, "w", errors, low=0.0, high=1.0, low_open=True, high_open=True) is None
    assert errors == {"w": "A number above 0 and below 1; not 1."}
