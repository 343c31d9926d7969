"""The `python` environment: an installed class named by an entry point plays like a built-in one, through
the episode runner too; a bad entry point is a clear error naming the task; it can be switched off."""

from __future__ import annotations

import textwrap

import pytest

from trainer.envs import make_env, replay
from trainer.evaluation import evaluate_rows
from trainer.rollout.hf import HFEngine

MODULE = '''
"""A guessing game: the answer is the number of the task's id; each wrong guess is told higher or lower."""
import json

from trainer.envs import StepResult, assistant_message
from trainer.verifiers import Score, parse_completion


class GuessEnv:
    def __init__(self, task):
        self.task = task
        self.tools = []
        self.target = int(task["id"].split("-")[1])

    def reset(self):
        self.guesses = []
        return [{"role": "user", "content": "Guess my number."}]

    def step(self, completion):
        parsed = parse_completion(completion)
        message = assistant_message(parsed, completion, len(self.guesses))
        try:
            guess = int(parsed.content.strip())
        except ValueError:
            guess = None
        self.guesses.append(guess)
        if guess == self.target or len(self.guesses) >= 3:
            return StepResult([message], True)
        hint = "higher" if guess is None or guess < self.target else "lower"
        return StepResult([message, {"role": "user", "content": hint}], False)

    def score(self):
        won = self.guesses[-1] == self.target
        return Score(1.0 / len(self.guesses) if won else 0.0, won, {"guesses": self.guesses},
                     None if won else "wrong_answer")


NOT_CALLABLE = 3


def no_step(task):
    return object()
'''


@pytest.fixture
def guess_module(tmp_path, monkeypatch):
    (tmp_path / "guess_envs.py").write_text(textwrap.dedent(MODULE))
    (tmp_path / "broken_envs.py").write_text("raise RuntimeError('needs a licence key')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "guess_envs"


def task(entry_point: str, number: int = 7) -> dict:
    return {"id": f"guess-{number}", "messages": [], "env": {"type": "python", "entry_point": entry_point,
                                                             "max_turns": 3}}


def test_an_entry_point_environment_plays_like_a_built_in(guess_module):
    env = make_env(task("guess_envs:GuessEnv"))
    assert type(env).__name__ == "GuessEnv"
    messages, score = replay(task("guess_envs:GuessEnv"), ["3", "9", "7"])
    assert [m["content"] for m in messages if m["role"] == "user"] == ["Guess my number.", "higher", "lower"]
    assert score.passed and score.reward == pytest.approx(1 / 3)
    _, score = replay(task("guess_envs:GuessEnv"), ["1", "2", "3"])
    assert not score.passed and score.failure == "wrong_answer"


def test_the_episode_runner_plays_it(guess_module, make_lora_policy):
    model, tokenizer = make_lora_policy()
    rows = [task("guess_envs:GuessEnv", n) for n in (2, 5)]
    metrics, cases = evaluate_rows(HFEngine(model, tokenizer), tokenizer, rows, samples_per_prompt=2, temperature=1.0,
                                   max_new_tokens=8, keep_messages=True)
    assert metrics["n"] == 4 and [c["id"] for c in cases] == ["guess-2", "guess-5"]
    for case in cases:
        for sample in case["samples"]:
            # The samples' transcripts start after the environment's own opening message.
            turns = [m for m in sample["messages"] if m["role"] == "assistant"]
            hints = [m["content"] for m in sample["messages"] if m["role"] == "user"]
            assert sample["messages"][0]["role"] == "assistant"
            # The environment's own rules ran: a hint after every wrong guess but the last, at most 3 turns.
            assert 1 <= len(turns) <= 3 and len(hints) == len(turns) - 1
            assert set(hints) <= {"higher", "lower"}


@pytest.mark.parametrize("entry_point, message", [
    ("guess_envs.GuessEnv", r"must be \"package\.module:attribute\", got 'guess_envs\.GuessEnv'"),
    (None, r"must be \"package\.module:attribute\", got None"),
    ("no_such_envs:Env", r"'no_such_envs:Env': module 'no_such_envs' is not installed"),
    ("guess_envs:Nope", r"guess_envs has no attribute 'Nope'"),
    ("guess_envs:NOT_CALLABLE", r"NOT_CALLABLE is not callable"),
    ("guess_envs:no_step", r"returned a object without reset, step, score, tools \(a list\)"),
    ("broken_envs:Env", r"importing broken_envs failed: RuntimeError: needs a licence key"),
])
def test_a_bad_entry_point_names_the_task(guess_module, entry_point, message):
    with pytest.raises(ValueError, match=r"task 'guess-7': env\.entry_point.*" + message):
        make_env(task(entry_point))


def test_entry_points_can_be_switched_off(guess_module, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_ENV_ENTRY_POINTS", "0")
    with pytest.raises(ValueError, match=r"task 'guess-7': env type \"python\" is switched off here"):
        make_env(task("guess_envs:GuessEnv"))
