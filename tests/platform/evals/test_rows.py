"""A row's origin has one reader (`origin_of`, `origins_of`): every guard the call sites used to write apart."""

from __future__ import annotations

import pytest

from flywheel.evals.rows import Origin, Origins, build_row, origin_of, origins_of


def test_a_promoted_row_reads_back_its_trajectory_and_failure_mode():
    row = build_row(row_id="case-1", messages=[], tools=[], verifier={}, env=None, trajectory_id=17, failure_mode_id=3)
    assert origin_of(row) == Origin(trajectory_id=17, failure_mode=3)


@pytest.mark.parametrize(
    "row",
    [
        {},
        {"origin": None},
        {"origin": "trajectory 17"},
        {"origin": [17]},
        {"origin": {"trajectory_id": None, "failure_mode": None}},
        {"origin": {"trajectory_id": "17", "failure_mode": 3.0}},
        {"origin": {"trajectory_id": True, "failure_mode": False}},
        {"origin": {"trajectory_id": 0, "failure_mode": -4}},
        {"origin": {"generator": "workplace", "split": "train", "level": 2}},
        "not a row",
        None,
    ],
)
def test_a_missing_or_malformed_origin_reads_as_no_origin(row):
    assert origin_of(row) == Origin()


def test_one_good_id_is_kept_beside_a_bad_one():
    assert origin_of({"origin": {"trajectory_id": 5, "failure_mode": "x"}}) == Origin(trajectory_id=5)


def test_the_origins_of_rows_are_their_distinct_ids():
    rows = [
        {"origin": {"trajectory_id": 2, "failure_mode": 9}},
        {"origin": {"trajectory_id": 1, "failure_mode": 9}},
        {"origin": {"trajectory_id": 2}},
        {"origin": {"generator": "workplace"}},
        {"id": "no origin"},
    ]
    assert origins_of(rows) == Origins(trajectories=frozenset({1, 2}), failure_modes=frozenset({9}))
    assert origins_of([]) == Origins()
