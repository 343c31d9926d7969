"""Promotion: a trajectory, at one assistant message, becomes a regression eval case or an environment task.

One function per action, called by the page, the API and the tests alike:
- `promotion_prefill` proposes the form: context = the messages before the chosen turn, tools = those
  declared, expected = what the agent did there (for the reviewer to correct);
- `promotion_check` builds the row from the reviewer's fields and runs the verifier, through the trainer's
  own environment code, on the agent's original output (which should fail) and on the stated reference
  (which must pass). Bad fields come back as field-level errors, never as an exception;
- `trajectory_promote` saves one row after those checks and the leakage guard, and makes a new version;
- `selection_promote` and `failure_mode_promote` make one draft per trajectory from one stated expectation,
  save those that pass both checks and list the others with the reason.

Fields (strings from the form, JSON values from the API):
  message_index     the assistant message to promote at
  expect            calls | answer | state
  expected_calls    [{"name", "arguments": {arg: value or matcher}}] (matchers: one_of, regex, range, any,
                    optional, equals; see trainer.verifiers.matchers)
  reference_calls   the correct calls, concrete values; blank = the agent's calls corrected by expected_calls
  answer_match      exact | regex | json_schema, with expected_answer (a value, an RE2 pattern, a schema)
  reference_answer  the correct final answer; blank with exact = the expected value
  expected_state    the final state a workplace episode must reach (`state` verifier)
  env_type          single_turn | replay | workplace; max_turns; initial_state (workplace);
  observations      replay: {tool name: observation} a corrected call gets. Prefilled from a successful
                    recorded result of the same tool; where the trajectory has none, the reviewer states it
  observation_error_expected
                    replay: a stated observation may be an error (the right call does fail); without it an
                    error observation is refused, since training would teach the right call then an error
  leakage_reason    where the leakage guard is unsure that the request differs from one on the other side,
                    the reviewer's reason that it does; kept with the row (`leakage_confirmation`). Without
                    it such a row is not saved; a bulk promotion skips it

"An error" is decided in one place, `is_error_observation`, with the ingest's definition of a tool error.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from flywheel.accounts.services import project_lock
from flywheel.evals import leakage
from flywheel.evals import rows as row_shape
from flywheel.evals.models import EnvType
from flywheel.evals.services import version_create
from flywheel.trajectories.ingest import is_tool_error
from flywheel.trajectories.models import Trajectory
from trainer.envs.http_env import EnvServerError
from trainer.verifiers import Score, parse_completion, validate_spec
from trainer.verifiers.base import short
from trainer.verifiers.matchers import Compiler, is_matcher, is_optional

EXPECT_KINDS = ("calls", "answer", "state")
ANSWER_MATCHES = ("exact", "regex", "json_schema")
ENV_TYPES = tuple(EnvType.values)
MAX_TURNS_LIMIT = 50
_MISSING = object()

ORIGINAL_PASSES = ("The verifier passes the agent's original output, so it would not catch this failure. "
                   "Correct the expected result, or save anyway if the original was in fact right.")


@dataclass
class PromotionCheck:
    """What `promotion_check` found: the row it would save, both verifier results, and what is wrong."""

    trajectory: Trajectory
    values: dict[str, Any]  # the fields as understood (for the form to show again)
    row: dict[str, Any] | None = None
    original: dict[str, Any] | None = None  # the agent's output at message_index
    reference: dict[str, Any] | None = None  # the stated correct output
    original_score: Score | None = None
    reference_score: Score | None = None
    errors: dict[str, list[str]] = field(default_factory=dict)
    conflicts: list[leakage.Conflict] = field(default_factory=list)
    # Pairs the leakage guard is unsure of: saved only with the reviewer's reason (`leakage_reason`).
    doubts: list[leakage.Conflict] = field(default_factory=list)

    def error(self, name: str, message: str) -> None:
        self.errors.setdefault(name, []).append(message)

    @property
    def original_passes(self) -> bool:
        return self.original_score is not None and self.original_score.passed

    @property
    def reference_passes(self) -> bool:
        return self.reference_score is not None and self.reference_score.passed

    @property
    def warnings(self) -> list[str]:
        return [ORIGINAL_PASSES] if self.original_passes else []

    @property
    def confirmed(self) -> bool:
        """The reviewer stated why the requests the guard is unsure of are different ones."""
        return not self.doubts or bool(self.values.get("leakage_reason"))

    def savable(self, *, accept_passing_original: bool = False) -> bool:
        return (not self.errors and not self.conflicts and self.confirmed and self.reference_passes
                and (accept_passing_original or not self.original_passes))

    def reasons(self) -> list[str]:
        """Why it cannot be saved, one line each (what a bulk promotion lists)."""
        out = [f"{name}: {message}" for name, messages in self.errors.items() for message in messages]
        out += [str(c) for c in self.conflicts]
        if not self.confirmed:
            out += [f"{c} (the guard is unsure: a reviewer must say why these are different requests, in "
                    f"leakage_reason, promoting this trajectory on its own)" for c in self.doubts]
        if not self.errors and self.reference_score is not None and not self.reference_score.passed:
            out.append(f"the reference fails the verifier ({self.reference_score.failure})")
        out += self.warnings
        return out


class PromotionRefused(Exception):
    def __init__(self, check: PromotionCheck):
        self.check = check
        super().__init__("; ".join(check.reasons()) or "not savable")


@dataclass
class BulkResult:
    saved: list[Any] = field(default_factory=list)
    skipped: list[tuple[Trajectory, list[str]]] = field(default_factory=list)
    version: Any = None


# --- reading a trajectory ---------------------------------------------------------------------------------


def _messages(trajectory: Trajectory) -> list[Any]:
    return trajectory.messages if isinstance(trajectory.messages, list) else []


def _is_assistant(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") == "assistant"


def default_message_index(trajectory: Trajectory, hint: int | None = None) -> int | None:
    """The assistant turn to promote at: the hint's (a signal's or an assignment's message, or the assistant
    turn before it), else the first flagged one, else the last assistant turn that made calls, else the last."""
    messages = _messages(trajectory)
    hints = [hint] if hint is not None else []
    hints += sorted(s.message_index for s in trajectory.signals.all() if s.message_index is not None)
    for h in hints:
        for i in range(min(h, len(messages) - 1), -1, -1):
            if _is_assistant(messages[i]):
                return i
    assistant = [i for i, m in enumerate(messages) if _is_assistant(m)]
    with_calls = [i for i in assistant if messages[i].get("tool_calls")]
    return (with_calls or assistant or [None])[-1]


@dataclass(frozen=True)
class RecordedCall:
    """A call the agent made and the tool message that answered it."""

    turn: int  # the index of the assistant message that made the call
    name: str
    arguments: dict[str, Any]
    message: dict[str, Any]  # the tool message

    @property
    def observation(self) -> Any:
        # A tool message without content still answered: its observation is the empty string.
        content = self.message.get("content")
        return "" if content is None else content

    @property
    def is_error(self) -> bool:
        return is_error_observation(self.observation, message=self.message)


def recorded_calls(messages: list[Any], start: int = 0) -> list[RecordedCall]:
    """Every answered call of the assistant turns from message `start` on, in order.

    A call is answered by the tool message with its id that follows its own assistant turn, before the next
    assistant turn: agents often number calls afresh each turn (`call_0` in every turn), so an id alone would
    give one turn's call another turn's result. Within a turn, a repeated id's answers are taken in order."""
    out: list[RecordedCall] = []
    for i in range(start, len(messages)):
        m = messages[i]
        if not _is_assistant(m) or not m.get("tool_calls"):
            continue
        answers: dict[str, list[dict[str, Any]]] = {}
        for later in messages[i + 1:]:
            if _is_assistant(later):
                break
            if isinstance(later, dict) and later.get("role") == "tool" and isinstance(later.get("tool_call_id"), str):
                answers.setdefault(later["tool_call_id"], []).append(later)
        # parse_completion keeps every call or none, so its calls line up with the wire ones.
        for wire, call in zip(m.get("tool_calls") or [], parse_completion(m).calls, strict=False):
            pending = answers.get(wire.get("id")) if isinstance(wire, dict) else None
            if pending:
                out.append(RecordedCall(i, call["name"], call["arguments"], pending.pop(0)))
    return out


