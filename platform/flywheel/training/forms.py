"""The new-job form's advanced section: one input per GRPOConfig field, made from the dataclass itself (its
defaults and its help), so a field added to the trainer shows up here without a change."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from flywheel.training.services import RECIPE, config_check, project_defaults


def config_fields(project=None) -> list[dict[str, Any]]:
    """One row per GRPOConfig field: its default (the project's saved value, else the field's recipe, else the
    dataclass's), whether the project set it, its help and its type."""
    from trainer.config import GRPOConfig, config_field_types

    types_of = config_field_types()
    defaults = GRPOConfig()
    saved = project_defaults(project)
    rows = []
    for field in dataclasses.fields(GRPOConfig):
        default = saved.get(field.name, RECIPE.get(field.name, getattr(defaults, field.name)))
        rows.append({
            "name": field.name,
            "project": field.name in saved,
            "help": field.metadata.get("help", ""),
            "default": json.dumps(default) if isinstance(default, list | dict | type(None) | bool) else default,
            "type": _type_name(types_of[field.name]),
        })
    return rows


def _type_name(allowed: tuple[type, ...]) -> str:
    kind = next((a for a in allowed if a is not type(None)), str)
    return "list" if kind in (list, tuple) else getattr(kind, "__name__", "str")


def config_from_post(post, *, algorithm: str = "grpo", project=None) -> tuple[dict[str, Any], dict[str, str]]:
    """The fields the user typed (blank keeps the default), each read as the value its text stands for, then
    checked as a job's config is (`services.config_check`: GRPOConfig's own types and ranges, with the recipe
    and the project's defaults under them). Errors per field."""
    from django.core.exceptions import ValidationError

    from trainer.config import config_field_types

    values: dict[str, Any] = {}
    for name, allowed in config_field_types().items():
        raw = post.get(f"cfg_{name}", "").strip()
        if raw:
            values[name] = _from_text(raw, allowed)
    try:
        config_check(algorithm=algorithm, config=values, project=project)
    except ValidationError as exc:
        return values, {name: messages[0] for name, messages in exc.message_dict.items()}
    return values, {}


def _from_text(raw: str, allowed: tuple[type, ...]) -> Any:
    """An input's text as the value it stands for (`null`, a number, true or false, a JSON list); text that
    reads as nothing else stays text, so that GRPOConfig's check names the field and the type it wants."""
    if raw == "null":
        return None
    if str in allowed:
        return raw
    if bool in allowed and raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    if int in allowed or float in allowed:
        for parse in (int, float):
            try:
                return parse(raw)
            except ValueError:
                pass
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw
