"""Several weighted rewards on one row: the weighted sum, pass and failure, per-component rewards in the
score, the step event, MLflow and the suite metrics, and row errors that name the component."""

from __future__ import annotations

import json

import pytest

from trainer.config import GRPOConfig, JobSpec, write_jsonl
from trainer.envs import make_env, replay
from trainer.envs.workplace import TOOLS, generate_tasks
from trainer.loop import train_grpo
from trainer.tracking import EventLog
from trainer.verifiers import SpecError, summarize
from trainer.verifiers.rewards import score_task

CALL = {"type": "tool_call",
        "expected_calls": [{"name": "create_task", "arguments": {"title": "Fix login", "project": "apollo"}}],
        "unsafe": [{"name": "delete_*"}]}
SAYS_DONE = {"type": "regex", "pattern": "(?i)done"}


def row(reward: list[dict]) -> dict:
    return {"id": "w-1", "messages": [{"role": "user", "content": "Create a task Fix login"}],
            "tools": [TOOLS["create_task"], TOOLS["delete_task"]], "reward": reward}


def call(tool: str, text: str = "", /, **args) -> str:
    return f"<tool_call>{json.dumps({'name': tool, 'arguments': args})}</tool_call>{text}"


def test_the_reward_is_the_weighted_sum_and_each_component_is_kept():
    task = row([{"verifier": CALL, "weight": 0.7, "name": "calls"}, {"verifier": SAYS_DONE, "weight": 0.3}])
    both = score_task(task, call("create_task", " Done.", title="fix login", project="apollo"), tools=task["tools"])
    assert both.reward == pytest.approx(1.0) and both.passed and both.failure is None
    assert both.components == {"calls": 1.0, "regex": 1.0}
    assert both.to_dict()["components"] == {"calls": 1.0, "regex": 1.0}

    silent = score_task(task, call("create_task", title="fix login", project="apollo"), tools=task["tools"])
    assert silent.reward == pytest.approx(0.7) and not silent.passed and silent.failure == "wrong_answer"
    assert silent.components == {"calls": 1.0, "regex": 0.0}
    assert silent.checks["rewards"]["regex"]["failure"] == "wrong_answer"

    wrong = score_task(task, "Done, I think.", tools=task["tools"])
    assert wrong.reward == pytest.approx(0.3) and wrong.failure == "missing_call"

    unsafe = score_task(task, call("delete_task", " done", task_id="T1"), tools=task["tools"])
    assert unsafe.failure == "unsafe_action" and unsafe.unsafe  # the suite's unsafe rate sees it


def test_a_zero_weight_component_is_logged_but_does_not_count():
    task = row([{"verifier": CALL, "weight": 1.0}, {"verifier": SAYS_DONE, "weight": 0, "name": "polite"},
                {"verifier": {**CALL, "string_match": "exact"}, "weight": -0.5}])
    s = score_task(task, call("create_task", title="fix login", project="apollo"), tools=task["tools"])
    # Passes on the counted components; the exact-match one fails and takes its negative weight off.
    assert s.components == {"tool_call": 1.0, "polite": 0.0, "tool_call_2": 0.0}
    assert s.reward == pytest.approx(1.0) and not s.passed and s.failure == "wrong_arguments"
    s = score_task(task, call("create_task", title="Fix login", project="apollo"), tools=task["tools"])
    assert s.reward == pytest.approx(1.0 - 0.5) and s.passed  # "polite" failed, and does not count


def test_summarize_and_environments_carry_the_components():
    task = generate_tasks(1, seed=4, split="train", difficulty="single")[0]
    weighted = {**{k: v for k, v in task.items() if k != "verifier"},
                "reward": [{"verifier": task["verifier"], "name": "state"},
                           {"verifier": SAYS_DONE, "weight": 0.5, "name": "done"}]}
    env = make_env(weighted)
    _, solved = replay(weighted, task["solution"])  # the workplace's state verifier inside a component
    _, idle = replay(weighted, ["Nothing to do."])
    assert type(env).__name__ == "WorkplaceEnv" and solved.checks["episode"]["finished"]
    assert solved.components["state"] == 1.0 and idle.components == {"state": 0.0, "done": 0.0}
    assert solved.reward == pytest.approx(1.0 + 0.5 * solved.components["done"])
    metrics = summarize([solved, idle])
    assert metrics["reward/state"] == 0.5 and metrics["reward/done"] == solved.components["done"] / 2
    assert "reward/state" not in summarize([replay(task, task["solution"])[1]])


