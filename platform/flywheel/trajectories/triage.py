"""Triage: detectors that read a stored trajectory and record what looks wrong in it, as signals.

Tool calls are read and checked by `trainer.verifiers` (the one scoring path): each assistant message that
makes calls is scored by the tool_call verifier with no expected calls and the project's unsafe rules
(`triage_policy`), against the trajectory's declared tools. The rest is read here:

    invalid_arguments   a call's arguments are not JSON (or not an object)      format            high
    undeclared_tool     a call to a tool the trajectory does not declare         hallucinated_api  high
                        (only when it declares tools at all)
    schema_violation    arguments that break the tool's parameters schema        wrong_arguments   medium
    unsafe_action       a call matching a rule of the project's unsafe policy    unsafe_action     critical
    tool_error          a tool result that reports an error (`ingest.is_tool_error`)  other        low
    loop                the same call with the same arguments 3 times or more   bad_planning      medium
    no_final_answer     the last message is not an assistant answer with text    bad_planning      medium
                        and no tool call (it ends on a call, a result, a user turn)
    negative_feedback   `feedback` says so (see `feedback_negative`)             other             medium
    human_intervention  `human_intervention` is set (not null, false or empty)  other             high

The suggested category is the category of the signals present that comes first in CATEGORY_PRECEDENCE.

Triage runs on a worker: ingestion calls `triage_request` (one message per project, after the commit), and
the task triages the project's untriaged trajectories (`triage_version = 0`) CHUNK at a time, each chunk
locked (`FOR UPDATE SKIP LOCKED`) so that two tasks share the work instead of doing it twice. A replay sets
`triage_version` back to 0. A maintainer's re-run (`triage_run_start`) triages every trajectory whose version
is below the policy's. Both are outboxes (flywheel.outbox): `triage_sweep` sends again what waits too long."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.utils import timezone

from flywheel import outbox
from flywheel.accounts.models import Project
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
from flywheel.trajectories.triage_policy import policy_for, policy_spec
from trainer.verifiers import compile_spec, parse_completion
from trainer.verifiers.schemas import tool_index
from trainer.verifiers.tool_call import score_tool_call

logger = logging.getLogger(__name__)

CHUNK = 250  # trajectories per transaction; they stay locked meanwhile, so a replay waits one chunk at most
LOOP_MIN_REPEATS = 3
EXCERPT = 200  # characters of agent text kept in a signal's detail
MAX_ITEMS = 5  # errors, names... kept in a signal's detail
# A run whose worker wrote nothing for this long has lost it: the sweep sends it again.
RUN_STALE_AFTER = timedelta(minutes=5)

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
    rules. The same spec object should be passed for every trajectory: the verifier caches it by identity."""
    signals: list[Signal] = []
    messages = messages if isinstance(messages, list) else []
    declared = tools if isinstance(tools, list) and tools else None
    index_of_tools = tool_index(declared)
    compiled = compile_spec(unsafe_spec).data
    call_names: dict[str, str] = {}  # tool_call_id -> tool name, to name the tool of an error result
    seen: dict[tuple[str, str], list[int]] = {}  # (name, arguments) -> message indexes of that call
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        if role == "assistant" and (message.get("tool_calls") or message.get("function_call")):
            parsed = parse_completion(message)
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
                calls = [{"tool": _excerpt(c["name"], 80), "rule": c["rule"]} for c in unsafe["calls"][:MAX_ITEMS]]
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