def is_error_observation(observation: Any, *, message: Mapping[str, Any] | None = None) -> bool:
    """Whether a tool's result reports an error, by the ingest's definition (`is_tool_error`, which also sets a
    trajectory's "tool error" flag): the tool message marked as one (`is_error: true`, `status: "error"`, an
    `error` field), content that is a JSON object with a non-empty `error` (or `is_error: true`, or
    `status: "error"`), or text that starts like one ("Error: ...", "Traceback ...").

    `observation` is the content (a string, verbatim, as the replay environment sends it; other JSON values are
    read as their serialisation); `message`, for a recorded result, is the tool message that carried it."""
    if isinstance(observation, str | list):
        content = observation
    else:
        try:
            content = json.dumps(observation, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):
            return False
    return is_tool_error({**(message or {}), "role": "tool", "content": content})


def _successful_results(messages: list[Any]) -> dict[str, Any]:
    """Per tool name, the first recorded result of a call to it that is not an error: what a corrected call
    of that tool is first offered (a failing call's own error would answer the right call with it)."""
    out: dict[str, Any] = {}
    for recorded in recorded_calls(messages):
        if recorded.name not in out and not recorded.is_error:
            out[recorded.name] = recorded.observation
    return out


def promotion_prefill(*, trajectory: Trajectory, message_index: int | None = None) -> dict[str, Any]:
    """The form's starting values: expected = what the agent did at the chosen assistant turn."""
    messages = _messages(trajectory)
    index = message_index if message_index is not None else default_message_index(trajectory)
    values: dict[str, Any] = {
        "message_index": index, "expect": "calls", "expected_calls": [], "reference_calls": None,
        "answer_match": "exact", "expected_answer": "", "reference_answer": "", "expected_state": None,
        "env_type": EnvType.SINGLE_TURN, "observations": {}, "observation_error_expected": False,
        "initial_state": None, "max_turns": None,
    }
    if index is None or not (0 <= index < len(messages)) or not _is_assistant(messages[index]):
        return values
    parsed = parse_completion(messages[index])
    if parsed.calls:
        values["expected_calls"] = [{"name": c["name"], "arguments": c["arguments"]} for c in parsed.calls]
        # A tool with no successful result is left out: the check then asks the reviewer to state it.
        recorded = _successful_results(messages)
        values["observations"] = {c["name"]: recorded[c["name"]] for c in parsed.calls if c["name"] in recorded}
    else:
        values["expect"] = "answer"
        values["expected_answer"] = parsed.content
    return values


