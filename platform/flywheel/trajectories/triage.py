"""Triage: detectors that read a stored trajectory and record what looks wrong in it, as signals.

Tool calls are read and checked by `trainer.verifiers` (the one scoring path): each assistant message that
makes calls is scored by the tool_call verifier with no expected calls and the project's unsafe rules
(`triage_policy`), against the trajectory's declared tools. The rest is read here:

    invalid_arguments   a call's arguments are not JSON (or not an object)      format            high
    undeclared_tool     a call to a tool the trajectory does not declare         hallucinated_api  high
                        (only when it declares tools at all)
    schema_violation    arguments that break the tool's parameters schema        wrong_arguments   medium
    unsafe_action       a call matching a rule of the project's unsafe policy    unsafe_action     critical
                        (unless the rule is `unless_requested` and the user asked for that call)
    tool_error          a tool result that reports an error (`ingest.is_tool_error`)  other        low
    loop                the same call with the same arguments 3 times or more   bad_planning      medium
    no_final_answer     the episode stops before the agent answers: it ends on   bad_planning      medium
                        a tool result, a user turn, an empty assistant message, or
                        a call after earlier calls (see below)
    negative_feedback   `feedback` says so (see `feedback_negative`)             other             medium
    human_intervention  `human_intervention` is set (not null, false or empty)  other             high

The suggested category is the category of the signals present that comes first in CATEGORY_PRECEDENCE.

What counts as a final answer: an assistant message with text and no call; a call of a final-answer tool
(FINAL_ANSWER_TOOLS: smolagents' `final_answer`, OpenHands' `finish`), answered or not; and a record of one
action, where the agent's only call ends the record and no tool result precedes it (one completion
recorded, an agent whose application runs the call and confirms it itself, a single-turn eval's shape): the
call is the answer, and the other detectors judge it. A call after earlier calls is an episode cut off
mid-way. A user's short closing after the agent's answer ("Thanks!", "ok, bye") asks nothing more: the
answer before it stands (CLOSING_WORDS; a question mark or any other word makes it a request). An
assistant message whose text is a call (a Hermes `<tool_call>` block or a bare call object, as some serving
stacks leave it) is read as that call, never as a final answer.

Each detector's precision and recall against reviewers' labels are on the calibration page
(`evals.calibration.detector_calibrate`; `bench/triage_calibration.py` prints them for a database), and against
a set labeled by hand that the detectors never saw (`detector_reference`,
`tests/platform/trajectories/data/triage_reference.jsonl`; the README gives the figures).

Triage runs on a worker: ingestion calls `triage_request` (one message per project, after the commit), and
the task triages the project's untriaged trajectories (`triage_version = 0`) CHUNK at a time, each chunk
locked (`FOR UPDATE SKIP LOCKED`) so that two tasks share the work instead of doing it twice. A replay sets
`triage_version` back to 0. A maintainer's re-run (`triage_run_start`) triages every trajectory whose version
is below the policy's. Both are outboxes (flywheel.outbox): `triage_sweep` sends again what waits too long."""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from flywheel import outbox, runs, timelimits
from flywheel.accounts.models import Project
from flywheel.supervise import Refused
from flywheel.trajectories.ingest import content_text, is_tool_error
from flywheel.trajectories.models import (
    FailureCategory,
    Severity,
    SignalKind,
    Trajectory,
    TriagePolicy,
    TriageRun,
    TriageRunStatus,
    TriageSignal,
)
from flywheel.trajectories.triage_policy import excusable, policy_for, policy_spec, verifier_rules
from trainer.verifiers import compile_spec, parse_completion
from trainer.verifiers.jsonschemas import SchemaProblem
from trainer.verifiers.parsing import OPEN_TAG
from trainer.verifiers.schemas import ToolIndex, tool_index
from trainer.verifiers.tool_call import UnsafeRule, score_tool_call, unsafe_calls

logger = logging.getLogger(__name__)

CHUNK = 250  # trajectories per transaction; they stay locked meanwhile, so a replay waits one chunk at most
# The longest one statement of a chunk's transaction may run, on PostgreSQL (`_bound_statements`): a chunk's
# statements take milliseconds; one that waits this long is stuck, and its locks are released with it.
STATEMENT_TIMEOUT_MS = 30_000
LOOP_MIN_REPEATS = 3
EXCERPT = 200  # characters of agent text kept in a signal's detail
MAX_ITEMS = 5  # errors, names... kept in a signal's detail

