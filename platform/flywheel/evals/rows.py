"""The JSONL row that eval cases and environment tasks share, its canonical form and content hash, and the
normalised prompt the leakage guard compares.

A row is `{id, messages, tools, verifier, env?, origin: {trajectory_id, failure_mode}}`, the shape
`python -m trainer evaluate --suite` and `train` read. A version's content hash is the SHA-256 of its
export: one canonical JSON row a line, so `sha256sum` of a downloaded file gives the hash on the page.
A row's origin is read by `origin_of` (one row) and `origins_of` (a version's rows), nowhere else.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from trainer.verifiers import normalize_text


def canonical_json(value: Any) -> str:
    """Keys sorted, no spaces, UTF-8 kept: the same rows always give the same text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def export_jsonl(rows: Iterable[dict[str, Any]]) -> bytes:
    """The version's file: one canonical row a line, each line ending in a newline."""
    return "".join(canonical_json(row) + "\n" for row in rows).encode("utf-8")


def content_hash(rows: Iterable[dict[str, Any]]) -> str:
    return hashlib.sha256(export_jsonl(rows)).hexdigest()


def message_text(message: Any) -> str:
    """The text of a chat message's content (a string, or the text parts of a list)."""
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def last_user_request(messages: Any) -> str:
    """The last user message's text: what a task asks for, and what two near-duplicate prompts share."""
    if not isinstance(messages, list):
        return ""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return message_text(message)
    return ""


def prompt_digest(messages: Any) -> str:
    """SHA-256 of the normalised last user request (case, spaces and punctuation removed); "" when there
    is no request to compare, so that prompt-less rows never count as duplicates of each other."""
    text = normalize_text(last_user_request(messages))
    return hashlib.sha256(text.encode("utf-8")).hexdigest() if text else ""


def build_row(
    *, row_id: str, messages: list, tools: list, verifier: dict, env: dict | None,
    trajectory_id: int | None, failure_mode_id: int | None,
) -> dict[str, Any]:
    """One row in the trainer's shape. `env` is left out for a single-turn row, as the trainer's default."""
    row: dict[str, Any] = {
        "id": row_id,
        "messages": messages,
        "tools": tools,
        "verifier": verifier,
        "origin": {"trajectory_id": trajectory_id, "failure_mode": failure_mode_id},
    }
    if env and env.get("type", "single_turn") != "single_turn":
        row["env"] = env
    return row


@dataclass(frozen=True)
class Origin:
    """Where a row came from: the trajectory it was promoted from and the failure mode it stands for, each an
    id or None. Rows a generator made (the workplace's tasks) carry other keys and no ids."""

    trajectory_id: int | None = None
    failure_mode: int | None = None


def _id(value: Any) -> int | None:
    # bool is an int to Python, and a row edited by hand may say `true`: that is no id.
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def origin_of(row: Any) -> Origin:
    """The row's `origin`, whatever the row holds: a missing or malformed origin, or an id that is not a
    positive integer, reads as None."""
    origin = row.get("origin") if isinstance(row, dict) else None
    if not isinstance(origin, dict):
        return Origin()
    return Origin(trajectory_id=_id(origin.get("trajectory_id")), failure_mode=_id(origin.get("failure_mode")))


@dataclass(frozen=True)
class Origins:
    """The trajectories and failure modes behind a set of rows (a task-set version: what a model learned from)."""

    trajectories: frozenset[int] = frozenset()
    failure_modes: frozenset[int] = frozenset()


def origins_of(rows: Iterable[Any]) -> Origins:
    """Every trajectory and failure mode the rows came from: the one reading of a model version's lineage,
    stored when the version is made and recomputed by the dashboard."""
    found = [origin_of(row) for row in rows]
    return Origins(
        trajectories=frozenset(o.trajectory_id for o in found if o.trajectory_id is not None),
        failure_modes=frozenset(o.failure_mode for o in found if o.failure_mode is not None),
    )