# --- the fields -------------------------------------------------------------------------------------------


def _json_value(check: PromotionCheck, data: Mapping[str, Any], name: str, default: Any) -> Any:
    """A JSON field: the API sends the value, the form its text (blank = default)."""
    value = data.get(name, default)
    if isinstance(value, str):
        if not value.strip():
            return default
        try:
            return json.loads(value)
        except (ValueError, RecursionError) as exc:
            check.error(name, f"not valid JSON: {exc}")
            return default
    return value


def _choice(check: PromotionCheck, data: Mapping[str, Any], name: str, choices: tuple[str, ...], default: str) -> str:
    value = data.get(name) or default
    if value not in choices:
        check.error(name, f"choose one of {', '.join(choices)} (got {short(value)})")
        return default
    return value


def _int(check: PromotionCheck, data: Mapping[str, Any], name: str, lo: int, hi: int | None) -> int | None:
    value = data.get(name)
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        number = int(value)
        if isinstance(value, bool) or (isinstance(value, float) and value != number):
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        check.error(name, f"must be a whole number, got {short(value)}")
        return None
    if number < lo or (hi is not None and number > hi):
        check.error(name, f"must be between {lo} and {hi}" if hi is not None else f"must be at least {lo}")
        return None
    return number


def _flag(check: PromotionCheck, data: Mapping[str, Any], name: str) -> bool:
    """A checkbox: the form sends "on" when ticked and nothing otherwise, the API a boolean."""
    value = data.get(name)
    if value is None or value is False or value == "":
        return False
    if value is True or (isinstance(value, str) and value.strip().lower() in ("on", "true", "1", "yes")):
        return True
    if isinstance(value, str) and value.strip().lower() in ("off", "false", "0", "no"):
        return False
    check.error(name, f"must be true or false, got {short(value)}")
    return False


