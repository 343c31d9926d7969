"""Numbers and yes/no values read from a form's text or a JSON body, with one message per field.

Every settings form and filter of the platform reads its fields through these (the canary's and the watch's
rules, online evaluation's settings, a clustering run's filter), so a value is accepted, refused and explained
the same way everywhere: `errors[name]` gets the field's message and the reader answers None, so that a caller
collects every wrong field before it raises one ValidationError. A field left out (or blank, for a form's text)
answers `default`, or is an error when `required`. A boolean is not a number, a float that is not whole is not a whole number, and infinities
and NaN are no number at all."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

TRUE = frozenset({"true", "on", "1", "yes"})
FALSE = frozenset({"false", "off", "0", "no"})


def _blank(raw: Any) -> bool:
    return raw is None or (isinstance(raw, str) and raw.strip() == "")


def _shown(raw: Any) -> str:
    text = raw.strip() if isinstance(raw, str) else str(raw)
    return text[:40] + ("…" if len(text) > 40 else "")


def _say(label: str, text: str) -> str:
    return f"{label}: {text}" if label else text[:1].upper() + text[1:]


def whole(data: Mapping[str, Any], name: str, errors: dict[str, str], *, low: int, high: int,
          default: int | None = None, label: str = "", required: bool = False) -> int | None:
    """The field as a whole number in [low, high]."""
    raw = data.get(name)
    if _blank(raw):
        if required:
            errors[name] = _say(label, f"a whole number from {low:,} to {high:,} is needed.")
        return default
    wanted = f"a whole number from {low:,} to {high:,}, not {_shown(raw)}."
    if isinstance(raw, bool):
        errors[name] = _say(label, wanted)
        return None
    if isinstance(raw, float):
        value = int(raw) if math.isfinite(raw) and raw.is_integer() else None
    elif isinstance(raw, int):
        value = raw
    else:
        text = str(raw).strip()
        value = int(text) if text.isascii() and text.lstrip("-").isdigit() and len(text) <= 19 else None
    if value is None or not low <= value <= high:
        errors[name] = _say(label, wanted)
        return None
    return value


def number(data: Mapping[str, Any], name: str, errors: dict[str, str], *, low: float, high: float,
           low_open: bool = False, high_open: bool = False, example: str = "", default: float | None = None,
           label: str = "", required: bool = False) -> float | None:
    """The field as a finite number in [low, high], either end left out with `low_open` / `high_open`."""
    raw = data.get(name)
    span = (f"above {low:g}" if low_open else f"from {low:g}") + (f" and below {high:g}" if high_open else
                                                                  (" and up to " if low_open else " to ") + f"{high:g}")
    if _blank(raw):
        if required:
            errors[name] = _say(label, f"a number {span} is needed" + (f", like {example}." if example else "."))
        return default
    wanted = f"a number {span}" + (f", like {example}" if example else "") + f"; not {_shown(raw)}."
    value: float | None
    if isinstance(raw, bool):
        value = None
    else:
        try:
            value = float(raw.strip() if isinstance(raw, str) else raw)
        except (TypeError, ValueError):
            value = None
    if (value is None or not math.isfinite(value) or not (low < value if low_open else low <= value)
            or not (value < high if high_open else value <= high)):
        errors[name] = _say(label, wanted)
        return None
    return value


def flag(data: Mapping[str, Any], name: str, errors: dict[str, str], *, default: bool | None = None,
         label: str = "") -> bool | None:
    """The field as true or false: a JSON boolean, or a form's text (a ticked box sends "on")."""
    raw = data.get(name)
    if isinstance(raw, bool):
        return raw
    if _blank(raw):
        return default
    text = raw.strip().lower() if isinstance(raw, str) else None
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    errors[name] = _say(label, f"true or false, not {_shown(raw)}.")
    return None
