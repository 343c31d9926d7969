"""Replay rows from promotion: what a corrected call is answered with (never the failing call's own error
unless the reviewer says so), and recordings matched to their calls by turn when call ids repeat."""

from __future__ import annotations

import json

import pytest

from flywheel.evals import promotion

pytestmark = pytest.mark.django_db

LOOKUP_TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Find a customer.",
    "parameters": {"type": "object", "properties": {"customer_id": {"type": "string"}}, "required": ["customer_id"]}}}]
NOT_FOUND = json.dumps({"error": "customer not found"})
FOUND = json.dumps({"customer_id": "C-17", "name": "Ada", "plan": "pro"})


def _call(call_id: str, name: str, **arguments: object) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def lookup_record(external_id: str, *, later_success: bool = False) -> dict:
    """The user is C-17; the agent looks up C-71 (a typo) and gets "customer not found"."""
    messages = [
        {"role": "user", "content": f"What plan am I on? I'm customer C-17 ({external_id})."},
        {"role": "assistant", "content": None, "tool_calls": [_call("c1", "lookup", customer_id="C-71")]},
        {"role": "tool", "tool_call_id": "c1", "content": NOT_FOUND},
    ]
    if later_success:  # the agent tried again and got it right
        messages += [{"role": "assistant", "content": None, "tool_calls": [_call("c2", "lookup", customer_id="C-17")]},
                     {"role": "tool", "tool_call_id": "c2", "content": FOUND}]
    messages.append({"role": "assistant", "content": "I could not find your account."})
    return {"external_id": external_id, "outcome": "failure", "messages": messages, "tools": LOOKUP_TOOLS}


CORRECTED_LOOKUP = {"message_index": 1, "expect": "calls", "env_type": "replay",
                    "expected_calls": [{"name": "lookup", "arguments": {"customer_id": "C-17"}}]}


def test_the_failing_calls_error_is_not_offered_to_the_corrected_call(ingest, task_set):
    t = ingest(lookup_record("lk-1"))
    values = promotion.promotion_prefill(trajectory=t, message_index=1)
    # The only recorded result of lookup is the failing call's error: nothing to prefill.
    assert values["observations"] == {}
    check = promotion.promotion_check(trajectory=t, data={**values, **CORRECTED_LOOKUP}, target=task_set)
    assert "observations" in check.errors and "lookup" in check.errors["observations"][0]
    assert "state what the corrected call" in check.errors["observations"][0]
    assert not check.savable()


def test_a_successful_result_of_the_same_tool_is_prefilled(ingest, task_set):
    from trainer.envs import replay

    t = ingest(lookup_record("lk-2", later_success=True))
    values = promotion.promotion_prefill(trajectory=t, message_index=1)
    assert values["observations"] == {"lookup": FOUND}
    check = promotion.promotion_check(trajectory=t, data={**values, **CORRECTED_LOOKUP}, target=task_set)
    assert not check.errors, check.errors
    assert check.savable()
    # In the trainer's replay environment the corrected call gets the customer, not the error.
    transcript, score = replay(check.row, [check.reference, {"role": "assistant", "content": "You are on pro."}])
    assert transcript[len(check.row["messages"]) + 1]["content"] == FOUND
    assert score.passed


def test_an_error_observation_for_the_corrected_call_needs_the_reviewer_to_expect_it(ingest, task_set):
    t = ingest(lookup_record("lk-3"))
    data = {**CORRECTED_LOOKUP, "observations": {"lookup": NOT_FOUND}}
    check = promotion.promotion_check(trajectory=t, data=data, target=task_set)
    assert list(check.errors) == ["observations"]
    assert "is an error" in check.errors["observations"][0] and "lookup" in check.errors["observations"][0]
    with pytest.raises(promotion.PromotionRefused) as refused:
        promotion.trajectory_promote(trajectory=t, data=data, target=task_set)
    assert "observations" in refused.value.check.errors
    # Said to be expected (the form's checkbox sends "on"), it is kept.
    check = promotion.promotion_check(trajectory=t, data={**data, "observation_error_expected": "on"}, target=task_set)
    assert not check.errors, check.errors
    assert check.row["env"]["recorded"][-1] == {"name": "lookup", "arguments": {"customer_id": "C-17"},
                                                "observation": NOT_FOUND}
    bad_flag = promotion.promotion_check(trajectory=t, data={**data, "observation_error_expected": [1]}, target=task_set)
    assert "observation_error_expected" in bad_flag.errors


