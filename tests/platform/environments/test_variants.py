"""Synthetic variants of a task: argument values from the project's own trajectories for the same tool and
argument, templated rephrasings; each kept only if its verifier passes on its reference; the leakage guard
applies to them as to any task."""

from __future__ import annotations

import json

import pytest

from flywheel.environments.variants import REPHRASINGS, task_variants_create
from flywheel.evals.promotion import score_output

pytestmark = pytest.mark.django_db


def test_argument_values_come_from_the_projects_trajectories(task, user):
    result = task_variants_create(task=task, user=user, kinds=("argument",))
    pairs = {tuple(v.verifier["expected_calls"][0]["arguments"][k] for k in ("person", "day")): v for v in result.saved}
    # What the agent passed to book_meeting.person and .day elsewhere, one argument swapped at a time.
    assert set(pairs) == {("bob", "tuesday"), ("carol", "tuesday"), ("alice", "monday"), ("alice", "friday")}
    bob = pairs[("bob", "tuesday")]
    assert bob.prompt_text == "Book a meeting with bob on tuesday."
    assert pairs[("alice", "friday")].prompt_text == "Book a meeting with alice on friday."
    assert json.loads(bob.reference["tool_calls"][0]["function"]["arguments"]) == {"person": "bob", "day": "tuesday"}
    assert bob.parent == task and bob.variant_kind == "argument" and bob.trajectory_id == task.trajectory_id
    # Kept because its verifier passes its reference, checked the way the trainer scores it.
    assert score_output(bob.row(), bob.reference).passed
    version = task.task_set.versions.order_by("-number").first()
    assert version.number == 2 and version.size == 5 and "variant" in version.note


def test_rephrasings_and_repeats_are_not_kept_twice(task, user):
    first = task_variants_create(task=task, user=user, kinds=("rephrase",))
    assert len(first.saved) == len(REPHRASINGS)
    assert first.saved[0].prompt_text == "Hi! Book a meeting with alice on tuesday."
    again = task_variants_create(task=task, user=user, kinds=("rephrase",))
    assert again.saved == [] and all("already has" in why for _, why in again.skipped)


def test_a_variant_whose_reference_fails_its_verifier_is_dropped(task, user):
    # A reference that no longer satisfies the verifier (edited by hand): no variant of it can pass.
    task.reference = {"role": "assistant", "content": "I booked it."}
    task.save()
    result = task_variants_create(task=task, user=user)
    assert result.saved == [] and result.skipped
    assert all(why == "its verifier fails its reference" for _, why in result.skipped)


def test_variants_inherit_the_leakage_guard(task, user, project):
    from flywheel.evals.rows import last_user_request, prompt_digest
    from flywheel.evals.services import suite_create

    # An eval case asks what every rephrasing asks: all those variants are refused.
    suite = suite_create(project=project, name="Held out", kind="holdout")
    messages = [{"role": "user", "content": "hi!  book a meeting with ALICE on tuesday"}]
    suite.cases.create(messages=messages, verifier={"type": "exact", "expected": "x"},
                       prompt_digest=prompt_digest(messages), prompt_text=last_user_request(messages))
    result = task_variants_create(task=task, user=user, kinds=("rephrase",))
    refused = dict(result.skipped)
    # The same request once case and punctuation are gone, and the same request reworded. (The distilled
    # embedding at 0.90 let two of these rewordings through: "... Thanks in advance.", "I need this done, ...".)
    assert len(refused) == len(REPHRASINGS) and result.saved == []
    assert "same request" in refused["rephrased: Hi!"] and "Held out" in refused["rephrased: Hi!"]
    assert all("reworded request" in why for what, why in refused.items() if what != "rephrased: Hi!")
    # Another person is another request, however alike the words.
    suite.cases.all().delete()
    messages = [{"role": "user", "content": "Book a meeting with Bob on tuesday"}]
    suite.cases.create(messages=messages, verifier={"type": "exact", "expected": "x"},
                       prompt_digest=prompt_digest(messages), prompt_text=last_user_request(messages))
    assert len(task_variants_create(task=task, user=user, kinds=("rephrase",)).saved) == len(REPHRASINGS)


def _holdout_case(project, user, trajectory, person, day):
    """`trajectory` promoted into a holdout suite as it is (its call taken as right)."""
    from flywheel.evals.promotion import trajectory_promote
    from flywheel.evals.services import suite_create

    suite = suite_create(project=project, name="Held out", kind="holdout", user=user)
    data = {"message_index": 1, "expect": "calls",
            "expected_calls": [{"name": "book_meeting", "arguments": {"person": person, "day": day}}]}
    return trajectory_promote(trajectory=trajectory, data=data, target=suite, user=user, accept_passing_original=True)[0]


def test_argument_values_are_never_drawn_from_an_eval_cases_trajectory(task, book, project, user):
    _holdout_case(project, user, book("b-4", "erin", "thursday", "Set up time with erin thursday"), "erin", "thursday")
    result = task_variants_create(task=task, user=user, kinds=("argument",))
    values = {v for t in result.saved for v in t.verifier["expected_calls"][0]["arguments"].values()}
    assert {"bob", "carol", "friday"} <= values  # the other trajectories' values are drawn on...
    assert not values & {"erin", "thursday"}  # ...the holdout's never, whatever the request's wording


def test_a_variant_asking_what_a_holdout_case_asks_is_refused(task, book, project, user):
    """The holdout asks "Could you book a meeting with bob on tuesday?"; bob is booked in another trajectory
    too (b-2), so the argument variant "Book a meeting with bob on tuesday." is drafted, and refused as the same
    request reworded."""
    asked = book("b-5", "bob", "tuesday", "Could you book a meeting with bob on tuesday?")
    case = _holdout_case(project, user, asked, "bob", "tuesday")
    result = task_variants_create(task=task, user=user)
    assert "Book a meeting with bob on tuesday." not in {t.prompt_text for t in result.saved}
    why = dict(result.skipped)["book_meeting.person: 'alice' -> 'bob'"]
    assert "reworded request" in why and f"{case.row_id} in eval suite 'Held out'" in why
    assert result.saved  # the other variants are kept
