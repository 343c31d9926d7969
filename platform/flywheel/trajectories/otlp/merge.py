"""One trace's spans into one conversation (re-sent history not repeated, tool results matched to their
calls) and the trajectory record it makes, merged with what is stored of the trace, within the caps."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from flywheel.trajectories.ingest import content_text
from flywheel.trajectories.models import Trajectory
from flywheel.trajectories.otlp.conventions import ToolRun, llm_call, tool_run, tool_schema
from flywheel.trajectories.otlp.decode import STATUS_ERROR, Span


def _key(message: dict[str, Any]) -> tuple:
    """What makes two messages the same one, re-sent: role, text and the names of the tools called.
    Ids are left out on purpose: instrumentations often drop them from the history they re-send."""
    names = tuple((c.get("function") or {}).get("name") or "" for c in message.get("tool_calls") or ())
    return (message.get("role"), content_text(message.get("content")).strip(), names)


def _ids(message: dict[str, Any]) -> set[str]:
    """The tool call ids a message carries: those it makes (assistant) or answers (tool)."""
    if message.get("role") == "tool":
        return {message["tool_call_id"]} if message.get("tool_call_id") else set()
    return {c["id"] for c in message.get("tool_calls") or () if c.get("id")}


class Conversation:
    """The messages of one trace, with what deduplication and tool-call matching need kept as indexes, so
    that adding a span costs what the span carries, not what the conversation holds. New messages past
    `limit` are dropped and counted in `dropped`; the stored history (`seed`) is kept whole."""

    def __init__(self, seed: Iterable[dict[str, Any]] = (), *, limit: int | None = None) -> None:
        self.messages: list[dict[str, Any]] = []
        self.counts: Counter = Counter()  # key -> copies held
        self.idless: Counter = Counter()  # key -> copies held that carry no tool call id
        self.ids: dict[str, set[str]] = {"assistant": set(), "tool": set()}
        self.calls_by_name: dict[str, list[str | None]] = {}  # tool name -> ids of its calls, in order
        # Stored messages with ids are counted by key only once a message without ids asks (a re-sent
        # history): spans that carry ids (tool runs, most LLM outputs) never pay for keying the history.
        self._unkeyed: list[dict[str, Any]] = []
        self.messages = list(seed)
        for message in self.messages:
            ids = _ids(message)
            if ids:
                self._unkeyed.append(message)
            else:
                key = _key(message)
                self.counts[key] += 1
                self.idless[key] += 1
            self._index(message, ids)
        self.seeded = len(self.messages)
        self.limit = limit
        self.dropped = 0

    def _copies(self, key: tuple) -> int:
        if self._unkeyed:
            self.counts.update(_key(m) for m in self._unkeyed)
            self._unkeyed = []
        return self.counts[key]

    def _append(self, message: dict[str, Any], key: tuple, ids: set[str]) -> None:
        self.messages.append(message)
        self.counts[key] += 1
        if not ids:
            self.idless[key] += 1
        self._index(message, ids)

    def _index(self, message: dict[str, Any], ids: set[str]) -> None:
        known = self.ids.get(message.get("role"))
        if known is not None:
            known |= ids
        if message.get("role") == "assistant":
            for call in message.get("tool_calls") or ():
                name = (call.get("function") or {}).get("name") or ""
                self.calls_by_name.setdefault(name, []).append(call.get("id"))

    def extend(self, sequence: list[dict[str, Any]]) -> None:
        """Append what `sequence` adds. A message is already there when it carries a tool call id the
        conversation holds, or else when the conversation holds as many copies of it as `sequence` has up
        to that point (the history an LLM call re-sends; counted, so a repeated "yes" stays twice). A message
        whose ids are all new is new, even when its text repeats (the same tool result for another call),
        unless copies of it were stored without ids (a history re-sent with ids its first report lacked)."""
        seen: Counter = Counter()
        for message in sequence:
            key = _key(message)
            seen[key] += 1
            ids = _ids(message)
            known = self.ids.get(message.get("role"))
            if ids and known is not None:
                if ids & known or seen[key] <= self.idless[key]:
                    continue
            elif seen[key] <= self._copies(key):
                continue
            if self.limit is not None and len(self.messages) >= self.limit:
                self.dropped += 1
                continue
            self._append(message, key, ids)

    def add_tool_run(self, run: ToolRun, span_id: str) -> None:
        call_id = run.call_id
        if call_id is None:  # no id on the span: the latest unanswered call of that tool
            for candidate in reversed(self.calls_by_name.get(run.name, ())):
                if candidate not in self.ids["tool"]:
                    call_id = candidate
                    break
        if call_id is None or call_id not in self.ids["assistant"]:
            # A tool ran that no recorded LLM call asked for: record the call too, so the result has one.
            call_id = call_id or f"call_{span_id}"
            self.extend(
                [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": call_id,
                                "type": "function",
                                "function": {"name": run.name, "arguments": run.arguments},
                            }
                        ],
                    }
                ]
            )
        message: dict[str, Any] = {
            "role": "tool",
            "tool_call_id": call_id,
            "name": run.name,
            "content": run.result,
        }
        if run.error:
            message["is_error"] = True
        self.extend([message])


def _iso(ns: int) -> str | None:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).isoformat() if ns else None


@dataclass
class TraceMerge:
    """What merging one trace's spans of an export gave: the record to write (None: nothing to write) and
    what the answer must say about it."""

    record: dict[str, Any] | None = None
    spans: int = 0  # spans of this export merged into the trajectory
    skipped: bool = False  # a new trace without any LLM or tool span: not a trajectory
    dropped_spans: int = 0  # spans not merged: the trace holds the most it may (`full`)
    full: str = ""  # which cap made spans go: "spans" or "messages"
    dropped_messages: int = 0  # over FLYWHEEL_OTLP_MAX_MESSAGES_PER_TRACE
    replaced: int = 0  # values made storable
    seeded: int = 0  # messages of record["messages"] already stored: the rest are new


def unmerged_spans(spans: list[Span], known: Iterable[str]) -> list[Span]:
    """The spans of an export not merged yet (a span sent twice counts once), in start order."""
    seen = set(known)
    fresh = []
    for span in sorted(spans, key=lambda s: (s.start_ns, s.end_ns)):
        if span.span_id not in seen:
            seen.add(span.span_id)
            fresh.append(span)
    return fresh


def trace_record(
    trace_id: str,
    spans: list[Span],
    existing: Trajectory | None,
    history: list[dict[str, Any]] | None = None,
    *,
    max_spans: int,
    max_messages: int,
) -> TraceMerge:
    """The trajectory record for one trace, merged with what is stored of it (`existing`, its messages in
    `history`). Spans merged before are not replayed; nothing new means nothing to write."""
    previous = (existing.metadata or {}).get("otlp", {}) if existing is not None else {}
    span_meta: dict[str, list[int]] = dict(previous.get("spans", {}))
    fresh = unmerged_spans(spans, span_meta)
    merge = TraceMerge()
    if existing is not None and fresh and existing.message_count >= max_messages:
        # A full conversation takes nothing more, so its spans are not merged either: the trajectory stays
        # as it is, and the export costs no read of the conversation and no write.
        merge.dropped_spans, merge.full = len(fresh), "messages"
        return merge
    room = max(max_spans - len(span_meta), 0)
    if len(fresh) > room:
        merge.dropped_spans, merge.full = len(fresh) - room, "spans"
        fresh = fresh[:room]  # past the cap, the latest spans go: a trajectory keeps its beginning
    if not fresh and existing is not None:
        return merge
    merge.spans = len(fresh)

    conversation = Conversation(history or (), limit=max_messages)
    merge.seeded = conversation.seeded
    tools: dict[str, dict[str, Any]] = {
        t["function"]["name"]: t for t in (existing.tools if existing else []) if tool_schema(t)
    }
    model = existing.model_version if existing is not None else ""
    found = bool(span_meta)  # spans of an earlier export, already in the stored conversation
    for span in fresh:
        merge.replaced += span.replaced
        call = llm_call(span)
        if call is not None:
            found = True
            merge.replaced += call.replaced
            conversation.extend(call.inputs + call.outputs)
            for tool in call.tools:
                tools.setdefault(tool["function"]["name"], tool)
            model = call.model or model
            span_meta[span.span_id] = [span.start_ns, span.end_ns, call.prompt_tokens, call.completion_tokens]
            continue
        run = tool_run(span)
        if run is not None:
            found = True
            conversation.add_tool_run(run, span.span_id)
        span_meta[span.span_id] = [span.start_ns, span.end_ns, 0, 0]
    merge.dropped_messages = conversation.dropped
    if not found and existing is None:
        merge.skipped = True
        return merge

    starts = [m[0] for m in span_meta.values() if m[0]]
    ends = [m[1] for m in span_meta.values() if m[1]]
    prompt = sum(m[2] for m in span_meta.values())
    completion = sum(m[3] for m in span_meta.values())
    latency = max(ends) - min(starts) if starts and ends else None
    ids = {s.span_id for s in spans}
    roots = [s for s in spans if not s.parent_span_id or s.parent_span_id not in ids]
    root = min(roots, key=lambda s: s.start_ns) if roots else spans[0]
    attrs = {
        k: v
        for s in spans
        for k, v in s.attributes.items()
        if k in ("gen_ai.agent.name", "agent.name", "session.id", "gen_ai.conversation.id", "flywheel.evidence")
    }
    agent = (
        attrs.get("gen_ai.agent.name") or attrs.get("agent.name") or root.resource.get("service.name") or ""
    )
    outcome = (
        "failure"
        if root.status_code == STATUS_ERROR and not root.parent_span_id
        else (existing.outcome if existing else "unknown")
    )
    metadata = dict(existing.metadata or {}) if existing is not None else {}
    metadata["otlp"] = {
        "trace_id": trace_id,
        "root_span": previous.get("root_span") or (root.name if not root.parent_span_id else ""),
        "service": root.resource.get("service.name", ""),
        "spans": span_meta,
    }
    if previous.get("truncated") or merge.dropped_spans or merge.dropped_messages:
        metadata["otlp"]["truncated"] = True  # a cap was reached: the trajectory is not the whole trace
    for key in ("session.id", "gen_ai.conversation.id"):
        if key in attrs:
            metadata[key] = attrs[key]
    if "flywheel.evidence" in attrs:  # the router's evidence token, as the agent's instrumentation recorded it
        metadata["flywheel_evidence"] = attrs["flywheel.evidence"]
    if any(m.get("is_error") for m in conversation.messages[conversation.seeded :]):
        metadata["has_tool_error"] = True
    merge.record = {
        "external_id": trace_id,
        "agent": str(agent)[:200],
        "model_version": str(model)[:200],
        "messages": conversation.messages,
        "tools": list(tools.values()),
        "outcome": outcome,
        # None when the spans' clocks disagree (an end before every start): unknown, not negative.
        "latency_ms": min(latency // 1_000_000, 2**31 - 1) if latency is not None and latency >= 0 else None,
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
        "metadata": metadata,
        "started_at": _iso(min(starts)) if starts else None,
    }
    return merge