def _no_final_answer(messages: list[Any]) -> str | None:
    """Why the episode has no final answer, or None when its last message is an assistant's text without
    tool calls."""
    if not messages:
        return "there are no messages"
    last = messages[-1]
    if not isinstance(last, dict):
        return "the last message is not a message object"
    role = last.get("role")
    if role == "assistant":
        if last.get("tool_calls") or last.get("function_call"):
            return "it ends on a tool call"
        if not content_text(last.get("content")).strip():
            return "the last assistant message is empty"
        return None
    if role == "tool":
        return "it ends on a tool result"
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
        stale = Q(status=TriageRunStatus.QUEUED, queued_at__lt=cutoff) | Q(
            status=TriageRunStatus.RUNNING, heartbeat_at__lt=now - RUN_STALE_AFTER
        )
        for run_id in TriageRun.objects.filter(stale).order_by("pk").values_list("pk", flat=True)[:100]:
            # Compare-and-set, so that of two sweeps at once one sends it.
            if TriageRun.objects.filter(stale, pk=run_id).update(status=TriageRunStatus.QUEUED, queued_at=now):
                outbox.send(triage_run_task, run_id)
                sent += 1
    except outbox.BrokerUnavailable as exc:
        logger.warning("triage sweep: the broker is unavailable (%s); trying again next sweep", exc)
    return sent


# --- the work --------------------------------------------------------------------------------------------


def triage_chunk(*, project_id: int, stale: bool = False, size: int = CHUNK) -> int:
    """Triage up to `size` of the project's untriaged trajectories (`stale`: also those triaged under an older
    policy version) in one transaction; how many. Rows another transaction holds are skipped, not waited for:
    two tasks on one project share the work, and a replay waits at most one chunk for its row."""
    with transaction.atomic():
        policy = policy_for(project_id=project_id)
        spec = policy_spec(policy)
        pending = Trajectory.objects.filter(project_id=project_id)
        pending = pending.filter(triage_version__lt=policy.version) if stale else pending.filter(triage_version=0)
        ids = list(pending.select_for_update(skip_locked=True).values_list("id", flat=True)[:size])
        if not ids:
            return 0
        rows = Trajectory.objects.filter(id__in=ids).values_list(
            "id", "messages", "tools", "feedback", "human_intervention"
        )
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
            except Exception:
                # Agent data is untrusted: one trajectory that breaks a detector must not stop its chunk forever
                # (the sweep would send it again and again). It is marked triaged, without signals, and logged.
                logger.exception("triage of trajectory %s failed; marked triaged without signals", trajectory_id)
                found = []
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
        TriageSignal.objects.filter(trajectory_id__in=ids).delete()
        TriageSignal.objects.bulk_create(signals, batch_size=1000)
        now = timezone.now()
        for (category, severity), group in groups.items():
            # .update() leaves updated_at alone: it is when the agent's data last changed (the sweep reads it).
            Trajectory.objects.filter(id__in=group).update(
                triage_version=policy.version, triaged_at=now, suggested_category=category, triage_severity=severity
            )
    return len(ids)


def triage_project(*, project_id: int) -> int:
    """Triage every untriaged trajectory of the project, chunk by chunk; how many. Idempotent: a second run
    finds nothing to do."""
    total = 0
    while n := triage_chunk(project_id=project_id):
        total += n
    return total


# --- re-runs ---------------------------------------------------------------------------------------------


class TriageRunRefused(ValueError):
    pass


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


def triage_run_process(*, run_id: int) -> TriageRun | None:
    """Run a re-run to its end, writing its progress after each chunk. A run that is running or done (a
    duplicate message) is left alone; one the sweep sent again while it was only slow goes on harmlessly
    beside the new one, since each chunk triages only what is still out of date. A failure is recorded on the
    run, for the page."""
    now = timezone.now()
    # Claimed from `queued` only: a second message while it runs does nothing (the sweep queues a run
    # again when its worker stopped writing).
    claimed = TriageRun.objects.filter(pk=run_id, status=TriageRunStatus.QUEUED).update(
        status=TriageRunStatus.RUNNING, started_at=now, heartbeat_at=now
    )
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
            status=TriageRunStatus.FAILED, finished_at=timezone.now(), error=f"{type(exc).__name__}: {exc}"[:2000]
        )
    else:
        TriageRun.objects.filter(pk=run_id, status=TriageRunStatus.RUNNING).update(
            status=TriageRunStatus.DONE, finished_at=timezone.now()
        )
    return TriageRun.objects.get(pk=run_id)