def _read_fields(check: PromotionCheck, data: Mapping[str, Any]) -> dict[str, Any]:
    v = check.values
    v["message_index"] = _int(check, data, "message_index", 0, None)
    v["expect"] = _choice(check, data, "expect", EXPECT_KINDS, "calls")
    v["env_type"] = _choice(check, data, "env_type", ENV_TYPES, EnvType.SINGLE_TURN)
    v["max_turns"] = _int(check, data, "max_turns", 1, MAX_TURNS_LIMIT)
    v["answer_match"] = _choice(check, data, "answer_match", ANSWER_MATCHES, "exact")
    v["expected_calls"] = _json_value(check, data, "expected_calls", [])
    v["reference_calls"] = _json_value(check, data, "reference_calls", None)
    v["expected_state"] = _json_value(check, data, "expected_state", None)
    v["observations"] = _json_value(check, data, "observations", {})
    v["observation_error_expected"] = _flag(check, data, "observation_error_expected")
    v["initial_state"] = _json_value(check, data, "initial_state", None)
    answer = data.get("expected_answer", "")
    v["expected_answer"] = _json_value(check, data, "expected_answer", None) if v["answer_match"] == "json_schema" else answer
    reference = data.get("reference_answer")
    v["reference_answer"] = reference if isinstance(reference, str) else ("" if reference is None else json.dumps(reference))
    v["leakage_reason"] = _reason(check, data)
    return v


LEAKAGE_REASON_MIN = 10  # characters: a sentence, not "ok"
LEAKAGE_REASON_MAX = 1000


def _reason(check: PromotionCheck, data: Mapping[str, Any]) -> str:
    """The reviewer's reason that requests the guard is unsure of are different requests, spaces squeezed
    ("" when none). Checked once the guard has run (`_check_reason`): it matters only where it is unsure."""
    value = data.get("leakage_reason")
    if value is None:
        return ""
    if not isinstance(value, str):
        check.error("leakage_reason", f"must be text, got {short(value)}")
        return ""
    return " ".join(value.split())


def _check_reason(check: PromotionCheck) -> None:
    reason = check.values.get("leakage_reason", "")
    if not check.doubts or not reason:
        return
    if len(reason) < LEAKAGE_REASON_MIN:
        check.error("leakage_reason", f"say why the requests differ, in at least {LEAKAGE_REASON_MIN} characters")
    elif len(reason) > LEAKAGE_REASON_MAX:
        check.error("leakage_reason", f"at most {LEAKAGE_REASON_MAX} characters")


def _check_calls(check: PromotionCheck, name: str, calls: Any, *, concrete: bool) -> list[dict[str, Any]] | None:
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        check.error(name, 'must be a list of calls: [{"name": "tool", "arguments": {...}}]')
        return None
    for k, call in enumerate(calls):
        extra = set(call) - {"name", "arguments"}
        if extra:
            check.error(name, f"[{k}]: unknown key(s) {sorted(extra)} (a call has name and arguments)")
        if not isinstance(call.get("name"), str) or not call["name"]:
            check.error(name, f"[{k}].name: a tool name is needed")
        if not isinstance(call.get("arguments", {}), dict):
            check.error(name, f"[{k}].arguments: must be an object")
        elif concrete:
            for key, value in call.get("arguments", {}).items():
                if is_matcher(value):
                    check.error(name, f"[{k}].arguments.{key}: the reference states a value, not a matcher")
    return calls if name not in check.errors else None


def _concrete(matcher: Any, agent_value: Any, path: str) -> Any:
    """A value that `matcher` accepts: the agent's own when it already matches, else the matcher's single
    value (a literal, `equals`, the first of `one_of`, a bound of `range`); _MISSING when there is none."""
    compiler = Compiler(normalized=True, allow_extra=False)
    if not is_matcher(matcher):
        return matcher
    if agent_value is not _MISSING and compiler.compile(matcher, path)(agent_value) is None and not compiler.problems:
        return agent_value
    if "equals" in matcher:
        return matcher["equals"]
    if isinstance(matcher.get("one_of"), list) and matcher["one_of"]:
        return _concrete(matcher["one_of"][0], _MISSING, path)
    bounds = matcher.get("range")
    if isinstance(bounds, list) and len(bounds) == 2:
        return bounds[0] if bounds[0] is not None else bounds[1]
    return _MISSING


