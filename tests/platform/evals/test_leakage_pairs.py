"""The leakage guard on requests written by hand (tests/platform/evals/data/leakage_pairs.jsonl): requests
reworded as people word them, and different requests that share most of their words or all their literal
values. Goal: at least 90% of the rewordings caught, at most 10% of the different requests refused.

Every pair goes through `leakage.conflicts_between`, the rules promotion, variants and freezing run. "Refused"
is a conflict no person can wave through; "asked" is an "unsure" conflict, which promotion puts to the
reviewer (a reason is needed and kept). The threshold was chosen on the pairs marked "tune"; the pairs marked
"test" were held out. Run with -s to see the figures with their Wilson 95% intervals (`bench/leakage.py`
prints the same and the guard's cost)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from flywheel.evals import leakage
from flywheel.evals import rows as row_shape
from flywheel.registry.sequential import wilson

pytestmark = pytest.mark.django_db  # the guard keeps request vectors in the database

PAIRS = Path(__file__).parent / "data" / "leakage_pairs.jsonl"
KINDS = {True: {"reworded"}, False: {"literal", "antonym", "object", "action", "direction", "related"}}


def load_pairs() -> list[dict]:
    return [json.loads(line) for line in PAIRS.read_text(encoding="utf-8").splitlines() if line.strip()]


def _candidate(label: str, text: str) -> leakage.Candidate:
    return leakage.Candidate(label, None, row_shape.prompt_digest([{"role": "user", "content": text}]), text)


def outcome(a: str, b: str) -> str:
    """"refused", "asked" or "passed": what the guard does with `a` joining one side while `b` is on the other."""
    conflicts = leakage.conflicts_between([_candidate("a", a)], [_candidate("b", b)])
    if [c for c in conflicts if not getattr(c, "confirmable", False)]:
        return "refused"
    return "asked" if conflicts else "passed"


@pytest.fixture(scope="module")
def outcomes(django_db_setup, django_db_blocker) -> list[tuple[dict, str]]:
    pairs = load_pairs()
    with django_db_blocker.unblock():  # the guard keeps request vectors in the database
        # One batch through the model rather than a forward pass per request.
        leakage._vectors(tuple(sorted({text for p in pairs for text in (p["a"], p["b"])})))
        return [(pair, outcome(pair["a"], pair["b"])) for pair in pairs]


def figures(rows: list[tuple[dict, str]]) -> dict[str, tuple[int, int]]:
    same = [o for p, o in rows if p["same"]]
    different = [o for p, o in rows if not p["same"]]
    return {"reworded refused": (same.count("refused"), len(same)),
            "reworded caught (refused or asked)": (len(same) - same.count("passed"), len(same)),
            "different refused": (different.count("refused"), len(different)),
            "different asked": (different.count("asked"), len(different))}


def test_the_set_is_written_as_described():
    pairs = load_pairs()
    assert all(set(p) == {"a", "b", "same", "kind", "domain", "split"} for p in pairs)
    assert all(p["kind"] in KINDS[p["same"]] and p["split"] in ("tune", "test") for p in pairs)
    counts = Counter(p["same"] for p in pairs)
    assert counts[True] >= 100 and counts[False] >= 100, counts
    assert len({(p["a"], p["b"]) for p in pairs}) == len(pairs)
    assert {"workplace", "support", "travel", "banking", "it", "hr"} <= {p["domain"] for p in pairs}
    halves = Counter((p["same"], p["split"]) for p in pairs)
    assert min(halves.values()) >= 50, halves  # each half holds enough of both to measure on


def test_the_guard_holds_the_goal_on_the_hand_written_pairs(outcomes):
    print()
    for name, rows in (("held out", [r for r in outcomes if r[0]["split"] == "test"]),
                       ("tuning half", [r for r in outcomes if r[0]["split"] == "tune"]), ("all", outcomes)):
        print(f"{name}:")
        for label, (k, n) in figures(rows).items():
            low, high = wilson(k, n)
            print(f"  {label:36} {k:3}/{n:3} = {k / n:.3f}  (95% {low:.3f}-{high:.3f})")
    for name, rows in (("held out", [r for r in outcomes if r[0]["split"] == "test"]), ("all", outcomes)):
        f = figures(rows)
        refused, n_same = f["reworded refused"]
        wrong, n_different = f["different refused"]
        assert refused / n_same >= 0.90, (name, f)
        assert wrong / n_different <= 0.10, (name, f)
    missed = [(p["a"], p["b"], o) for p, o in outcomes if p["same"] and o != "refused"]
    wrong = [(p["kind"], p["a"], p["b"]) for p, o in outcomes if not p["same"] and o == "refused"]
    print("rewordings not refused:", *missed, sep="\n  ")
    print("different requests refused:", *wrong, sep="\n  ")


@pytest.mark.parametrize(("a", "b"), [
    # The report's examples: reworded, so refused.
    ("Could you book a meeting with Bob on Tuesday?", "Please set up a meeting with Bob for Tuesday."),
    ("What's the status of ticket T-902?", "Can you tell me where ticket T-902 stands?"),
    ("Transfer 250 dollars from checking to savings.", "Move $250 from my checking account into savings."),
])
def test_the_reported_rewordings_are_refused(a, b):
    assert outcome(a, b) == "refused"


@pytest.mark.parametrize(("a", "b"), [
    ("Add Priya to the design review on Monday.", "Remove Priya from the design review on Monday."),
    ("Transfer 250 dollars from checking to savings.", "Transfer 250 dollars from savings to checking."),
    ("What's the status of ticket T-902?", "What's the status of ticket T-920?"),
])
def test_the_reported_different_requests_pass(a, b):
    assert outcome(a, b) == "passed"
