"""Failure modes: a project's taxonomy of categories, the modes reviewers name, which trajectories carry
them, the history of every review change, and the review queue's claims.

A trajectory can carry several modes; an assignment is unique per (mode, trajectory), so bulk assignment
inserts with ON CONFLICT DO NOTHING and counts only what it added."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from flywheel.accounts.models import Project
from flywheel.trajectories.models import Trajectory


class TaxonomyCategory(models.Model):
    """One category of a project's failure taxonomy, seeded from trajectories.models.FailureCategory and
    edited by maintainers (renamed, described, added to; never deleted while a mode uses it)."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="failure_categories")
    key = models.SlugField(max_length=32)
    name = models.CharField(max_length=100)
    description = models.TextField(blank=True, default="")
    position = models.IntegerField(default=0)

    class Meta:
        ordering = ["position", "id"]
        verbose_name_plural = "taxonomy categories"
        constraints = [models.UniqueConstraint(fields=["project", "key"], name="taxonomy_unique_project_key")]

    def __str__(self) -> str:
        return f"{self.project_id}:{self.key}"


class FailureModeStatus(models.TextChoices):
    OPEN = "open", "Open"
    BEING_FIXED = "being_fixed", "Being fixed"
    FIXED = "fixed", "Fixed"


class FailureMode(models.Model):
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="failure_modes")
    name = models.CharField(max_length=200)
    description = models.TextField(blank=True, default="")
    category = models.ForeignKey(TaxonomyCategory, on_delete=models.PROTECT, related_name="failure_modes")
    status = models.CharField(max_length=16, choices=FailureModeStatus.choices, default=FailureModeStatus.OPEN)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    # When it counted as fixed (a person set the status, or a promoted version passed its eval cases), and
    # the registry version number serving then: a plain number, this app does not depend on the registry.
    fixed_at = models.DateTimeField(null=True, blank=True)
    fixed_version_number = models.PositiveIntegerField(null=True, blank=True)
    # When production traffic brought it back (flywheel.failures.recurrence), and why: the rule, its figures,
    # the matching trajectory ids.
    reopened_at = models.DateTimeField(null=True, blank=True)
    recurrence = models.JSONField(default=dict, blank=True)
    # The watch of a fixed mode between sweeps: its profile (centroid, threshold, dominant signal and its rate
    # before the fix), the last trajectory id looked at, the signal rule's running counts.
    recurrence_watch = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["name", "id"]
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="failuremode_unique_project_name")]
        indexes = [
            # The recurrence sweep: fixed modes only.
            models.Index(fields=["status"], name="failuremode_fixed", condition=models.Q(status="fixed")),
        ]

    def __str__(self) -> str:
        return self.name


class FailureModeAssignment(models.Model):
    failure_mode = models.ForeignKey(FailureMode, on_delete=models.CASCADE, related_name="assignments")
    trajectory = models.ForeignKey(Trajectory, on_delete=models.CASCADE, related_name="failure_assignments")
    message_index = models.IntegerField(null=True, blank=True)  # None: the whole trajectory
    note = models.TextField(blank=True, default="")
    assigned_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    assigned_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-assigned_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["failure_mode", "trajectory"], name="assignment_unique_mode_trajectory")
        ]
        indexes = [
            # A mode's page: its trajectories newest first, and its count per week.
            models.Index(fields=["failure_mode", "-trajectory"], name="assignment_mode_traj"),
        ]

    def __str__(self) -> str:
        return f"{self.failure_mode_id} on {self.trajectory_id}"


class ReviewField(models.TextChoices):
    OUTCOME = "outcome", "Outcome"
    MODES = "modes", "Failure modes"
    TAGS = "tags", "Tags"


class ReviewChange(models.Model):
    """One change a reviewer made to a trajectory's review: which field, the value before and after.

    Values are JSON: the outcome as a string ("" for none), modes and tags as sorted lists of names, so that
    the history still reads after a mode is renamed or deleted."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="+", db_index=False)
    trajectory = models.ForeignKey(Trajectory, on_delete=models.CASCADE, related_name="review_changes")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    field = models.CharField(max_length=16, choices=ReviewField.choices)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["trajectory", "-id"], name="reviewchange_traj_id"),
            models.Index(fields=["project", "user", "-id"], name="reviewchange_project_user_id"),
        ]

    def __str__(self) -> str:
        return f"{self.field} of {self.trajectory_id}: {self.before!r} -> {self.after!r}"


class QueueClaim(models.Model):
    """A reviewer holding a queue item until `expires_at`; one row per trajectory, taken over once expired.

    Claims are written only while holding the trajectory's row lock (flywheel.failures.queue), so two
    reviewers can never both hold one."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="+")
    trajectory = models.OneToOneField(Trajectory, on_delete=models.CASCADE, related_name="queue_claim")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    claimed_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.trajectory_id} by {self.user_id} until {self.expires_at:%H:%M:%S}"


class QueueSkip(models.Model):
    """A queue item a reviewer skipped: the queue does not offer it to them again (others still get it)."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="+")
    trajectory = models.ForeignKey(Trajectory, on_delete=models.CASCADE, related_name="+")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    skipped_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "trajectory"], name="queueskip_unique_user_traj")]


class RecurrenceRule(models.TextChoices):
    SIMILARITY = "similarity", "Close to its members"
    SIGNAL = "signal", "Its signal's rate rose"


class RecurrenceMatch(models.Model):
    """A production failure after a mode's fix that matches the mode (flywheel.failures.recurrence): close to
    its members by the clustering's features (`similarity`: cosine to their centroid), or carrying its dominant
    signal when that signal's rate rose (`signal`). Unique per (mode, trajectory). The review queue puts
    these first; the mode's page lists them and counts them per model version."""

    failure_mode = models.ForeignKey(FailureMode, on_delete=models.CASCADE, related_name="recurrence_matches")
    trajectory = models.ForeignKey(Trajectory, on_delete=models.CASCADE, related_name="recurrence_matches")
    rule = models.CharField(max_length=16, choices=RecurrenceRule.choices)
    similarity = models.FloatField(null=True, blank=True)
    signal = models.CharField(max_length=32, blank=True, default="")
    model_version = models.CharField(max_length=200, blank=True, default="")  # the trajectory's, for per-version counts
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-trajectory_id"]
        constraints = [
            models.UniqueConstraint(fields=["failure_mode", "trajectory"], name="recurrence_unique_mode_trajectory")
        ]
        indexes = [models.Index(fields=["trajectory"], name="recurrence_trajectory")]

    def __str__(self) -> str:
        return f"{self.failure_mode_id} again on {self.trajectory_id} ({self.rule})"