SEVERITY: dict[str, int] = {
    SignalKind.INVALID_ARGUMENTS: Severity.HIGH,
    SignalKind.UNDECLARED_TOOL: Severity.HIGH,
    SignalKind.SCHEMA_VIOLATION: Severity.MEDIUM,
    SignalKind.UNSAFE_ACTION: Severity.CRITICAL,
    SignalKind.TOOL_ERROR: Severity.LOW,
    SignalKind.LOOP: Severity.MEDIUM,
    SignalKind.NO_FINAL_ANSWER: Severity.MEDIUM,
    SignalKind.NEGATIVE_FEEDBACK: Severity.MEDIUM,
    SignalKind.HUMAN_INTERVENTION: Severity.HIGH,
}
CATEGORY: dict[str, str] = {
    SignalKind.INVALID_ARGUMENTS: FailureCategory.FORMAT,
    SignalKind.UNDECLARED_TOOL: FailureCategory.HALLUCINATED_API,
    SignalKind.SCHEMA_VIOLATION: FailureCategory.WRONG_ARGUMENTS,
    SignalKind.UNSAFE_ACTION: FailureCategory.UNSAFE_ACTION,
    SignalKind.TOOL_ERROR: FailureCategory.OTHER,
    SignalKind.LOOP: FailureCategory.BAD_PLANNING,
    SignalKind.NO_FINAL_ANSWER: FailureCategory.BAD_PLANNING,
    SignalKind.NEGATIVE_FEEDBACK: FailureCategory.OTHER,
    SignalKind.HUMAN_INTERVENTION: FailureCategory.OTHER,
}
# Which category a trajectory with several kinds of signal suggests: the one a reviewer would look at first.
# An unsafe call matters more than anything else; a call to a tool that does not exist or that cannot be
# parsed explains what follows it (errors, loops); feedback and interventions say only that something went wrong.
CATEGORY_PRECEDENCE: tuple[str, ...] = (
    FailureCategory.UNSAFE_ACTION,
    FailureCategory.HALLUCINATED_API,
    FailureCategory.FORMAT,
    FailureCategory.WRONG_TOOL,
    FailureCategory.WRONG_ARGUMENTS,
    FailureCategory.BAD_PLANNING,
    FailureCategory.RETRIEVAL_ERROR,
    FailureCategory.OTHER,
)
_CATEGORY_RANK = {category: rank for rank, category in enumerate(CATEGORY_PRECEDENCE)}


@dataclass(frozen=True, slots=True)
class Signal:
    kind: str
    message_index: int | None
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def severity(self) -> int:
        return SEVERITY[self.kind]