def derive_reference(expected: list[dict[str, Any]], agent_calls: list[dict[str, Any]]) -> tuple[list[dict], list[str]]:
    """The agent's calls corrected by the expected calls: each expected call takes the agent's call of the
    same tool (in order), keeps the agent's argument values its matchers accept and replaces the others."""
    unused = list(agent_calls)
    out, problems = [], []
    for k, exp in enumerate(expected):
        partner = next((c for c in unused if c["name"] == exp["name"]), None)
        if partner is not None:
            unused.remove(partner)
        agent_args = partner["arguments"] if partner and isinstance(partner.get("arguments"), dict) else {}
        args = {}
        for key, matcher in (exp.get("arguments") or {}).items():
            value = _concrete(matcher, agent_args.get(key, _MISSING), f"{key}")
            if value is _MISSING:
                if not is_optional(matcher):
                    problems.append(f"[{k}].arguments.{key}: no single value satisfies this matcher and the agent's "
                                    "does not; state the reference calls")
                continue
            args[key] = value
        out.append({"name": exp["name"], "arguments": args})
    return out, problems


def _assistant_calls(calls: list[dict[str, Any]]) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_ref_{k}", "type": "function",
         "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments") or {}, ensure_ascii=False)}}
        for k, c in enumerate(calls)
    ]}


def _literal(arguments: dict[str, Any]) -> dict[str, Any]:
    """Recorded arguments are read as matchers by the trainer: a value the agent sent that looks like one
    (an object of matcher keywords) is wrapped in `equals`, so it still means exactly that value."""
    return {k: {"equals": v} if is_matcher(v) else v for k, v in arguments.items()}


def replay_recordings(messages: list[Any], index: int) -> list[dict[str, Any]]:
    """A replay row's `env.recorded`: each call recorded from the assistant turn at `index` on, with the result
    it got in production."""
    return [{"name": r.name, "arguments": _literal(r.arguments), "observation": r.observation}
            for r in recorded_calls(messages, index)]


def _call_text(call: dict[str, Any]) -> str:
    arguments = row_shape.canonical_json(call.get("arguments") or {})
    return f"{call['name']}({arguments if len(arguments) <= 80 else arguments[:77] + '...'})"


def _replay_env(check: PromotionCheck, messages: list[Any], index: int, reference_calls: list[dict]) -> dict[str, Any]:
    """The recorded calls from the promoted turn on, each with its observation, plus each corrected call
    with the observation the reviewer stated for its tool (the trainer answers other calls with an error).

    A corrected call was never made, so its observation is the reviewer's word: it must be stated, and it
    must not be an error unless the reviewer says the right call does fail."""
    v = check.values
    observations, error_expected = v["observations"], v["observation_error_expected"]
    recorded = replay_recordings(messages, index)
    seen = {(r["name"], row_shape.canonical_json(r["arguments"])) for r in recorded}
    for call in reference_calls:
        key = (call["name"], row_shape.canonical_json(call.get("arguments") or {}))
        if key in seen:
            continue
        if call["name"] not in observations:
            check.error("observations", f"{call['name']}: state what the corrected call {_call_text(call)} gets "
                                        "back (the trajectory has no successful result of this tool to offer)")
            continue
        observation = observations[call["name"]]
        if not error_expected and is_error_observation(observation):
            check.error("observations", f"{call['name']}: {short(observation)} is an error, so the corrected call "
                                        f"{_call_text(call)} would be answered with it; state the result the "
                                        "call should get, or mark the error as expected")
            continue
        recorded.append({"name": call["name"], "arguments": call.get("arguments") or {}, "observation": observation})
        seen.add(key)
    env: dict[str, Any] = {"type": EnvType.REPLAY, "recorded": recorded}
    if v["max_turns"]:
        env["max_turns"] = v["max_turns"]
    return env


