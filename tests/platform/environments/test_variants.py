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

    # An eval case asks exactly what one rephrasing would ask: that variant is refused, the others kept.
    suite = suite_create(project=project, name="Held out", kind="holdout")
    messages = [{"role": "user", "content": "hi!  book a meeting with ALICE on tuesday"}]
    suite.cases.create(messages=messages, verifier={"type": "exact", "expected": "x"},
                       prompt_digest=prompt_digest(messages), prompt_text=last_user_request(messages))
    result = task_variants_create(task=task, user=user, kinds=("rephrase",))
    refused = [why for _, why in result.skipped]
    assert len(refused) == 1 and "same request" in refused[0] and "Held out" in refused[0]
    assert len(result.saved) == len(REPHRASINGS) - 1