@pytest.mark.parametrize(("observation", "is_error"), [
    ({"error": "customer not found"}, True),
    ('{"error": "customer not found"}', True),
    ('{"status": "error", "detail": "timeout"}', True),
    ("Error: connection refused", True),
    ({"error": None, "customer_id": "C-17"}, False),
    (FOUND, False),
    ("", False),
    ([], False),
])
def test_what_counts_as_an_error_observation(observation, is_error):
    assert promotion.is_error_observation(observation) is is_error


def test_a_recorded_result_marked_as_an_error_is_not_prefilled(ingest, task_set):
    record = lookup_record("lk-4", later_success=True)
    # The second lookup's result reads fine, but the tool message says it failed (OTLP maps a span's error so).
    record["messages"][4]["is_error"] = True
    t = ingest(record)
    assert promotion.promotion_prefill(trajectory=t, message_index=1)["observations"] == {}


def test_bulk_promotion_takes_observations_per_tool(ingest, task_set, user):
    trajectories = [ingest(lookup_record(f"lk-bulk-{i}")) for i in range(2)]
    data = {"expect": "calls", "env_type": "replay",
            "expected_calls": [{"name": "lookup", "arguments": {"customer_id": "C-17"}}]}
    # Without a stated observation, no draft can answer the corrected call: each says so.
    refused = promotion.selection_promote(items=[(t, 1) for t in trajectories], data=data, target=task_set, user=user)
    assert not refused.saved and len(refused.skipped) == 2
    assert all(any(r.startswith("observations: lookup") for r in reasons) for _, reasons in refused.skipped)
    # Stated once for the batch (the bulk form sends it as JSON text), per tool name.
    stated = {**data, "observations": json.dumps({"lookup": FOUND})}
    result = promotion.selection_promote(items=[(t, 1) for t in trajectories], data=stated, target=task_set, user=user)
    assert len(result.saved) == 2 and not result.skipped
    for task in result.saved:
        assert task.env["recorded"][-1] == {"name": "lookup", "arguments": {"customer_id": "C-17"}, "observation": FOUND}


def test_bulk_promotion_refuses_an_error_observation_unless_expected(ingest, task_set, user):
    t = ingest(lookup_record("lk-bulk-err"))
    data = {"expect": "calls", "env_type": "replay", "observations": {"lookup": NOT_FOUND},
            "expected_calls": [{"name": "lookup", "arguments": {"customer_id": "C-17"}}]}
    result = promotion.selection_promote(items=[(t, 1)], data=data, target=task_set, user=user)
    assert not result.saved and "is an error" in result.skipped[0][1][0]
    result = promotion.selection_promote(items=[(t, 1)], data={**data, "observation_error_expected": "on"},
                                         target=task_set, user=user)
    assert [task.trajectory_id for task in result.saved] == [t.pk]


# --- repeated call ids -----------------------------------------------------------------------------------

