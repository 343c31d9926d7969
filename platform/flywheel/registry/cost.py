"""What a version costs to serve: its price per 1M input and output tokens (set on the version, else on its base
model: an adapter is sold at its base's price), applied to the tokens its live traffic carried, and the GPU time
self-hosted serving reported, both per 1,000 requests (trajectories).

Tokens: a trajectory's `usage` as the agent sent it; only trajectories that carried input and output tokens
apart (prompt_tokens + completion_tokens, or input_tokens + output_tokens) are priced, and `priced_share` says
how many of the traffic's trajectories those were. GPU time: usage's `gpu_seconds`, a number the serving stack
reports for the request (a self-hosted server that times its GPU work puts it in its answer, e.g. a
`X-GPU-Seconds` header, and the agent copies it into usage); trajectories without it are left out of the mean.
Prices are in whatever currency the project uses; the pages print them with `$`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from django.core.exceptions import ValidationError

from flywheel.registry.models import PRICE_MAX, BaseModel, ModelVersion

PRICE_FIELDS = ("price_input_per_m", "price_output_per_m")
PER = 1000  # requests the pages and the API price


@dataclass(frozen=True)
class Price:
    """A version's prices per 1M tokens (None: not set on it nor on its base) and where each came from."""

    input_per_m: float | None
    output_per_m: float | None
    source: str  # "version", "base", "version and base" or "" (none set)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def price_of(version: ModelVersion) -> Price:
    """The version's own price per field, else its base model's."""
    values, sources = [], set()
    for field in PRICE_FIELDS:
        own, base = getattr(version, field), getattr(version.base, field)
        values.append(own if own is not None else base)
        if own is not None:
            sources.add("version")
        elif base is not None:
            sources.add("base")
    return Price(values[0], values[1], " and ".join(sorted(sources, reverse=True)))


def _price(value: Any, errors: dict[str, str], field: str) -> float | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, bool):
        errors[field] = "A number (a price per 1M tokens), not true or false."
        return None
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        errors[field] = f"A number (a price per 1M tokens), not {str(value)[:20]!r}."
        return None
    if not math.isfinite(number) or not 0 <= number <= PRICE_MAX:
        errors[field] = f"Between 0 and {PRICE_MAX:,.0f} per 1M tokens."
        return None
    return number


def price_set(*, target: ModelVersion | BaseModel, data: Mapping[str, Any]) -> ModelVersion | BaseModel:
    """Set a version's or a base model's price per 1M input and output tokens from `data` (form or JSON values);
    a field left out keeps its value, an empty one (or null) clears it (a version then uses its base's).
    ValidationError naming each field at fault; nothing is saved then."""
    errors: dict[str, str] = {}
    values = {field: _price(data[field], errors, field) for field in PRICE_FIELDS if field in data}
    if errors:
        raise ValidationError(errors)
    for field, value in values.items():
        setattr(target, field, value)
    target.save(update_fields=list(values))
    return target


def _per(value: float | None) -> float | None:
    return None if value is None else value * PER


def cost_of(metrics: Mapping[str, Any], price: Price) -> dict[str, Any]:
    """Per 1,000 requests, from a version's live metrics (flywheel.registry.live.metrics_of): the input and
    output tokens, what they cost at `price` (None without a price for a side that has tokens, or without
    tokens carried apart), and the GPU-seconds reported. `priced_share`: the trajectories priced, of all."""
    tokens_in, tokens_out = metrics.get("input_tokens_per_trajectory"), metrics.get("output_tokens_per_trajectory")
    token_cost = None
    if tokens_in is not None and tokens_out is not None:
        sides = [(tokens_in, price.input_per_m), (tokens_out, price.output_per_m)]
        if all(p is not None or t == 0 for t, p in sides):
            token_cost = sum(t * (p or 0.0) for t, p in sides) / 1e6 * PER
    trajectories = metrics.get("trajectories") or 0
    gpu = metrics.get("gpu_seconds_per_trajectory")
    return {
        "price_input_per_m": price.input_per_m, "price_output_per_m": price.output_per_m,
        "price_source": price.source,
        "input_tokens_per_1k": _per(tokens_in), "output_tokens_per_1k": _per(tokens_out),
        "token_cost_per_1k": token_cost,
        "priced_share": (metrics.get("split_n") or 0) / trajectories if trajectories else None,
        "gpu_seconds_per_1k": _per(gpu),
        "gpu_share": (metrics.get("gpu_n") or 0) / trajectories if trajectories else None,
    }


def money(value: float | None) -> str:
    """A cost as the pages print it: cents below $100, whole units above; — when unknown."""
    if value is None:
        return "—"
    return f"${value:,.2f}" if value < 100 else f"${value:,.0f}"


def gpu_time(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    return f"{seconds / 3600:,.2f} GPU-h" if seconds >= 3600 else f"{seconds:,.1f} GPU-s"


GATE_WINDOW = "7d"  # the live traffic the gate's page prices beside the holdout


def gate_cost(*, decision: Any) -> list[dict[str, Any]]:
    """Both sides of a gate decision priced per 1,000 requests, production's then the candidate's: on the
    holdout, the output tokens per case its "tokens per case" rule measured at the side's output price (the
    prompts are the same cases on both sides, so only the output differs); on live traffic, `cost_of` over
    the last GATE_WINDOW (a candidate has none until it serves). Read when shown, so a price set later counts."""
    from flywheel.registry import live

    tokens = next((r for r in decision.report.get("rules", []) if r.get("name") == "tokens per case"), {})
    sides = []
    for side, version in (("production", decision.production), ("candidate", decision.candidate)):
        price = price_of(version)
        per_case = tokens.get(side)
        holdout = (per_case * price.output_per_m / 1e6 * PER
                   if per_case is not None and price.output_per_m is not None else None)
        metrics = live.live_metrics(project=decision.project, version=version, window=GATE_WINDOW)
        sides.append({"side": side, "version": version, "price": price, "holdout_output_tokens": per_case,
                      "holdout_cost_per_1k": holdout, "live": metrics["cost"],
                      "live_trajectories": metrics["metrics"]["trajectories"]})
    return sides
