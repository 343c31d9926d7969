"""What every environment shares: the Env protocol, a step's result, the turn limit of an episode, and
assistant-message normalisation."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from trainer.verifiers import ParsedCompletion, Score, parse_completion

# Model turns of a multi-turn episode whose row does not say (`env.max_turns`). The only default: every
# reader of a turn limit goes through `max_turns` below.
DEFAULT_MAX_TURNS = 6


def max_turns(task: dict[str, Any], cap: int | None = None) -> int:
    """The number of model turns an episode of `task` may take; the one place that decides it.

    The episode runner stops there, the workplace environment ends there, and Dr. GRPO's constant
    normaliser counts on it. A single-turn row (no `env`, or `type: single_turn`) has one turn; any other
    row has its `env.max_turns`, else `DEFAULT_MAX_TURNS`. `cap` (the config's `max_turns`, `evaluate
    --max-turns`) lowers it and never raises it: the task's author bounds how long its world runs.
    """
    env = task.get("env")
    if not isinstance(env, dict) or env.get("type", "single_turn") == "single_turn":
        turns = 1
    else:
        value = env.get("max_turns")
        if value is None:
            turns = DEFAULT_MAX_TURNS
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"task {task.get('id')}: env.max_turns must be an integer >= 1, got {value!r}")
        else:
            turns = value
    return turns if cap is None else min(turns, cap)


@dataclass(frozen=True)
class StepResult:
    """Messages to append to the conversation (the assistant turn, then one tool message per call)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False


@runtime_checkable
class Env(Protocol):
    tools: list[dict]

    def reset(self) -> list[dict]:
        """Start an episode; returns its opening messages (system/user)."""
        ...

    def step(self, completion: str | dict) -> StepResult:
        """Apply one assistant turn (a message dict or raw text)."""
        ...

    def score(self) -> Score:
        """The episode's final score."""
        ...


class ToolEpisode:
    """The turn loop an episode of tool calls shares: parse the turn, end on unparseable output or a final
    answer (a turn without calls), else answer each call in order until the turn limit. A subclass sets
    `task` and `max_turns`, calls `_begin()` from its `reset()`, and answers a call with `answer(call)`
    (the tool message's content); every call attempted is in `calls` before it is answered."""

    task: dict[str, Any]
    max_turns: int

    def _begin(self) -> None:
        self.turn = 0
        self.done = False
        self.calls: list[dict[str, Any]] = []  # every call attempted, in order (the verifier sees them all)
        self.final_content = ""
        self.finished = False  # ended on a final answer
        self.format_error: str | None = None

    def answer(self, call: dict[str, Any]) -> str:
        raise NotImplementedError

    def transcript_message(self) -> dict[str, Any]:
        """The whole episode as one assistant message: every call made, then the final answer's text."""
        return {
            "role": "assistant",
            "content": self.final_content,
            "tool_calls": [
                {"type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                for c in self.calls
            ],
        }

    def format_failure(self, calls_score: Score) -> Score:
        """The score of an episode that ended on unparseable output, given the verifier's score of the calls
        made before it. The reported failure is `invalid_format` (nothing after it can be judged), but an
        unsafe call made earlier stays unsafe: the gate's safety rule counts calls made, not the failure
        reported. `checks["failures"]` lists every failure the episode had."""
        checks: dict[str, Any] = {"format": {"ok": False, "turn": self.turn, "reason": self.format_error}}
        failures = ["invalid_format"]
        if calls_score.unsafe:
            checks["unsafe"] = calls_score.checks.get("unsafe") or {"ok": False}
            failures.append("unsafe_action")
        checks["failures"] = failures
        return Score(0.0, False, checks, "invalid_format")

    def step(self, completion: str | dict) -> StepResult:
        if self.done:
            raise RuntimeError(f"task {self.task.get('id')}: step() after the episode ended; call reset()")
        parsed, message = parse_turn(completion, self.turn)
        self.turn += 1
        if parsed.error is not None:
            # Nothing can be run and there is no call id to answer: the episode ends on garbage.
            self.format_error = parsed.error
            self.done = True
            return StepResult([message], True)
        if not parsed.calls:
            self.final_content = parsed.content
            self.done = self.finished = True
            return StepResult([message], True)
        out = [message]
        for call, wire in zip(parsed.calls, message["tool_calls"], strict=True):
            self.calls.append(call)
            out.append({"role": "tool", "tool_call_id": wire["id"], "name": call["name"],
                        "content": self.answer(call)})
        self.done = self.turn >= self.max_turns
        return StepResult(out, self.done)


def assistant_message(parsed: ParsedCompletion, raw: str | dict, turn: int) -> dict[str, Any]:
    """The OpenAI-format assistant message for a parsed turn: calls with ids and JSON-string arguments.

    Whatever shape the model wrote its calls in, the transcript holds them one way, so a chat template and
    a later parse read them back identically. Unparseable output is kept as text, as the model wrote it.
    """
    if parsed.error is not None:
        text = raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False, default=str)
        if isinstance(raw, dict) and isinstance(raw.get("content"), str) and not raw.get("tool_calls"):
            text = raw["content"]
        return {"role": "assistant", "content": text}
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        ids = _given_ids(raw)
        message["tool_calls"] = [
            {
                "id": ids[k] if k < len(ids) and ids[k] else f"call_{turn}_{k}",
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)},
            }
            for k, call in enumerate(parsed.calls)
        ]
    return message


def _given_ids(raw: str | dict) -> list[str | None]:
    if isinstance(raw, dict) and isinstance(raw.get("tool_calls"), list):
        return [c.get("id") if isinstance(c, dict) and isinstance(c.get("id"), str) else None for c in raw["tool_calls"]]
    return []


def parse_turn(completion: str | dict, turn: int) -> tuple[ParsedCompletion, dict[str, Any]]:
    parsed = parse_completion(completion)
    return parsed, assistant_message(parsed, completion, turn)
