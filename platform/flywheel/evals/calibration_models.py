"""Verifier calibrations: a verifier scored against a project's labeled trajectories on a worker, with its
progress and its figures. Imported by `models.py`; the work is in `flywheel.evals.calibration`."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import models

from flywheel.accounts.models import Project
from flywheel.runs import SupervisedRun, one_active_per_project


class CalibrationStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    DONE = "done", "Done"
    FAILED = "failed", "Failed"


CALIBRATION_ACTIVE = (CalibrationStatus.QUEUED, CalibrationStatus.RUNNING)


class VerifierCalibration(SupervisedRun):
    """One calibration (flywheel.runs): queued, running with its progress, then done with its figures in
    `result` or failed with why in `error`. Scoring runs the trainer's verifiers on agent data, so it runs
    on a worker under a time limit, never inside a web request. The row is its own outbox: the sweep sends
    a queued one again and fails one whose worker stopped beating."""

    ACTIVE = CALIBRATION_ACTIVE
    NOUN = "calibration"
    HEARTBEAT_TIMEOUT = timedelta(minutes=5)  # it beats every few trajectories scored

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="verifier_calibrations")
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    verifier = models.JSONField()  # the spec scored (a case's or task's, or one written for it)
    source = models.CharField(max_length=40, blank=True, default="")  # case:ID or task:ID
    agent = models.CharField(max_length=200, blank=True, default="")  # only trajectories of this agent
    status = models.CharField(max_length=16, choices=CalibrationStatus.choices, default=CalibrationStatus.QUEUED)
    total = models.PositiveIntegerField(default=0)
    done = models.PositiveIntegerField(default=0)
    # n, matrix, precision, recall, kappa, accuracy, too_few, disagreements (calibration.Calibration.to_dict)
    result = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["project", "-id"], name="calibration_project_id")]
        constraints = [
            # One at a time per project: calibration is open to every member and every `read` key, and each
            # holds a worker for up to its time limit.
            one_active_per_project("calibration_one_active_per_project", CALIBRATION_ACTIVE),
        ]

    def __str__(self) -> str:
        return f"calibration {self.pk} of project {self.project_id} ({self.status})"

    @property
    def percent(self) -> int:
        if self.status == CalibrationStatus.DONE:
            return 100
        return min(100, self.done * 100 // self.total) if self.total else 0
