"""The replay environment: recorded observations for matching calls (under the verifier's matching rules),
an error observation for any other call, the turn limit, row errors that name the entry, and a replay suite
evaluated through the `evaluate` command's own code."""

from __future__ import annotations

import json

import pytest

from trainer.cli import build_parser, cmd_evaluate
from trainer.config import read_jsonl, write_jsonl
from trainer.envs import DEFAULT_MAX_TURNS, make_env, replay, validate_task
from trainer.envs.replay_env import NO_RECORDING, ReplayEnv
from trainer.envs.workplace import TOOLS, generate_tasks
from trainer.tracking import EventLog
from trainer.verifiers import SpecError

ERROR = json.dumps({"error": NO_RECORDING})


def call(tool: str, /, **args) -> str:
    return f"<tool_call>{json.dumps({'name': tool, 'arguments': args})}</tool_call>"


def row(**overrides) -> dict:
    verifier = {"type": "tool_call", "order": "strict", "expected_calls": [
        {"name": "find_person", "arguments": {"name": "Peggy"}},
        {"name": "update_task", "arguments": {"task_id": "T4", "assignee": "peggy"}},
    ]}
    base = {
        "id": "rp-1",
        "messages": [{"role": "user", "content": "Assign T4 to Peggy."}],
        "tools": [TOOLS["find_person"], TOOLS["update_task"], TOOLS["delete_task"]],
        "verifier": verifier,
        "env": {"type": "replay", "max_turns": 4, "recorded": [
            {"name": "find_person", "arguments": {"name": "Peggy"}, "observation": {"id": "peggy"}},
            # A corrected call the agent never made: the reviewer states the observation it should get.
            {"name": "update_task", "arguments": {"task_id": "T4", "assignee": {"one_of": ["peggy", "Peggy"]}},
             "observation": "ok: T4 reassigned"},
        ]},
    }
    return {**base, **overrides}


def observations(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "tool"]


def test_matching_calls_get_the_recording_and_others_an_error():
    task = row()
    env = make_env(task)
    assert isinstance(env, ReplayEnv) and env.reset() == task["messages"]
    first = env.step(call("find_person", name="peggy"))  # normalised strings: the verifier's default
    assert not first.done and observations(first.messages) == ['{"id":"peggy"}']
    assert first.messages[1]["tool_call_id"] == first.messages[0]["tool_calls"][0]["id"]
    wrong = env.step(call("update_task", task_id="T5", assignee="peggy"))  # an argument the recording lacks
    assert observations(wrong.messages) == [ERROR]
    unknown = env.step(call("teleport", where="mars"))
    assert observations(unknown.messages) == [ERROR]
    final = env.step("Done.")
    assert final.done and final.messages == [{"role": "assistant", "content": "Done."}]
    score = env.score()
    # The verifier scores every call made: the right person, then the wrong task, then an invented tool.
    assert not score.passed and score.failure == "hallucinated_api"
    assert score.checks["episode"] == {"turns": 4, "finished": True, "unanswered": [
        {"turn": 2, "name": "update_task"}, {"turn": 3, "name": "teleport"}]}

    messages, score = replay(task, [call("find_person", name="Peggy"), call("update_task", task_id="T4", assignee="Peggy"),
                                    "Done."])
    assert observations(messages) == ['{"id":"peggy"}', "ok: T4 reassigned"]
    assert score.passed and score.reward == 1.0 and score.checks["episode"]["unanswered"] == []


def test_the_verifiers_matching_rules_decide_what_matches():
    exact = row(verifier={**row()["verifier"], "string_match": "exact"})
    messages, _ = replay(exact, [call("find_person", name="peggy"), "Done."])
    assert observations(messages) == [ERROR]  # "peggy" is not "Peggy" once strings match exactly
    messages, _ = replay(exact, [call("find_person", name="Peggy"), "Done."])
    assert observations(messages) == ['{"id":"peggy"}']

    extra = call("find_person", name="Peggy", team="sales")
    messages, _ = replay(row(), [extra, "Done."])
    assert observations(messages) == [ERROR]  # an argument the recording does not name
    loose = row(verifier={**row()["verifier"], "allow_extra_arguments": True})
    messages, _ = replay(loose, [extra, "Done."])
    assert observations(messages) == ['{"id":"peggy"}']

    # The rules come from the first tool_call verifier, wherever it sits (here inside "all").
    nested = row(verifier={"type": "all", "verifiers": [{"type": "regex", "pattern": "Done"},
                                                        {**row()["verifier"], "string_match": "exact"}]})
    messages, _ = replay(nested, [call("find_person", name="peggy"), "Done."])
    assert observations(messages) == [ERROR]


def test_recordings_are_used_in_order_then_repeated():
    task = row(env={"type": "replay", "recorded": [
        {"name": "find_person", "arguments": {"name": {"any": True}}, "observation": "first"},
        {"name": "find_person", "arguments": {"name": {"any": True}}, "observation": "second"},
    ]})
    messages, _ = replay(task, [call("find_person", name="a"), call("find_person", name="b"),
                                call("find_person", name="c"), "Done."])
    assert observations(messages) == ["first", "second", "second"]


def test_the_episode_ends_at_max_turns():
    task = row(env={**row()["env"], "max_turns": 2})
    env = make_env(task)
    env.reset()
    results = [env.step(call("find_person", name="Peggy")) for _ in range(2)]
    assert [r.done for r in results] == [False, True]
    assert env.score().checks["episode"]["finished"] is False
    with pytest.raises(RuntimeError):
        env.step("Done.")

    bare = row(env={k: v for k, v in row()["env"].items() if k != "max_turns"})
    env = make_env(bare)
    env.reset()
    assert [env.step(call("find_person", name="x")).done for _ in range(DEFAULT_MAX_TURNS)][-1] is True


