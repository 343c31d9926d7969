"""A task row's reward: its one `verifier`, or several weighted verifiers (`reward`).

A row carries exactly one of:
    "verifier": {...spec...}
    "reward": [{"verifier": {...spec...}, "weight": 1.0, "name"?: "calls"}, ...]

With `reward`, every component scores the same output; the episode's reward is the weighted sum of the
components' rewards, it passes when every component with a non-zero weight passes (a weight of 0 logs a
component without letting it count), and `Score.components` keeps each component's own reward by name, so
the trainer logs them one by one (`reward/<name>`). A name defaults to the component's verifier type
(`tool_call`, then `tool_call_2` for a second one). Every environment scores through `score_task`.
"""

from __future__ import annotations

import math
import re
from typing import Any

from trainer.verifiers import Score, SpecError, first_failure, score, validate_spec

COMPONENT_KEYS = frozenset({"verifier", "weight", "name"})
# Component names end up in MLflow metric keys (`train/reward/<name>`): keep them to what MLflow takes.
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

_cache: dict[int, tuple[Any, list[tuple[str, dict, float]]]] = {}


def reward_components(task: dict[str, Any]) -> list[tuple[str, dict, float]] | None:
    """`[(name, verifier spec, weight)]` of a row's weighted `reward`, None for a row with one `verifier`.

    Raises SpecError naming the task and the component for a malformed list (cached by the list's identity,
    like compiled verifier specs: a row is not edited in place once scored)."""
    spec = task.get("reward")
    if spec is None:
        return None
    hit = _cache.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    where = f"task {task.get('id')!r}: reward"
    problems: list[str] = []
    if "verifier" in task:
        problems.append(f"task {task.get('id')!r}: a row has a `verifier` or a weighted `reward` list, not both")
    if not isinstance(spec, list) or not spec:
        raise SpecError([*problems, f"{where}: must be a non-empty list of {{\"verifier\", \"weight\", \"name\"?}}"])
    out: list[tuple[str, dict, float]] = []
    seen: dict[str, int] = {}
    for i, comp in enumerate(spec):
        at = f"{where}[{i}]"
        if not isinstance(comp, dict) or not isinstance(comp.get("verifier"), dict):
            problems.append(f"{at}: needs \"verifier\": a verifier spec")
            continue
        for key in sorted(set(comp) - COMPONENT_KEYS):
            problems.append(f"{at}: unknown key {key!r} (expected one of {sorted(COMPONENT_KEYS)})")
        weight = comp.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            problems.append(f"{at}.weight: must be a finite number, got {weight!r}")
            weight = 0.0
        problems.extend(f"{at}.verifier: {p}" for p in validate_spec(comp["verifier"]))
        name = comp.get("name")
        if name is None:
            base = str(comp["verifier"].get("type"))
            seen[base] = seen.get(base, 0) + 1
            name = base if seen[base] == 1 else f"{base}_{seen[base]}"
        elif not isinstance(name, str) or not _NAME.match(name):
            problems.append(f"{at}.name: 1-64 letters, digits, '_', '.' or '-', got {name!r}")
        out.append((str(name), comp["verifier"], float(weight)))
    names = [n for n, _, _ in out]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{where}: two components are named {dup!r}")
    if problems:
        raise SpecError(problems)
    if len(_cache) >= 4096:
        _cache.clear()
    _cache[id(spec)] = (spec, out)
    return out


def score_task(task: dict[str, Any], completion: str | dict, *, tools: list[dict] | None = None,
               state: dict | None = None) -> Score:
    """Score one output of a task row with its `verifier`, or with its weighted `reward` components."""
    components = reward_components(task)
    if components is None:
        if "verifier" not in task:
            raise SpecError([f"task {task.get('id')!r}: needs a `verifier` (or a weighted `reward` list)"])
        return score(task["verifier"], completion, tools=tools, state=state)
    parts = [(name, weight, score(spec, completion, tools=tools, state=state)) for name, spec, weight in components]
    counted = [s for _, w, s in parts if w != 0]
    passed = all(s.passed for s in counted)
    failure = None if passed else first_failure([s.failure for s in counted if not s.passed])
    checks: dict[str, Any] = {
        "rewards": {name: {"weight": w, "reward": s.reward, "passed": s.passed, "failure": s.failure,
                           "checks": s.checks} for name, w, s in parts},
    }
    unsafe = [name for name, _, s in parts if s.unsafe]
    if unsafe:  # the suite's unsafe-action rate reads checks["unsafe"]: one unsafe component makes it unsafe
        calls = {}
        for _, _, s in parts:  # the same call flagged by two components is one unsafe call
            for call in (s.checks.get("unsafe") or {}).get("calls") or []:
                calls.setdefault(call.get("index"), call)
        checks["unsafe"] = {"ok": False, "components": unsafe, "calls": [calls[k] for k in sorted(calls, key=lambda k: -1 if k is None else k)]}
    total = round(sum(w * s.reward for _, w, s in parts), 6)
    return Score(total, passed, checks, failure, {name: float(s.reward) for name, _, s in parts})
