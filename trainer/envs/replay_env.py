"""The replay environment: a production trajectory played again, its tools answered from the recording.

Row shape (`env.type: "replay"`):

    {"id": "...", "messages": [...up to the step to retrain...], "tools": [...], "verifier": {...},
     "env": {"type": "replay", "max_turns"?: 4,
             "recorded": [{"name": "search_orders", "arguments": {"customer": "C-17"},
                           "observation": {"orders": [...]}}, ...]}}

A call the policy makes gets the observation of a recorded call it matches: the same tool name, and
arguments that match the recorded ones under the verifier's matching rules (its `string_match` and
`allow_extra_arguments`; recorded arguments may use matchers such as `{"any": true}` or `{"regex": ...}`;
a recording without `arguments` expects none, as an expected call does). Recordings are used in order: a
call takes the first matching one no earlier call took; once every match was taken, the last one taken is
answered again (a repeated read). Any other call gets `{"error": "no recorded result for this call"}`.
An `observation` string is the tool message's content verbatim; any other JSON value is serialised.

A reviewer's corrected call was never made in production, so it has no recording of its own: the row states
the observation it should get (an entry like any other), which lets the episode go on past that step.
The episode ends at a final answer (a turn without calls), at unparseable output, or at
`trainer.envs.max_turns`; the verifier then scores every call made, in order, with the final answer's text.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from trainer.envs.base import ToolEpisode, max_turns
from trainer.verifiers import Score, SpecError
from trainer.verifiers.matchers import Compiler
from trainer.verifiers.rewards import score_task
from trainer.verifiers.tool_call import ExpectedCall, call_mismatches, compile_expected_call, matching_rules

NO_RECORDING = "no recorded result for this call"


@dataclass(frozen=True)
class Recording:
    call: ExpectedCall
    observation: str  # the tool message's content


def compile_recorded(task: dict[str, Any]) -> tuple[list[Recording], bool]:
    """The row's recordings and whether calls may carry arguments the recording does not name.

    Raises SpecError naming the task and the entry (`env.recorded[2].observation: missing`)."""
    where = f"task {task.get('id')!r}: env.recorded"
    recorded = (task.get("env") or {}).get("recorded")
    if not isinstance(recorded, list):
        raise SpecError([f"{where}: a replay task needs a list of {{\"name\", \"arguments\", \"observation\"}}"])
    rules = task["reward"] if "reward" in task else task.get("verifier")
    normalized, allow_extra = matching_rules(rules)
    compiler = Compiler(normalized=normalized, allow_extra=allow_extra)
    problems: list[str] = []
    out = []
    for i, entry in enumerate(recorded):
        at = f"{where}[{i}]"
        call = compile_expected_call(entry, compiler, at, problems, extra_keys=frozenset({"observation"}))
        if call is None:
            continue
        if "observation" not in entry:
            problems.append(f"{at}.observation: missing (the tool's answer to this call)")
            continue
        obs = entry["observation"]
        text = obs if isinstance(obs, str) else json.dumps(obs, ensure_ascii=False, separators=(",", ":"))
        out.append(Recording(call, text))
    problems.extend(f"{where}: {p}" for p in compiler.problems)
    if problems:
        raise SpecError(problems)
    return out, allow_extra


class ReplayEnv(ToolEpisode):
    """One episode of a replay task; the task's `tools` are what the policy is shown."""

    def __init__(self, task: dict[str, Any]):
        self.task = task
        self.tools: list[dict] = task.get("tools") or []
        self.recordings, self._allow_extra = compile_recorded(task)
        self.max_turns: int = max_turns(task)
        self.reset()

    def reset(self) -> list[dict]:
        self._begin()
        self.unanswered: list[dict[str, Any]] = []  # calls that got the error observation
        self._taken: dict[int, int] = {}  # recording index -> when it was taken (a call counter)
        return copy.deepcopy(self.task.get("messages") or [])

    def answer(self, call: dict[str, Any]) -> str:
        """The recorded answer to `call`, or the error observation."""
        matches = [i for i, r in enumerate(self.recordings)
                   if not call_mismatches(r.call, call, self._allow_extra)]
        fresh = next((i for i in matches if i not in self._taken), None)
        if fresh is not None:
            self._taken[fresh] = len(self.calls)
            return self.recordings[fresh].observation
        if matches:  # every matching recording was taken: the same read gets the same answer again
            return self.recordings[max(matches, key=self._taken.__getitem__)].observation
        self.unanswered.append({"turn": self.turn, "name": call["name"]})
        return json.dumps({"error": NO_RECORDING})

    def score(self) -> Score:
        result = score_task(self.task, self.transcript_message(), tools=self.task.get("tools"))
        if self.format_error is not None:
            return self.format_failure(result)
        checks = dict(result.checks)
        checks["episode"] = {"turns": self.turn, "finished": self.finished, "unanswered": self.unanswered}
        return Score(result.reward, result.passed, checks, result.failure, result.components)
