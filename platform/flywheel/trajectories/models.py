"""Trajectories as agents send them, plus what reviewers add (outcome, comments, tags).

Messages are kept whole as JSON in the OpenAI chat format; annotations point at a message index.
A few fields are derived at ingestion (counts, tool errors, a text digest) so that the list page
filters on indexed columns instead of digging through JSON."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

from django.conf import settings
from django.db import models
from django.utils import timezone

from flywheel import outbox
from flywheel.accounts.models import Project
from flywheel.runs import SupervisedRun, one_active_per_project


class Outcome(models.TextChoices):
    SUCCESS = "success", "Success"
    FAILURE = "failure", "Failure"
    UNKNOWN = "unknown", "Unknown"


# Where a trajectory came in: the REST API, a UI upload, OTLP, `manage.py ingest`, the demo seeding.
SOURCES = ("api", "upload", "otlp", "cli", "demo")


class FailureCategory(models.TextChoices):
    """The field's failure categories: a trajectory's suggested category (from its triage signals) is one of
    these, and a project's failure-mode taxonomy is seeded from them."""

    FORMAT = "format", "Format"
    WRONG_TOOL = "wrong_tool", "Wrong tool"
    WRONG_ARGUMENTS = "wrong_arguments", "Wrong arguments"
    HALLUCINATED_API = "hallucinated_api", "Hallucinated API"
    BAD_PLANNING = "bad_planning", "Bad planning"
    UNSAFE_ACTION = "unsafe_action", "Unsafe action"
    RETRIEVAL_ERROR = "retrieval_error", "Retrieval error"
    OTHER = "other", "Other"


class SignalKind(models.TextChoices):
    """What a triage detector found (flywheel.trajectories.triage says how each is detected)."""

    INVALID_ARGUMENTS = "invalid_arguments", "Arguments not JSON"
    UNDECLARED_TOOL = "undeclared_tool", "Undeclared tool"
    SCHEMA_VIOLATION = "schema_violation", "Breaks the tool schema"
    TOOL_ERROR = "tool_error", "Tool error"
    UNSAFE_ACTION = "unsafe_action", "Unsafe action"
    NEGATIVE_FEEDBACK = "negative_feedback", "Negative feedback"
    HUMAN_INTERVENTION = "human_intervention", "Human intervention"
    LOOP = "loop", "Loop"
    NO_FINAL_ANSWER = "no_final_answer", "No final answer"


class Vouch(models.TextChoices):
    """Whether the platform vouches for the version a trajectory names (flywheel.trajectories.vouch): only
    vouched trajectories may move the canary or the watch by themselves. Anything else says why not."""

    NONE = "", "No evidence token"
    VOUCHED = "vouched", "Vouched for"
    MALFORMED = "malformed", "Not an evidence token"
    BAD_MAC = "bad_mac", "Not signed with the project's evidence key"
    OTHER_VERSION = "other_version", "Signed for another version"
    EXPIRED = "expired", "Its token had expired"
    FUTURE = "future", "Its token is dated in the future"
    REPLAYED = "replayed", "Its token vouched for another trajectory, or was sent by another key"


class Severity(models.IntegerChoices):
    LOW = 1, "low"
    MEDIUM = 2, "medium"
    HIGH = 3, "high"
    CRITICAL = 4, "critical"


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

    # Triage (flywheel.trajectories.triage). triage_version 0: not triaged yet (ingestion writes 0, so a
    # replay is triaged again); else the project's triage version (TriagePolicy.version) it was triaged under.
    # Migration 0009 indexes (project, triage_version): "untriaged" and "under an older policy" are index scans.
    # Defaults in the database too: ingestion's raw INSERT names only the columns it writes.
    triage_version = models.PositiveIntegerField(default=0, db_default=0)
    triaged_at = models.DateTimeField(null=True, blank=True)
    suggested_category = models.CharField(
        max_length=32, choices=FailureCategory.choices, blank=True, default="", db_default=""
    )
    triage_severity = models.PositiveSmallIntegerField(default=0, db_default=0)  # its signals' highest; 0: none
    # Live evidence (flywheel.trajectories.vouch): whether the router vouched for the version that answered, or
    # why not; the request id its token names (a second trajectory with it is a replay); who sent it ("key:<id>",
    # "user:<id>", "" from the command line or the demo), so that one key's share of an arm can be capped.
    vouch = models.CharField(max_length=16, choices=Vouch.choices, blank=True, default="", db_default="")
    vouch_request = models.CharField(max_length=64, blank=True, default="", db_default="")
    ingested_by = models.CharField(max_length=32, blank=True, default="", db_default="")
    # Live metrics (flywheel.registry.live): migration 0011 indexes updated_at and triaged_at (what the rollup's
    # refresh looks for) and (project, model_version, coalesce(started_at, created_at)) (one bucket's trajectories).

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
            # Replays of an evidence token are found by its request id; only traffic with a token is indexed.
            models.Index(fields=["project", "vouch_request"], name="traj_project_vouch_request",
                         condition=~models.Q(vouch_request="")),
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


