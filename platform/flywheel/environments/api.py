"""The task-set endpoints of the JSON API: the same operations as eval suites (flywheel.evals.api)."""

from __future__ import annotations

from flywheel.environments.models import TaskSet
from flywheel.evals.api import register

router = register(model=TaskSet, prefix="task-sets", tag="task-sets", id_name="task_set_id")
