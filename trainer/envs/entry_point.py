"""The `python` environment: an installed environment loaded from an entry point (command line only).

Row: `{..., "env": {"type": "python", "entry_point": "package.module:make_env", ...}}`. The entry point is
a class or function called with the task row; it returns an object with the built-in environments'
interface (`trainer.envs.Env`): a `tools` list, `reset() -> messages`, `step(completion) -> StepResult`,
`score() -> Score`. Setting `concurrent = True` on it makes the episode runner step its episodes in
threads (for an environment that waits on I/O).

This imports and runs code named by the row, so it is for rows a user writes for the trainer's command
line. Where rows come from elsewhere (the platform's task sets), the process sets
`FLYWHEEL_ENV_ENTRY_POINTS=0` and a `python` row is refused.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

_loaded: dict[str, Callable[[dict], Any]] = {}


def entry_points_allowed() -> bool:
    return os.environ.get("FLYWHEEL_ENV_ENTRY_POINTS", "1").strip().lower() not in ("0", "false", "no", "off")


def load_entry_point(task: dict[str, Any]) -> Callable[[dict], Any]:
    """The callable a `python` row names; ValueError naming the task and what is wrong with it."""
    where = f"task {task.get('id')!r}: env.entry_point"
    if not entry_points_allowed():
        raise ValueError(f"task {task.get('id')!r}: env type \"python\" is switched off here "
                         "(FLYWHEEL_ENV_ENTRY_POINTS=0): it runs code named by the row")
    spec = (task.get("env") or {}).get("entry_point")
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"{where} must be \"package.module:attribute\", got {spec!r}")
    if spec in _loaded:
        return _loaded[spec]
    module_name, attr = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"{where} {spec!r}: module {exc.name!r} is not installed") from None
    except Exception as exc:  # noqa: BLE001 (the user's module failed while importing: say so, with why)
        raise ValueError(f"{where} {spec!r}: importing {module_name} failed: {type(exc).__name__}: {exc}") from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{where} {spec!r}: {module_name} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{where} {spec!r}: {attr} is not callable (expected a class or a function)")
    _loaded[spec] = target
    return target


def make_python_env(task: dict[str, Any]) -> Any:
    factory = load_entry_point(task)
    env = factory(task)
    missing = [name for name in ("reset", "step", "score") if not callable(getattr(env, name, None))]
    if not isinstance(getattr(env, "tools", None), list):
        missing.append("tools (a list)")
    if missing:
        spec = task["env"]["entry_point"]
        raise ValueError(f"task {task.get('id')!r}: env.entry_point {spec!r} returned a {type(env).__name__} "
                         f"without {', '.join(missing)} (the environment interface is tools, reset, step, score)")
    return env