def _valid(check: PromotionCheck, spec: dict[str, Any]) -> bool:
    """The trainer's own spec validation; each problem (a bad matcher, a regex RE2 refuses) on the field."""
    problems = validate_spec(spec)
    for problem in problems:
        check.error(_spec_field(check.values["expect"]), problem)
    return not problems


def _verifier_and_reference(check: PromotionCheck, agent_calls: list[dict[str, Any]]) -> tuple[dict | None, dict | None, list]:
    """(verifier spec, reference output, reference calls) from the fields; errors go to their field."""
    v = check.values
    expect = v["expect"]
    if expect == "answer":
        match, expected = v["answer_match"], v["expected_answer"]
        if match == "exact":
            spec = {"type": "exact", "expected": expected}
        elif match == "regex":
            spec = {"type": "regex", "pattern": expected}
        else:
            spec = {"type": "json_schema", "schema": expected}
        if not _valid(check, spec):
            return spec, None, []
        reference = v["reference_answer"]
        if not reference:
            if match == "exact" and isinstance(expected, str):
                reference = expected
            else:
                check.error("reference_answer", "state the correct answer: a pattern or a schema has no single value")
        return spec, ({"role": "assistant", "content": reference} if reference else None), []
    if expect == "state":
        if not isinstance(v["expected_state"], dict) or not v["expected_state"]:
            check.error("expected_state", "state the expected final state: an object of key -> value")
            return None, None, []
        spec = {"type": "state", "expected": v["expected_state"]}
    else:
        expected_calls = _check_calls(check, "expected_calls", v["expected_calls"], concrete=False)
        if expected_calls is None:
            return None, None, []
        if not expected_calls:
            check.error("expected_calls", "state at least one expected call (or expect a final answer)")
            return None, None, []
        spec = {"type": "tool_call", "expected_calls": expected_calls}
    if not _valid(check, spec):
        return spec, None, []
    reference_calls = v["reference_calls"]
    if reference_calls is None:
        if expect == "state":
            reference_calls = agent_calls
        else:
            reference_calls, problems = derive_reference(spec["expected_calls"], agent_calls)
            for p in problems:
                check.error("reference_calls", p)
            if problems:
                return spec, None, []
    elif _check_calls(check, "reference_calls", reference_calls, concrete=True) is None:
        return spec, None, []
    return spec, _assistant_calls(reference_calls), reference_calls


def _env(check: PromotionCheck, messages: list[Any], index: int, reference_calls: list) -> dict | None:
    v = check.values
    kind = v["env_type"]
    if kind == EnvType.SINGLE_TURN:
        return None
    if kind == EnvType.REPLAY:
        if not isinstance(v["observations"], dict):
            check.error("observations", "must be an object: tool name -> the observation a corrected call gets")
            return None
        return _replay_env(check, messages, index, reference_calls)
    if not isinstance(v["initial_state"], dict):
        check.error("initial_state", "a workplace task needs the world's initial state (an object)")
        return None
    env = {"type": EnvType.WORKPLACE, "initial_state": v["initial_state"]}
    if v["max_turns"]:
        env["max_turns"] = v["max_turns"]
    return env


def score_episode(row: dict[str, Any], turns: list[dict[str, Any]]) -> Score:
    """The row's verifier on an episode of given assistant turns (the environment stops taking them when the
    episode ends), run through the trainer's environment for the row, exactly as an eval run or a GRPO step
    would score it. Raises SpecError or ValueError when the trainer refuses the row."""
    from trainer.envs import replay

    return replay(row, turns)[1]


def score_output(row: dict[str, Any], output: dict[str, Any]) -> Score:
    """The row's verifier on one assistant turn, through the row's environment (`score_episode`)."""
    return score_episode(row, [output])


def _spec_field(expect: str) -> str:
    return {"calls": "expected_calls", "answer": "expected_answer", "state": "expected_state"}[expect]


