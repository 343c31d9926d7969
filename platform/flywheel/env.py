"""Settings from the environment, read in one place.

Every setting the platform takes from the outside goes through `get_env`, so a missing
required value fails loudly at start-up instead of at the first request that needs it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

_REQUIRED = object()


class MissingSetting(RuntimeError):
    pass


def _to_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError(f"not a boolean: {value!r}")


def get_env(name: str, default: Any = _REQUIRED, *, cast: Callable[[str], Any] = str) -> Any:
    """The value of environment variable `name`, cast; `default` when unset (required when no default)."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if default is _REQUIRED:
            raise MissingSetting(f"environment variable {name} is required")
        return default
    if cast is bool:
        cast = _to_bool
    try:
        return cast(raw)
    except ValueError as exc:
        raise MissingSetting(f"environment variable {name}={raw!r} is invalid: {exc}") from exc


def get_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if not raw:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]
