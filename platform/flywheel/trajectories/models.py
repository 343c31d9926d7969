"""Trajectories as agents send them, plus what reviewers add (outcome, comments, tags).

Messages are kept whole as JSON in the OpenAI chat format; annotations point at a message index.
A few fields are derived at ingestion (counts, tool errors, a text digest) so that the list page
filters on indexed columns instead of digging through JSON."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from flywheel.accounts.models import Project


class Outcome(models.TextChoices):
    SUCCESS = "success", "Success"
    FAILURE = "failure", "Failure"
    UNKNOWN = "unknown", "Unknown"


# Where a trajectory came in: the REST API, a UI upload, OTLP, `manage.py ingest`, the demo seeding.
SOURCES = ("api", "upload", "otlp", "cli", "demo")


class Tag(models.Model):
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="tags")
    name = models.CharField(max_length=64)

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="tag_unique_project_name")]

    def __str__(self) -> str:
        return self.name


class Trajectory(models.Model):
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="trajectories")
    external_id = models.CharField(max_length=255)
    agent = models.CharField(max_length=200, blank=True, default="")
    model_version = models.CharField(max_length=200, blank=True, default="")
    messages = models.JSONField(default=list)
    tools = models.JSONField(default=list)
    outcome = models.CharField(max_length=16, choices=Outcome.choices, default=Outcome.UNKNOWN)
    feedback = models.JSONField(null=True, blank=True)
    human_intervention = models.JSONField(null=True, blank=True)
    latency_ms = models.IntegerField(null=True, blank=True)
    usage = models.JSONField(null=True, blank=True)
    metadata = models.JSONField(default=dict, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    source = models.CharField(max_length=16, default="api")  # one of SOURCES

    # Derived at ingestion, for filtering and for the list page.
    message_count = models.PositiveIntegerField(default=0)
    tool_call_count = models.PositiveIntegerField(default=0)
    has_tool_error = models.BooleanField(default=False)
    title = models.CharField(max_length=200, blank=True, default="")  # the first user message, cut short
    search_text = models.TextField(blank=True, default="")  # message text, lower-cased, for text search

    # Review: the outcome a reviewer set wins over the agent's own and survives replays.
    reviewed_outcome = models.CharField(max_length=16, choices=Outcome.choices, blank=True, default="")
    reviewed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    reviewed_at = models.DateTimeField(null=True, blank=True)
    tags = models.ManyToManyField(Tag, blank=True, related_name="trajectories")

    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            # Replays update; concurrent duplicates are stopped by the database, not a check-then-insert.
            models.UniqueConstraint(fields=["project", "external_id"], name="trajectory_unique_project_external_id"),
        ]
        indexes = [
            # The list page pages by id, newest first, within a project (keyset pagination).
            models.Index(fields=["project", "-id"], name="traj_project_id"),
            models.Index(fields=["project", "outcome", "-id"], name="traj_project_outcome_id"),
            models.Index(fields=["project", "agent", "-id"], name="traj_project_agent_id"),
            models.Index(fields=["project", "model_version", "-id"], name="traj_project_model_id"),
            models.Index(fields=["project", "started_at"], name="traj_project_started"),
        ]

    def __str__(self) -> str:
        return f"{self.project.slug}/{self.external_id}"

    @property
    def effective_outcome(self) -> str:
        return self.reviewed_outcome or self.outcome


class Comment(models.Model):
    trajectory = models.ForeignKey(Trajectory, on_delete=models.CASCADE, related_name="comments")
    message_index = models.IntegerField(null=True, blank=True)  # None: on the whole trajectory
    author = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    body = models.TextField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at", "id"]


class UploadStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    PROCESSING = "processing", "Processing"
    DONE = "done", "Done"
    FAILED = "failed", "Failed"


class Upload(models.Model):
    """A JSONL file uploaded in the UI, ingested line by line through the one ingest service.

    The file is kept in the database (not on a volume) so that a worker on another host can read it,
    and so that a failed or interrupted run can be retried: ingestion is an upsert, so a rerun of the
    whole file is safe."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="uploads")
    uploaded_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    filename = models.CharField(max_length=255)
    content = models.BinaryField()
    size_bytes = models.PositiveBigIntegerField(default=0)
    status = models.CharField(max_length=16, choices=UploadStatus.choices, default=UploadStatus.QUEUED)
    attempts = models.PositiveIntegerField(default=0)
    lines_total = models.PositiveIntegerField(default=0)
    lines_done = models.PositiveIntegerField(default=0)
    accepted = models.PositiveIntegerField(default=0)
    created = models.PositiveIntegerField(default=0)
    updated = models.PositiveIntegerField(default=0)
    rejected_count = models.PositiveIntegerField(default=0)
    # Per-line errors, [{"line", "external_id", "errors": [{"field", "message"}]}], the first few hundred.
    rejected = models.JSONField(default=list, blank=True)
    error = models.TextField(blank=True, default="")  # why a run failed, shown in the UI
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["project", "-id"], name="upload_project_id")]

    def __str__(self) -> str:
        return f"{self.project.slug}/{self.filename} ({self.status})"
