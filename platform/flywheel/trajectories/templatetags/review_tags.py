"""Template helpers for the review pages. None of them marks anything safe: agent text stays escaped."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django import template

from flywheel.trajectories.presentation import pretty_json
from flywheel.trajectories.selectors import TrajectoryFilters

register = template.Library()


@register.simple_tag
def filter_qs(filters: TrajectoryFilters, **extra: Any) -> str:
    """The filters' query string with `extra` parameters set (a value of None or "" drops the key)."""
    params: dict[str, Any] = filters.params()
    for key, value in extra.items():
        if value in (None, ""):
            params.pop(key, None)
        else:
            params[key] = value
    return urlencode(params)


@register.filter
def as_json(value: Any) -> str:
    return pretty_json(value)


@register.filter
def duration_ms(value: Any) -> str:
    if value in (None, ""):
        return ""
    try:
        ms = float(value)
    except (TypeError, ValueError):
        return str(value)
    if ms < 1000:
        return f"{ms:.0f} ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f} s"
    return f"{ms / 60_000:.1f} min"
