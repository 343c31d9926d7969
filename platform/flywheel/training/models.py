"""A training job, the events its trainer printed, and the checkpoints it saved.

A job's life: `evaluating` (production is measured on the holdout to give advice) → `ready` (the advice is
shown; a person confirms) → `queued` → `running` → `succeeded` | `failed` | `cancelled`. A failed or
cancelled job can be retried: the trainer resumes from the last checkpoint in the job's directory."""

from __future__ import annotations

from typing import Any, ClassVar

from django.conf import settings
from django.db import models

from flywheel.accounts.models import Project
from flywheel.runs import CancellableRun, DeviceUsage


class JobStatus(models.TextChoices):
    EVALUATING = "evaluating", "Measuring production"
    READY = "ready", "Waiting for confirmation"
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


class Algorithm(models.TextChoices):
    GRPO = "grpo", "GRPO (RL with verifiable rewards)"
    SFT = "sft", "SFT (supervised on references)"
    DPO = "dpo", "DPO (references preferred over the agent's outputs)"
    SFT_GRPO = "sft_grpo", "SFT, then GRPO (one job, one gate)"


class TrainingJob(CancellableRun, DeviceUsage):
    """A job's run (flywheel.runs): `evaluating` both waits for a worker and, once one measures production,
    beats; a cancel stops it, and a job waiting for confirmation, at once."""

    QUEUED = (JobStatus.QUEUED, JobStatus.EVALUATING)
    RUNNING = (JobStatus.RUNNING, JobStatus.EVALUATING)
    ACTIVE = (JobStatus.EVALUATING, JobStatus.QUEUED, JobStatus.RUNNING)
    CANCEL_AT_ONCE = (JobStatus.EVALUATING, JobStatus.READY, JobStatus.QUEUED)
    NOUN = "job"
    SET_ON_LOST: ClassVar[dict[str, Any]] = {"failed_step": models.F("step"), "pid": None}

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="training_jobs")
    task_set_version = models.ForeignKey("environments.TaskSetVersion", on_delete=models.PROTECT, related_name="+")
    holdout_version = models.ForeignKey("evals.EvalSuiteVersion", null=True, blank=True, on_delete=models.PROTECT,
                                        related_name="+")
    regression_version = models.ForeignKey("evals.EvalSuiteVersion", null=True, blank=True,
                                           on_delete=models.PROTECT, related_name="+")
    # The model it starts from and must beat: production when the job was made.
    base_version = models.ForeignKey("registry.ModelVersion", on_delete=models.PROTECT, related_name="+")
    algorithm = models.CharField(max_length=16, choices=Algorithm.choices, default=Algorithm.GRPO)
    config = models.JSONField(default=dict)  # GRPOConfig fields that differ from the recipe's defaults
    num_gpus = models.PositiveSmallIntegerField(default=1)

    status = models.CharField(max_length=16, choices=JobStatus.choices, default=JobStatus.EVALUATING)
    step = models.PositiveIntegerField(default=0)
    max_steps = models.PositiveIntegerField(default=0)
    # Production on the holdout before training, and what the field advises from it.
    advice = models.JSONField(default=dict, blank=True)
    failed_step = models.IntegerField(null=True, blank=True)
    result = models.JSONField(default=dict, blank=True)  # the trainer's `done` event
    mlflow_run_id = models.CharField(max_length=64, blank=True, default="")
    candidate_version = models.ForeignKey("registry.ModelVersion", null=True, blank=True,
                                          on_delete=models.SET_NULL, related_name="+")

    # The trainer's process; the worker that holds it writes `heartbeat_at` while it runs (flywheel.runs).
    pid = models.IntegerField(null=True, blank=True)
    # Started from the API with `confirm`: training follows the measurement without waiting for a person.
    confirmed_in_advance = models.BooleanField(default=False)

    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["status", "heartbeat_at"], name="training_job_status_hb")]

    def __str__(self) -> str:
        return f"job {self.pk}"

    def lost_message(self) -> str:
        return (f"The worker running this job ({self.worker or 'unknown'}) stopped answering at step {self.step} "
                f"(no heartbeat since {self.heartbeat_at:%Y-%m-%d %H:%M:%S} UTC). Retry resumes from the last "
                "checkpoint.")

    @property
    def progress(self) -> float:
        return min(1.0, self.step / self.max_steps) if self.max_steps else 0.0


class JobEvent(models.Model):
    """One line the trainer printed (or one the platform added: queued, cancelled, reaped)."""

    job = models.ForeignKey(TrainingJob, on_delete=models.CASCADE, related_name="events")
    attempt = models.PositiveIntegerField(default=0)
    kind = models.CharField(max_length=32)
    step = models.IntegerField(null=True, blank=True)
    data = models.JSONField(default=dict)
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["job", "kind", "id"], name="training_event_job_kind")]


class Checkpoint(models.Model):
    job = models.ForeignKey(TrainingJob, on_delete=models.CASCADE, related_name="checkpoints")
    step = models.PositiveIntegerField()
    path = models.CharField(max_length=1000)
    holdout = models.JSONField(default=dict, blank=True)  # the holdout metrics at this step
    best = models.BooleanField(default=False)
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["step"]
        constraints = [models.UniqueConstraint(fields=["job", "step"], name="training_checkpoint_unique_step")]


class TrainingDefaults(models.Model):
    """A project's own recipe: GRPOConfig values its new jobs start from (the form's prefilled values, and
    what the API merges under a job's `config`), saved from the new-job form. The field's recipe applies to
    whatever the project does not set."""

    project = models.OneToOneField(Project, on_delete=models.CASCADE, related_name="training_defaults")
    config = models.JSONField(default=dict, blank=True)
    updated_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"training defaults of {self.project}"
