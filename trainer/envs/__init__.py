"""Environments the trainer rolls out in.

`make_env(task)` takes one task row (`{id, messages, tools, verifier | reward, env?: {type, max_turns, ...},
origin}`) and returns an `Env`: `reset()` gives the opening messages, `step(completion)` the messages to
append and whether the episode is over, `score()` the verifier's `Score` for the episode. `env.type`:
`single_turn` (default), `workplace` (the simulated company), `replay` (a recorded trajectory answers the
calls, `trainer.envs.replay_env`), `http` (an environment server, `trainer.envs.http_env`) and `python` (an
installed entry point, command line only, `trainer.envs.entry_point`).
"""

from __future__ import annotations

import copy
from typing import Any

from trainer.envs.base import DEFAULT_MAX_TURNS, Env, StepResult, assistant_message, max_turns, parse_turn
from trainer.verifiers import Score, SpecError, validate_spec
from trainer.verifiers.rewards import reward_components, score_task

__all__ = ["DEFAULT_MAX_TURNS", "Env", "SingleTurnEnv", "StepResult", "assistant_message", "make_env", "max_turns",
           "replay", "validate_task", "ENV_TYPES"]


class SingleTurnEnv:
    """One assistant turn, scored by the task's verifier: the shape of an eval case from a production failure."""

    def __init__(self, task: dict[str, Any]):
        self.task = task
        self.tools: list[dict] = task.get("tools") or []
        self._completion: str | dict | None = None
        self._done = False

    def reset(self) -> list[dict]:
        self._completion = None
        self._done = False
        return copy.deepcopy(self.task.get("messages") or [])

    def step(self, completion: str | dict) -> StepResult:
        if self._done:
            raise RuntimeError(f"task {self.task.get('id')}: step() after the episode ended; call reset()")
        self._completion = completion
        self._done = True
        _, message = parse_turn(completion, 0)
        return StepResult([message], True)

    def score(self) -> Score:
        if not self._done:
            raise RuntimeError(f"task {self.task.get('id')}: score() before step()")
        # A row without "tools" skips the declared-tool check; an empty list declares that there are none.
        return score_task(self.task, self._completion, tools=self.task.get("tools"))


def make_env(task: dict[str, Any]) -> Env:
    """The environment a task row asks for (no `env` block: single-turn)."""
    env_spec = task.get("env")
    kind = env_spec.get("type", "single_turn") if isinstance(env_spec, dict) else "single_turn"
    factory = ENV_TYPES.get(kind)
    if factory is None:
        raise ValueError(f"task {task.get('id')}: unknown env type {kind!r} (expected one of {sorted(ENV_TYPES)})")
    return factory(task)


def validate_task(task: Any) -> list[str]:
    """What is wrong with a task row, one readable line each naming the field ([] when nothing is): its
    env type and turn limit, a replay row's recordings, an http row's settings, a workplace row's state, its
    `verifier` or weighted `reward`. It contacts no server and imports no entry point, so a row can be
    checked where it is written (the platform, before saving a task)."""
    if not isinstance(task, dict):
        return [f"a task row must be a JSON object, got {type(task).__name__}"]
    env_spec = task.get("env")
    if env_spec is not None and not isinstance(env_spec, dict):
        return [f"task {task.get('id')!r}: env must be an object"]
    kind = (env_spec or {}).get("type", "single_turn")
    if kind not in ENV_TYPES:
        return [f"task {task.get('id')!r}: unknown env type {kind!r} (expected one of {sorted(ENV_TYPES)})"]
    problems: list[str] = []
    try:
        max_turns(task)
        if kind in ("replay", "workplace", "http"):
            ENV_TYPES[kind](task)  # their constructors check the row and do nothing else
    except SpecError as exc:
        problems.extend(exc.problems)
    except ValueError as exc:
        problems.append(str(exc))
    # An http or python environment scores its own episodes; every other row needs a verifier or rewards.
    if kind not in ("http", "python") or "verifier" in task or "reward" in task:
        try:
            if reward_components(task) is None:
                if "verifier" not in task:
                    problems.append(f"task {task.get('id')!r}: needs a `verifier` (or a weighted `reward` list)")
                else:
                    problems.extend(f"task {task.get('id')!r}: verifier: {p}" for p in validate_spec(task["verifier"]))
        except SpecError as exc:
            problems.extend(exc.problems)
    return list(dict.fromkeys(problems))


def replay(task: dict[str, Any], completions: list[str | dict]) -> tuple[list[dict], Score]:
    """Run an episode from given assistant turns; returns the full transcript and its score.

    With `task["solution"]` this yields the solved conversation, tool observations included (SFT data).
    """
    env = make_env(task)
    messages = env.reset()
    for completion in completions:
        result = env.step(completion)
        messages.extend(result.messages)
        if result.done:
            break
    return messages, env.score()


def _workplace(task: dict[str, Any]) -> Env:
    from trainer.envs.workplace.env import WorkplaceEnv  # deferred: the workplace is only loaded when used

    return WorkplaceEnv(task)


def _replay(task: dict[str, Any]) -> Env:
    from trainer.envs.replay_env import ReplayEnv

    return ReplayEnv(task)


def _http(task: dict[str, Any]) -> Env:
    from trainer.envs.http_env import HttpEnv

    return HttpEnv(task)


def _python(task: dict[str, Any]) -> Env:
    from trainer.envs.entry_point import make_python_env

    return make_python_env(task)


ENV_TYPES = {"single_turn": SingleTurnEnv, "workplace": _workplace, "replay": _replay, "http": _http,
             "python": _python}
