"""What the training tests build their jobs on: frozen versions of a task set or an eval suite, and a small
project of ticket-closing tasks with a registered base model (a folder with a config, never loaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flywheel.environments.models import TaskSet, TaskSetVersion
from flywheel.evals import rows as row_shape
from flywheel.evals.models import EvalSuite, EvalSuiteVersion
from flywheel.registry import services as registry


def frozen_version(model, owner, rows, **owner_fields):
    """Version 1 of a new task set (model TaskSetVersion, owner TaskSet) or eval suite holding `rows`."""
    collection = owner.objects.create(**owner_fields)
    key = "task_set" if model is TaskSetVersion else "suite"
    return model.objects.create(**{key: collection}, number=1, rows=rows, size=len(rows),
                                content_hash=row_shape.content_hash(rows))


def ticket_rows(prefix: str, n: int) -> list[dict]:
    tools = [{"type": "function", "function": {"name": "close_ticket", "parameters": {"type": "object"}}}]
    return [{"id": f"{prefix}-{i}", "messages": [{"role": "user", "content": f"Close ticket {prefix} {i}."}],
             "tools": tools,
             "verifier": {"type": "tool_call", "expected_calls": [{"name": "close_ticket", "arguments": {"id": i}}]}}
            for i in range(n)]


def tickets_world(project, user, folder: Path, *, holdout_cases: int) -> dict[str, Any]:
    """Production (a base model registered at `folder`), a 6-task task set and a holdout of `holdout_cases`."""
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    production = registry.base_model_register(project=project, name="tiny", path=str(folder), user=user)
    return {
        "project": project, "user": user, "production": production,
        "train": frozen_version(TaskSetVersion, TaskSet, ticket_rows("task", 6), project=project, name="tickets"),
        "holdout": frozen_version(EvalSuiteVersion, EvalSuite, ticket_rows("case", holdout_cases), project=project,
                                  name="holdout", kind="holdout"),
    }