def _excerpt(value: Any, limit: int = EXCERPT) -> str:
    """Agent text, bounded, as a signal's detail keeps it (PostgreSQL's jsonb refuses NUL)."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text.replace("\x00", "\ufffd")


# --- negative feedback -----------------------------------------------------------------------------------

NEGATIVE_WORDS = frozenset(
    {"down", "thumbs_down", "thumbs-down", "thumbsdown", "negative", "bad", "wrong", "unhelpful", "👎"}
)
VERDICT_KEYS = ("thumbs", "thumb", "vote", "sentiment", "label", "value", "rating", "score")
FLAG_KEYS = ("thumbs_up", "helpful", "correct", "positive", "liked", "resolved", "satisfied")
RATING_SCALE_KEYS = ("max", "out_of", "scale_max", "best")


def feedback_negative(feedback: Any) -> str | None:
    """Why `feedback` is negative, or None. Negative is:
    - `false`, a number below 0, or one of NEGATIVE_WORDS ("down", "thumbs_down", "negative", "bad", "👎"…);
    - an object whose `thumbs`/`thumb`/`vote`/`sentiment`/`label`/`value` is one of those, whose
      `thumbs_up`/`helpful`/`correct`/`positive`/`liked`/`resolved`/`satisfied` is false, whose `score` is a
      number at or below 0 (a binary score's 0) or false, or whose `rating` is at most 40% of its scale
      (`max`/`out_of`, 5 when not given: 1 and 2 of 5);
    - a list holding any of these."""
    if isinstance(feedback, list):
        for item in feedback[:50]:
            why = feedback_negative(item)
            if why:
                return why
        return None
    if feedback is False:
        return "false"
    if isinstance(feedback, int | float) and not isinstance(feedback, bool):
        return f"{feedback} is below 0" if feedback < 0 else None
    if isinstance(feedback, str):
        return f"{feedback.strip()!r}" if feedback.strip().lower() in NEGATIVE_WORDS else None
    if not isinstance(feedback, dict):
        return None
    for key in FLAG_KEYS:
        if feedback.get(key) is False:
            return f"{key}: false"
    for key in VERDICT_KEYS:
        if key not in feedback:
            continue
        value = feedback[key]
        if key == "rating":
            why = _rating_negative(value, feedback)
        elif key == "score":
            number = isinstance(value, int | float) and not isinstance(value, bool)
            why = f"score {value}" if value is False or (number and value <= 0) else None
        elif value is False or (isinstance(value, str) and value.strip().lower() in NEGATIVE_WORDS):
            why = f"{key}: {_excerpt(value, 40)}"
        elif isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
            why = f"{key}: {value}"
        else:
            why = None
        if why:
            return why
    return None


def _rating_negative(value: Any, feedback: dict[str, Any]) -> str | None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return None
    scale = next((feedback[k] for k in RATING_SCALE_KEYS if k in feedback), 5)
    if not isinstance(scale, int | float) or isinstance(scale, bool) or scale <= 0:
        scale = 5
    return f"rating {value} of {scale}" if value <= 0.4 * scale else None


def intervention_present(value: Any) -> bool:
    """A human intervention is recorded: anything but null, false, 0, "" or an empty object or list."""
    return value not in (None, False, 0, "", {}, [])


# --- the detectors ---------------------------------------------------------------------------------------


def _call_key(name: str, arguments: Any) -> tuple[str, str]:
    if isinstance(arguments, str):
        return name, arguments
    return name, json.dumps(arguments, sort_keys=True, default=str)


def _raw_calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    """(name, raw arguments) of each call as sent, for the loop detector when the verifier could not parse."""
    out = []
    raw = message.get("tool_calls")
    if not isinstance(raw, list):
        raw = [{"function": message["function_call"]}] if isinstance(message.get("function_call"), dict) else []
    for call in raw:
        function = call.get("function") if isinstance(call, dict) and isinstance(call.get("function"), dict) else {}
        out.append((str(function.get("name") or ""), function.get("arguments")))
    return out


# --- what the user asked for ----------------------------------------------------------------------------

# Tools whose call is the agent's final answer (smolagents' `final_answer`, OpenHands' `finish`).
FINAL_ANSWER_TOOLS = frozenset({"final_answer", "finish"})
# Words a request may use for the action a tool's name says; a verb outside these must be said as it is.
VERB_GROUPS: tuple[tuple[str, ...], ...] = (
    ("delete", "remove", "erase", "destroy", "trash", "purge", "wipe"),
    ("cancel", "call off", "abort"),
    ("drop",),
)
_NEGATIONS = frozenset({"not", "never", "no", "dont", "don't", "doesn't", "without", "stop", "nor"})
MAX_REQUEST_CHARS = 5000  # of the request read for a verb and the call's values
# A user's last message made only of these words (at most CLOSING_MAX_WORDS, no question mark) closes the
# conversation; one of CLOSING_ANCHORS must be in it ("so much" alone closes nothing).
CLOSING_WORDS = frozenset({
    "thanks", "thank", "you", "thx", "ty", "ok", "okay", "k", "great", "perfect", "cool", "bye", "goodbye",
    "cheers", "awesome", "got", "it", "that's", "thats", "all", "nice", "appreciated", "appreciate", "much", "so",
    "very", "a", "lot", "alright", "good", "fine", "wonderful", "excellent", "sounds", "lovely", "super", "again",
    "have", "day", "bye-bye", "ciao", "merci", "danke", "gracias",
})
CLOSING_ANCHORS = frozenset({"thanks", "thank", "thx", "ty", "ok", "okay", "bye", "goodbye", "cheers", "perfect",
                             "great", "appreciated", "merci", "danke", "gracias", "ciao"})
CLOSING_MAX_WORDS = 8
_NAME_WORDS = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+")
_WORD = re.compile(r"[\w']+")


def _verb_pattern(verb: str) -> str:
    """A verb and its forms ("delete": deletes, deleted, deleting, deletion), the particle of a phrasal one."""
    first, *rest = verb.split()
    stem = first[:-1] if first.endswith("e") else first
    return r"\b" + re.escape(stem) + r"\w*" + "".join(r"\s+" + re.escape(word) + r"\b" for word in rest)


def _verbs_of(tool: str) -> list[str]:
    """The verbs a request may use for what `tool` does: the groups of VERB_GROUPS its name's words are in,
    else its name's first word."""
    words = [w.lower() for w in _NAME_WORDS.findall(tool)]
    verbs = [verb for group in VERB_GROUPS if any(w in group for w in words) for verb in group]
    return verbs or words[:1]


def _values(arguments: Any, out: list[str], depth: int = 0) -> None:
    """The scalar values of a call's arguments as a request would write them (strings, numbers)."""
    if depth > 8 or len(out) > 20:
        out.append("\x00")  # too deep or too many to have been named: never excused
        return
    if isinstance(arguments, dict):
        for value in arguments.values():
            _values(value, out, depth + 1)
    elif isinstance(arguments, list):
        for value in arguments:
            _values(value, out, depth + 1)
    elif isinstance(arguments, str):
        if arguments.strip():
            out.append(arguments.strip())
    elif isinstance(arguments, int | float) and not isinstance(arguments, bool):
        out.append(str(int(arguments)) if float(arguments).is_integer() else str(arguments))


def requested(call: dict[str, Any], request: str) -> bool:
    """Whether the user's `request` asks for exactly this call: it says the tool's verb (or one of its
    group: "remove" for `delete_task`), never negated anywhere ("don't delete"), and names every value of
    the call's arguments (the task's id "T3", not "T31"). A call with no value names no record: not asked.

    Conservative by design: a request that names the record only through a lookup ("delete the Lunch
    email") does not excuse the delete, and a request that both asks and forbids does not either."""
    request = request[:MAX_REQUEST_CHARS].replace("\u2019", "'")
    values: list[str] = []
    _values(call.get("arguments"), values)
    if not values or not request:
        return False
    asked = False
    for verb in _verbs_of(str(call.get("name") or "")):
        for match in re.finditer(_verb_pattern(verb), request, re.IGNORECASE):
            before = [w.lower() for w in _WORD.findall(request[max(0, match.start() - 40):match.start()])][-3:]
            if any(w in _NEGATIONS or w.endswith("n't") for w in before):
                return False
            asked = True
    if not asked:
        return False
    return all(
        re.search(r"(?<![0-9A-Za-z])" + re.escape(value) + r"(?![0-9A-Za-z])", request, re.IGNORECASE)
        for value in values
    )


@dataclass(frozen=True, slots=True)
class _Unsafe:
    verifier: dict[str, Any]  # the tool_call spec the verifier scores with (triage's own key stripped)
    strict: tuple[UnsafeRule, ...]  # the rules no request excuses
    excusable: bool  # some rule is `unless_requested`


_unsafe_cache: dict[int, tuple[dict[str, Any], _Unsafe]] = {}


def _unsafe_of(spec: dict[str, Any]) -> _Unsafe:
    """`spec` split for the verifier and for requests; cached by identity like the verifier's own cache (the
    entry keeps `spec` alive, so its id is not reused while cached)."""
    hit = _unsafe_cache.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    rules = spec.get("unsafe")
    if not isinstance(rules, list):
        split = _Unsafe(spec, compile_spec(spec).data.unsafe, False)
    else:
        strict = [rule for rule in rules if not excusable(rule)]
        strict_spec = {"type": "tool_call", "expected_calls": [], "unsafe": verifier_rules(strict)}
        split = _Unsafe({**spec, "unsafe": verifier_rules(rules)}, compile_spec(strict_spec).data.unsafe,
                        len(strict) < len(rules))
    if len(_unsafe_cache) >= 1000:
        _unsafe_cache.clear()
    _unsafe_cache[id(spec)] = (spec, split)
    return split


def _text_call(message: dict[str, Any]) -> bool:
    """Whether an assistant message without structured calls holds a call in its text: a Hermes block, or
    text that is a call object or list and nothing else. Prose that quotes JSON is left as an answer."""
    text = content_text(message.get("content")).strip()
    return OPEN_TAG in text or text[:1] in ("{", "[")


def detect(
    *,
    messages: Any,
    tools: Any,
    unsafe_spec: dict[str, Any],
    feedback: Any = None,
    human_intervention: Any = None,
) -> list[Signal]:
    """Every signal of one trajectory, in message order (trajectory-wide ones last).

    `unsafe_spec` is `triage_policy.policy_spec(...)`: a tool_call verifier spec with the project's unsafe
    rules (which may carry triage's `unless_requested`). The same spec object should be passed for every
    trajectory: it is split and compiled once, cached by identity."""
    signals: list[Signal] = []
    messages = messages if isinstance(messages, list) else []
    declared = tools if isinstance(tools, list) and tools else None
    index_of_tools = tool_index(declared)
    unsafe_rules = _unsafe_of(unsafe_spec)
    compiled = compile_spec(unsafe_rules.verifier).data
    call_names: dict[str, str] = {}  # tool_call_id -> tool name, to name the tool of an error result
    seen: dict[tuple[str, str], list[int]] = {}  # (name, arguments) -> message indexes of that call
    request = ""  # the latest user message: what the user asked for
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        if role == "user":
            request = content_text(message.get("content"))
        elif role == "assistant" and (
            message.get("tool_calls") or message.get("function_call") or _text_call(message)
        ):
            parsed = parse_completion(message)
            if not parsed.calls and parsed.error is None:
                continue  # text that only looked like a call: an answer
            for call in message.get("tool_calls") or ():
                if isinstance(call, dict) and call.get("id") and isinstance(call.get("function"), dict):
                    call_names[str(call["id"])] = str(call["function"].get("name") or "")
            if parsed.error is not None:
                signals.append(Signal(SignalKind.INVALID_ARGUMENTS, index, {"error": _excerpt(parsed.error)}))
                for name, arguments in _raw_calls(message):
                    seen.setdefault(_call_key(name, arguments), []).append(index)
                continue
            for call in parsed.calls:
                seen.setdefault(_call_key(call["name"], call["arguments"]), []).append(index)
            checks = score_tool_call(compiled, parsed, index_of_tools).checks
            unknown = checks.get("declared", {}).get("unknown")
            if unknown:
                signals.append(
                    Signal(SignalKind.UNDECLARED_TOOL, index, {"tools": [_excerpt(n, 80) for n in unknown[:MAX_ITEMS]]})
                )
            errors = checks.get("schema", {}).get("errors")
            if errors:
                signals.append(
                    Signal(SignalKind.SCHEMA_VIOLATION, index, {"errors": [_excerpt(e) for e in errors[:MAX_ITEMS]]})
                )
            unsafe = checks.get("unsafe", {})
            if unsafe.get("ok") is False:
                flagged = [c for c in unsafe["calls"]
                           if not _excused(parsed.calls[c["index"]], unsafe_rules, request, index_of_tools)]
                calls = [{"tool": _excerpt(c["name"], 80), "rule": c["rule"]} for c in flagged[:MAX_ITEMS]]
                if calls:
                    signals.append(Signal(SignalKind.UNSAFE_ACTION, index, {"calls": calls}))
        elif role == "tool" and is_tool_error(message):
            name = call_names.get(str(message.get("tool_call_id") or "")) or str(message.get("name") or "")
            detail = {"tool": _excerpt(name, 80), "excerpt": _excerpt(content_text(message.get("content")).strip())}
            signals.append(Signal(SignalKind.TOOL_ERROR, index, detail))
    for (name, arguments), indexes in seen.items():
        if len(indexes) >= LOOP_MIN_REPEATS:
            detail = {
                "tool": _excerpt(name, 80),
                "arguments": _excerpt(arguments, 120),
                "count": len(indexes),
                "messages": indexes[:20],
            }
            signals.append(Signal(SignalKind.LOOP, indexes[LOOP_MIN_REPEATS - 1], detail))
    ending = _no_final_answer(messages)
    if ending is not None:
        signals.append(Signal(SignalKind.NO_FINAL_ANSWER, len(messages) - 1, {"reason": ending}))
    why = feedback_negative(feedback)
    if why:
        signals.append(Signal(SignalKind.NEGATIVE_FEEDBACK, None, {"why": why, "feedback": _excerpt(feedback)}))
    if intervention_present(human_intervention):
        at = human_intervention.get("message_index") if isinstance(human_intervention, dict) else None
        in_range = isinstance(at, int) and not isinstance(at, bool) and 0 <= at < len(messages)
        signals.append(
            Signal(SignalKind.HUMAN_INTERVENTION, at if in_range else None, {"intervention": _excerpt(human_intervention)})
        )
    return signals


def _excused(call: dict[str, Any], rules: _Unsafe, request: str, tools: ToolIndex | None) -> bool:
    """A call flagged unsafe that the user asked for, under a rule that allows it (and no rule that does not).
    A call of a tool the trajectory does not declare, or that breaks its tool's schema, is not the call the
    user asked for (`delete_email` with a `task_id`, when the user named a task)."""
    if not rules.excusable or unsafe_calls(rules.strict, [call]):
        return False
    if tools is not None:
        info = tools.get(call["name"])
        if info is None:
            return False
        try:
            if not info.schema_problem and info.errors(call["arguments"], call["name"]):
                return False
        except SchemaProblem:
            pass  # a schema that cannot judge the arguments is skipped, as one with a schema_problem is
    return requested(call, request)


def closing(text: str) -> bool:
    """Whether a user's message only closes the conversation ("Thanks!", "ok great, bye 👍")."""
    if "?" in text or len(text) > 200:
        return False
    words = re.findall(r"[a-z'\-]+", text.lower().replace("\u2019", "'"))
    return (0 < len(words) <= CLOSING_MAX_WORDS and all(w in CLOSING_WORDS for w in words)
            and any(w in CLOSING_ANCHORS for w in words))


def _answers(message: Any) -> bool:
    """An assistant message that is a final answer: text, and no call."""
    return (isinstance(message, dict) and message.get("role") == "assistant" and _call_names(message) is None
            and bool(content_text(message.get("content")).strip()))


def _call_names(message: dict[str, Any]) -> list[str] | None:
    """The names of the calls an assistant message makes, or None when it makes none."""
    if message.get("tool_calls") or message.get("function_call") or _text_call(message):
        parsed = parse_completion(message)
        if parsed.calls:
            return [call["name"] for call in parsed.calls]
        if parsed.error is not None:
            return [name for name, _ in _raw_calls(message)]
    return None


def _no_final_answer(messages: list[Any]) -> str | None:
    """Why the episode stops before the agent answers, or None when it has a final answer (see the module's
    docstring for what counts as one)."""
    if not messages:
        return "there are no messages"
    last = messages[-1]
    if not isinstance(last, dict):
        return "the last message is not a message object"
    role = last.get("role")
    if role == "assistant":
        names = _call_names(last)
        if names is None:
            return None if content_text(last.get("content")).strip() else "the last assistant message is empty"
        if FINAL_ANSWER_TOOLS.intersection(names):
            return None
        earlier = messages[:-1]
        if not any(isinstance(m, dict) and (m.get("role") == "tool" or m.get("role") == "assistant"
                                            and _call_names(m) is not None) for m in earlier):
            return None  # one action recorded: the call is the answer
        return "it ends on a tool call, after earlier calls"
    if role == "tool":
        answering = next((m for m in reversed(messages) if isinstance(m, dict) and m.get("role") == "assistant"), None)
        if answering is not None and FINAL_ANSWER_TOOLS.intersection(_call_names(answering) or ()):
            return None
        return "it ends on a tool result"
    if role == "user" and len(messages) > 1 and _answers(messages[-2]) and closing(content_text(last.get("content"))):
        return None
    return f"it ends on a {_excerpt(role, 20)} message"


def suggest_category(signals: Iterable[Signal]) -> str:
    """The category of the signals that comes first in CATEGORY_PRECEDENCE; "" without signals."""
    categories = {CATEGORY[s.kind] for s in signals}
    return min(categories, key=_CATEGORY_RANK.__getitem__) if categories else ""


# --- queueing --------------------------------------------------------------------------------------------


def triage_enabled() -> bool:
    """Whether ingestion has trajectories triaged automatically (FLYWHEEL_TRIAGE)."""
    return bool(settings.FLYWHEEL_TRIAGE)


def triage_request(*, project_id: int) -> None:
    """Have the project's untriaged trajectories triaged once the current transaction commits: what ingestion
    calls after writing. One message per project per transaction (an OTLP export appends to many traces);
    a broker that is down is logged, and the sweep sends it later. Off when FLYWHEEL_TRIAGE is false."""
    if not triage_enabled():
        return
    connection = transaction.get_connection()
    if connection.in_atomic_block and any(
        getattr(callback, "triage_project_id", None) == project_id for _, callback, *_ in connection.run_on_commit
    ):
        return
    from flywheel.trajectories.tasks import triage_project_task  # tasks import this module

    # outbox.send_on_commit, with a mark on the callback that the check above finds.
    def after_commit() -> None:
        try:
            outbox.send(triage_project_task, project_id)
        except outbox.BrokerUnavailable as exc:
            logger.warning("could not queue the triage of project %s (%s); the sweep sends it again", project_id, exc)

    after_commit.triage_project_id = project_id  # type: ignore[attr-defined]
    transaction.on_commit(after_commit)


def triage_sweep() -> int:
    """Send again what waits too long (flywheel.outbox): a project whose untriaged trajectories have waited
    past FLYWHEEL_REQUEUE_AFTER_S, and a re-run still queued past it or whose worker stopped writing.
    Returns how many messages were sent."""
    from flywheel.trajectories.tasks import triage_project_task, triage_run_task

    now = timezone.now()
    cutoff = now - outbox.requeue_after()
    sent = 0
    try:
        if triage_enabled():
            # Projects are few; each probe is one step on the (project_id, triage_version) index.
            for project_id in Project.objects.order_by("pk").values_list("pk", flat=True):
                waiting = Trajectory.objects.filter(project_id=project_id, triage_version=0, updated_at__lt=cutoff)
                if waiting.exists():
                    outbox.send(triage_project_task, project_id)
                    sent += 1
    except outbox.BrokerUnavailable as exc:
        logger.warning("triage sweep: the broker is unavailable (%s); trying again next sweep", exc)
    return sent + runs.run_sweep(TriageRun, task=triage_run_task)


# --- the work --------------------------------------------------------------------------------------------


def triage_chunk(*, project_id: int, stale: bool = False, size: int | None = None) -> int:
    """Triage up to `size` (default CHUNK) of the project's untriaged trajectories (`stale`: also those triaged
    under an older policy version) in one transaction; how many. Rows another transaction holds are skipped, not
    waited for: two tasks on one project share the work, and a replay waits at most one chunk for its row.

    A trajectory that holds the task until its time limit is marked triaged without signals (as one that breaks
    a detector), with the chunk's trajectories before it; the rest stay for the next attempt, and the task's
    SoftTimeLimitExceeded is raised again once that is committed."""
    stopped: SoftTimeLimitExceeded | None = None
    with transaction.atomic():
        _bound_statements()
        policy = policy_for(project_id=project_id)
        spec = policy_spec(policy)
        pending = Trajectory.objects.filter(project_id=project_id)
        pending = pending.filter(triage_version__lt=policy.version) if stale else pending.filter(triage_version=0)
        ids = list(pending.select_for_update(skip_locked=True).values_list("id", flat=True)[:size or CHUNK])
        if not ids:
            return 0
        rows = Trajectory.objects.filter(id__in=ids).order_by("id").values_list(
            "id", "messages", "tools", "feedback", "human_intervention"
        )
        done: list[int] = []
        signals: list[TriageSignal] = []
        groups: dict[tuple[str, int], list[int]] = {}  # (category, severity) -> ids: a few UPDATEs per chunk
        for trajectory_id, messages, tools, feedback, human_intervention in rows:
            try:
                found = detect(
                    messages=messages,
                    tools=tools,
                    unsafe_spec=spec,
                    feedback=feedback,
                    human_intervention=human_intervention,
                )
            except SoftTimeLimitExceeded as exc:
                # A chunk takes seconds and the task stops taking chunks long before its limit: this trajectory
                # is what held it. Marked, so that the next attempt does not meet it again.
                logger.error("triage of trajectory %s ran into the task's time limit; marked triaged without "
                             "signals", trajectory_id)
                found, stopped = [], exc
            except Exception:
                # Agent data is untrusted: one trajectory that breaks a detector must not stop its chunk forever
                # (the sweep would send it again and again). It is marked triaged, without signals, and logged.
                logger.exception("triage of trajectory %s failed; marked triaged without signals", trajectory_id)
                found = []
            done.append(trajectory_id)
            signals.extend(
                TriageSignal(
                    project_id=project_id,
                    trajectory_id=trajectory_id,
                    kind=s.kind,
                    message_index=s.message_index,
                    severity=s.severity,
                    detail=s.detail,
                )
                for s in found
            )
            key = (suggest_category(found), max((s.severity for s in found), default=0))
            groups.setdefault(key, []).append(trajectory_id)
            if stopped is not None:
                break
        TriageSignal.objects.filter(trajectory_id__in=done).delete()
        TriageSignal.objects.bulk_create(signals, batch_size=1000)
        now = timezone.now()
        for (category, severity), group in groups.items():
            # .update() leaves updated_at alone: it is when the agent's data last changed (the sweep reads it).
            Trajectory.objects.filter(id__in=group).update(
                triage_version=policy.version, triaged_at=now, suggested_category=category, triage_severity=severity
            )
    if stopped is not None:
        raise stopped
    return len(done)


def _bound_statements() -> None:
    """On PostgreSQL, no statement of the chunk's transaction runs longer than STATEMENT_TIMEOUT_MS (SET LOCAL:
    this transaction only). The chunk holds its trajectories' row locks, which a replay of one of them and the
    live rollup's watermark wait on; a statement that hangs ends the transaction and releases them."""
    connection = transaction.get_connection()
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"SET LOCAL statement_timeout = {int(STATEMENT_TIMEOUT_MS)}")


