"""`wrap(openai_client, agent="support")`: record an agent's chat completions as Flywheel trajectories.

The wrapped client answers exactly as the OpenAI client does; each `chat.completions.create` call is also
recorded (the messages sent, the tools, the reply with its tool calls, the model, token usage and latency), and
finished conversations are sent to Flywheel from a background thread. Recording never blocks the agent's call
and never fails it: a recording or sending error is logged (logger `flywheel_client`), never raised.

When a conversation is finished. A tool-calling agent re-sends the whole conversation on every call, so a call
whose messages begin with everything an earlier conversation holds (its messages and the reply it got)
continues that conversation; any other call starts a new one. A conversation is finished, and sent, when a
reply calls no tool (the agent's final answer). A conversation that goes on after that (the user's next turn)
keeps its external_id and is sent again when it next finishes: the platform updates the trajectory in place.
A conversation left waiting on a tool longer than `idle_s` is sent as it stands, and so is every open one on
`flush()`, on `close()` (or the end of a `with` block) and when the interpreter exits.

Evidence. Behind the platform's router (`python -m flywheel.router`), each answer carries an evidence token that
vouches for the version that gave it (`flywheel.evidence` in the body). The wrapper keeps each call's, and sends
the trajectory with the token of its last call answered by the version the trajectory names, in
`metadata.flywheel_evidence`: only trajectories the platform vouches for this way may move a canary or a watch by
themselves. Nothing is needed from the agent; without the router there is no token and nothing changes.

How it went. The wrapper cannot know whether the agent succeeded: a conversation is sent with outcome
"unknown" until the agent says, with `report(response, outcome="failure", feedback={...})` naming any
completion of that conversation (or its external_id); the trajectory is then sent again, updated in place.
Live metrics per version (failure rates, the canary decision) count only what an agent or a reviewer said.

Not recorded: streamed completions (`stream=True`), the async client, and the other endpoints; they work as
without the wrapper."""

from __future__ import annotations

import atexit
import json
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from flywheel_client import __version__
from flywheel_client.client import Flywheel

log = logging.getLogger("flywheel_client")

OUTCOMES = ("success", "failure", "unknown")
KEPT_CONVERSATIONS = 512  # conversations remembered for continuation; the oldest are forgotten (sent first)
SEND_BATCH = 100
EVIDENCE_KEY = "flywheel_evidence"  # where a trajectory carries the router's token (the platform reads it there)


def wrap(openai_client: Any, *, agent: str, flywheel: Flywheel | None = None, model_version: str | None = None,
         metadata: dict[str, Any] | None = None, idle_s: float = 300.0, queue_size: int = 1000) -> RecordedOpenAI:
    """The OpenAI client `openai_client`, recording its chat completions for `agent` into Flywheel.

    `flywheel`: the Flywheel client to send with (default: one made from FLYWHEEL_URL and FLYWHEEL_API_KEY, which
    must then be set: a missing setting is an error here, at start-up, not in the agent's calls).
    `model_version`: what the trajectories' model_version says (default: the model each reply names).
    `metadata`: added to every trajectory's metadata. `queue_size`: conversations waiting to be sent, beyond
    which new ones are dropped (and logged) rather than the agent slowed."""
    if not hasattr(getattr(openai_client, "chat", None), "completions"):
        raise TypeError("wrap() takes an OpenAI client (openai.OpenAI or a compatible one with chat.completions).")
    recorder = Recorder(flywheel or Flywheel(max_retries=3, timeout=15.0), agent=agent, model_version=model_version,
                        metadata=metadata, idle_s=idle_s, queue_size=queue_size)
    return RecordedOpenAI(openai_client, recorder)


class RecordedOpenAI:
    """The wrapped client: every attribute is the OpenAI client's, but `chat.completions.create` also records."""

    def __init__(self, client: Any, recorder: Recorder) -> None:
        self._client = client
        self.recorder = recorder
        self.chat = _Chat(client.chat, recorder)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def flush(self, timeout: float = 30.0) -> bool:
        """Send every open conversation now and wait until all are sent (True) or `timeout` passed (False)."""
        return self.recorder.flush(timeout)

    def report(self, completion: Any, *, outcome: str, feedback: dict[str, Any] | None = None) -> str | None:
        """Say how the conversation of `completion` (a response `create` returned, or a conversation's
        external_id) went: outcome "success" | "failure" | "unknown", and the user's feedback if any. Returns the
        conversation's external_id, or None when it is not known (forgotten, or never recorded)."""
        return self.recorder.report(completion, outcome=outcome, feedback=feedback)

    def close(self, timeout: float = 30.0) -> None:
        """Flush, stop the sending thread, and close the OpenAI client."""
        self.recorder.close(timeout)
        close = getattr(self._client, "close", None)
        if callable(close):
            close()

    def __enter__(self) -> RecordedOpenAI:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Chat:
    def __init__(self, chat: Any, recorder: Recorder) -> None:
        self._chat = chat
        self.completions = _Completions(chat.completions, recorder)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._chat, name)