class Upload(SupervisedRun):
    """A JSONL file uploaded in the UI, ingested line by line through the one ingest service.

    The file is kept in the database (not on a volume) so that a worker on another host can read it,
    and so that a failed or interrupted run can be retried: ingestion is an upsert, so a rerun of the
    whole file is safe. Its run (flywheel.runs) is held by a lease rather than watched by its heartbeat: a
    run whose lease expired has lost its worker."""

    RUNNING = (UploadStatus.PROCESSING,)
    ACTIVE = (UploadStatus.QUEUED, UploadStatus.PROCESSING)
    NOUN = "upload"
    LOST_WORKER_ATTEMPTS = 3
    RESET_ON_QUEUE = {"lease_owner": "", "lease_expires_at": None}
    SET_ON_LOST = {"lease_expires_at": None}

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="uploads")
    uploaded_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    filename = models.CharField(max_length=255)
    content = models.BinaryField()
    size_bytes = models.PositiveBigIntegerField(default=0)
    status = models.CharField(max_length=16, choices=UploadStatus.choices, default=UploadStatus.QUEUED)
    lines_total = models.PositiveIntegerField(default=0)
    lines_done = models.PositiveIntegerField(default=0)
    accepted = models.PositiveIntegerField(default=0)
    created = models.PositiveIntegerField(default=0)
    updated = models.PositiveIntegerField(default=0)
    rejected_count = models.PositiveIntegerField(default=0)
    # Per-line errors, [{"line", "external_id", "errors": [{"field", "message"}]}], the first few hundred.
    rejected = models.JSONField(default=list, blank=True)
    # The row is its own outbox (flywheel.outbox): `queued` since `queued_at`, sent again by the sweep when no
    # worker has taken it in time, as a lost message or a broker that was down leaves it. The run that holds
    # the upload: who (host, process, run) and until when. A run renews its lease (and its heartbeat) with
    # every chunk and writes nothing once another run holds it; an expired lease may be taken over.
    lease_owner = models.CharField(max_length=255, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index(fields=["project", "-id"], name="upload_project_id"),
            # The sweep: rows still waiting for, or held by, a worker.
            models.Index(
                fields=["status", "queued_at"],
                name="upload_waiting",
                condition=models.Q(status__in=["queued", "processing"]),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.project.slug}/{self.filename} ({self.status})"

    @classmethod
    def lost(cls, now: datetime) -> models.Q:
        return models.Q(status=UploadStatus.PROCESSING, lease_expires_at__lt=now)

    @property
    def stale(self) -> bool:
        """Processing, but its run's lease has expired: the run has probably lost its worker."""
        return (self.status == UploadStatus.PROCESSING and self.lease_expires_at is not None
                and self.lease_expires_at < timezone.now())

    @property
    def waiting_long(self) -> bool:
        """Queued for longer than the sweep waits: its message may have been lost."""
        return (self.status == UploadStatus.QUEUED and self.queued_at is not None
                and self.queued_at < timezone.now() - outbox.requeue_after())

    @property
    def retryable(self) -> bool:
        # A stuck or long-waiting upload is run again too: its lease, or its message, is taken over.
        return super().retryable or self.stale or self.waiting_long

    def retry_refusal(self) -> str:
        return f"The upload is {self.get_status_display().lower()}: only a failed, stuck or long-waiting upload is retried."


class TriageSignal(models.Model):
    """A fact a triage detector found in a trajectory, at a message index (None: the whole trajectory)."""

    # The project is repeated here so that the list's signal filter is one index range per kind
    # (signal_project_kind_traj), newest trajectory first, whatever the other projects hold.
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="+", db_index=False)
    trajectory = models.ForeignKey(Trajectory, on_delete=models.CASCADE, related_name="signals")
    kind = models.CharField(max_length=32, choices=SignalKind.choices)
    message_index = models.IntegerField(null=True, blank=True)
    severity = models.PositiveSmallIntegerField(choices=Severity.choices, default=Severity.MEDIUM)
    detail = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["trajectory_id", "message_index", "id"]
        indexes = [models.Index(fields=["project", "kind", "-trajectory"], name="signal_project_kind_traj")]

    def __str__(self) -> str:
        return f"{self.kind}@{self.message_index} of {self.trajectory_id}"

    @property
    def summary(self) -> str:
        """One line a reviewer reads on the signal's badge (templates escape it)."""
        detail = self.detail if isinstance(self.detail, dict) else {}
        kind = self.kind
        if kind == SignalKind.UNDECLARED_TOOL:
            return "not declared: " + ", ".join(map(str, detail.get("tools", [])))
        if kind == SignalKind.SCHEMA_VIOLATION:
            return "; ".join(map(str, detail.get("errors", [])[:2]))
        if kind == SignalKind.UNSAFE_ACTION:
            return ", ".join(f"{c.get('tool')} matches {c.get('rule')}" for c in detail.get("calls", []) if isinstance(c, dict))
        if kind == SignalKind.INVALID_ARGUMENTS:
            return str(detail.get("error", ""))
        if kind == SignalKind.TOOL_ERROR:
            return f"{detail.get('tool') or 'tool'}: {detail.get('excerpt', '')}"
        if kind == SignalKind.LOOP:
            return f"{detail.get('tool')} ×{detail.get('count')} with {detail.get('arguments')}"
        if kind == SignalKind.NO_FINAL_ANSWER:
            return str(detail.get("reason", ""))
        if kind == SignalKind.NEGATIVE_FEEDBACK:
            return str(detail.get("why", ""))
        if kind == SignalKind.HUMAN_INTERVENTION:
            return str(detail.get("intervention", ""))
        return json.dumps(detail, ensure_ascii=False)[:200]


