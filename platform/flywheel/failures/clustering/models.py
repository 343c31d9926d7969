"""Clustering runs, the suggestions they make, and the decisions reviewers take on them.

A run clusters a chosen set of failures on a worker (flywheel.failures.clustering.services); each suggestion
is a group of trajectories for a reviewer to accept as a new failure mode, merge into an existing one, split
(cluster its members again) or dismiss. A suggestion with a `target_mode` was attached to that existing
mode instead of being clustered (its members sit among the mode's). Dismissed groups are remembered so that
later runs do not suggest them again."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import models

from flywheel.accounts.models import Project
from flywheel.failures.models import FailureMode
from flywheel.runs import SupervisedRun, one_active_per_project


class RunStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    DONE = "done", "Done"
    FAILED = "failed", "Failed"


class RunStage(models.TextChoices):
    WAITING = "waiting", "Waiting for a worker"
    LOADING = "loading", "Reading failures"
    EMBEDDING = "embedding", "Embedding signatures"
    CLUSTERING = "clustering", "Clustering"
    SAVING = "saving", "Saving suggestions"
    DONE = "done", "Done"


ACTIVE_STATUSES = (RunStatus.QUEUED, RunStatus.RUNNING)

# How far each stage has brought the run, in percent, when it starts (the bar's position).
STAGE_START = {
    RunStage.WAITING: 0,
    RunStage.LOADING: 5,
    RunStage.EMBEDDING: 40,
    RunStage.CLUSTERING: 70,
    RunStage.SAVING: 90,
    RunStage.DONE: 100,
}


class ClusteringRun(SupervisedRun):
    """One clustering of a project's failures, by a worker, with its progress.

    The row is its own outbox (flywheel.outbox, flywheel.runs): `queued` since `queued_at`, or `running` with a
    heartbeat that stopped, is sent again by the sweep (up to LOST_WORKER_ATTEMPTS times, then it fails); a
    failed run says why and can be retried. Running it again replaces its suggestions: the work is recomputed
    from the filter, which is stored."""

    ACTIVE = ACTIVE_STATUSES
    NOUN = "clustering run"
    # It writes its progress at least every chunk of failures read or embedded.
    HEARTBEAT_TIMEOUT = timedelta(minutes=10)
    LOST_WORKER_ATTEMPTS = 3
    RESET_ON_QUEUE = {"stage": RunStage.WAITING, "done": 0}

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="clustering_runs")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # The chosen set: {"days", "limit", "outcome", "unassigned", "agent", "signal"} (services.RunFilter).
    filter = models.JSONField(default=dict, blank=True)
    # A split: the suggestion whose members this run clusters again (then `filter` is ignored).
    parent = models.ForeignKey(
        "ClusterSuggestion", null=True, blank=True, on_delete=models.SET_NULL, related_name="split_runs"
    )
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.QUEUED)
    stage = models.CharField(max_length=16, choices=RunStage.choices, default=RunStage.WAITING)
    total = models.PositiveIntegerField(default=0)  # failures in the set
    done = models.PositiveIntegerField(default=0)  # of them, through the current stage
    clusters = models.PositiveIntegerField(default=0)  # new groups suggested
    attached = models.PositiveIntegerField(default=0)  # failures suggested for existing modes
    noise = models.PositiveIntegerField(default=0)  # failures in no group
    skipped_dismissed = models.PositiveIntegerField(default=0)  # groups not suggested: dismissed before
    embedder = models.CharField(max_length=64, blank=True, default="")

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index(fields=["project", "-id"], name="clusterrun_project_id"),
            models.Index(
                fields=["status", "queued_at"],
                name="clusterrun_waiting",
                condition=models.Q(status__in=["queued", "running"]),
            ),
        ]
        constraints = [
            # One run at a time per project: a second start finds the first instead.
            one_active_per_project("clusterrun_one_active_per_project", ACTIVE_STATUSES),
        ]

    def __str__(self) -> str:
        return f"clustering run {self.pk} of {self.project.slug} ({self.status})"

    @property
    def percent(self) -> int:
        if self.status == RunStatus.DONE:
            return 100
        start = STAGE_START.get(self.stage, 0)
        following = [v for v in STAGE_START.values() if v > start]
        end = min(following) if following else 100
        within = self.done / self.total if self.total else 0
        return int(start + (end - start) * min(1.0, within))


class Decision(models.TextChoices):
    PENDING = "pending", "Pending"
    ACCEPTED = "accepted", "Accepted as a new mode"
    MERGED = "merged", "Merged into a mode"
    SPLIT = "split", "Split"
    DISMISSED = "dismissed", "Dismissed"


class ClusterSuggestion(models.Model):
    """A group of failures a run suggests, and what a reviewer decided about it."""

    run = models.ForeignKey(ClusteringRun, on_delete=models.CASCADE, related_name="suggestions")
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="+")
    position = models.PositiveIntegerField(default=0)  # biggest first, within its run
    size = models.PositiveIntegerField()
    label = models.CharField(max_length=200)
    terms = models.JSONField(default=list, blank=True)  # its most distinctive words (c-TF-IDF), best first
    tool = models.CharField(max_length=80, blank=True, default="")
    signal = models.CharField(max_length=32, blank=True, default="")  # its most distinctive signal kind
    suggested_category = models.CharField(max_length=32, blank=True, default="")  # its members' usual one
    trajectory_ids = models.JSONField(default=list)
    representative_ids = models.JSONField(default=list)  # nearest the centre first
    # The representatives' signatures, cut short: [{"id", "request", "step", "result"}] (agent text: escape it).
    examples = models.JSONField(default=list, blank=True)
    signals = models.JSONField(default=dict, blank=True)  # signal kind -> members carrying it
    centroid = models.JSONField(default=list, blank=True)  # unit vector in the embedder's space
    # Set: the members sit among this existing mode's; accepting assigns them to it.
    target_mode = models.ForeignKey(
        FailureMode, null=True, blank=True, on_delete=models.CASCADE, related_name="cluster_suggestions"
    )
    decision = models.CharField(max_length=16, choices=Decision.choices, default=Decision.PENDING)
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    failure_mode = models.ForeignKey(  # the mode it became or was merged into
        FailureMode, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["run_id", "position", "id"]
        indexes = [models.Index(fields=["project", "decision", "-id"], name="clustersugg_project_decision")]

    def __str__(self) -> str:
        return f"{self.label} ({self.size}, {self.decision})"


class DismissedGroup(models.Model):
    """A group a reviewer dismissed: later runs do not suggest a cluster whose centroid is this close, or
    whose members were mostly in it (engine.matches_dismissed)."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="dismissed_clusters")
    suggestion = models.OneToOneField(
        ClusterSuggestion, null=True, blank=True, on_delete=models.SET_NULL, related_name="dismissed_group"
    )
    label = models.CharField(max_length=200, blank=True, default="")
    embedder = models.CharField(max_length=64, blank=True, default="")
    centroid = models.JSONField(default=list, blank=True)
    trajectory_ids = models.JSONField(default=list)
    dismissed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    dismissed_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"dismissed: {self.label}"