def triage_project(*, project_id: int, slice_s: float | None = None) -> int:
    """Triage every untriaged trajectory of the project, chunk by chunk; how many. Idempotent: a second run
    finds nothing to do. With `slice_s` (the task's), it takes no new chunk after that many seconds and queues
    itself again for the rest: a large backlog never brings the task near its time limit, and other projects'
    messages get their turn in between."""
    deadline = None if slice_s is None else time.monotonic() + slice_s
    total = 0
    while n := triage_chunk(project_id=project_id):
        total += n
        if deadline is not None and time.monotonic() >= deadline:
            from flywheel.trajectories.tasks import triage_project_task  # tasks import this module

            try:
                outbox.send(triage_project_task, project_id)
            except outbox.BrokerUnavailable as exc:
                logger.warning("could not queue the rest of project %s's triage (%s); the sweep sends it", project_id,
                               exc)
            break
    return total


# --- re-runs ---------------------------------------------------------------------------------------------


class TriageRunRefused(Refused):
    """A re-run of the project's triage is already on its way."""


def triage_run_start(*, project: Project, user: Any = None) -> TriageRun:
    """Triage the whole project again under its current policy: one run at a time, on a worker, with progress.

    The policy's version goes up, so every trajectory is out of date until the run reaches it; new ones are
    triaged under the new version as they arrive."""
    from flywheel.trajectories.tasks import triage_run_task  # tasks import this module

    try:
        with transaction.atomic():
            policy = policy_for(project_id=project.pk, for_update=True)
            TriagePolicy.objects.filter(pk=policy.pk).update(version=F("version") + 1)
            policy.refresh_from_db(fields=["version"])
            run = TriageRun.objects.create(
                project=project, started_by=user, version=policy.version, queued_at=timezone.now()
            )
            outbox.send_on_commit(triage_run_task, run.pk)
    except IntegrityError:
        raise TriageRunRefused("A re-run of this project's triage is already on its way.") from None
    return run


