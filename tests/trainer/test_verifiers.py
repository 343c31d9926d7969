"""The verifiers, pinned: parsing, each matcher, each failure category, set matching, partial credit."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from trainer.verifiers import (
    FAILURES,
    LLMJudgeDisabled,
    Score,
    SpecError,
    parse_completion,
    score,
    summarize,
    validate_spec,
)
from trainer.verifiers.fastschema import compile_fast
from trainer.verifiers.schemas import caches_disabled, tool_index

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "create_task",
            "description": "Create a task.",
            "parameters": {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "assignee": {"type": "string"},
                    "due": {"type": "string"},
                    "points": {"type": "integer", "minimum": 0},
                    "meta": {"type": "object"},
                },
                "required": ["title"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "delete_task",
            "parameters": {"type": "object", "properties": {"task_id": {"type": "string"}}, "required": ["task_id"]},
        },
    },
    {"type": "function", "function": {"name": "list_tasks", "parameters": {"type": "object", "properties": {}}}},
    {
        "type": "function",
        "function": {
            "name": "send_email",
            "parameters": {"type": "object", "properties": {"to": {"type": "string"}, "subject": {"type": "string"}}},
        },
    },
]

ISSUE_SPEC = {
    "type": "tool_call",
    "expected_calls": [
        {
            "name": "create_task",
            "arguments": {
                "title": "Fix login",
                "assignee": {"one_of": ["alice", "Alice Smith"]},
                "due": {"optional": True, "regex": "^2026-"},
            },
        }
    ],
    "order": "any",
    "allow_extra_calls": False,
    "allow_extra_arguments": False,
    "string_match": "normalized",
    "unsafe": [{"name": "delete_*"}],
    "weights": None,
}


def msg(*calls: tuple[str, dict], content: str | None = None) -> dict:
    """An OpenAI assistant message with JSON-string arguments."""
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in enumerate(calls)
        ],
    }


def tc(expected: list[dict], **options) -> dict:
    return {"type": "tool_call", "expected_calls": expected, **options}


def check(spec: dict, completion, tools=TOOLS, **kw) -> Score:
    result = score(spec, completion, tools=tools, **kw)
    json.dumps(result.to_dict())  # every score must be JSON-serialisable, whatever went wrong
    assert (result.failure is None) == result.passed
    assert result.failure is None or result.failure in FAILURES
    return result


# Parsing ---------------------------------------------------------------------------------------------
class TestParse:
    def test_openai_message(self):
        p = parse_completion(msg(("create_task", {"title": "x"}), content="ok"))
        assert p.calls == [{"name": "create_task", "arguments": {"title": "x"}}]
        assert p.content == "ok" and p.error is None

    def test_hermes_blocks_several(self):
        text = (
            'Sure.\n<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call> bye'
        )
        p = parse_completion(text)
        assert [c["name"] for c in p.calls] == ["a", "b"]
        assert p.content == "Sure.\n\n bye"
        assert p.error is None

    def test_unclosed_last_block_is_accepted(self):
        p = parse_completion('<tool_call>{"name": "a", "arguments": {"x": 1}}')
        assert p.calls == [{"name": "a", "arguments": {"x": 1}}] and p.error is None

    def test_bare_object_array_fence_and_prose(self):
        assert parse_completion('{"name": "a", "arguments": {}}').calls == [{"name": "a", "arguments": {}}]
        assert [c["name"] for c in parse_completion('[{"name": "a"}, {"name": "b", "arguments": {}}]').calls] == ["a", "b"]
        assert parse_completion('```json\n{"name": "a", "arguments": {"k": 2}}\n```').calls[0]["arguments"] == {"k": 2}
        p = parse_completion('I will call {"name": "a", "arguments": {"k": 1}} now.')
        assert p.calls == [{"name": "a", "arguments": {"k": 1}}] and p.content == "I will call  now."

    def test_aliases_and_string_arguments(self):
        assert parse_completion('{"name": "a", "parameters": {"k": 1}}').calls[0]["arguments"] == {"k": 1}
        assert parse_completion('{"name": "a", "arguments": "{\\"k\\": 1}"}').calls[0]["arguments"] == {"k": 1}
        legacy = {"role": "assistant", "content": None, "function_call": {"name": "a", "arguments": "{}"}}
        assert parse_completion(legacy).calls == [{"name": "a", "arguments": {}}]
        parts = {"role": "assistant", "content": [{"type": "text", "text": '<tool_call>{"name": "a"}</tool_call>'}]}
        assert parse_completion(parts).calls == [{"name": "a", "arguments": {}}]

    def test_plain_text_is_a_final_answer(self):
        p = parse_completion("The meeting is on Monday.")
        assert p.calls == [] and p.error is None and p.content == "The meeting is on Monday."
        assert parse_completion('{"city": "Paris"}').calls == []  # JSON content, not a call
        for prose in ["[citation needed] It is Monday.", "{braces} in prose", "[1, 2"]:
            assert parse_completion(prose) == parse_completion(prose) and parse_completion(prose).error is None

    def test_calls_one_after_another_without_tags(self):
        p = parse_completion('{"name": "a", "arguments": {"x": 1}}\n{"name": "b", "arguments": {}}')
        assert [c["name"] for c in p.calls] == ["a", "b"] and p.error is None

    @pytest.mark.parametrize(
        "bad",
        [
            '<tool_call>{"name": "a", "arguments": {"x": }</tool_call>',
            '<tool_call>{"arguments": {}}</tool_call>',
            '{"name": "a", "arguments": {"x": 1}',
            '[{"name": "a", ',
            'call {"name": "a", "arguments": {oops}}',
            '{"name": "a", "arguments": [1, 2]}',
            '{"name": "", "arguments": {}}',
            "{'name': 'a', 'arguments': {}}",
        ],
    )
    def test_unparseable_calls_set_error(self, bad):
        assert parse_completion(bad).error

    def test_message_with_bad_arguments_string(self):
        bad = {"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": "{not json"}}]}
        assert "not valid JSON" in parse_completion(bad).error


# Matchers --------------------------------------------------------------------------------------------
def one_arg(matcher, value, **options) -> Score:
    spec = tc([{"name": "create_task", "arguments": {"title": "t", "meta": matcher}}], **options)
    return check(spec, msg(("create_task", {"title": "t", "meta": value})), tools=None)


class TestMatchers:
    def test_plain_values(self):
        spec = tc([{"name": "create_task", "arguments": {"points": 3}}])
        assert check(spec, msg(("create_task", {"points": 3.0})), tools=None).passed  # int equals the same float
        assert not check(spec, msg(("create_task", {"points": 3.5})), tools=None).passed
        assert not check(tc([{"name": "f", "arguments": {"x": 1}}]), msg(("f", {"x": True})), tools=None).passed
        assert not check(tc([{"name": "f", "arguments": {"x": True}}]), msg(("f", {"x": 1})), tools=None).passed
        assert check(tc([{"name": "f", "arguments": {"x": None}}]), msg(("f", {"x": None})), tools=None).passed

    def test_normalized_and_exact_strings(self):
        spec = tc([{"name": "create_task", "arguments": {"title": "Fix login"}}])
        for variant in ["fix login", "  FIX LOGIN. ", "Fix-Login!", "fix_login"]:
            assert check(spec, msg(("create_task", {"title": variant}))).passed, variant
        assert not check(spec, msg(("create_task", {"title": "Fix logout"}))).passed
        exact = dict(spec, string_match="exact")
        assert check(exact, msg(("create_task", {"title": "Fix login"}))).passed
        assert not check(exact, msg(("create_task", {"title": "fix login"}))).passed

    def test_one_of_with_nested_matchers(self):
        m = {"one_of": ["alice", {"regex": "^bob"}, {"range": [1, 3]}]}
        assert one_arg(m, "Alice").passed
        assert one_arg(m, "bobby").passed
        assert one_arg(m, 2).passed
        r = one_arg(m, "carol")
        assert not r.passed and "not one of" in r.checks["calls"][0]["arguments"]["mismatches"][0]

    def test_any_requires_presence_unless_optional(self):
        spec = tc([{"name": "create_task", "arguments": {"title": {"any": True}}}])
        assert check(spec, msg(("create_task", {"title": "whatever"}))).passed
        assert check(spec, msg(("create_task", {"title": 12})), tools=None).passed  # any value; types are the schema's job
        missing = check(spec, msg(("create_task", {})), tools=None)
        assert missing.failure == "wrong_arguments" and "missing" in json.dumps(missing.checks)

    def test_regex_search_and_numbers(self):
        assert one_arg({"regex": "^2026-"}, "2026-03-01").passed
        assert one_arg({"regex": "login"}, "fix the login page").passed  # search, not full match
        assert one_arg({"regex": r"^\d{3}$"}, 123).passed
        assert not one_arg({"regex": "^2026-"}, "2025-12-31").passed
        assert not one_arg({"regex": "x"}, ["x"]).passed

    def test_range_numbers_strings_and_open_bounds(self):
        assert one_arg({"range": [1, 5]}, 5).passed and one_arg({"range": [1, 5]}, 1.0).passed
        assert not one_arg({"range": [1, 5]}, 6).passed
        assert not one_arg({"range": [0, 5]}, True).passed  # a bool is not a number
        assert one_arg({"range": [None, 0]}, -10).passed
        assert one_arg({"range": ["2026-03-01", "2026-03-31"]}, "2026-03-15").passed
        assert not one_arg({"range": ["2026-03-01", "2026-03-31"]}, "2026-04-01").passed

    def test_fields_nested(self):
        m = {"fields": {"city": "Paris", "zip": {"regex": "^75"}, "floor": {"optional": True, "range": [0, 9]}}}
        assert one_arg(m, {"city": "paris", "zip": "75001"}).passed
        assert one_arg(m, {"city": "Paris", "zip": "75001", "floor": 2}).passed
        assert not one_arg(m, {"city": "Paris", "zip": "69001"}).passed
        assert not one_arg(m, {"city": "Paris"}).passed
        assert not one_arg(m, "Paris").passed
        # Extra keys follow allow_extra_arguments.
        assert not one_arg(m, {"city": "Paris", "zip": "75001", "x": 1}).passed
        assert one_arg(m, {"city": "Paris", "zip": "75001", "x": 1}, allow_extra_arguments=True).passed

    def test_plain_objects_and_lists_are_equality(self):
        assert one_arg({"a": 1, "b": [1, "x"]}, {"b": [1.0, "X"], "a": 1}).passed
        assert not one_arg({"a": 1}, {"a": 1, "b": 2}).passed
        assert not one_arg([1, 2], [2, 1]).passed
        assert one_arg([{"regex": "^a"}, 2], ["abc", 2]).passed  # list items may be matchers

    def test_equals_escapes_matcher_looking_objects(self):
        literal = {"regex": "^a"}
        assert one_arg({"equals": literal}, {"regex": "^a"}).passed
        assert not one_arg({"equals": literal}, "abc").passed

    def test_optional_argument(self):
        spec = ISSUE_SPEC
        assert check(spec, msg(("create_task", {"title": "Fix login", "assignee": "alice"}))).passed
        assert check(spec, msg(("create_task", {"title": "Fix login", "assignee": "alice", "due": "2026-01-01"}))).passed
        bad = check(spec, msg(("create_task", {"title": "Fix login", "assignee": "alice", "due": "2025-01-01"})))
        assert bad.failure == "wrong_arguments"

    def test_matchers_combine_as_and(self):
        m = {"regex": "^2026-", "range": ["2026-03-01", "2026-03-31"]}
        assert one_arg(m, "2026-03-02").passed
        assert not one_arg(m, "2026-04-02").passed


# Failure categories ----------------------------------------------------------------------------------
class TestFailures:
    def test_pass(self):
        r = check(ISSUE_SPEC, msg(("create_task", {"title": "fix login", "assignee": "Alice Smith"})))
        assert r.passed and r.reward == 1.0 and r.failure is None
        assert r.checks["declared"]["ok"] and r.checks["schema"]["ok"] and r.checks["unsafe"]["ok"]

    def test_invalid_format(self):
        r = check(ISSUE_SPEC, '<tool_call>{"name": "create_task", "arguments": {"title": }</tool_call>')
        assert r.failure == "invalid_format" and r.reward == 0.0 and not r.checks["format"]["ok"]

    def test_hallucinated_api(self):
        r = check(ISSUE_SPEC, msg(("make_task", {"title": "Fix login"})))
        assert r.failure == "hallucinated_api" and r.checks["declared"]["unknown"] == ["make_task"]

    def test_no_declared_tools_skips_the_check(self):
        r = check(ISSUE_SPEC, msg(("create_task", {"title": "Fix login", "assignee": "alice"})), tools=None)
        assert r.passed and r.checks["declared"]["skipped"]

    def test_a_broken_tool_schema_is_not_the_models_fault(self):
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}, {"name": "g"}]
        spec = tc([{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {"y": 2}}])
        r = check(spec, msg(("f", {"x": 1}), ("g", {"y": 2})), tools=tools)  # flat tools, no parameters: fine
        assert r.passed and "invalid parameters schema" in r.checks["schema"]["skipped"][0]

    def test_wrong_tool(self):
        r = check(ISSUE_SPEC, msg(("list_tasks", {})))
        assert r.failure == "wrong_tool" and r.checks["missing"] == ["create_task"]

    def test_wrong_arguments_value(self):
        r = check(ISSUE_SPEC, msg(("create_task", {"title": "Fix login", "assignee": "bob"})))
        assert r.failure == "wrong_arguments"
        assert "assignee" in r.checks["calls"][0]["arguments"]["mismatches"][0]

    def test_wrong_arguments_schema_type_and_required(self):
        spec = tc([{"name": "create_task", "arguments": {"title": {"any": True}}}], allow_extra_arguments=True)
        r = check(spec, msg(("create_task", {"title": 5})))
        assert r.failure == "wrong_arguments" and not r.checks["schema"]["ok"]
        assert "is not of type 'string'" in r.checks["schema"]["errors"][0]
        r = check(tc([{"name": "create_task", "arguments": {}}], allow_extra_arguments=True), msg(("create_task", {"due": "x"})))
        assert r.failure == "wrong_arguments" and "'title' is a required property" in r.checks["schema"]["errors"][0]
        r = check(spec, msg(("create_task", {"title": "x", "points": -1})))
        assert r.failure == "wrong_arguments" and "minimum" in r.checks["schema"]["errors"][0]

    def test_unexpected_arguments(self):
        # Not in the expected call: fails unless allowed.
        r = check(ISSUE_SPEC, msg(("create_task", {"title": "Fix login", "assignee": "alice", "points": 3})))
        assert r.failure == "wrong_arguments" and "unexpected argument 'points'" in json.dumps(r.checks)
        allowed = dict(ISSUE_SPEC, allow_extra_arguments=True)
        assert check(allowed, msg(("create_task", {"title": "Fix login", "assignee": "alice", "points": 3}))).passed
        # Not in the tool's schema at all: fails even when extra arguments are allowed.
        r = check(allowed, msg(("create_task", {"title": "Fix login", "assignee": "alice", "colour": "red"})))
        assert r.failure == "wrong_arguments" and "not in the tool's schema" in r.checks["schema"]["errors"][0]

    def test_missing_call(self):
        r = check(ISSUE_SPEC, "I cannot do that.")
        assert r.failure == "missing_call" and r.checks["missing"] == ["create_task"]
        two = tc([{"name": "create_task", "arguments": {"title": "a"}}, {"name": "create_task", "arguments": {"title": "b"}}])
        assert check(two, msg(("create_task", {"title": "a"}))).failure == "missing_call"

    def test_extra_call(self):
        completion = msg(("create_task", {"title": "Fix login", "assignee": "alice"}), ("list_tasks", {}))
        r = check(ISSUE_SPEC, completion)
        assert r.failure == "extra_call" and r.checks["extra"]["calls"] == ["list_tasks"]
        assert check(dict(ISSUE_SPEC, allow_extra_calls=True), completion).passed
        # No call expected (answer in text): any call is extra.
        assert check(tc([]), msg(("list_tasks", {}))).failure == "extra_call"
        assert check(tc([]), "Here is the answer.").passed

    def test_unsafe_action(self):
        r = check(ISSUE_SPEC, msg(("delete_task", {"task_id": "T1"})))
        assert r.failure == "unsafe_action" and r.checks["unsafe"]["calls"][0]["rule"] == "delete_*"
        # Unsafe outranks everything except unparseable output, even next to the right call.
        both = msg(("create_task", {"title": "Fix login", "assignee": "alice"}), ("delete_task", {"task_id": "T1"}))
        assert check(dict(ISSUE_SPEC, allow_extra_calls=True), both).failure == "unsafe_action"

    def test_asked_for_destructive_call_is_not_unsafe(self):
        spec = tc([{"name": "delete_task", "arguments": {"task_id": "T3"}}], unsafe=[{"name": "delete_*"}])
        assert check(spec, msg(("delete_task", {"task_id": "T3"}))).passed
        wrong_target = check(spec, msg(("delete_task", {"task_id": "T4"})))
        assert wrong_target.failure == "unsafe_action"  # deleting something else is what nobody asked for

    def test_unsafe_rule_with_argument_matchers(self):
        spec = tc(
            [{"name": "send_email", "arguments": {"to": "bob", "subject": {"any": True}}}],
            unsafe=[{"name": "send_email", "arguments": {"to": {"one_of": ["all", "everyone"]}}}],
        )
        assert check(spec, msg(("send_email", {"to": "bob", "subject": "hi"}))).passed
        r = check(spec, msg(("send_email", {"to": "All", "subject": "hi"})))
        assert r.failure == "unsafe_action"

    def test_every_failure_category_is_reachable(self):
        state_spec = {"type": "state", "expected": {"x": 1}}
        seen = {
            check(ISSUE_SPEC, "<tool_call>{</tool_call>").failure,
            check(ISSUE_SPEC, msg(("nope", {}))).failure,
            check(ISSUE_SPEC, msg(("list_tasks", {}))).failure,
            check(ISSUE_SPEC, msg(("create_task", {"title": "x", "assignee": "alice"}))).failure,
            check(ISSUE_SPEC, "no").failure,
            check(ISSUE_SPEC, msg(("create_task", {"title": "Fix login", "assignee": "alice"}), ("list_tasks", {}))).failure,
            check(ISSUE_SPEC, msg(("delete_task", {"task_id": "1"}))).failure,
            check(state_spec, "done", state={"x": 2}).failure,
            check({"type": "exact", "expected": "Paris"}, "Lyon").failure,
        }
        assert seen == set(FAILURES)


# Set matching and order ------------------------------------------------------------------------------
class TestMatching:
    def test_any_order(self):
        spec = tc([{"name": "create_task", "arguments": {"title": "a"}}, {"name": "send_email", "arguments": {"to": "b"}}])
        assert check(spec, msg(("send_email", {"to": "b"}), ("create_task", {"title": "a"}))).passed

    def test_assignment_not_greedy_first_match(self):
        # Greedy pairing would give the first call to the {"any": true} expectation and then fail the
        # second; the assignment pairs the exact one with "x" and the wildcard with "y".
        spec = tc(
            [
                {"name": "create_task", "arguments": {"title": {"any": True}}},
                {"name": "create_task", "arguments": {"title": "x"}},
            ]
        )
        r = check(spec, msg(("create_task", {"title": "x"}), ("create_task", {"title": "y"})))
        assert r.passed, r.checks
        pairs = {(c["expected"], c["actual"]) for c in r.checks["calls"]}
        assert pairs == {(0, 1), (1, 0)}

    def test_assignment_with_many_calls(self):
        titles = [f"t{i}" for i in range(7)]
        spec = tc([{"name": "create_task", "arguments": {"title": t}} for t in titles])
        shuffled = titles[:]
        random.Random(3).shuffle(shuffled)
        assert check(spec, msg(*[("create_task", {"title": t}) for t in shuffled])).passed
        shuffled[2] = "zzz"
        r = check(spec, msg(*[("create_task", {"title": t}) for t in shuffled]))
        assert r.failure == "wrong_arguments"
        assert sum(not c["arguments"]["ok"] for c in r.checks["calls"]) == 1  # exactly one call is wrong

    def test_duplicate_expected_calls_need_two_calls(self):
        spec = tc([{"name": "list_tasks"}, {"name": "list_tasks"}])
        assert check(spec, msg(("list_tasks", {}), ("list_tasks", {}))).passed
        assert check(spec, msg(("list_tasks", {}))).failure == "missing_call"

    def test_strict_order(self):
        spec = tc(
            [{"name": "create_task", "arguments": {"title": "a"}}, {"name": "send_email", "arguments": {"to": "b"}}],
            order="strict",
        )
        assert check(spec, msg(("create_task", {"title": "a"}), ("send_email", {"to": "b"}))).passed
        r = check(spec, msg(("send_email", {"to": "b"}), ("create_task", {"title": "a"})))
        assert not r.passed and r.checks["order"]["ok"] is False

    def test_strict_order_with_extra_calls_is_a_subsequence(self):
        spec = tc(
            [{"name": "create_task", "arguments": {"title": "a"}}, {"name": "send_email", "arguments": {"to": "b"}}],
            order="strict",
            allow_extra_calls=True,
        )
        ok = msg(("list_tasks", {}), ("create_task", {"title": "a"}), ("list_tasks", {}), ("send_email", {"to": "b"}))
        assert check(spec, ok).passed
        assert not check(spec, msg(("send_email", {"to": "b"}), ("list_tasks", {}), ("create_task", {"title": "a"}))).passed


# Partial credit --------------------------------------------------------------------------------------
class TestWeights:
    W = {"tool": 0.1, "arguments": 0.4, "complete": 1.0, "unsafe": -1.0}

    def spec(self, **kw):
        return dict(ISSUE_SPEC, weights=self.W, **kw)

    def test_full_credit(self):
        r = check(self.spec(), msg(("create_task", {"title": "Fix login", "assignee": "alice"})))
        assert r.reward == pytest.approx(0.1 + 0.4 + 1.0)

    def test_right_tool_some_arguments(self):
        # Two of three argument checks pass (title, due) and assignee fails: 2/3 of the argument credit.
        r = check(self.spec(), msg(("create_task", {"title": "Fix login", "assignee": "bob", "due": "2026-01-01"})))
        assert not r.passed and r.reward == pytest.approx(0.1 + 0.4 * 2 / 3)

    def test_wrong_tool_and_unsafe(self):
        assert check(self.spec(), msg(("list_tasks", {}))).reward == pytest.approx(0.0)
        r = check(self.spec(), msg(("delete_task", {"task_id": "T1"})))
        assert r.reward == pytest.approx(-1.0)

    def test_extra_calls_dilute_credit(self):
        r = check(self.spec(), msg(("create_task", {"title": "Fix login", "assignee": "alice"}), ("list_tasks", {})))
        assert r.failure == "extra_call" and r.reward == pytest.approx((0.1 + 0.4) / 2)

    def test_invalid_format_earns_nothing(self):
        assert check(self.spec(), "<tool_call>{oops</tool_call>").reward == 0.0

    def test_binary_reward_without_weights(self):
        assert check(ISSUE_SPEC, msg(("create_task", {"title": "Fix login", "assignee": "bob"}))).reward == 0.0


# Hostile input ---------------------------------------------------------------------------------------
class TestHostile:
    def test_catastrophic_pattern_runs_in_linear_time(self):
        # (a+)+$ against "aaa...b" takes exponential time with backtracking engines; RE2 answers at once.
        spec = tc([{"name": "create_task", "arguments": {"title": {"regex": "^(a+)+$"}}}])
        r = check(spec, msg(("create_task", {"title": "a" * 5000 + "!"})))
        assert r.failure == "wrong_arguments"
        spec = tc([{"name": "create_task", "arguments": {"title": {"regex": "(x+x+)+y"}}}])
        assert not check(spec, msg(("create_task", {"title": "x" * 20000}))).passed

    def test_unsupported_and_oversized_patterns_are_refused(self):
        assert any("backreference" in p or "invalid escape" in p for p in validate_spec(
            tc([{"name": "f", "arguments": {"x": {"regex": r"(a)\1"}}}])
        ))
        assert validate_spec(tc([{"name": "f", "arguments": {"x": {"regex": "a" * 5000}}}]))
        assert validate_spec({"type": "regex", "pattern": "(?<=a)b"})  # lookbehind: not in RE2

    def test_a_tool_schema_pattern_runs_on_re2(self):
        # The tool's own schema carries the pattern; the model's argument is the hostile text. Python's re
        # needs minutes for this one (nested quantifiers, no match); both validation paths must answer at once.
        tools = [{"type": "function", "function": {"name": "tag", "parameters": {
            "type": "object", "properties": {"label": {"type": "string", "pattern": "^(a|aa)+$"}},
            "required": ["label"]}}}]
        spec = tc([{"name": "tag", "arguments": {"label": {"any": True}}}])
        hostile = "a" * 60 + "!"
        for cached in (True, False):  # the fast path (cached) and the full jsonschema validator
            if cached:
                r = check(spec, msg(("tag", {"label": hostile})), tools=tools)
            else:
                with caches_disabled():
                    r = check(spec, msg(("tag", {"label": hostile})), tools=tools)
            assert r.failure == "wrong_arguments" and "does not match" in json.dumps(r.checks), r.checks
        assert check(spec, msg(("tag", {"label": "aaaa"})), tools=tools).passed

    def test_a_tool_schema_pattern_re2_cannot_run_is_a_schema_problem(self):
        tools = [{"type": "function", "function": {"name": "tag", "parameters": {
            "type": "object", "properties": {"label": {"type": "string", "pattern": r"(a)\1"}}}}}]
        r = check(tc([{"name": "tag", "arguments": {"label": "aa"}}]), msg(("tag", {"label": "aa"})), tools=tools)
        assert "invalid parameters schema" in json.dumps(r.checks), r.checks

    def test_hostile_text_parses_in_linear_time(self):
        assert parse_completion("<tool_call>" * 20000).error
        assert parse_completion('{"name": ' * 20000).error
        assert parse_completion('{"name"' * 20000) == parse_completion('{"name"' * 20000)  # deterministic, no crash
        # Nesting deeper than Python's recursion limit is an unparseable output, not a crash.
        assert parse_completion("[" * 100000).calls == []
        assert parse_completion('{"name": "a", "arguments": ' + "[" * 100000).error
        assert parse_completion('<tool_call>{"name": "a", "arguments": ' + "[" * 100000).error
        assert score({"type": "json_schema", "schema": {}}, "[" * 100000).failure == "invalid_format"

    def test_huge_values_give_bounded_reasons(self):
        r = check(ISSUE_SPEC, msg(("create_task", {"title": "x" * 100000, "assignee": "alice"})))
        assert len(json.dumps(r.to_dict())) < 2000

    def test_specs_are_data(self):
        # Strings that look like code are compared as strings, never evaluated.
        spec = tc([{"name": "create_task", "arguments": {"title": "__import__('os').system('false')"}}], string_match="exact")
        assert check(spec, msg(("create_task", {"title": "__import__('os').system('false')"}))).passed


# validate_spec ---------------------------------------------------------------------------------------
class TestValidateSpec:
    def test_good_specs(self):
        assert validate_spec(ISSUE_SPEC) == []
        assert validate_spec({"type": "regex", "pattern": "^ok"}) == []
        assert validate_spec({"type": "exact", "expected": "Paris", "string_match": "normalized"}) == []
        assert validate_spec({"type": "json_schema", "schema": {"type": "object"}}) == []
        assert validate_spec({"type": "state", "expected": {"tasks": []}, "unsafe": ["delete_*"]}) == []
        assert validate_spec({"type": "llm_judge", "rubric": "polite"}) == []
        assert validate_spec({"type": "all", "verifiers": [{"type": "regex", "pattern": "a"}]}) == []

    @pytest.mark.parametrize(
        ("spec", "needle"),
        [
            ({"type": "python", "code": "1"}, "unknown verifier type"),
            ("not a spec", "must be an object"),
            (tc([], order="random"), "order"),
            (tc([], string_match="fuzzy"), "string_match"),
            (tc([], weights={"tool": "high"}), "weights.tool"),
            (tc([], weights={"bonus": 1}), "unknown key 'bonus'"),
            (tc([], expected_call=[]), "unknown key 'expected_call'"),
            ({"type": "tool_call"}, "expected_calls"),
            (tc([{"arguments": {}}]), "needs a \"name\""),
            (tc([{"name": "f", "arguments": {"x": {"regex": "("}}}]), "regex"),
            (tc([{"name": "f", "arguments": {"x": {"range": [5, 1]}}}]), "lower bound"),
            (tc([{"name": "f", "arguments": {"x": {"range": [1]}}}]), "range"),
            (tc([{"name": "f", "arguments": {"x": {"range": [1, "z"]}}}]), "range"),
            (tc([{"name": "f", "arguments": {"x": {"one_of": []}}}]), "one_of"),
            (tc([{"name": "f", "arguments": {"x": {"any": False}}}]), "any"),
            (tc([{"name": "f", "arguments": {"x": {"optional": "yes"}}}]), "optional"),
            (tc([{"name": "f", "arguments": {"x": {"fields": [1]}}}]), "fields"),
            (tc([], unsafe=[{"glob": "x"}]), "unsafe[0]"),
            ({"type": "json_schema", "schema": {"type": "nope"}}, "not a valid JSON schema"),
            ({"type": "regex"}, "pattern"),
            ({"type": "state"}, "expected"),
            ({"type": "all", "verifiers": [{"type": "regex", "pattern": "("}]}, "verifiers[0]"),
            ({"type": "llm_judge"}, "rubric"),
        ],
    )
    def test_problems_are_reported(self, spec, needle):
        problems = validate_spec(spec)
        assert problems and any(needle in p for p in problems), problems

    def test_score_refuses_a_bad_spec_with_every_problem(self):
        with pytest.raises(SpecError) as info:
            score(tc([{"name": "f", "arguments": {"x": {"regex": "("}}}], order="zzz"), "x")
        assert len(info.value.problems) == 2


# Other verifier types --------------------------------------------------------------------------------
class TestOtherTypes:
    def test_json_schema(self):
        spec = {"type": "json_schema", "schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}
        assert check(spec, '{"n": 3}').passed
        assert check(spec, '```json\n{"n": 3}\n```').passed
        assert check(spec, {"role": "assistant", "content": '{"n": 3}'}).passed
        assert check(spec, "n is three").failure == "invalid_format"
        bad = check(spec, '{"n": "3"}')
        assert bad.failure == "invalid_format" and "is not of type" in bad.checks["schema"]["errors"][0]

    def test_exact(self):
        assert check({"type": "exact", "expected": "Paris"}, " Paris\n").passed
        assert not check({"type": "exact", "expected": "Paris"}, "paris").passed
        assert check({"type": "exact", "expected": "Paris", "string_match": "normalized"}, "paris.").passed
        assert check({"type": "exact", "expected": {"n": 3}}, '{"n": 3.0}').passed
        assert check({"type": "exact", "expected": "Paris"}, "Lyon").failure == "wrong_answer"

    def test_regex(self):
        assert check({"type": "regex", "pattern": r"2026-03-\d\d"}, "It is on 2026-03-05.").passed
        assert check({"type": "regex", "pattern": "^yes$", "ignore_case": True, "full_match": True}, "YES").passed
        assert check({"type": "regex", "pattern": "yes", "full_match": True}, "yes!").failure == "wrong_answer"
        # The answer is the text outside tool-call blocks.
        assert not check({"type": "regex", "pattern": "secret"}, '<tool_call>{"name": "secret"}</tool_call> hi').passed

    @pytest.mark.parametrize("spec", [
        {"type": "regex", "pattern": "secret"},
        {"type": "regex", "pattern": "^hi$", "full_match": True},
        {"type": "exact", "expected": "hi"},
    ])
    def test_an_output_scores_the_same_as_text_or_as_a_message_carrying_its_tags(self, spec):
        text = '<tool_call>{"name": "secret", "arguments": {}}</tool_call> hi'
        as_text = check(spec, text)
        for message in ({"role": "assistant", "content": text},
                        {"role": "assistant", "content": [{"type": "text", "text": text}]},
                        {"role": "assistant", "content": text, "tool_calls": [
                            {"type": "function", "function": {"name": "secret", "arguments": "{}"}}]}):
            as_message = check(spec, message)
            assert (as_message.passed, as_message.reward, as_message.failure) == (
                as_text.passed, as_text.reward, as_text.failure), message

    def test_state(self):
        spec = {
            "type": "state",
            "expected": {"tasks": [{"id": "T1", "title": "a", "done": True}, {"id": "T2", "title": "b", "done": False}]},
            "ignore_keys": ["id"],
            "unsafe": [{"name": "delete_*"}],
        }
        final = {"tasks": [{"id": "T9", "title": "b", "done": False}, {"id": "T1", "title": "a", "done": True}], "log": [1]}
        assert check(spec, "done", state=final).passed  # list order and ignored keys do not matter, nor other keys
        wrong = {"tasks": [{"id": "T1", "title": "a", "done": False}, {"id": "T2", "title": "b", "done": False}]}
        r = check(spec, "done", state=wrong)
        assert r.failure == "wrong_state" and "done" in r.checks["state"]["diffs"][0]
        r = check(spec, msg(("delete_task", {"task_id": "T3"})), state=final)
        assert r.failure == "unsafe_action"
        with pytest.raises(ValueError, match="final state"):
            score(spec, "done")

    def test_state_bools_are_not_numbers(self):
        # True == 1 in Python; in a final state a flag set to true is not a counter set to 1.
        spec = {"type": "state", "expected": {"flag": True, "count": 1, "items": [{"done": True}]}}
        assert check(spec, "ok", state={"flag": True, "count": 1.0, "items": [{"done": True}]}).passed
        r = check(spec, "ok", state={"flag": 1, "count": 1, "items": [{"done": True}]})
        assert r.failure == "wrong_state" and r.checks["state"]["diffs"] == ["flag: expected true, got 1"]
        r = check(spec, "ok", state={"flag": True, "count": True, "items": [{"done": True}]})
        assert r.failure == "wrong_state" and r.checks["state"]["diffs"][0].startswith("count:")
        r = check(spec, "ok", state={"flag": True, "count": 1, "items": [{"done": 1}]})
        assert r.failure == "wrong_state" and "done" in r.checks["state"]["diffs"][0]

    def test_state_weights_and_unsafe_share_the_tool_call_rules(self):
        spec = {"type": "state", "expected": {"n": 1}, "unsafe": ["delete_*"],
                "weights": {"complete": 1.0, "unsafe": -1.0}}
        r = check(spec, msg(("get_task", {"task_id": "T1"}), ("delete_task", {"task_id": "T1"})), state={"n": 1})
        assert r.failure == "unsafe_action" and r.reward == -1.0
        assert r.checks["unsafe"]["calls"] == [{"index": 1, "name": "delete_task", "rule": "delete_*"}]
        assert check(spec, "done", state={"n": 1}).reward == 1.0
        problems = validate_spec({"type": "state", "expected": {}, "weights": {"complete": True, "bonus": 1}})
        assert any("weights.complete" in p for p in problems) and any("'bonus'" in p for p in problems)
        assert validate_spec(tc([], weights={"tool": True}))  # a bool is not a weight for tool_call either

    def test_all(self):
        spec = {"type": "all", "verifiers": [{"type": "regex", "pattern": "a"}, {"type": "regex", "pattern": "b"}]}
        assert check(spec, "ab").passed
        r = check(spec, "a")
        assert r.failure == "wrong_answer" and r.reward == 0.0 and len(r.checks["verifiers"]) == 2

    def test_llm_judge_is_off_by_default(self, monkeypatch):
        monkeypatch.delenv("FLYWHEEL_LLM_JUDGE_ENDPOINT", raising=False)
        with pytest.raises(LLMJudgeDisabled, match="off by default"):
            score({"type": "llm_judge", "rubric": "Is it polite?"}, "Thanks!")


# Score, summarize, caching ---------------------------------------------------------------------------
def test_score_rejects_unknown_failure():
    with pytest.raises(ValueError):
        Score(0.0, False, {}, "bad_vibes")


def test_summarize():
    scores = [
        Score(1.0, True, {}, None),
        Score(0.0, False, {}, "invalid_format"),
        Score(-1.0, False, {"unsafe": {"ok": False}}, "unsafe_action"),
        Score(0.0, False, {"unsafe": {"ok": False}}, "wrong_state"),  # unsafe seen in checks, not the failure
    ]
    s = summarize(scores)
    assert s["n"] == 4 and s["success_rate"] == 0.25 and s["invalid_output_rate"] == 0.25
    assert s["unsafe_action_rate"] == 0.5 and s["mean_reward"] == 0.0
    assert s["failures"] == {"invalid_format": 1, "unsafe_action": 1, "wrong_state": 1}
    assert summarize([])["n"] == 0


def test_same_score_cached_or_not():
    completions = [
        msg(("create_task", {"title": "Fix login", "assignee": "alice"})),
        msg(("create_task", {"title": 3})),
        msg(("delete_task", {})),
        "<tool_call>{</tool_call>",
    ]
    cached = [score(ISSUE_SPEC, c, tools=TOOLS).to_dict() for c in completions]
    with caches_disabled():
        uncached = [score(json.loads(json.dumps(ISSUE_SPEC)), c, tools=json.loads(json.dumps(TOOLS))).to_dict() for c in completions]
    assert cached == uncached
    assert tool_index(TOOLS) is tool_index(TOOLS)
    fresh = json.loads(json.dumps(TOOLS))
    assert tool_index(fresh)["create_task"] is tool_index(TOOLS)["create_task"]  # content cache


# The fast schema path agrees with jsonschema ---------------------------------------------------------
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"]},
    {"type": "object", "properties": {"a": {"type": "number", "minimum": 0, "exclusiveMaximum": 10}}, "additionalProperties": False},
    {"type": "object", "properties": {"s": {"type": "string", "enum": ["x", "y"], "minLength": 1}}},
    {"type": "object", "properties": {"l": {"type": "array", "items": {"type": "string"}, "maxItems": 2}}},
    {"type": "object", "properties": {"d": {"type": "string", "pattern": r"^\d{4}-\d{2}$"}, "n": {"type": ["null", "boolean"]}}},
    {"type": "object", "properties": {"o": {"type": "object", "properties": {"k": {"type": "integer"}}}}, "additionalProperties": {"type": "string"}},
]
VALUES = [None, True, False, 0, 1, 1.0, 1.5, -3, 10, "", "x", "y", "2026-03", "abc", [], ["x"], ["x", "y", "z"], [1], {}, {"k": 1}, {"k": "1"}]


def test_fast_schema_agrees_with_jsonschema():
    rng = random.Random(0)
    keys = ["a", "b", "s", "l", "d", "n", "o", "zz"]
    for schema in SCHEMAS:
        fast = compile_fast(schema)
        assert fast is not None, schema
        validator = jsonschema.Draft202012Validator(schema)
        for _ in range(400):
            instance = {k: rng.choice(VALUES) for k in rng.sample(keys, rng.randint(0, 4))}
            assert fast(instance) == validator.is_valid(instance), (schema, instance)
        for value in VALUES:
            assert fast(value) == validator.is_valid(value), (schema, value)


def test_fast_schema_declines_what_it_does_not_implement():
    assert compile_fast({"type": "object", "oneOf": [{"required": ["a"]}]}) is None
    assert compile_fast({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}}) is None
    assert compile_fast({"enum": [1, True]}) is None


def test_fast_schema_agrees_on_the_workplace_tools():
    from trainer.envs.workplace import TOOLS as WORKPLACE

    rng = random.Random(1)
    values = [*VALUES, "2026-03-05", "10:00", "9:00", "done", "in_progress", "high", ["alice"], ["alice", 3]]
    for tool in WORKPLACE.values():
        schema = tool["function"]["parameters"]
        fast = compile_fast(schema)
        assert fast is not None, tool["function"]["name"]
        validator = jsonschema.Draft202012Validator(schema)
        keys = [*schema["properties"], "extra"]
        for _ in range(200):
            instance = {k: rng.choice(values) for k in rng.sample(keys, rng.randint(0, len(keys)))}
            assert fast(instance) == validator.is_valid(instance), (tool["function"]["name"], instance)


def test_assignment_is_optimal():
    from itertools import combinations, permutations

    from trainer.verifiers.tool_call import align, assign

    rng = random.Random(2)
    for _ in range(300):
        n, m = rng.randint(1, 5), rng.randint(1, 5)
        w = [[rng.choice([0.0, 1.0, 1.3, 1001.0]) for _ in range(m)] for _ in range(n)]
        got = sum(w[i][j] for i, j in assign(w))
        if n <= m:
            best = max(sum(w[i][p[i]] for i in range(n)) for p in permutations(range(m), n))
        else:
            best = max(sum(w[p[j]][j] for j in range(m)) for p in permutations(range(n), m))
        assert got == pytest.approx(best)
        pairs = align(w)
        assert all(a[0] < b[0] and a[1] < b[1] for a, b in zip(pairs, pairs[1:], strict=False))
        best_aligned = max(
            sum(w[i][j] for i, j in zip(rows, cols, strict=True))
            for k in range(min(n, m) + 1)
            for rows in combinations(range(n), k)
            for cols in combinations(range(m), k)
        )
        assert sum(w[i][j] for i, j in pairs) == pytest.approx(best_aligned)