ORDER_TOOLS = [
    {"type": "function", "function": {"name": "lookup_order", "parameters": {
        "type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}},
    {"type": "function", "function": {"name": "refund", "parameters": {
        "type": "object", "properties": {"order_id": {"type": "string"}, "amount": {"type": "number"}},
        "required": ["order_id", "amount"]}}},
]
ORDER = json.dumps({"order_id": "A-1", "total": 80.0})
REFUNDED = json.dumps({"ok": True, "refunded": 500.0})


def repeated_ids_record(external_id: str) -> dict:
    """Both turns number their call `call_0`, as many agents do."""
    return {"external_id": external_id, "outcome": "failure", "tools": ORDER_TOOLS, "messages": [
        {"role": "user", "content": "Refund 50 on order A-1, please."},
        {"role": "assistant", "content": None, "tool_calls": [_call("call_0", "lookup_order", order_id="A-1")]},
        {"role": "tool", "tool_call_id": "call_0", "content": ORDER},
        {"role": "assistant", "content": None, "tool_calls": [_call("call_0", "refund", order_id="A-1", amount=500)]},
        {"role": "tool", "tool_call_id": "call_0", "content": REFUNDED},
        {"role": "assistant", "content": "Refunded."},
    ]}


def test_repeated_call_ids_are_recorded_per_turn(ingest, task_set):
    t = ingest(repeated_ids_record("dup-1"))
    data = {"message_index": 1, "expect": "calls", "env_type": "replay",
            "expected_calls": [{"name": "lookup_order", "arguments": {"order_id": "A-1"}}]}
    check = promotion.promotion_check(trajectory=t, data=data, target=task_set)
    assert not check.errors, check.errors
    assert check.row["env"]["recorded"] == [
        {"name": "lookup_order", "arguments": {"order_id": "A-1"}, "observation": ORDER},
        {"name": "refund", "arguments": {"order_id": "A-1", "amount": 500}, "observation": REFUNDED},
    ]
    # The prefilled observation of each tool is its own result.
    assert promotion.promotion_prefill(trajectory=t, message_index=3)["observations"] == {"refund": REFUNDED}
    assert promotion.promotion_prefill(trajectory=t, message_index=1)["observations"] == {"lookup_order": ORDER}


def test_a_repeated_id_within_one_turn_takes_its_answers_in_order():
    messages = [
        {"role": "user", "content": "Look up A-1 and B-2."},
        {"role": "assistant", "content": None, "tool_calls": [_call("x", "lookup_order", order_id="A-1"),
                                                              _call("x", "lookup_order", order_id="B-2")]},
        {"role": "tool", "tool_call_id": "x", "content": "first"},
        {"role": "tool", "tool_call_id": "x", "content": "second"},
        # A tool message after the next assistant turn answers nothing of the turn before.
        {"role": "assistant", "content": "Done."},
        {"role": "tool", "tool_call_id": "x", "content": "stray"},
    ]
    got = [(r.turn, r.arguments["order_id"], r.observation) for r in promotion.recorded_calls(messages)]
    assert got == [(1, "A-1", "first"), (1, "B-2", "second")]


# --- the pages -------------------------------------------------------------------------------------------


def test_the_form_asks_for_the_observation_and_takes_an_expected_error(client_for, user, project, ingest, task_set):
    from django.urls import reverse

    t = ingest(lookup_record("lk-page"))
    client = client_for(user)
    url = reverse("promotion_form", args=[project.slug, t.pk])
    page = client.get(url, {"message": 1})
    html = page.content.decode()
    assert page.status_code == 200 and 'name="observation_error_expected"' in html
    assert "customer not found" not in html.split('id="f-observations"')[1].split("</textarea>")[0]
    form = {"target": f"taskset:{task_set.pk}", "action": "check", "message_index": 1, "expect": "calls",
            "expected_calls": json.dumps(CORRECTED_LOOKUP["expected_calls"]), "answer_match": "exact",
            "env_type": "replay", "observations": json.dumps({"lookup": NOT_FOUND})}
    refused = client.post(url, form)
    html = refused.content.decode()
    assert refused.status_code == 422 and 'data-errors="observations"' in html and "is an error" in html
    accepted = client.post(url, {**form, "observation_error_expected": "on"})
    html = accepted.content.decode()
    assert accepted.status_code == 200 and 'data-errors="observations"' not in html
    assert 'id="f-observation-error-expected" checked' in html  # the tick survives the round trip
    saved = client.post(url, {**form, "observation_error_expected": "on", "action": "save"})
    assert saved.status_code == 302 and task_set.tasks.get().env["recorded"][-1]["observation"] == NOT_FOUND


def test_the_bulk_page_takes_observations_per_tool(client_for, user, project, ingest, task_set):
    from django.urls import reverse

    trajectories = [ingest(lookup_record(f"lk-bulk-page-{i}")) for i in range(2)]
    client = client_for(user)
    url = reverse("bulk_promotion", args=[project.slug])
    assert 'name="observations"' in client.get(url).content.decode()
    response = client.post(url, {
        "ids": ",".join(str(t.pk) for t in trajectories), "target": f"taskset:{task_set.pk}", "expect": "calls",
        "expected_calls": json.dumps(CORRECTED_LOOKUP["expected_calls"]), "answer_match": "exact",
        "env_type": "replay", "observations": json.dumps({"lookup": FOUND})})
    assert response.status_code == 200
    assert sorted(task.trajectory_id for task in task_set.tasks.all()) == sorted(t.pk for t in trajectories)
    assert all(task.env["recorded"][-1]["observation"] == FOUND for task in task_set.tasks.all())