def test_unparseable_output_ends_the_episode():
    env = make_env(row())
    env.reset()
    assert env.step('<tool_call>{"name": "find_person", "arguments": {</tool_call>').done
    assert env.score().failure == "invalid_format"


@pytest.mark.parametrize("recorded, message", [
    (None, r"env\.recorded: a replay task needs a list"),
    ([{"name": "find_person", "arguments": {"name": "x"}}], r"env\.recorded\[0\]\.observation: missing"),
    ([{"arguments": {}, "observation": 1}], r"env\.recorded\[0\]: needs a \"name\""),
    ([{"name": "f", "observation": 1, "result": 2}], r"env\.recorded\[0\]: unknown key\(s\) \['result'\]"),
    ([{"name": "f", "arguments": {"q": {"regex": "(a)\\1"}}, "observation": 1}], r"env\.recorded: f\.q: unsupported"),
])
def test_a_bad_recording_names_the_task_and_entry(recorded, message):
    env = {"type": "replay"} if recorded is None else {"type": "replay", "recorded": recorded}
    with pytest.raises(SpecError, match=r"task 'rp-1': " + message):
        make_env(row(env=env))


def replay_row(task: dict) -> dict:
    """A workplace task as a promoted replay task: its solution's calls recorded with the observations the
    workplace gave them, the verifier asking for those calls."""
    messages, _ = replay(task, task["solution"])
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for m in messages if m.get("tool_calls") for c in m["tool_calls"]]
    answers = [m["content"] for m in messages if m["role"] == "tool"]
    return {"id": task["id"], "messages": task["messages"], "tools": task["tools"],
            "verifier": {"type": "tool_call", "expected_calls": [{"name": n, "arguments": a} for n, a in calls]},
            "env": {"type": "replay", "max_turns": task["env"]["max_turns"],
                    "recorded": [{"name": n, "arguments": a, "observation": o}
                                 for (n, a), o in zip(calls, answers, strict=True)]}}


def test_evaluate_a_replay_suite(tiny_model, tmp_path):
    rows = [replay_row(t) for t in generate_tasks(6, seed=11, split="holdout", difficulty="single")]
    write_jsonl(tmp_path / "suite.jsonl", rows)
    args = build_parser().parse_args(["evaluate", "--model", str(tiny_model), "--suite", str(tmp_path / "suite.jsonl"),
                                      "--samples", "2", "--max-new-tokens", "48", "--out", str(tmp_path / "out.jsonl")])
    events = EventLog(None)
    assert cmd_evaluate(args, events) == 0
    done = events.events[-1]
    assert done["event"] == "done" and done["metrics"]["n"] == 12
    cases = read_jsonl(tmp_path / "out.jsonl")
    assert [c["id"] for c in cases] == [r["id"] for r in rows]
    seen = set()
    for r, case in zip(rows, cases, strict=True):
        recorded = {e["observation"] for e in r["env"]["recorded"]}
        for sample in case["samples"]:
            for obs in observations(sample["messages"]):
                assert obs in recorded or obs == ERROR
                seen.add("recorded" if obs in recorded else "error")
            # The same turns replayed in a fresh environment give the same transcript and score: the
            # suite ran in the replay environment, with its verifier.
            turns = [m for m in sample["messages"] if m["role"] == "assistant"]
            messages, score = replay(r, turns)
            assert messages[len(r["messages"]):] == sample["messages"]
            assert (score.reward, score.passed, score.failure) == (sample["reward"], sample["passed"], sample["failure"])
    assert "recorded" in seen  # the model made calls that the recording answered


def test_validate_task_lists_every_problem_without_running_anything():
    assert validate_task(row()) == []
    bad = row(verifier={"type": "tool_call", "expected_calls": "refund"},
              env={"type": "replay", "max_turns": 0, "recorded": [{"name": "find_person"}]})
    assert validate_task(bad) == [
        "task rp-1: env.max_turns must be an integer >= 1, got 0",
        "task 'rp-1': verifier: expected_calls must be a list of {\"name\", \"arguments\"} (it may be empty)",
    ]
    bad = row(env={"type": "replay", "recorded": [{"name": "find_person"}]})
    assert validate_task(bad) == ["task 'rp-1': env.recorded[0].observation: missing (the tool's answer to this call)"]
    assert validate_task({**row(), "verifier": None} | {"reward": [{"verifier": {"type": "nope"}}]})[0].startswith(
        "task 'rp-1': a row has a `verifier` or a weighted `reward` list, not both")
    assert validate_task({"id": "x", "env": {"type": "teleport"}}) == [
        "task 'x': unknown env type 'teleport' (expected one of ['http', 'python', 'replay', 'single_turn', 'workplace'])"]
    # An environment server scores its own episodes: no verifier needed, and nothing is contacted.
    assert validate_task({"id": "h", "env": {"type": "http", "url": "http://127.0.0.1:9"}}) == []
    assert validate_task({"id": "h", "env": {"type": "http"}}) == [
        "task 'h': env.url must be an http:// or https:// URL, got None"]
    assert validate_task({"id": "p", "env": {"type": "python", "entry_point": "no_such_module:make"}}) == []
    assert validate_task({"id": "w", "verifier": {"type": "exact", "expected": "x"}, "env": {"type": "workplace"}}) == [
        "task w: a workplace task needs env.initial_state"]