class TriagePolicy(models.Model):
    """A project's triage policy: its unsafe-action rules, in the `unsafe` format of the tool_call verifier
    (`[{"name": glob, "arguments"?: {argument: matcher}}]`, RE2 regexes), edited by maintainers. `version`
    goes up with every edit and every re-run; a trajectory triaged under a lower one is out of date."""

    project = models.OneToOneField(Project, on_delete=models.CASCADE, related_name="triage_policy")
    unsafe = models.JSONField(default=list, blank=True)
    version = models.PositiveIntegerField(default=1)
    updated_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"triage policy of {self.project.slug} (v{self.version})"


class TriageRunStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    DONE = "done", "Done"
    FAILED = "failed", "Failed"


TRIAGE_RUN_ACTIVE = (TriageRunStatus.QUEUED, TriageRunStatus.RUNNING)


class TriageRun(SupervisedRun):
    """Triage run again over a whole project (after a policy change), by a worker, with its progress.

    The row is its own outbox (flywheel.outbox, flywheel.runs): `queued` since `queued_at`, or `running` with a
    heartbeat that stopped, is sent again by the sweep (up to LOST_WORKER_ATTEMPTS times, then it fails).
    Running it twice is harmless: it triages what is out of date."""

    ACTIVE = TRIAGE_RUN_ACTIVE
    NOUN = "triage re-run"
    HEARTBEAT_TIMEOUT = timedelta(minutes=5)  # it beats after every chunk of trajectories
    LOST_WORKER_ATTEMPTS = 3

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="triage_runs")
    started_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    version = models.PositiveIntegerField()  # the triage version it brings every trajectory to
    status = models.CharField(max_length=16, choices=TriageRunStatus.choices, default=TriageRunStatus.QUEUED)
    total = models.PositiveIntegerField(default=0)
    done = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["project", "-id"], name="triagerun_project_id")]
        constraints = [
            # One run at a time per project: a second Re-run while one is on its way finds it instead.
            one_active_per_project("triagerun_one_active_per_project", TRIAGE_RUN_ACTIVE),
        ]

    def __str__(self) -> str:
        return f"triage run {self.pk} of {self.project.slug} ({self.status})"

    @property
    def percent(self) -> int:
        if self.status == TriageRunStatus.DONE:
            return 100
        return min(100, self.done * 100 // self.total) if self.total else 0