def promotion_check(*, trajectory: Trajectory, data: Mapping[str, Any], target: Any,
                    others: list[leakage.Candidate] | None = None) -> PromotionCheck:
    """Build the row the fields describe and run both verifier checks and the leakage guard (against
    `others`, the other side's rows, when a batch read them once)."""
    check = PromotionCheck(trajectory=trajectory, values={})
    _read_fields(check, data)
    messages = _messages(trajectory)
    index = check.values["message_index"]
    if index is None and "message_index" not in check.errors:
        check.error("message_index", "choose the assistant message to promote at")
    elif index is not None and (index >= len(messages) or not _is_assistant(messages[index])):
        check.error("message_index", f"message #{index} is not an assistant message of this trajectory")
    if "message_index" in check.errors:
        return check
    check.original = messages[index]
    agent = parse_completion(check.original)
    spec, reference, reference_calls = _verifier_and_reference(check, agent.calls)
    env = _env(check, messages, index, reference_calls)
    server_env = getattr(target, "server_env", None)  # a task set's; an eval suite has no server
    on_server = server_env(max_turns=check.values["max_turns"]) if server_env is not None else None
    if on_server is not None:
        # A task set bound to an environment server: the episode runs there, whatever env type was chosen.
        check.errors.pop("observations", None)
        check.errors.pop("initial_state", None)
        env = on_server
    if check.errors or spec is None:
        return check
    check.reference = reference
    row = row_shape.build_row(row_id="draft", messages=messages[:index], tools=trajectory.tools or [],
                              verifier=spec, env=env, trajectory_id=trajectory.pk, failure_mode_id=None)
    try:
        check.original_score = score_output(row, check.original)
        if reference is not None:
            check.reference_score = score_output(row, reference)
    except (ValueError, EnvServerError) as exc:  # the trainer refuses the row, or its server failed: say where
        check.error("env_type", str(exc))
        return check
    check.row = row
    # An item made from this trajectory at this message, or at a message it did not record (a whole-trajectory
    # item, as the demo's seeding makes), is the same failure: a second copy would weigh it twice in training.
    existing = (target.items.filter(trajectory=trajectory)
                .filter(Q(message_index=index) | Q(message_index__isnull=True)).order_by("pk").first())
    if existing is not None:
        at = f"message #{index} of this trajectory" if existing.message_index == index else "this trajectory"
        check.error("target", f"{at} is already {existing.row_id} of {target.LABEL} '{target.name}'")
    found = leakage.leakage_conflicts(
        project=trajectory.project, side=target.SIDE,
        candidates=[leakage.Candidate(f"trajectory #{trajectory.pk}", trajectory.pk,
                                      row_shape.prompt_digest(row["messages"]),
                                      row_shape.last_user_request(row["messages"]))],
        others=others,
    )
    check.conflicts = leakage.certain(found)
    check.doubts = [c for c in found if c.confirmable]
    _check_reason(check)
    return check


# --- saving -----------------------------------------------------------------------------------------------


def _failure_mode_of(trajectory: Trajectory) -> Any:
    assignment = getattr(trajectory, "failure_assignments", None)
    first = assignment.order_by("id").first() if assignment is not None else None
    return first.failure_mode if first is not None else None


def _confirmation(check: PromotionCheck, user: Any) -> dict[str, Any] | None:
    """What is kept of a reviewer's word on pairs the guard was unsure of: who, when, why, and the pairs."""
    if not check.doubts:
        return None
    return {"reason": check.values["leakage_reason"],
            "by": getattr(user, "username", None) if user is not None else None,
            "at": timezone.now().isoformat(),
            "pairs": [{"other": c.other, "detail": c.detail} for c in check.doubts]}


def _save(check: PromotionCheck, *, target: Any, user: Any, failure_mode: Any) -> Any:
    row = check.row
    assert row is not None
    return target.items.create(
        leakage_confirmation=_confirmation(check, user),
        trajectory=check.trajectory, message_index=check.values["message_index"],
        failure_mode=failure_mode if failure_mode is not None else _failure_mode_of(check.trajectory),
        messages=row["messages"], tools=row["tools"], verifier=row["verifier"], env=row.get("env"),
        reference=check.reference, prompt_digest=row_shape.prompt_digest(row["messages"]),
        prompt_text=row_shape.last_user_request(row["messages"])[:2000], created_by=user,
    )