def triage_run_retry(*, run: TriageRun) -> TriageRun:
    """Queue a failed re-run again: it goes on with what is still out of date."""
    from flywheel.trajectories.tasks import triage_run_task  # tasks import this module

    return runs.run_retry(run, task=triage_run_task)


def triage_run_process(*, run_id: int) -> TriageRun | None:
    """Run a re-run to its end, writing its progress after each chunk. A run that is running or done (a
    duplicate message) is left alone; one the sweep sent again while it was only slow goes on harmlessly
    beside the new one, since each chunk triages only what is still out of date. A failure is recorded on the
    run, for the page."""
    # Claimed from `queued` only: a second message while it runs does nothing (the sweep queues a run
    # again when its worker stopped writing).
    claimed = runs.run_claim(TriageRun, run_id)
    run = TriageRun.objects.filter(pk=run_id).first()
    if not claimed or run is None:
        return run
    try:
        if not run.total:
            version = policy_for(project_id=run.project_id).version
            total = Trajectory.objects.filter(project_id=run.project_id, triage_version__lt=version).count()
            TriageRun.objects.filter(pk=run_id).update(total=total)
        while n := triage_chunk(project_id=run.project_id, stale=True):
            TriageRun.objects.filter(pk=run_id).update(done=F("done") + n, heartbeat_at=timezone.now())
    except Exception as exc:
        logger.exception("triage run %s failed", run_id)
        TriageRun.objects.filter(pk=run_id).update(
            status=TriageRunStatus.FAILED, finished_at=timezone.now(), error=timelimits.stopped_reason(exc)[:2000]
        )
    else:
        TriageRun.objects.filter(pk=run_id, status=TriageRunStatus.RUNNING).update(
            status=TriageRunStatus.DONE, finished_at=timezone.now()
        )
    return TriageRun.objects.get(pk=run_id)