class _Completions:
    def __init__(self, completions: Any, recorder: Recorder) -> None:
        self._completions = completions
        self._recorder = recorder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._completions, name)

    def create(self, **kwargs: Any) -> Any:
        started = datetime.now(UTC)
        clock = time.perf_counter()
        response = self._completions.create(**kwargs)  # the agent's call: its errors are the agent's own
        latency_ms = int((time.perf_counter() - clock) * 1000)
        if kwargs.get("stream") is True:
            return response
        try:
            self._recorder.record(kwargs, response, started=started, latency_ms=latency_ms)
        except Exception:  # recording must never fail the agent's call
            log.exception("flywheel: could not record a chat completion")
        return response


# --- conversations ------------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A message, tool or reply as plain JSON data, without None values (OpenAI's objects and typed dicts alike)."""
    if hasattr(value, "model_dump"):
        value = value.model_dump(exclude_none=True)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def _message(value: Any) -> dict[str, Any]:
    message = _plain(value)
    if message.get("role") == "function":  # the legacy role is a tool's answer in the platform's contract
        message["role"] = "tool"
    if message.get("role") == "assistant" and not message.get("tool_calls"):
        message.pop("tool_calls", None)
        message.setdefault("content", "")
    return message


def _evidence_of(response: Any) -> str | None:
    """The router's evidence token in an answer's body (`flywheel.evidence`), if any."""
    extra = getattr(response, "model_extra", None)
    info = extra.get("flywheel") if isinstance(extra, dict) else getattr(response, "flywheel", None)
    token = info.get("evidence") if isinstance(info, dict) else None
    return token if isinstance(token, str) and token else None


