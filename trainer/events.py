"""The trainer's stdout contract: one JSON object a line, `{"event": <kind>, ...}`, written here by the trainer
(`encode`, through `tracking.EventLog.emit`) and read here by the platform (`parse_line`, in
`flywheel.supervise`), so both sides agree on one list of kinds and one shape.

Kinds: `step` (a training step's figures), `eval` (a split's metrics at a step, or one `case` row while
evaluating), `checkpoint` (an adapter saved), `stage` (sft -> grpo), `latency` (one timed case), `done` (the
command's result) and `error` (why it failed). `step`, when present, is an int. Anything else on stdout (a
library that slipped a line past `claim_stdout`, a line that is not an object, an unknown kind) is refused with
a reason rather than guessed at: the platform logs the reason and reads on.

This module imports nothing of the platform's or of torch's: both sides load it cheaply."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KINDS = frozenset({"step", "eval", "checkpoint", "stage", "latency", "done", "error"})


class EventRefused(ValueError):
    """A stdout line that is not an event of the contract; the message says why."""


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # NaN/inf are not JSON
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _jsonable(value.item())
    return value


@dataclass(frozen=True)
class Event:
    """One event: its kind, its step where it has one (an int, else None), and every other field."""

    kind: str
    step: int | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """The object as printed: `event`, then `step` if any, then the rest."""
        out: dict[str, Any] = {"event": self.kind}
        if self.step is not None:
            out["step"] = self.step
        return {**out, **self.data}

    @property
    def message(self) -> str:
        """An `error` event's reason ("" when it gave none)."""
        return str(self.data.get("message", ""))


def record(kind: str, **fields: Any) -> dict[str, Any]:
    """The JSON-ready object for an event the trainer emits; an unknown kind is a bug in the trainer."""
    if kind not in KINDS:
        raise EventRefused(f"unknown event kind {kind!r}; the contract knows {', '.join(sorted(KINDS))}")
    return _jsonable({"event": kind, **fields})


def encode(kind: str, **fields: Any) -> str:
    """One stdout line (without its newline)."""
    return json.dumps(record(kind, **fields))


def parse_line(line: bytes | str) -> Event | None:
    """The event on one stdout line; None for a blank line; EventRefused (with the reason) for anything else."""
    text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise EventRefused(f"not JSON ({exc.msg} at column {exc.colno}): {text[:120]!r}") from None
    if not isinstance(obj, dict):
        raise EventRefused(f"not a JSON object but a {type(obj).__name__}: {text[:120]!r}")
    kind = obj.pop("event", None)
    if not isinstance(kind, str):
        raise EventRefused(f"no \"event\" kind: {text[:120]!r}")
    if kind not in KINDS:
        raise EventRefused(f"unknown event kind {kind!r}: {text[:120]!r}")
    step = obj.pop("step", None)
    if not (isinstance(step, int) and not isinstance(step, bool)):
        if step is not None:
            obj["step"] = step  # kept as it came, for whoever reads the data; the event has no step
        step = None
    return Event(kind=kind, step=step, data=obj)


@dataclass
class Outcome:
    """What a platform-side run of a trainer command wants from its events: the `done` record (every field
    but `event`) and the `error` message. `on_event` is the `supervise` callback."""

    done: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    finished: bool = False

    def on_event(self, event: Event) -> None:
        if event.kind == "done":
            self.finished = True
            self.done.update(event.record())
            self.done.pop("event", None)
        elif event.kind == "error":
            self.error = event.message
