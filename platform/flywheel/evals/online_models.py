"""Online evaluation of live traffic: a project's settings and the scores of the trajectories it sampled.
Imported by `models.py`; the work is in `flywheel.evals.online`."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from flywheel.accounts.models import Project
from flywheel.sealed import SealedField


class OnlineEvalSettings(models.Model):
    """What a project's online evaluation samples and scores with. Off until a maintainer turns it on; only
    trajectories that arrive after that are sampled (`enabled_at`, and `watermark`: the highest trajectory id
    already considered, so each trajectory is considered once)."""

    project = models.OneToOneField(Project, on_delete=models.CASCADE, related_name="online_eval")
    enabled = models.BooleanField(default=False)
    enabled_at = models.DateTimeField(null=True, blank=True)
    sample_rate = models.FloatField(default=0.10)  # the share of new trajectories scored, by a hash of their id
    max_per_hour = models.PositiveIntegerField(default=200)  # scored trajectories per clock hour, at most
    # (a) the verifier of a task of this set whose declared tools are the trajectory's
    task_set = models.ForeignKey("environments.TaskSet", null=True, blank=True, on_delete=models.SET_NULL,
                                 related_name="+")
    # (b) an llm_judge on the project's OpenAI-compatible endpoint (sent through flywheel.outbound)
    judge_enabled = models.BooleanField(default=False)
    judge_url = models.URLField(max_length=500, blank=True, default="")
    judge_model = models.CharField(max_length=200, blank=True, default="")
    # Write-only in the API and page; sealed at rest (flywheel.sealed).
    judge_api_key = SealedField(max_length=500, blank=True, default="")
    judge_rubric = models.TextField(blank=True, default="")
    threshold = models.FloatField(default=0.5)  # a reward below it puts the trajectory in the review queue
    watermark = models.BigIntegerField(default=0)
    # The hourly cap's count: trajectories taken for scoring in the clock hour that began at `cap_hour`.
    cap_hour = models.DateTimeField(null=True, blank=True)
    cap_used = models.PositiveIntegerField(default=0)
    # The last run's first problem (a judge that did not answer, a task the trainer refused); "" when none.
    last_error = models.CharField(max_length=500, blank=True, default="")
    last_error_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)
    updated_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")

    def __str__(self) -> str:
        return f"online evaluation of {self.project_id}"


class OnlineScore(models.Model):
    """One verifier's score of one sampled trajectory. `model_version` is the trajectory's own string (what
    the agent reported), so scores join a version's live metrics by the strings that name it."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="online_scores")
    trajectory = models.ForeignKey("trajectories.Trajectory", on_delete=models.CASCADE, related_name="online_scores")
    model_version = models.CharField(max_length=200, blank=True, default="")
    verifier = models.CharField(max_length=80)  # "task_set:<id>" or "llm_judge"
    source = models.CharField(max_length=80, blank=True, default="")  # the task whose verifier scored it
    reward = models.FloatField()
    passed = models.BooleanField()
    below_threshold = models.BooleanField()  # reward < the threshold at scoring time: in the review queue
    failure = models.CharField(max_length=32, blank=True, default="")
    checks = models.JSONField(default=dict)
    # The judge's spend on this score (its answer's usage; None for a task's verifier or when it said nothing).
    input_tokens = models.PositiveIntegerField(null=True, blank=True)
    output_tokens = models.PositiveIntegerField(null=True, blank=True)
    scored_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["trajectory", "verifier"], name="onlinescore_unique_verifier")]
        indexes = [
            models.Index(fields=["project", "model_version", "scored_at"], name="onlinescore_version_time"),
            models.Index(fields=["project", "scored_at"], name="onlinescore_project_time"),
            # The review queue asks "has a low score?" of each candidate: a small partial index answers it.
            models.Index(fields=["trajectory"], condition=models.Q(below_threshold=True), name="onlinescore_low"),
        ]
