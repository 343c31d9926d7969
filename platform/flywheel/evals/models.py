"""Eval suites (holdout, regression) and their cases, and the immutable versions a suite's changes make.

The abstract bases here are shared with `flywheel.environments` (task sets and tasks): an eval case and an
environment task are the same row shape, and a version of either is the same frozen list of rows.
A version is written once and never edited: its `rows` are the export, its `content_hash` their SHA-256
(`flywheel.evals.rows`); each distinct row is stored once (`StoredRow`). Freezing (maintainers) marks a version fit for a job after a last leakage check.
"""

from __future__ import annotations

import hashlib
from typing import Any

from django.conf import settings
from django.db import models

from flywheel.accounts.models import Project
from flywheel.evals import rows as row_shape


class EnvType(models.TextChoices):
    SINGLE_TURN = "single_turn", "Single turn"
    REPLAY = "replay", "Replay"
    WORKPLACE = "workplace", "Workplace"


class ItemBase(models.Model):
    """One row of a suite or a task set, as it stands now (a version copies it)."""

    ROW_PREFIX = "item"

    message_index = models.IntegerField(null=True, blank=True)  # the assistant turn it was promoted at
    messages = models.JSONField(default=list)  # the context: messages before that turn
    tools = models.JSONField(default=list)
    verifier = models.JSONField(default=dict)
    env = models.JSONField(null=True, blank=True)  # None: single_turn
    reference = models.JSONField(null=True, blank=True)  # the stated correct output the verifier passed
    # The leakage guard compares prompts by this digest (flywheel.evals.rows.prompt_digest); the text is
    # kept to show a conflict to a reviewer.
    prompt_digest = models.CharField(max_length=64, blank=True, default="", db_index=True)
    prompt_text = models.TextField(blank=True, default="")
    # Where the leakage guard was unsure that this row's request differs from a row on the other side, the
    # person who let it in and why: {"reason", "by", "at", "pairs": [{"other", "detail"}]}.
    leakage_confirmation = models.JSONField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        abstract = True

    @property
    def row_id(self) -> str:
        return f"{self.ROW_PREFIX}-{self.pk}"

    @property
    def env_type(self) -> str:
        return (self.env or {}).get("type", EnvType.SINGLE_TURN) if isinstance(self.env, dict) else EnvType.SINGLE_TURN

    def row(self) -> dict[str, Any]:
        return row_shape.build_row(
            row_id=self.row_id, messages=self.messages, tools=self.tools, verifier=self.verifier, env=self.env,
            trajectory_id=self.trajectory_id, failure_mode_id=self.failure_mode_id,  # type: ignore[attr-defined]
        )


class StoredRow(models.Model):
    """One row's content, stored once however many versions hold it (keyed by the SHA-256 of its canonical
    JSON): a collection that grows by one row per version costs one new row per version, not a full copy."""

    digest = models.CharField(max_length=64, primary_key=True)
    data = models.JSONField()

    @classmethod
    def store(cls, rows: list[dict[str, Any]]) -> list[str]:
        """The digests of `rows`, in order, after storing the ones not stored yet."""
        digests = [hashlib.sha256(row_shape.canonical_json(row).encode("utf-8")).hexdigest() for row in rows]
        cls.objects.bulk_create([cls(digest=d, data=row) for d, row in zip(digests, rows, strict=True)],
                                ignore_conflicts=True)
        return digests


class VersionBase(models.Model):
    """An immutable snapshot of a collection's rows. Made by every change; never edited afterwards.

    The rows themselves live in `StoredRow`; a version holds their digests in order (`rows` reads them)."""

    number = models.PositiveIntegerField()
    content_hash = models.CharField(max_length=64)
    row_digests = models.JSONField(default=list)
    size = models.PositiveIntegerField(default=0)
    note = models.CharField(max_length=300, blank=True, default="")  # what changed
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    frozen_at = models.DateTimeField(null=True, blank=True)
    frozen_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        abstract = True
        ordering = ["-number"]

    @property
    def frozen(self) -> bool:
        return self.frozen_at is not None

    _rows: list[dict[str, Any]] | None = None
    _rows_given = False

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The version's rows in order: what its JSONL export holds. Given when the version is made
        (`create(rows=...)`), they are stored on its first save."""
        if self._rows is None:
            stored = StoredRow.objects.in_bulk(self.row_digests)
            self._rows = [stored[d].data for d in self.row_digests]
        return self._rows

    @rows.setter
    def rows(self, value: list[dict[str, Any]]) -> None:
        self._rows, self._rows_given = list(value), True

    # What may change on a stored version: who froze it and when (and the hash, set once it is stored).
    MUTABLE = frozenset({"frozen_at", "frozen_by", "content_hash"})

    def save(self, *args: Any, **kwargs: Any) -> None:
        if self.pk is None:
            if self._rows_given:
                self.row_digests = StoredRow.store(self._rows or [])
        elif self._rows_given or not set(kwargs.get("update_fields") or ("row_digests",)) <= self.MUTABLE:
            raise ValueError(f"version {self.number} is immutable: make a new version instead")
        super().save(*args, **kwargs)
        self._rows_given = False


class SuiteKind(models.TextChoices):
    HOLDOUT = "holdout", "Holdout"
    REGRESSION = "regression", "Regression"


class EvalSuite(models.Model):
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="eval_suites")
    name = models.CharField(max_length=120)
    kind = models.CharField(max_length=16, choices=SuiteKind.choices, default=SuiteKind.REGRESSION)
    description = models.TextField(blank=True, default="")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    # The leakage guard's side: an eval row never shares a trajectory or a prompt with a training row.
    SIDE = "eval"
    LABEL = "eval suite"

    class Meta:
        ordering = ["name", "id"]
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="evalsuite_unique_project_name")]

    def __str__(self) -> str:
        return f"{self.name} ({self.kind})"

    @property
    def items(self) -> models.Manager:
        return self.cases


class EvalCase(ItemBase):
    ROW_PREFIX = "case"

    suite = models.ForeignKey(EvalSuite, on_delete=models.CASCADE, related_name="cases")
    trajectory = models.ForeignKey(
        "trajectories.Trajectory", null=True, blank=True, on_delete=models.SET_NULL, related_name="eval_cases"
    )
    failure_mode = models.ForeignKey(
        "failures.FailureMode", null=True, blank=True, on_delete=models.SET_NULL, related_name="eval_cases"
    )

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return self.row_id


class EvalSuiteVersion(VersionBase):
    suite = models.ForeignKey(EvalSuite, on_delete=models.CASCADE, related_name="versions")

    class Meta(VersionBase.Meta):
        constraints = [models.UniqueConstraint(fields=["suite", "number"], name="evalsuiteversion_unique_number")]

    def __str__(self) -> str:
        return f"{self.suite.name} v{self.number}"


# Eval runs, online evaluation's settings and scores (flywheel.evals.online) and verifier calibrations live in
# their own modules; imported here so Django finds them in this app.
from flywheel.evals.calibration_models import VerifierCalibration  # noqa: E402, F401
from flywheel.evals.online_models import OnlineEvalSettings, OnlineScore  # noqa: E402, F401
from flywheel.evals.run_models import EvalCaseResult, EvalRun  # noqa: E402, F401


class RequestVector(models.Model):
    """A request's sentence vector by the leakage guard's model, computed once: the guard compares a new row
    with every row of the other side, and running the model over thousands of them on each check would take
    minutes (`bench/leakage.py`). Keyed by the SHA-256 of the model's name and the request's text."""

    digest = models.CharField(max_length=64, primary_key=True)
    vector = models.BinaryField()  # float32, unit length
