"""Triage: each detector on crafted trajectories (positive and negative), the suggested category, the policy
(RE2 errors are field errors, maintainers only), the task's chunks and replays, the sweep, the re-run, the
list's signal filter and the badges on the trajectory page. The worker tests are in test_triage_worker.py."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from django.core.exceptions import ValidationError
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from flywheel.trajectories import triage, triage_policy
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.models import Trajectory, TriagePolicy, TriageRun, TriageRunStatus, TriageSignal
from flywheel.trajectories.triage import detect, feedback_negative, suggest_category


@pytest.fixture(autouse=True)
def _triage_on(settings):
    """Automatic triage is what these tests are about (tests/conftest.py turns it off elsewhere)."""
    settings.FLYWHEEL_TRIAGE = True


SPEC = {"type": "tool_call", "expected_calls": [], "allow_extra_calls": True, "unsafe": triage_policy.DEFAULT_UNSAFE_RULES}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_order",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string", "pattern": "^NW-[0-9]{5}$"}},
                "required": ["order_id"],
            },
        },
    },
    {"type": "function", "function": {"name": "refund_order", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "delete_account", "parameters": {"type": "object"}}},
]


def call(name, arguments, call_id="c1"):
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]}


def result(content, call_id="c1"):
    return {"role": "tool", "tool_call_id": call_id, "content": content}


USER = {"role": "user", "content": "Where is NW-12345?"}
ANSWER = {"role": "assistant", "content": "It shipped."}


def kinds(messages, tools=TOOLS, **extra):
    return [(s.kind, s.message_index) for s in detect(messages=messages, tools=tools, unsafe_spec=SPEC, **extra)]


# --- detectors ---------------------------------------------------------------------------------------------


def test_a_clean_trajectory_has_no_signal():
    messages = [USER, call("get_order", {"order_id": "NW-12345"}), result('{"status": "shipped"}'), ANSWER]
    assert kinds(messages) == []
    assert suggest_category([]) == ""


def test_arguments_that_are_not_json():
    messages = [USER, call("get_order", '{"order_id": "NW-12345"'), result("{}"), ANSWER]
    signals = detect(messages=messages, tools=TOOLS, unsafe_spec=SPEC)
    assert [(s.kind, s.message_index) for s in signals] == [("invalid_arguments", 1)]
    assert "not valid JSON" in signals[0].detail["error"]
    assert suggest_category(signals) == "format"


def test_a_call_to_an_undeclared_tool_only_when_tools_are_declared():
    messages = [USER, call("cancel_order", {"order_id": "NW-12345"}), result("{}"), ANSWER]
    signals = detect(messages=messages, tools=TOOLS, unsafe_spec=SPEC)
    assert [(s.kind, s.message_index, s.detail) for s in signals] == [("undeclared_tool", 1, {"tools": ["cancel_order"]})]
    assert suggest_category(signals) == "hallucinated_api"
    # A trajectory that declares no tools cannot call an undeclared one.
    assert kinds(messages, tools=[]) == []


def test_arguments_that_break_the_schema_including_an_re2_pattern():
    wrong_type = [USER, call("get_order", {"order_id": 12345}), result("{}"), ANSWER]
    signals = detect(messages=wrong_type, tools=TOOLS, unsafe_spec=SPEC)
    assert [(s.kind, s.message_index) for s in signals] == [("schema_violation", 1)]
    assert "get_order" in signals[0].detail["errors"][0]
    assert suggest_category(signals) == "wrong_arguments"
    bad_pattern = [USER, call("get_order", {"order_id": "nw 12345"}), result("{}"), ANSWER]
    assert kinds(bad_pattern) == [("schema_violation", 1)]
    missing = [USER, call("get_order", {}), result("{}"), ANSWER]
    assert kinds(missing) == [("schema_violation", 1)]


def test_a_tool_result_that_reports_an_error_names_its_tool():
    messages = [USER, call("get_order", {"order_id": "NW-12345"}), result("Error: upstream timeout"), ANSWER]
    signals = detect(messages=messages, tools=TOOLS, unsafe_spec=SPEC)
    assert [(s.kind, s.message_index) for s in signals] == [("tool_error", 2)]
    assert signals[0].detail == {"tool": "get_order", "excerpt": "Error: upstream timeout"}
    assert kinds([USER, call("get_order", {"order_id": "NW-12345"}), result('{"error": "no such order"}'), ANSWER]) == [
        ("tool_error", 2)
    ]
    assert kinds([USER, call("get_order", {"order_id": "NW-12345"}), result('{"errors_seen": 0}'), ANSWER]) == []


WORKPLACE_TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
                   for name in ("delete_task", "cancel_event", "update_task", "refund_order")]
LIMITED = {**SPEC, "unsafe": [*triage_policy.DEFAULT_UNSAFE_RULES,
                              {"name": "refund_order", "arguments": {"amount_eur": {"range": [100, None]}}}]}


@pytest.mark.parametrize(
    "request_text, name, arguments, unsafe",
    [
        ('Delete task T3 "Fix login".', "delete_task", {"task_id": "T3"}, False),
        ('Remove "Fix login" (T3).', "delete_task", {"task_id": "T3"}, False),
        ("please DELETE t3", "delete_task", {"task_id": "T3"}, False),
        # What is truly unsafe stays flagged:
        ('Delete task T3 "Fix login".', "delete_task", {"task_id": "T31"}, True),  # another record
        ('Delete task T3 "Fix login".', "delete_task", {"task_id": "T4"}, True),
        ('Mark T3 "Fix login" as done.', "delete_task", {"task_id": "T3"}, True),  # not asked to delete
        ("Don't delete T3, mark it done.", "delete_task", {"task_id": "T3"}, True),  # forbidden
        ("Delete T3 but don’t delete T4.", "delete_task", {"task_id": "T3"}, True),  # asks and forbids
        ("Delete everything.", "delete_task", {}, True),  # names no record
        ('Delete the "Fix login" task.', "delete_task", {"task_id": "T3"}, True),  # named only by a lookup
        # A rule without `unless_requested` is never excused, asked or not.
        ("Drop table T3", "drop_table", {"table": "T3"}, True),
        ("Refund NW-40219, all 249 EUR of it.", "refund_order", {"order_id": "NW-40219", "amount_eur": 249}, True),
        ("Refund 18 EUR on NW-40388.", "refund_order", {"order_id": "NW-40388", "amount_eur": 18}, False),
    ],
)
def test_an_unsafe_call_the_user_asked_for_is_excused_only_under_its_rule(request_text, name, arguments, unsafe):
    messages = [{"role": "user", "content": request_text}, call(name, arguments)]
    signals = detect(messages=messages, tools=WORKPLACE_TOOLS, unsafe_spec=LIMITED)
    assert [s.kind for s in signals if s.kind == "unsafe_action"] == (["unsafe_action"] if unsafe else [])


def test_a_call_that_breaks_its_tools_schema_or_is_not_declared_is_never_excused():
    tools = [{"type": "function", "function": {"name": "delete_email", "parameters": {
        "type": "object", "required": ["email_id"], "properties": {"email_id": {"type": "string"}},
        "additionalProperties": False}}}]
    asked = {"role": "user", "content": 'Remove "Write test suite" (T1).'}
    # The user named a task; the agent deletes an email, with the task's id: the wrong kind of record.
    wrong_kind = call("delete_email", {"task_id": "T1"})
    assert kinds([asked, wrong_kind], tools) == [("schema_violation", 1), ("unsafe_action", 1)]
    assert kinds([asked, call("delete_task", {"task_id": "T1"})], tools) == [("undeclared_tool", 1), ("unsafe_action", 1)]
    assert kinds([{"role": "user", "content": "Delete email E1."}, call("delete_email", {"email_id": "E1"})], tools) == []


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"task_id": {"$ref": "#/$defs/missing"}}},  # refused when built
    {"type": "object", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"anyOf": [{"type": "string"}, {"$ref": "#"}]},  # past the check: never ends on an object
])
def test_a_tool_schema_that_cannot_be_applied_skips_the_schema_check_and_nothing_else(schema):
    tools = [{"type": "function", "function": {"name": "delete_task", "parameters": schema}}]
    messages = [{"role": "user", "content": "Where is T3?"}, call("delete_task", {"task_id": "T3"})]
    assert [(s.kind, s.message_index) for s in detect(messages=messages, tools=tools, unsafe_spec=LIMITED)] == [
        ("unsafe_action", 1)]
    # As with any schema problem, the request alone decides whether the call is excused.
    asked = [{"role": "user", "content": "Delete T3."}, call("delete_task", {"task_id": "T3"})]
    assert detect(messages=asked, tools=tools, unsafe_spec=LIMITED) == []


def test_the_request_is_the_latest_user_message_before_the_call():
    later = [{"role": "user", "content": "Delete T3."}, {"role": "assistant", "content": "Sure?"},
             {"role": "user", "content": "Actually, just mark it done."}, call("delete_task", {"task_id": "T3"})]
    assert ("unsafe_action", 3) in kinds(later, WORKPLACE_TOOLS)
    assert ("unsafe_action", 3) not in kinds([*later[2:3], *later[:1], later[3]], WORKPLACE_TOOLS)


def test_a_rule_also_matched_without_the_key_keeps_the_call_unsafe():
    spec = {**SPEC, "unsafe": [{"name": "delete_*", "unless_requested": True}, {"name": "delete_task"}]}
    signals = detect(messages=[{"role": "user", "content": "Delete T3."}, call("delete_task", {"task_id": "T3"})],
                     tools=WORKPLACE_TOOLS, unsafe_spec=spec)
    assert [(s.kind, s.detail) for s in signals] == [("unsafe_action", {"calls": [{"tool": "delete_task", "rule": "delete_*"}]})]


def test_unless_requested_must_be_a_boolean_and_is_kept():
    with pytest.raises(ValidationError) as caught:
        triage_policy.policy_parse('[{"name": "delete_*", "unless_requested": "yes"}]')
    assert caught.value.message_dict["unsafe"] == ['rule [0]: unless_requested must be true or false, not "yes"']
    rules = triage_policy.policy_parse('[{"name": "delete_*", "unless_requested": true}]')
    assert rules == [{"name": "delete_*", "unless_requested": True}]
    with pytest.raises(ValidationError) as caught:
        triage_policy.policy_parse('[{"name": "delete_*", "unless_requested": true, "when": 1}]')
    assert "rule [0]: unknown key(s) ['when']" in caught.value.message_dict["unsafe"][0]


def test_unsafe_actions_by_the_default_policy():
    signals = detect(messages=[USER, call("delete_account", {"id": 1}), result("{}"), ANSWER], tools=TOOLS, unsafe_spec=SPEC)
    assert [(s.kind, s.message_index) for s in signals] == [("unsafe_action", 1)]
    assert signals[0].detail == {"calls": [{"tool": "delete_account", "rule": "delete_*"}]}
    assert suggest_category(signals) == "unsafe_action"
    big = [USER, call("refund_order", {"amount": 250}), result("{}"), ANSWER]
    small = [USER, call("refund_order", {"amount": 20}), result("{}"), ANSWER]
    assert kinds(big) == [("unsafe_action", 1)]
    assert kinds(small) == []


def test_an_unsafe_call_outranks_the_other_categories():
    messages = [
        USER,
        call("cancel_order", {}, "c1"),
        result("Error: unknown tool", "c1"),
        call("delete_account", {"id": 1}, "c2"),
        result("{}", "c2"),
        ANSWER,
    ]
    signals = detect(messages=messages, tools=TOOLS, unsafe_spec=SPEC)
    assert {s.kind for s in signals} == {"undeclared_tool", "tool_error", "unsafe_action"}
    assert suggest_category(signals) == "unsafe_action"
    assert max(s.severity for s in signals) == 4


@pytest.mark.parametrize(
    "feedback, negative",
    [
        ({"thumbs": "down"}, True),
        ({"thumbs": "up"}, False),
        ({"score": 0}, True),
        ({"score": 1}, False),
        ({"score": -0.5}, True),
        ({"rating": 2}, True),
        ({"rating": 4}, False),
        ({"rating": 3, "max": 10}, True),
        ({"helpful": False}, True),
        ({"helpful": True}, False),
        ("thumbs_down", True),
        ("great", False),
        (-1, True),
        (1, False),
        (False, True),
        ([{"thumbs": "up"}, {"vote": "down"}], True),
        ({"comment": "did not look at my order"}, False),
        (None, False),
    ],
)
def test_what_counts_as_negative_feedback(feedback, negative):
    assert bool(feedback_negative(feedback)) is negative
    found = kinds([USER, ANSWER], feedback=feedback)
    assert found == ([("negative_feedback", None)] if negative else [])


def test_a_human_intervention_at_its_message_or_on_the_trajectory():
    assert kinds([USER, ANSWER], human_intervention={"by": "supervisor", "message_index": 1}) == [("human_intervention", 1)]
    assert kinds([USER, ANSWER], human_intervention={"by": "supervisor"}) == [("human_intervention", None)]
    assert kinds([USER, ANSWER], human_intervention={"message_index": 99}) == [("human_intervention", None)]
    for none in (None, False, {}, [], ""):
        assert kinds([USER, ANSWER], human_intervention=none) == []


def test_a_loop_is_the_same_call_with_the_same_arguments_three_times():
    same = [call("get_order", {"order_id": "NW-12345"}, f"c{i}") for i in range(3)]
    messages = [USER, same[0], result("{}", "c0"), same[1], result("{}", "c1"), same[2], result("{}", "c2"), ANSWER]
    signals = detect(messages=messages, tools=TOOLS, unsafe_spec=SPEC)
    assert [(s.kind, s.message_index) for s in signals] == [("loop", 5)]
    assert signals[0].detail["count"] == 3 and signals[0].detail["messages"] == [1, 3, 5]
    assert suggest_category(signals) == "bad_planning"
    # Twice is not a loop, and three calls with different arguments are not either.
    assert kinds(messages[:5] + [ANSWER]) == []
    varied = [USER] + [call("get_order", {"order_id": f"NW-1234{i}"}, f"c{i}") for i in range(3)] + [ANSWER]
    assert kinds(varied) == []
    # The same arguments in another key order are the same call.
    reordered = [USER] + [call("refund_order", args, f"c{i}") for i, args in enumerate(
        ['{"a": 1, "b": 2}', '{"b": 2, "a": 1}', '{"a":1,"b":2}'])] + [ANSWER]  # fmt: skip
    assert kinds(reordered) == [("loop", 3)]


LOOKUP = [call("get_order", {"order_id": "NW-12345"}), result('{"status": "shipped"}')]


@pytest.mark.parametrize(
    "tail, reason",
    [
        ([*LOOKUP, call("get_order", {"order_id": "NW-12346"}, "c2")], "it ends on a tool call, after earlier calls"),
        ([result("{}")], "it ends on a tool result"),
        ([*LOOKUP], "it ends on a tool result"),
        ([{"role": "user", "content": "Hello?"}], "it ends on a user message"),
        ([{"role": "assistant", "content": "  "}], "the last assistant message is empty"),
    ],
)
def test_an_episode_without_a_final_answer(tail, reason):
    signals = detect(messages=[USER, *tail], tools=TOOLS, unsafe_spec=SPEC)
    assert [(s.kind, s.message_index, s.detail) for s in signals if s.kind == "no_final_answer"] == [
        ("no_final_answer", len(tail), {"reason": reason})
    ]


@pytest.mark.parametrize(
    "tail",
    [
        # One action recorded: the agent's only call ends the record (a completion recorded, an application
        # that runs the call and confirms it itself, the workplace demo's single-turn plays).
        [call("get_order", {"order_id": "NW-12345"})],
        [{"role": "assistant", "content": "Let me look.", "tool_calls": LOOKUP[0]["tool_calls"]}],
        # A final-answer tool, answered or not (smolagents' final_answer, OpenHands' finish).
        [*LOOKUP, call("final_answer", {"answer": "It shipped."}, "c2")],
        [*LOOKUP, call("finish", {}, "c2"), result("ok", "c2")],
    ],
)
def test_what_counts_as_a_final_answer(tail):
    assert [s for s in detect(messages=[USER, *tail], tools=None, unsafe_spec=SPEC) if s.kind == "no_final_answer"] == []


@pytest.mark.parametrize(
    "closing, answered",
    [
        ("Thanks!", True),
        ("ok great, thank you so much 👍", True),
        ("Thanks! Bye", True),
        ("Thanks, but has MY order shipped?", False),  # a question: a request left unanswered
        ("thanks, now refund it", False),  # another request
        ("so much", False),  # no word that closes
    ],
)
def test_a_users_closing_after_the_answer_asks_nothing_more(closing, answered):
    found = kinds([USER, *LOOKUP, ANSWER, {"role": "user", "content": closing}])
    assert found == ([] if answered else [("no_final_answer", 4)])
    # Without an answer before it, even a closing is left unanswered.
    assert kinds([USER, *LOOKUP, {"role": "user", "content": closing}]) == [("no_final_answer", 3)]


def test_a_call_left_in_the_text_is_a_call_not_an_answer():
    hermes = {"role": "assistant", "content": '<tool_call>{"name": "delete_account", "arguments": {"id": 7}}</tool_call>'}
    assert kinds([USER, *LOOKUP, hermes]) == [("unsafe_action", 3), ("no_final_answer", 3)]
    broken = {"role": "assistant", "content": '{"name": "get_order", "arguments": {"order_id": '}
    assert kinds([USER, broken]) == [("invalid_arguments", 1)]
    # Prose that quotes JSON, or starts with a bracket, is an answer.
    for text in ['Your order: {"name": "boots", "size": 42}', "[1] Returns: 60 days."]:
        assert kinds([USER, *LOOKUP, {"role": "assistant", "content": text}]) == []


def test_a_final_answer_in_content_parts_counts():
    answer = {"role": "assistant", "content": [{"type": "text", "text": "It shipped."}]}
    assert kinds([USER, answer]) == []


def test_hostile_or_odd_messages_never_break_the_detectors():
    messages = [USER, "not a message", {"role": "assistant", "tool_calls": "nope"}, {"role": "assistant", "tool_calls": [None]}, ANSWER]
    found = kinds(messages)
    assert ("invalid_arguments", 2) in found and ("invalid_arguments", 3) in found


# --- the policy ----------------------------------------------------------------------------------------------


def test_a_regex_re2_refuses_is_a_field_error_naming_the_rule():
    text = json.dumps([{"name": "run_sql", "arguments": {"query": {"regex": "(?<=drop) table"}}}])
    with pytest.raises(ValidationError) as caught:
        triage_policy.policy_parse(text)
    (message,) = caught.value.message_dict["unsafe"]
    assert "rule [0]" in message and "regex" in message


@pytest.mark.parametrize(
    "text, says",
    [
        ("[{", "not valid JSON"),
        ('{"name": "delete_*"}', "must be a JSON list"),
        ('[{"tool": "delete_*"}]', "needs a \"name\" glob"),
        ('[{"name": "x", "arguments": {"a": {"range": [5, 1]}}}]', "above upper bound"),
    ],
)
def test_other_bad_policies_are_field_errors(text, says):
    with pytest.raises(ValidationError) as caught:
        triage_policy.policy_parse(text)
    assert says in " ".join(caught.value.message_dict["unsafe"])


# --- the database side ---------------------------------------------------------------------------------------


def record(external_id, messages, **extra):
    return {"external_id": external_id, "messages": messages, "tools": TOOLS, **extra}


def signals_of(project, external_id):
    return sorted(
        TriageSignal.objects.filter(trajectory__project=project, trajectory__external_id=external_id).values_list(
            "kind", "message_index"
        ),
        key=str,
    )


@pytest.mark.django_db
def test_the_task_triages_untriaged_trajectories_once_and_a_replay_again(project):
    ingest_trajectories(
        project=project,
        records=[
            record("clean", [USER, ANSWER]),
            record("unsafe", [USER, call("delete_account", {"id": 1}), result("{}"), ANSWER]),
            record("fed-up", [USER, ANSWER], feedback={"thumbs": "down"}),
        ],
    )
    assert set(Trajectory.objects.values_list("triage_version", flat=True)) == {0}
    assert triage.triage_project(project_id=project.pk) == 3
    assert triage.triage_project(project_id=project.pk) == 0  # idempotent: nothing left
    assert signals_of(project, "clean") == []
    assert signals_of(project, "unsafe") == [("unsafe_action", 1)]
    assert signals_of(project, "fed-up") == [("negative_feedback", None)]
    unsafe = Trajectory.objects.get(external_id="unsafe")
    assert (unsafe.suggested_category, unsafe.triage_severity, unsafe.triage_version) == ("unsafe_action", 4, 1)
    assert unsafe.triaged_at is not None

    # A replay makes it untriaged; triage replaces its signals, never adds to them.
    ingest_trajectories(project=project, records=[record("unsafe", [USER, call("cancel_order", {}), result("{}"), ANSWER])])
    assert Trajectory.objects.get(external_id="unsafe").triage_version == 0
    assert triage.triage_project(project_id=project.pk) == 1
    assert signals_of(project, "unsafe") == [("undeclared_tool", 1)]
    assert Trajectory.objects.get(external_id="unsafe").suggested_category == "hallucinated_api"


@pytest.mark.django_db
def test_the_task_works_in_chunks(project):
    ingest_trajectories(project=project, records=[record(f"t-{i}", [USER, call("get_order", {})]) for i in range(7)])
    assert triage.triage_chunk(project_id=project.pk, size=3) == 3
    assert Trajectory.objects.filter(triage_version=0).count() == 4
    assert triage.triage_project(project_id=project.pk) == 4
    assert TriageSignal.objects.filter(kind="schema_violation").count() == 7
    # One action recorded: the call is the answer, the schema detector judges it.
    assert TriageSignal.objects.filter(kind="no_final_answer").count() == 0


@pytest.mark.django_db
def test_a_trajectory_that_breaks_a_detector_does_not_stop_its_chunk(project, monkeypatch):
    ingest_trajectories(project=project, records=[record(f"t-{i}", [USER, call("delete_x", {})]) for i in range(3)])
    poison = Trajectory.objects.get(external_id="t-1").pk
    real = triage.detect

    def flaky(**kwargs):
        if kwargs["messages"] == Trajectory.objects.get(pk=poison).messages:
            raise RecursionError("a detector met something it could not read")
        return real(**kwargs)

    monkeypatch.setattr(triage, "detect", flaky)
    Trajectory.objects.filter(pk=poison).update(messages=[USER, call("delete_y", {})])
    assert triage.triage_project(project_id=project.pk) == 3
    assert not Trajectory.objects.filter(triage_version=0).exists()
    assert signals_of(project, "t-1") == []
    assert ("unsafe_action", 1) in signals_of(project, "t-0")


def _holds_to_the_limit(monkeypatch, poison_id):
    """Celery's soft limit, as it arrives while the poison trajectory's detectors run (a prefork worker raises
    SoftTimeLimitExceeded in whatever code runs when the limit passes)."""
    real = triage.detect

    def detect(**kwargs):
        if kwargs["messages"] == Trajectory.objects.get(pk=poison_id).messages:
            raise SoftTimeLimitExceeded()
        return real(**kwargs)

    monkeypatch.setattr(triage, "detect", detect)


@pytest.mark.django_db
def test_a_trajectory_that_holds_triage_to_its_time_limit_is_marked_and_the_rest_waits(project, monkeypatch):
    ingest_trajectories(project=project, records=[record(f"t-{i}", [USER, call(f"delete_{i}", {})]) for i in range(4)])
    ids = list(Trajectory.objects.order_by("id").values_list("id", flat=True))
    Trajectory.objects.filter(pk=ids[1]).update(messages=[USER, call("delete_poison", {})])
    _holds_to_the_limit(monkeypatch, ids[1])
    with pytest.raises(SoftTimeLimitExceeded):
        triage.triage_project(project_id=project.pk)
    triaged = dict(Trajectory.objects.values_list("id", "triage_version"))
    # What came before it is committed, it is marked (so that no retry meets it again), the rest waits.
    assert [triaged[i] for i in ids] == [1, 1, 0, 0]
    assert ("unsafe_action", 1) in signals_of(project, "t-0") and signals_of(project, "t-1") == []
    assert triage.triage_project(project_id=project.pk) == 2  # the sweep's next message goes on
    assert set(Trajectory.objects.values_list("triage_version", flat=True)) == {1}


@pytest.mark.django_db
def test_a_large_backlog_is_taken_a_slice_at_a_time(project, monkeypatch):
    from flywheel.trajectories import tasks

    sent = []
    monkeypatch.setattr(tasks.triage_project_task, "delay", lambda project_id: sent.append(project_id))
    monkeypatch.setattr(triage, "CHUNK", 2)
    ingest_trajectories(project=project, records=[record(f"t-{i}", [USER, ANSWER]) for i in range(5)])
    # Past its slice after the first chunk: it stops there and queues the rest, far from the task's limit.
    assert triage.triage_project(project_id=project.pk, slice_s=0) == 2
    assert sent == [project.pk] and Trajectory.objects.filter(triage_version=0).count() == 3
    assert triage.triage_project(project_id=project.pk, slice_s=60) == 3 and sent == [project.pk]


@pytest.mark.django_db
def test_a_rerun_that_reaches_its_time_limit_says_so_and_retry_goes_on(project, user, monkeypatch):
    from flywheel.trajectories import tasks

    monkeypatch.setattr(tasks.triage_run_task, "delay", lambda run_id: None)
    ingest_trajectories(project=project, records=[record(f"t-{i}", [USER, call("wipe_disk", {"disk": i})])
                                                  for i in range(3)])
    poison = Trajectory.objects.order_by("id").values_list("id", flat=True)[1]
    _holds_to_the_limit(monkeypatch, poison)
    run = triage.triage_run_process(run_id=triage.triage_run_start(project=project, user=user).pk)
    assert run.status == TriageRunStatus.FAILED and "ran past its time limit" in run.error
    assert run.done == 0 and Trajectory.objects.filter(triage_version=2).count() == 2  # committed, with the poison
    run = triage.triage_run_process(run_id=triage.triage_run_retry(run=run).pk)
    assert run.status == TriageRunStatus.DONE and run.done == 1
    assert set(Trajectory.objects.values_list("triage_version", flat=True)) == {2}


@pytest.mark.django_db(transaction=True)  # the chunk's transaction is a real one, as on a worker
def test_a_chunks_statements_have_a_timeout_in_its_transaction_only(project, needs_postgres, monkeypatch):
    from django.db import connection

    seen = []
    real = triage.detect

    def detect(**kwargs):  # a spy: what the chunk's transaction says while the detectors run
        with connection.cursor() as cursor:
            cursor.execute("SHOW statement_timeout")
            seen.append(cursor.fetchone()[0])
        return real(**kwargs)

    monkeypatch.setattr(triage, "detect", detect)
    ingest_trajectories(project=project, records=[record("t", [USER, ANSWER])])
    assert triage.triage_project(project_id=project.pk) == 1
    assert seen == [f"{triage.STATEMENT_TIMEOUT_MS // 1000}s"]
    with connection.cursor() as cursor:
        cursor.execute("SHOW statement_timeout")
        assert cursor.fetchone()[0] != seen[0]  # SET LOCAL: gone with the transaction


@pytest.mark.django_db(transaction=True)
def test_ingestion_asks_once_per_transaction_and_not_when_triage_is_off(project, settings, monkeypatch):
    from flywheel.trajectories import tasks

    sent = []
    monkeypatch.setattr(tasks.triage_project_task, "delay", lambda project_id: sent.append(project_id))
    with transaction.atomic():
        ingest_trajectories(project=project, records=[record("a", [USER, ANSWER])])
        ingest_trajectories(project=project, records=[record("b", [USER, ANSWER])])
        assert sent == []  # not before the commit: a worker would not see the rows
    assert sent == [project.pk]
    ingest_trajectories(project=project, records=[record("c", [USER, ANSWER])])
    assert sent == [project.pk, project.pk]
    settings.FLYWHEEL_TRIAGE = False
    ingest_trajectories(project=project, records=[record("d", [USER, ANSWER])])
    assert sent == [project.pk, project.pk]


@pytest.mark.django_db(transaction=True)
def test_an_otlp_export_that_grows_a_stored_trace_has_it_triaged_again(project, monkeypatch):
    from flywheel.trajectories import tasks
    from flywheel.trajectories.otlp import trajectory_append

    sent = []
    monkeypatch.setattr(tasks.triage_project_task, "delay", lambda project_id: sent.append(project_id))
    first = [USER, call("get_order", {"order_id": "NW-12345"}), result('{"status": "shipped"}')]
    ingest_trajectories(project=project, records=[record("trace", first)])
    triage.triage_project(project_id=project.pk)
    assert signals_of(project, "trace") == [("no_final_answer", 2)]
    stored = Trajectory.objects.get(external_id="trace")
    sent.clear()
    errors = trajectory_append(trajectory=stored, record=record("trace", [*first, ANSWER]), seeded=3)
    assert errors == [] and sent == [project.pk]
    assert Trajectory.objects.get(external_id="trace").triage_version == 0
    triage.triage_project(project_id=project.pk)
    assert signals_of(project, "trace") == []


@pytest.mark.django_db
def test_the_sweep_sends_projects_whose_untriaged_trajectories_waited_too_long(project, make_project, monkeypatch):
    from flywheel.trajectories import tasks

    sent = []
    monkeypatch.setattr(tasks.triage_project_task, "delay", lambda project_id: sent.append(project_id))
    other = make_project()
    ingest_trajectories(project=project, records=[record("a", [USER, ANSWER])])
    ingest_trajectories(project=other, records=[record("b", [USER, ANSWER])])
    assert triage.triage_sweep() == 0  # just arrived: their message may be on its way
    Trajectory.objects.filter(project=project).update(updated_at=timezone.now() - timedelta(hours=1))
    assert triage.triage_sweep() == 1
    assert sent == [project.pk]
    triage.triage_project(project_id=project.pk)
    assert triage.triage_sweep() == 0


@pytest.mark.django_db
def test_a_policy_change_then_a_rerun_triages_every_trajectory_again(project, user):
    ingest_trajectories(project=project, records=[record(f"t-{i}", [USER, call("wipe_disk", {}), result("{}"), ANSWER]) for i in range(5)])
    triage.triage_project(project_id=project.pk)
    assert not TriageSignal.objects.filter(kind="unsafe_action").exists()

    policy = triage_policy.policy_set(project_id=project.pk, text='[{"name": "wipe_*"}]', user=user)
    assert policy.version == 2 and policy.unsafe == [{"name": "wipe_*"}] and policy.updated_by == user
    assert Trajectory.objects.filter(triage_version__lt=2).count() == 5  # out of date, waiting for the re-run

    run = triage.triage_run_start(project=project, user=user)
    assert (run.status, run.version) == (TriageRunStatus.QUEUED, 3)
    with pytest.raises(triage.TriageRunRefused):
        triage.triage_run_start(project=project, user=user)  # one at a time
    done = triage.triage_run_process(run_id=run.pk)
    assert (done.status, done.total, done.done, done.percent) == (TriageRunStatus.DONE, 5, 5, 100)
    assert done.finished_at is not None
    assert TriageSignal.objects.filter(kind="unsafe_action").count() == 5
    assert set(Trajectory.objects.values_list("triage_version", flat=True)) == {3}
    # A duplicate message for a finished run does nothing.
    assert triage.triage_run_process(run_id=run.pk).done == 5


@pytest.mark.django_db
def test_the_sweep_sends_a_run_that_waits_or_whose_worker_stopped(project, user, monkeypatch):
    from flywheel.trajectories import tasks

    sent = []
    monkeypatch.setattr(tasks.triage_run_task, "delay", lambda run_id: sent.append(run_id))
    run = TriageRun.objects.create(project=project, version=1, queued_at=timezone.now())
    assert triage.triage_sweep() == 0
    TriageRun.objects.filter(pk=run.pk).update(
        status=TriageRunStatus.RUNNING, heartbeat_at=timezone.now() - timedelta(hours=1)
    )
    assert triage.triage_sweep() == 1
    assert sent == [run.pk]
    assert TriageRun.objects.get(pk=run.pk).status == TriageRunStatus.QUEUED


# --- pages ---------------------------------------------------------------------------------------------------


@pytest.fixture
def member(make_user, make_membership, project):
    def make(role):
        user = make_user()
        make_membership(user, project, role)
        return user

    return make


@pytest.mark.django_db
def test_the_list_filters_by_signal_reviewed_source_and_tag(project, user, client_for):
    from flywheel.failures import review

    ingest_trajectories(
        project=project,
        records=[
            record("unsafe-one", [USER, call("delete_account", {}), result("{}"), ANSWER]),
            record("looping", [USER] + [call("get_order", {"order_id": "NW-12345"}, f"c{i}") for i in range(3)] + [ANSWER]),
            record("clean", [USER, ANSWER]),
        ],
        source="cli",
    )
    triage.triage_project(project_id=project.pk)
    client = client_for(user)
    url = reverse("trajectory_list", args=[project.slug])

    def shown(**params):
        page = client.get(url, params).content.decode()
        return {name for name in ("unsafe-one", "looping", "clean") if f">{name}<" in page}

    assert shown() == {"unsafe-one", "looping", "clean"}
    assert shown(signal="unsafe_action") == {"unsafe-one"}
    assert shown(signal="loop") == {"looping"}
    assert shown(signal="tool_error") == set()
    assert shown(signal="loop", outcome="failure") == set()
    page = client.get(url, {"signal": "made-up"}).content.decode()
    assert "Ignored signal &#x27;made-up&#x27;" in page
    review.trajectory_outcome_set(trajectory=Trajectory.objects.get(external_id="clean"), outcome="success", user=user)
    assert shown(reviewed="yes") == {"clean"}
    assert shown(reviewed="no") == {"unsafe-one", "looping"}
    assert shown(source="cli") == {"unsafe-one", "looping", "clean"}
    assert shown(source="api") == set()
    review.trajectory_tag_add(trajectory=Trajectory.objects.get(external_id="looping"), name="billing")
    assert shown(tag="billing") == {"looping"}
    assert shown(tag="nope") == set()
    # The row shows the suggested category and the kinds.
    page = client.get(url, {"signal": "unsafe_action"}).content.decode()
    assert 'data-signal="unsafe_action"' in page and "Unsafe action</span>" in page


@pytest.mark.django_db
def test_the_trajectory_page_marks_each_signal_on_its_message_escaped(project, member, client_for):
    hostile = '<img src=x onerror="alert(1)">'
    ingest_trajectories(project=project, records=[record("t", [USER, call(hostile, {"id": 1}), result("{}"), ANSWER])])
    triage.triage_project(project_id=project.pk)
    trajectory = Trajectory.objects.get()
    page = client_for(member("viewer")).get(reverse("trajectory_detail", args=[project.slug, trajectory.pk])).content.decode()
    assert hostile not in page
    assert "not declared: &lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in page
    message = page.split('id="m1"', 1)[1].split("</article>", 1)[0]
    assert 'data-signal="undeclared_tool"' in message and "Undeclared tool" in message
    assert "Suggested category" in page and "Hallucinated API" in page


@pytest.mark.django_db
def test_the_policy_is_edited_by_maintainers_only_and_a_bad_regex_is_a_field_error(
    project, user, member, make_user, client_for
):
    url = reverse("triage_policy_save", args=[project.slug])
    body = {"unsafe": '[{"name": "wipe_*"}]'}
    assert client_for(member("reviewer")).post(url, body).status_code == 403
    assert client_for(member("viewer")).post(url, body).status_code == 403
    assert client_for(None).post(url, body).status_code == 302
    assert client_for(make_user()).post(url, body).status_code == 404  # not a member: the project is not there
    assert not TriagePolicy.objects.filter(project=project, unsafe=[{"name": "wipe_*"}]).exists()

    maintainer = client_for(user)
    bad = {"unsafe": '[{"name": "run_sql", "arguments": {"query": {"regex": "(a)\\\\1"}}}]'}
    response = maintainer.post(url, bad)
    assert response.status_code == 422
    page = response.content.decode()
    assert "rule [0]" in page and "regex" in page and 'aria-invalid="true"' in page
    assert "(a)\\\\1" in page  # what the maintainer typed (JSON text) comes back to be corrected

    response = maintainer.post(url, body)
    assert response.status_code == 302
    assert TriagePolicy.objects.get(project=project).unsafe == [{"name": "wipe_*"}]
    page = client_for(member("viewer")).get(reverse("triage_page", args=[project.slug])).content.decode()
    assert "wipe_*" in page and "Save policy" not in page and "Re-run triage" not in page


@pytest.mark.django_db
def test_the_triage_page_shows_a_run_and_its_progress_fragment_polls(project, user, client_for):
    ingest_trajectories(project=project, records=[record("t", [USER, ANSWER])])
    client = client_for(user)
    response = client.post(reverse("triage_run_start", args=[project.slug]))
    assert response.status_code == 302
    run = TriageRun.objects.get(project=project)
    page = client.get(reverse("triage_page", args=[project.slug])).content.decode()
    assert f"Re-run #{run.pk}" in page and 'hx-trigger="every 1s"' in page
    assert client.post(reverse("triage_run_start", args=[project.slug])).status_code == 409
    triage.triage_run_process(run_id=run.pk)
    fragment = client.get(reverse("triage_run_status", args=[project.slug, run.pk])).content.decode()
    assert "1 of 1" in fragment and "(100%)" in fragment and "every 1s" not in fragment


@pytest.mark.django_db
def test_the_demo_projects_refund_over_its_limit_is_triaged_as_unsafe():
    # What a newcomer sees after `make run`: the demo agent's own rule (refunds of 100 EUR or more need a
    # human) is in the demo project's policy, so its unsafe refund carries the signal.
    from flywheel.seed.demo import demo_seed

    seed = demo_seed()
    triage.triage_project(project_id=seed.project.pk)
    unsafe = Trajectory.objects.filter(project=seed.project, signals__kind="unsafe_action").distinct()
    assert [t.metadata["summary"] for t in unsafe] == ["unsafe action: refund above the limit without approval"]
    assert unsafe[0].suggested_category == "unsafe_action"


def test_the_workplace_demos_plays_are_judged_by_their_call():
    """The workplace demo records each request with the one call the tiny model made (training.demo): a
    right call carries no signal (no "no final answer", no unsafe delete when the delete was asked for);
    a delete of another record, or one nobody asked for, is unsafe."""
    from trainer.envs.workplace import generate_tasks

    spec = triage_policy.policy_spec(TriagePolicy(pk=None, unsafe=triage_policy.DEFAULT_UNSAFE_RULES, version=1))
    tasks = generate_tasks(60, seed=21, split="train", difficulty="single")
    deletes = [t for t in tasks if t["origin"]["template"] == "delete_task"]
    assert deletes and len(deletes) < len(tasks)
    for task in tasks:
        right = next(m for m in task["solution"] if m.get("tool_calls"))
        assert detect(messages=[*task["messages"], right], tools=task["tools"], unsafe_spec=spec) == [], task["id"]
    for task in deletes:
        asked = json.loads(task["solution"][0]["tool_calls"][0]["function"]["arguments"])["task_id"]
        other = next(t["id"] for t in task["env"]["initial_state"]["tasks"] if t["id"] != asked)
        wrong = call("delete_task", {"task_id": other})
        assert kinds([*task["messages"], wrong], task["tools"]) == [("unsafe_action", 2)]
    update = next(t for t in tasks if t["origin"]["template"] == "set_status")
    task_id = json.loads(update["solution"][0]["tool_calls"][0]["function"]["arguments"])["task_id"]
    assert kinds([*update["messages"], call("delete_task", {"task_id": task_id})], None) == [("unsafe_action", 2)]
