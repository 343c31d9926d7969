"""Task sets and their environment tasks (what the trainer trains on), with immutable versions.

A task is the same row shape as an eval case (`flywheel.evals.models.ItemBase`); a synthetic variant is a
task made from another (`parent`), and carries its parent's origin, so the leakage guard treats it as the
same trajectory's task.

An environment server is a team's own environment (the trainer's `http` environment: `POST /reset`, `/step`,
`/verify`), registered by URL; a task set bound to one (`TaskSet.server`) holds tasks that run on it.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from flywheel.accounts.models import Project
from flywheel.evals.models import ItemBase, VersionBase


class EnvironmentServer(models.Model):
    """A team's environment server, registered by a maintainer at a URL the operator allows
    (FLYWHEEL_ENV_URL_ALLOWLIST) after it answered `/reset`."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="environment_servers")
    name = models.CharField(max_length=120)
    url = models.URLField(max_length=500)
    description = models.TextField(blank=True, default="")
    # The last time it answered /reset (at registration, or a maintainer's "check again").
    checked_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name", "id"]
        constraints = [
            models.UniqueConstraint(fields=["project", "name"], name="envserver_unique_project_name"),
            models.UniqueConstraint(fields=["project", "url"], name="envserver_unique_project_url"),
        ]

    def __str__(self) -> str:
        return self.name


class TaskSet(models.Model):
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="task_sets")
    # Tasks promoted into a task set bound to a server run on that server (env type `http`).
    server = models.ForeignKey(EnvironmentServer, null=True, blank=True, on_delete=models.PROTECT,
                               related_name="task_sets")
    name = models.CharField(max_length=120)
    description = models.TextField(blank=True, default="")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    SIDE = "train"
    LABEL = "task set"

    class Meta:
        ordering = ["name", "id"]
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="taskset_unique_project_name")]

    def __str__(self) -> str:
        return self.name

    @property
    def items(self) -> models.Manager:
        return self.tasks

    def server_env(self, *, max_turns: int | None = None) -> dict | None:
        """The `env` block of a task promoted here: on this set's environment server, or None without one."""
        if self.server_id is None:
            return None
        env: dict = {"type": "http", "url": self.server.url}
        if max_turns:
            env["max_turns"] = max_turns
        return env


class VariantKind(models.TextChoices):
    ARGUMENT = "argument", "Argument value from the project's trajectories"
    REPHRASE = "rephrase", "Rephrased request"


class Task(ItemBase):
    ROW_PREFIX = "task"

    task_set = models.ForeignKey(TaskSet, on_delete=models.CASCADE, related_name="tasks")
    trajectory = models.ForeignKey(
        "trajectories.Trajectory", null=True, blank=True, on_delete=models.SET_NULL, related_name="tasks"
    )
    failure_mode = models.ForeignKey(
        "failures.FailureMode", null=True, blank=True, on_delete=models.SET_NULL, related_name="tasks"
    )
    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.CASCADE, related_name="variants")
    variant_kind = models.CharField(max_length=16, choices=VariantKind.choices, blank=True, default="")
    variant_note = models.CharField(max_length=300, blank=True, default="")  # what the variant changed

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return self.row_id


class TaskSetVersion(VersionBase):
    task_set = models.ForeignKey(TaskSet, on_delete=models.CASCADE, related_name="versions")

    class Meta(VersionBase.Meta):
        constraints = [models.UniqueConstraint(fields=["task_set", "number"], name="tasksetversion_unique_number")]

    def __str__(self) -> str:
        return f"{self.task_set.name} v{self.number}"