def trajectory_promote(*, trajectory: Trajectory, data: Mapping[str, Any], target: Any, user: Any = None,
                       accept_passing_original: bool = False, failure_mode: Any = None) -> tuple[Any, PromotionCheck]:
    """Promote one trajectory into `target` (an EvalSuite or a TaskSet): (the new case or task, its check).

    Raises PromotionRefused (its `check` holds the field errors, conflicts and both scores) when a field is
    wrong, the reference fails, the row would leak, or the verifier passes the original output and
    `accept_passing_original` is not set."""
    if trajectory.project_id != target.project_id:
        raise ValueError("the trajectory and the target belong to different projects")
    with transaction.atomic():
        # The project's lock holds the guard's read of the other side true until this row is saved.
        project_lock(project=target.project)
        check = promotion_check(trajectory=trajectory, data=data, target=target)
        if not check.savable(accept_passing_original=accept_passing_original):
            raise PromotionRefused(check)
        item = _save(check, target=target, user=user, failure_mode=failure_mode)
        version_create(collection=target, user=user, note=f"added {item.row_id} from trajectory #{trajectory.pk}")
    return item, check


# A bulk promotion runs in the request (about 200 drafts/s on a busy PostgreSQL): past this many, promote in
# parts, so that no request outlives a proxy's time-out.
BULK_MAX = 2000


class BulkTooLarge(ValueError):
    pass


# Fields the reviewer states once for a whole selection; the rest is drafted per trajectory.
SHARED_FIELDS = ("expect", "expected_calls", "answer_match", "expected_answer", "reference_answer",
                 "expected_state", "env_type", "initial_state", "max_turns", "observations",
                 "observation_error_expected")


def _stated_observations(data: Mapping[str, Any]) -> Any:
    """The bulk form's observations as a mapping (tool name -> observation), read once for the batch; a value
    that is not one goes to each draft as it is, for its check to report on the field."""
    value = data.get("observations")
    if isinstance(value, str) and value.strip():
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return value
    return value


def selection_promote(*, items: Iterable[tuple[Trajectory, int | None]], data: Mapping[str, Any], target: Any,
                      user: Any = None, failure_mode: Any = None) -> BulkResult:
    """One draft per (trajectory, message index hint) under the one stated expectation: saves the drafts that
    pass both checks (and the leakage guard), lists the others with the reason, and makes one version.

    A replay row's `observations` (tool name -> observation) apply to every draft, tool by tool over each
    trajectory's own prefilled results."""
    items = list(items)
    stated = _stated_observations(data)
    if len(items) > BULK_MAX:
        raise BulkTooLarge(f"{len(items)} trajectories: at most {BULK_MAX} at a time; promote a selection in parts")
    result = BulkResult()
    with transaction.atomic():
        # Under the project's lock the other side does not change while this batch adds to one side: read it once.
        project_lock(project=target.project)
        others = leakage.other_side(project=target.project, side=target.SIDE)
        for trajectory, hint in items:
            if trajectory.project_id != target.project_id:
                result.skipped.append((trajectory, ["belongs to another project"]))
                continue
            draft = promotion_prefill(trajectory=trajectory, message_index=default_message_index(trajectory, hint))
            draft_observations = draft["observations"]
            draft.update({k: data[k] for k in SHARED_FIELDS if k in data})
            # Stated observations win, tool by tool, over those prefilled from each trajectory's own results.
            if isinstance(stated, dict):
                draft["observations"] = {**draft_observations, **stated}
            check = promotion_check(trajectory=trajectory, data=draft, target=target, others=others)
            if check.savable():
                result.saved.append(_save(check, target=target, user=user, failure_mode=failure_mode))
            else:
                result.skipped.append((trajectory, check.reasons()))
        if result.saved:
            ids = ", ".join(item.row_id for item in result.saved[:10])
            more = f" and {len(result.saved) - 10} more" if len(result.saved) > 10 else ""
            result.version = version_create(collection=target, user=user, note=f"added {ids}{more} (bulk)")
    return result


def failure_mode_promote(*, failure_mode: Any, data: Mapping[str, Any], target: Any, user: Any = None) -> BulkResult:
    """Every trajectory of a failure mode, at its assigned message, through `selection_promote`."""
    assignments = failure_mode.assignments.select_related("trajectory").order_by("id")
    return selection_promote(items=[(a.trajectory, a.message_index) for a in assignments], data=data,
                             target=target, user=user, failure_mode=failure_mode)
