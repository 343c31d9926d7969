"""What the worker is doing to seed a demo project, for that project's pages to say while it works.

Platform-level and low: the pages of the trajectories and registry apps read it, `flywheel.seed` writes it,
and it imports no app."""

from __future__ import annotations

import json
import os
from pathlib import Path

from django.conf import settings


def _status_path(slug: str) -> Path:
    return Path(settings.VAR_DIR) / "demo-status" / f"{slug}.json"


def demo_status_set(*, project, text: str | None) -> None:
    """What the worker is doing to seed the demo project, for its pages to say ("building the demo model:
    step 300 of 1000"); None when it is done. A file beside the database: `make run`'s web process and
    workers share the var folder."""
    path = _status_path(project.slug)
    if text is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"text": text}))
    tmp.replace(path)  # a reader never sees half a file


def demo_status_of(*, project) -> str | None:
    """The demo's seeding step, while the worker seeds it."""
    try:
        return str(json.loads(_status_path(project.slug).read_text())["text"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
