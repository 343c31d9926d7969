"""Eval runs: a model version measured on a suite version, with per-case results. Imported by `models.py`.

A run is made by a person (Evaluate on the suite's version page, or the API) and runs `python -m trainer
evaluate` on a GPU worker, or is recorded from a training job's own measurements (production before training,
the candidate's best checkpoint), so the gate's numbers and the dashboard's are the same numbers."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from flywheel.accounts.models import Project
from flywheel.runs import CancellableRun, DeviceUsage


class EvalRunStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


class EvalRun(CancellableRun, DeviceUsage):
    """A run a worker supervises (flywheel.runs): queued, running, then succeeded, failed or cancelled. Only a
    person's run is retried; one recorded from a job's files is the job's, and so is its device time (counted on
    the job: DeviceUsage stays empty here)."""

    NOUN = "run"
    SET_ON_LOST = {"pid": None}

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="eval_runs")
    model_version = models.ForeignKey("registry.ModelVersion", on_delete=models.CASCADE, related_name="eval_runs")
    suite_version = models.ForeignKey("evals.EvalSuiteVersion", on_delete=models.CASCADE, related_name="runs")
    job = models.ForeignKey("training.TrainingJob", null=True, blank=True, on_delete=models.SET_NULL,
                            related_name="eval_runs")
    source = models.CharField(max_length=16, default="manual")  # manual | job
    step = models.IntegerField(null=True, blank=True)  # the checkpoint's step, for a job's candidate
    status = models.CharField(max_length=16, choices=EvalRunStatus.choices, default=EvalRunStatus.QUEUED)
    samples = models.PositiveSmallIntegerField(default=4)
    # What the run is for: a plain measurement, or the measurement a regression suite is built from
    # (`evals.regression`: the suite keeps the cases production passes reliably); `options` holds its settings
    # and, once built, what it kept.
    purpose = models.CharField(max_length=32, default="measure")
    options = models.JSONField(default=dict, blank=True)
    metrics = models.JSONField(default=dict, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    pid = models.IntegerField(null=True, blank=True)  # its trainer's, while it runs

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"run {self.pk}"

    @property
    def retryable(self) -> bool:
        return super().retryable and self.source == "manual"


class EvalCaseResult(models.Model):
    """One case of a run: pass or fail (most samples passed), the pass rate over samples, and what it said."""

    run = models.ForeignKey(EvalRun, on_delete=models.CASCADE, related_name="results")
    case_id = models.CharField(max_length=200)
    passed = models.BooleanField()
    pass_rate = models.FloatField()
    mean_reward = models.FloatField(default=0.0)
    failures = models.JSONField(default=dict, blank=True)  # failure category -> samples
    output = models.TextField(blank=True, default="")  # the first sample's answer, for reading
    # Where the case came from (the row's origin), for per-mode pass rates on the dashboard.
    failure_mode_id = models.IntegerField(null=True, blank=True, db_index=True)
    trajectory_id = models.IntegerField(null=True, blank=True)
    latency_ms = models.FloatField(null=True, blank=True)
    tokens = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["id"]
        constraints = [models.UniqueConstraint(fields=["run", "case_id"], name="evalresult_unique_case")]
