"""Template filters of the training pages."""

from __future__ import annotations

from typing import Any

from django import template

register = template.Library()


@register.filter
def setting(value: Any) -> str:
    """A config or rule value as a person reads it: JSON's words for None and booleans, lists joined, floats
    without trailing noise."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(setting(v) for v in value) or "[]"
    return str(value)


@register.filter
def at(values: list, index: int) -> Any:
    """`values|at:i`: the i-th item (None past the end)."""
    try:
        return values[index]
    except (IndexError, TypeError, KeyError):
        return None
