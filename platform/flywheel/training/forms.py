"""The new-job form's advanced section: one input per GRPOConfig field, made from the dataclass itself (its
defaults and its help), so a field added to the trainer shows up here without a change."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from flywheel.training.services import RECIPE, project_defaults


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


def config_from_post(post) -> tuple[dict[str, Any], dict[str, str]]:
    """The fields the user changed (blank means the default), each parsed by its type; errors per field."""
    values: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for row in config_fields():
        raw = post.get(f"cfg_{row['name']}", "").strip()
        if raw == "":
            continue
        kind = row["type"]
        try:
            if kind == "int":
                values[row["name"]] = int(raw)
            elif kind == "float":
                values[row["name"]] = float(raw)
            elif kind == "bool":
                if raw.lower() not in ("true", "false"):
                    raise ValueError
                values[row["name"]] = raw.lower() == "true"
            elif kind == "list":
                parsed = json.loads(raw)
                if not isinstance(parsed, list):
                    raise ValueError
                values[row["name"]] = parsed
            else:
                values[row["name"]] = None if raw == "null" else raw
        except ValueError:
            errors[row["name"]] = f"Expected a{'n' if kind[0] in 'aeiou' else ''} {kind}: {raw[:40]!r}."
    return values, errors