def _key(message: dict[str, Any]) -> str:
    """What makes two messages the same turn, whichever way the agent rebuilt it for the next call."""
    calls = [(c.get("id"), (c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
             for c in message.get("tool_calls") or []]
    return json.dumps([message.get("role"), message.get("content") or None, calls, message.get("tool_call_id")],
                      sort_keys=True, default=str)


@dataclass
class Conversation:
    external_id: str
    started_at: datetime
    messages: list[dict[str, Any]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    last_activity: float = field(default_factory=time.monotonic)
    sent: bool = False  # sent as it stands now; a continuation clears it
    finished: bool = False
    outcome: str = "unknown"  # what the agent reported (`report`)
    feedback: dict[str, Any] | None = None


class Recorder:
    """Keeps conversations in memory and sends the finished ones through `flywheel` on a daemon thread."""

    def __init__(self, flywheel: Flywheel, *, agent: str, model_version: str | None = None,
                 metadata: dict[str, Any] | None = None, idle_s: float = 300.0, queue_size: int = 1000) -> None:
        self.flywheel = flywheel
        self.agent = agent
        self.model_version = model_version
        self.metadata = dict(metadata or {})
        self.idle_s = idle_s
        self.sent = 0
        self.dropped = 0
        self._conversations: OrderedDict[str, Conversation] = OrderedDict()
        self._by_completion: dict[str, str] = {}  # a completion's id -> its conversation's external_id
        self._lock = threading.Lock()
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=queue_size)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="flywheel-recorder", daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)

    # --- the agent's side: in memory only ---------------------------------------------------------------------

    def record(self, request: dict[str, Any], response: Any, *, started: datetime, latency_ms: int) -> None:
        messages = [_message(m) for m in request.get("messages") or []]
        keys = [_key(m) for m in messages]
        choices = getattr(response, "choices", None) or []
        if not choices:
            return
        reply = _message(choices[0].message)
        tools = [t for t in _plain(request.get("tools")) or [] if isinstance(t, dict) and t.get("type") == "function"] \
            if isinstance(request.get("tools"), list) else []
        with self._lock:
            conversation = self._continued(keys)
            if conversation is None:
                conversation = Conversation(external_id=f"{self.agent}-{uuid.uuid4().hex}", started_at=started)
                self._conversations[conversation.external_id] = conversation
                self._forget_oldest()
            self._conversations.move_to_end(conversation.external_id)
            conversation.messages = [*messages, reply]
            conversation.keys = [*keys, _key(reply)]
            conversation.tools = tools or conversation.tools
            evidence = _evidence_of(response)
            conversation.calls.append({
                "model": getattr(response, "model", None) or request.get("model"),
                "latency_ms": latency_ms,
                "usage": _plain(getattr(response, "usage", None)) or {},
                "finish_reason": getattr(choices[0], "finish_reason", None),
                "message_index": len(messages),
                **({"evidence": evidence} if evidence else {}),
            })
            completion_id = getattr(response, "id", None)
            if isinstance(completion_id, str) and completion_id:
                self._by_completion[completion_id] = conversation.external_id
            conversation.last_activity = time.monotonic()
            conversation.finished = not reply.get("tool_calls")
            conversation.sent = False
            if conversation.finished:
                self._send(conversation)

    def report(self, completion: Any, *, outcome: str, feedback: dict[str, Any] | None = None) -> str | None:
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {', '.join(OUTCOMES)}, not {outcome!r}")
        with self._lock:
            key = completion if isinstance(completion, str) else getattr(completion, "id", None)
            external_id = key if key in self._conversations else self._by_completion.get(key or "")
            conversation = self._conversations.get(external_id or "")
            if conversation is None:
                log.warning("flywheel: no recorded conversation for %r; its outcome was not sent", key)
                return None
            conversation.outcome = outcome
            if feedback is not None:
                conversation.feedback = _plain(feedback)
            self._send(conversation)  # updated in place on the platform (same external_id)
            return conversation.external_id

    def _continued(self, keys: list[str]) -> Conversation | None:
        """The conversation these messages go on from: the longest one they begin with."""
        best = None
        for conversation in self._conversations.values():
            n = len(conversation.keys)
            if n and len(keys) >= n and keys[:n] == conversation.keys and (best is None or n > len(best.keys)):
                best = conversation
        return best

    def _forget_oldest(self) -> None:
        while len(self._conversations) > KEPT_CONVERSATIONS:
            _, oldest = self._conversations.popitem(last=False)
            if not oldest.sent:
                self._send(oldest)
            for completion_id in [k for k, v in self._by_completion.items() if v == oldest.external_id]:
                del self._by_completion[completion_id]

    def _send(self, conversation: Conversation) -> None:
        """Queue the conversation as it stands (under the lock); a full queue drops it rather than wait."""
        try:
            self._queue.put_nowait(self._trajectory(conversation))
        except queue.Full:
            self.dropped += 1
            log.warning("flywheel: the send queue is full; conversation %s was not recorded", conversation.external_id)
            return
        conversation.sent = True

    def _trajectory(self, conversation: Conversation) -> dict[str, Any]:
        usage: dict[str, int] = {}
        for call in conversation.calls:
            for name, value in call["usage"].items():
                if isinstance(value, int):
                    usage[name] = usage.get(name, 0) + value
        models = [call["model"] for call in conversation.calls if call["model"]]
        model_version = self.model_version or (models[-1] if models else "")
        # The token of the last call the named version answered: the one that vouches for that version.
        evidence = next((call["evidence"] for call in reversed(conversation.calls)
                         if call.get("evidence") and call["model"] == model_version), None)
        return {
            "external_id": conversation.external_id,
            "agent": self.agent,
            "model_version": model_version,
            "messages": list(conversation.messages),
            "tools": list(conversation.tools),
            "outcome": conversation.outcome,
            **({"feedback": conversation.feedback} if conversation.feedback is not None else {}),
            "latency_ms": sum(call["latency_ms"] for call in conversation.calls),
            "usage": usage or None,
            "started_at": conversation.started_at.isoformat(),
            "metadata": {**self.metadata, "recorded_by": f"flywheel-client/{__version__}",
                         "finished": conversation.finished, "calls": list(conversation.calls),
                         **({EVIDENCE_KEY: evidence} if evidence else {})},
        }

    # --- the sending thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=1.0)
            except queue.Empty:
                self._send_idle()
                continue
            batch, done = [], False
            while True:
                if item is None:
                    done = True
                else:
                    batch.append(item)
                if done or len(batch) >= SEND_BATCH:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            self._deliver(batch)
            for _ in range(len(batch) + done):
                self._queue.task_done()
            if done:
                return

    def _deliver(self, batch: list[dict[str, Any]]) -> None:
        if not batch:
            return
        try:
            result = self.flywheel.ingest(batch)
        except Exception as exc:  # the agent goes on; what could not be sent is said in the log
            log.warning("flywheel: %d conversation(s) not sent: %s", len(batch), exc)
            return
        self.sent += result.accepted
        for rejection in result.rejected:
            log.warning("flywheel: conversation %s refused: %s", batch[rejection.index]["external_id"], rejection)

    def _send_idle(self) -> None:
        now = time.monotonic()
        with self._lock:
            for conversation in self._conversations.values():
                if not conversation.sent and now - conversation.last_activity > self.idle_s:
                    self._send(conversation)

    # --- flush and close --------------------------------------------------------------------------------------

    def flush(self, timeout: float = 30.0) -> bool:
        """Send every open conversation as it stands, and wait until the queue is empty (True) or `timeout`."""
        with self._lock:
            for conversation in self._conversations.values():
                if not conversation.sent:
                    self._send(conversation)
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and self._thread.is_alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return not self._queue.unfinished_tasks

    def close(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        self.flush(timeout)
        self._closed = True
        atexit.unregister(self._at_exit)
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._thread.join(timeout=5.0)

    def _at_exit(self) -> None:
        try:
            self.close(timeout=10.0)
        except Exception:
            log.exception("flywheel: could not send the last conversations at exit")