@pytest.mark.parametrize("reward, message", [
    ([], r"reward: must be a non-empty list"),
    ([{"weight": 1}], r"reward\[0\]: needs \"verifier\""),
    ([{"verifier": SAYS_DONE, "weight": "high"}], r"reward\[0\]\.weight: must be a finite number"),
    ([{"verifier": SAYS_DONE, "weight": True}], r"reward\[0\]\.weight: must be a finite number"),
    ([{"verifier": SAYS_DONE, "name": "a b"}], r"reward\[0\]\.name: 1-64 letters"),
    ([{"verifier": SAYS_DONE}, {"verifier": SAYS_DONE, "name": "regex"}], r"reward: two components are named 'regex'"),
    ([{"verifier": SAYS_DONE, "scale": 2}], r"reward\[0\]: unknown key 'scale'"),
    ([{"verifier": {"type": "regex", "pattern": "(a)\\1"}}], r"reward\[0\]\.verifier: .*unsupported"),
])
def test_a_bad_reward_list_names_the_component(reward, message):
    with pytest.raises(SpecError, match=r"task 'w-1': " + message):
        score_task(row(reward), "x")


def test_verifier_and_reward_are_one_or_the_other():
    with pytest.raises(SpecError, match=r"a row has a `verifier` or a weighted `reward` list, not both"):
        score_task({**row([{"verifier": SAYS_DONE}]), "verifier": CALL}, "x")
    with pytest.raises(SpecError, match=r"task 'w-1': needs a `verifier`"):
        score_task({"id": "w-1"}, "x")


def test_each_component_is_logged_in_the_step_event_and_mlflow(tiny_model, tmp_path):
    import mlflow

    tasks = generate_tasks(8, seed=6, split="train", difficulty="single")
    rows = [{**{k: v for k, v in t.items() if k != "verifier"},
             "reward": [{"verifier": t["verifier"], "name": "state"},
                        {"verifier": {"type": "regex", "pattern": "(?i)done|created|updated"}, "weight": 0.5,
                         "name": "reply"}]} for t in tasks]
    write_jsonl(tmp_path / "train.jsonl", rows)
    config = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=4, max_new_tokens=40, max_steps=1,
                        eval_on_start=False, r=4, alpha=8, num_threads=1, learning_rate=1e-3)
    spec = JobSpec(model=str(tiny_model), job_dir=tmp_path, train=tmp_path / "train.jsonl", config=config)
    seen = []
    events = EventLog(None)
    done = train_grpo(spec, events, reward_fn=lambda ep: seen.append(ep.score) or ep.reward)
    step = next(e for e in events.events if e["event"] == "step")
    assert len(seen) == 8
    for name in ("state", "reply"):
        assert step[f"reward/{name}"] == pytest.approx(sum(s.components[name] for s in seen) / 8)
    assert len({s.reward for s in seen}) > 1  # not a degenerate batch
    assert step["reward_mean"] == pytest.approx(sum(s.components["state"] + 0.5 * s.components["reply"]
                                                    for s in seen) / 8, abs=1e-6)
    run = mlflow.tracking.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(done["mlflow_run_id"])
    assert run.data.metrics["train/reward/state"] == pytest.approx(step["reward/state"])
    assert run.data.metrics["train/reward/reply"] == pytest.approx(step["reward/reply"])


def test_the_score_command_scores_weighted_rows(tmp_path):
    import io

    from trainer.cli import build_parser, cmd_score

    task = row([{"verifier": CALL, "weight": 0.7, "name": "calls"}, {"verifier": SAYS_DONE, "weight": 0.3}])
    write_jsonl(tmp_path / "cases.jsonl", [task])
    write_jsonl(tmp_path / "completions.jsonl",
                [{"id": "w-1", "completion": call("create_task", title="Fix login", project="apollo")}])
    out = io.StringIO()
    assert cmd_score(build_parser().parse_args(["score", str(tmp_path / "cases.jsonl"),
                                                str(tmp_path / "completions.jsonl")]), out) == 0
    line = json.loads(out.getvalue())
    assert line["reward"] == pytest.approx(0.7) and line["components"] == {"calls": 1.0, "regex": 0.0}
