"""The result type every verifier returns, the failure taxonomy, and the spec error."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# Ordered by precedence: when several things are wrong with one output, the first listed that applies is
# the one reported, because it is the one a reviewer would fix first (an unsafe call matters more than a
# missing argument, and nothing else can be judged about output that does not parse).
FAILURES: tuple[str, ...] = (
    "invalid_format",
    "hallucinated_api",
    "wrong_tool",
    "wrong_arguments",
    "missing_call",
    "extra_call",
    "unsafe_action",
    "wrong_state",
    "wrong_answer",
)

# Precedence used to pick the reported failure. Differs from the order of FAILURES (kept as specified for
# display) in one place: an unsafe action outranks everything except unparseable output.
FAILURE_PRECEDENCE: tuple[str, ...] = (
    "invalid_format",
    "unsafe_action",
    "hallucinated_api",
    "wrong_tool",
    "wrong_arguments",
    "missing_call",
    "extra_call",
    "wrong_state",
    "wrong_answer",
)
_RANK = {name: i for i, name in enumerate(FAILURE_PRECEDENCE)}


def first_failure(failures: list[str | None] | set[str]) -> str | None:
    """The failure to report among several, by precedence; None when there is none."""
    present = [f for f in failures if f]
    return min(present, key=_RANK.__getitem__) if present else None


class SpecError(ValueError):
    """A verifier spec is malformed; `problems` lists what is wrong, one human-readable line each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid verifier spec: " + "; ".join(self.problems))


@dataclass(frozen=True)
class Score:
    """What a verifier says about one output.

    `reward` is what GRPO optimises, `passed` what success rates count, `failure` one of FAILURES (None when
    passed), and `checks` says, check by check, what was looked at and why it failed (JSON-serialisable).
    `components` holds, for a row with several weighted rewards, each one's own (unweighted) reward by name;
    `reward` is then their weighted sum.
    """

    reward: float
    passed: bool
    checks: dict[str, Any] = field(default_factory=dict)
    failure: str | None = None
    components: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.failure is not None and self.failure not in _RANK:
            raise ValueError(f"unknown failure category {self.failure!r}; expected one of {FAILURES}")

    @property
    def unsafe(self) -> bool:
        """True when the output made a destructive call nobody asked for (whatever failure is reported)."""
        if self.failure == "unsafe_action":
            return True
        unsafe = self.checks.get("unsafe")
        return isinstance(unsafe, dict) and unsafe.get("ok") is False

    @property
    def invalid(self) -> bool:
        """True when the output (or a turn of the episode) could not be parsed: the gate's invalid outputs."""
        return self.failure == "invalid_format"

    @property
    def unsafe_actions(self) -> list[str]:
        """The names of the unsafe calls the output made, in order (empty when it made none, or when the
        verifier flagged it unsafe without naming a call)."""
        unsafe = self.checks.get("unsafe")
        calls = unsafe.get("calls") if isinstance(unsafe, dict) else None
        return [str(c.get("name")) for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []

    def to_dict(self) -> dict[str, Any]:
        out = {"reward": self.reward, "passed": self.passed, "failure": self.failure, "checks": self.checks}
        if self.components:
            out["components"] = dict(self.components)
        return out


def component_means(scores: list[Score]) -> dict[str, float]:
    """`{"reward/<name>": mean}` of each reward component over the scores that have it (the step event's
    and the suite metrics' per-component figures); {} when no score has components."""
    sums: dict[str, list[float]] = {}
    for s in scores:
        for name, value in s.components.items():
            acc = sums.setdefault(name, [0.0, 0.0])
            acc[0] += value
            acc[1] += 1
    return {f"reward/{name}": total / n for name, (total, n) in sums.items()}


def short(value: Any, limit: int = 80) -> str:
    """A bounded JSON-ish rendering of a value for a check's reason (outputs can be huge or hostile)."""
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
