"""The workplace episode: tool calls change a simulated company's state until a final answer or max_turns."""

from __future__ import annotations

import copy
import json
from typing import Any

from trainer.envs.base import ToolEpisode, max_turns
from trainer.envs.workplace.tools import HANDLERS, ToolError
from trainer.verifiers import Score
from trainer.verifiers.jsonschemas import SchemaProblem
from trainer.verifiers.rewards import score_task
from trainer.verifiers.schemas import tool_index


class WorkplaceEnv(ToolEpisode):
    """One task's episode. The task's `tools` are the only ones callable; anything else is an unknown tool."""

    def __init__(self, task: dict[str, Any]):
        self.task = task
        self.tools: list[dict] = task.get("tools") or []
        env = task.get("env") or {}
        if not isinstance(env.get("initial_state"), dict):
            raise ValueError(f"task {task.get('id')}: a workplace task needs env.initial_state")
        self.max_turns: int = max_turns(task)
        self._index = tool_index(self.tools) or {}
        self.reset()

    def reset(self) -> list[dict]:
        self.state: dict[str, Any] = copy.deepcopy(self.task["env"]["initial_state"])
        self._begin()
        self.call_errors: list[dict[str, Any]] = []
        return copy.deepcopy(self.task.get("messages") or [])

    def answer(self, call: dict[str, Any]) -> str:
        return json.dumps(self._execute(call), ensure_ascii=False, separators=(",", ":"))

    def _execute(self, call: dict[str, Any]) -> dict[str, Any]:
        name, args = call["name"], call["arguments"]
        info = self._index.get(name)
        if info is None or name not in HANDLERS:
            return self._error(call, "hallucinated_api", f"unknown tool {name!r}")
        try:
            errors = info.errors(args, name)
        except SchemaProblem:
            errors = []  # a task row's schema that cannot judge the call: the handler does, as without a schema
        if errors:
            return self._error(call, "wrong_arguments", "invalid arguments: " + "; ".join(errors))
        try:
            return HANDLERS[name](self.state, **args)
        except ToolError as exc:
            return self._error(call, "wrong_arguments", str(exc))
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            # A task row whose tool schema was edited away from the handler's signature: the model's call
            # still gets an observation, and the episode goes on rather than crashing the rollout.
            return self._error(call, "wrong_arguments", f"{name} failed: {exc}")

    def _error(self, call: dict[str, Any], kind: str, message: str) -> dict[str, Any]:
        self.call_errors.append({"turn": self.turn, "name": call["name"], "kind": kind, "error": message})
        return {"error": message}

    def score(self) -> Score:
        result = score_task(self.task, self.transcript_message(), tools=self.tools, state=self.state)
        if self.format_error is not None:
            return self.format_failure(result)
        checks = dict(result.checks)
        checks["episode"] = {"turns": self.turn, "finished": bool(self.done and self.final_content), "errors": self.call_errors}
        failure = result.failure
        if failure in ("wrong_state", "wrong_answer") and self.call_errors:
            # The episode failed and a call failed on the way: the failed call is the more useful diagnosis
            # (an invented tool, or arguments the tool refused).
            kinds = {e["kind"] for e in self.call_errors}
            failure = "hallucinated_api" if "hallucinated_api" in kinds else "wrong_arguments"
        return Score(result.reward, result.passed, checks, failure, result.components)
