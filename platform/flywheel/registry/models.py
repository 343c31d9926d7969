"""Registry rows. The database is the system of record the pages read; MLflow mirrors it.

MLflow keeps one registered model per project and its aliases, but no history of an alias: `AliasEvent` is
that history (who moved it, when, from which version to which, why). A move is one database transaction;
mirroring it to MLflow and telling the serving stack (the webhook) happen after the commit and are retried
until they succeed, so an MLflow outage never leaves a half-applied promotion."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models

from flywheel.accounts.models import Project
from flywheel.sealed import SealedField


class Alias(models.TextChoices):
    PRODUCTION = "production", "Production"
    CANDIDATE = "candidate", "Candidate"
    # A version serving a share of traffic beside production (AliasAssignment.weight is its share).
    CANARY = "canary", "Canary"


# Prices per 1M tokens (flywheel.registry.cost): at most this, so a slip of the keyboard cannot make a version
# look a thousand times dearer than any model sold.
PRICE_MAX = 10_000.0


class Priced(models.Model):
    """What a million input (prompt) and output (completion) tokens cost; None: not set. A version without its
    own price uses its base model's (flywheel.registry.cost.price_of)."""

    price_input_per_m = models.FloatField(null=True, blank=True)
    price_output_per_m = models.FloatField(null=True, blank=True)

    class Meta:
        abstract = True


class BaseModel(Priced):
    """A model the platform can load: a local path (a Hugging Face folder), never a hub name."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="base_models")
    name = models.CharField(max_length=200)
    path = models.CharField(max_length=1000)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="registry_base_unique_name")]
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class SyncState(models.TextChoices):
    PENDING = "pending", "Waiting"
    DONE = "done", "Done"
    FAILED = "failed", "Failed, retried"


class ModelVersion(Priced):
    """A base model, alone or with a LoRA adapter. `number` counts per project, as MLflow's versions do."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="model_versions")
    number = models.PositiveIntegerField()
    base = models.ForeignKey(BaseModel, on_delete=models.PROTECT, related_name="versions")
    adapter_path = models.CharField(max_length=1000, blank=True, default="")  # "" is the base model alone
    adapter_sha256 = models.CharField(max_length=64, blank=True, default="")
    description = models.TextField(blank=True, default="")
    # Where it came from: {"job": id, "task_set_version": id, "failure_modes": [...], "trajectories": [...]}.
    lineage = models.JSONField(default=dict, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    # The MLflow mirror: its version number once registered there.
    mlflow_version = models.CharField(max_length=32, blank=True, default="")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "number"], name="registry_version_unique_number")]
        ordering = ["-number"]

    def __str__(self) -> str:
        return f"v{self.number}"

    @property
    def label(self) -> str:
        return f"v{self.number} · {self.base.name}" + (" + adapter" if self.adapter_path else "")


class AliasAssignment(models.Model):
    """Where an alias points now (one row per project and alias)."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="aliases")
    alias = models.CharField(max_length=32, choices=Alias.choices)
    version = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="aliases")
    # The share of traffic the alias serves: set for `canary` (0 < weight < 1); None for the others.
    weight = models.FloatField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "alias"], name="registry_alias_unique")]


class AliasEventKind(models.TextChoices):
    SET = "set", "Set"
    PROMOTE = "promote", "Promoted"
    ROLLBACK = "rollback", "Rolled back"
    # The alias no longer points anywhere (a canary that ended): to_version is the version it left.
    END = "end", "Ended"


class AliasEvent(models.Model):
    """One move of an alias: the history MLflow does not keep. Also the outbox of its side effects."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="alias_events")
    alias = models.CharField(max_length=32, choices=Alias.choices)
    kind = models.CharField(max_length=16, choices=AliasEventKind.choices)
    from_version = models.ForeignKey(ModelVersion, null=True, blank=True, on_delete=models.PROTECT,
                                     related_name="+")
    to_version = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="+")
    reason = models.TextField(blank=True, default="")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                             related_name="+")
    # Who moved it when no person did: "" (a person or the API), "gate" (automatic promotion), "canary" (the
    # canary decision), "watch" (the watch after a promotion). `evidence` holds the figures a rule acted on.
    actor = models.CharField(max_length=16, blank=True, default="")
    evidence = models.JSONField(default=dict, blank=True)
    weight = models.FloatField(null=True, blank=True)  # a canary's share of traffic after this move
    at = models.DateTimeField(auto_now_add=True)
    mlflow_state = models.CharField(max_length=16, choices=SyncState.choices, default=SyncState.PENDING)
    webhook_state = models.CharField(max_length=16, choices=SyncState.choices, default=SyncState.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)  # the sweep retries after this
    last_error = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["project", "alias", "-at"], name="registry_event_alias_at")]


class RegistrySettings(models.Model):
    """Per project: where to tell the serving stack that `production` moved."""

    project = models.OneToOneField(Project, on_delete=models.CASCADE, related_name="registry_settings")
    webhook_url = models.URLField(max_length=1000, blank=True, default="")
    # The webhook's body is signed with HMAC-SHA256 under this secret (header X-Flywheel-Signature).
    webhook_secret = SealedField(max_length=200, blank=True, default="")  # sealed at rest (flywheel.sealed)
    # A vLLM server started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING: each production version
    # is loaded under its own adapter name (never a reload of one name in place).
    vllm_url = models.URLField(max_length=1000, blank=True, default="")
    # The gate's rules (flywheel.registry.gate.GateRules fields); empty: the defaults.
    gate_rules = models.JSONField(default=dict, blank=True)
    # A candidate that passes the gate goes to production at once (else a maintainer clicks Promote).
    auto_promote = models.BooleanField(default=False)
    # Canary rollout (flywheel.registry.canary): the share a canary serves, the trajectories each arm needs
    # before a decision, the longest a canary may run, and whether the decision acts by itself.
    canary_weight = models.FloatField(default=0.1)
    canary_min_per_arm = models.PositiveIntegerField(default=1000)
    canary_max_hours = models.PositiveIntegerField(default=72)
    canary_auto = models.BooleanField(default=False)
    # The failure-rate increase (absolute, 0.05 = five points) under which a canary may be promoted: its
    # always-valid upper bound must be at most this (flywheel.registry.sequential).
    canary_tolerance = models.FloatField(default=0.05)
    # The watch after a full promotion: how long (hours) or how many trajectories it lasts (whichever ends
    # first; 0 trajectories: by time only), and whether a significantly worse version is rolled back (else
    # flagged on the page and the webhook).
    watch_hours = models.PositiveIntegerField(default=24)
    watch_trajectories = models.PositiveIntegerField(default=0)
    watch_rollback = models.BooleanField(default=False)
    # The share of traffic the replaced version keeps during the watch (the router's holdback arm), so that the
    # watch compares the two at the same hours; 0: no holdback, and the watch then compares with the replaced
    # version's hours before the move, which may flag but never roll back by itself.
    watch_holdback = models.FloatField(default=0.05)
    # Where notifications (a rollback by rule, a reopened failure mode) are mailed, one address a line; empty:
    # the webhook only. Sent through Django's mail backend.
    notify_emails = models.TextField(blank=True, default="")

    def clean(self) -> None:
        # Save-time check of where the worker will POST (the send-time check in flywheel.outbound is the one
        # that counts); a malformed URL is the field's own error already.
        from django.core.validators import URLValidator

        from flywheel.outbound import check_url_field

        for field in ("webhook_url", "vllm_url"):
            url = getattr(self, field)
            try:
                URLValidator()(url)
            except ValidationError:
                continue
            check_url_field(url, field)


class GateDecision(models.Model):
    """The gate's verdict on a candidate against production, with the report the page shows rule by rule."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="gate_decisions")
    job = models.ForeignKey("training.TrainingJob", null=True, blank=True, on_delete=models.SET_NULL,
                            related_name="gate_decisions")
    candidate = models.ForeignKey(ModelVersion, on_delete=models.CASCADE, related_name="gate_decisions")
    production = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="+")
    passed = models.BooleanField()
    rules = models.JSONField(default=dict)  # the GateRules it was judged by
    report = models.JSONField(default=dict)  # GateReport.to_dict(): each rule, both values, pass or fail
    error = models.TextField(blank=True, default="")  # the gate could not judge (no holdout, files missing)
    decided_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-decided_at", "-id"]


class Notification(models.Model):
    """Something a person should hear about without watching a page (a rollback by rule, a flagged version, a
    failure mode that came back): sent on the project's signed webhook with its event type, and mailed to
    RegistrySettings.notify_emails where set. The row is the outbox: the sweep retries until both are sent."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="notifications")
    event_type = models.CharField(max_length=64)  # e.g. "canary.rolled_back", "watch.flagged", "mode.reopened"
    subject = models.CharField(max_length=200)
    text = models.TextField(blank=True, default="")
    payload = models.JSONField(default=dict, blank=True)
    at = models.DateTimeField(auto_now_add=True)
    webhook_state = models.CharField(max_length=16, choices=SyncState.choices, default=SyncState.PENDING)
    email_state = models.CharField(max_length=16, choices=SyncState.choices, default=SyncState.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["-at", "-id"]


class WebhookDelivery(models.Model):
    """One attempt to tell the serving stack about a move of an alias (`event`), or to deliver a notification
    (`notification`): the delivery log."""

    event = models.ForeignKey(AliasEvent, null=True, blank=True, on_delete=models.CASCADE, related_name="deliveries")
    notification = models.ForeignKey(Notification, null=True, blank=True, on_delete=models.CASCADE,
                                     related_name="deliveries")
    target = models.CharField(max_length=16, default="webhook")  # webhook | vllm
    url = models.CharField(max_length=1000)
    at = models.DateTimeField(auto_now_add=True)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    duration_ms = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-at", "-id"]


class VersionName(models.Model):
    """A `model_version` string production traffic carries, mapped to a registry version by a maintainer.

    Adapter names the platform gives vLLM (`<slug>-v<n>`) map by themselves and need no row."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="version_names")
    name = models.CharField(max_length=200)
    version = models.ForeignKey(ModelVersion, on_delete=models.CASCADE, related_name="names")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="registry_versionname_unique")]
        ordering = ["name"]


class LiveRollup(models.Model):
    """Production traffic of one `model_version` string in one hour (the trajectory's started_at, else its
    arrival): the counts live metrics sum, kept up to date as trajectories are triaged and reviewed, so that
    no page scans trajectories. Keyed by the raw string: the mapping to versions is applied when read."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="+")
    model_version = models.CharField(max_length=200, blank=True, default="")
    hour = models.DateTimeField()
    trajectories = models.PositiveIntegerField(default=0)
    failures = models.PositiveIntegerField(default=0)  # effective outcome (a reviewer's wins) is failure
    # Triaged (triage_version > 0): the denominator of the signal rates, since a trajectory not triaged yet
    # has no signals (a replay waits for its triage again).
    triaged = models.PositiveIntegerField(default=0)
    # {signal kind: triaged trajectories carrying it}
    signals = models.JSONField(default=dict, blank=True)
    tokens_sum = models.BigIntegerField(default=0)
    tokens_n = models.PositiveIntegerField(default=0)  # trajectories that carried usage
    # Input and output tokens apart, of the trajectories that carried both (`split_n`): what a price applies to.
    tokens_in_sum = models.BigIntegerField(default=0)
    tokens_out_sum = models.BigIntegerField(default=0)
    split_n = models.PositiveIntegerField(default=0)
    # GPU time the serving reported (usage's gpu_seconds, flywheel.registry.cost), in ms, over `gpu_n`.
    gpu_ms_sum = models.BigIntegerField(default=0)
    gpu_n = models.PositiveIntegerField(default=0)
    latency_sum = models.BigIntegerField(default=0)  # ms
    latency_n = models.PositiveIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "model_version", "hour"],
                                               name="registry_rollup_unique")]
        indexes = [models.Index(fields=["project", "hour"], name="registry_rollup_project_hour")]


class LiveCheckKind(models.TextChoices):
    CANARY = "canary", "Canary decision"
    WATCH = "watch", "Watch after promotion"


class LiveCheckStatus(models.TextChoices):
    RUNNING = "running", "Running"
    PROMOTED = "promoted", "Promoted to production"  # canary: no harm found once each arm had its minimum
    ROLLED_BACK = "rolled_back", "Rolled back"
    FLAGGED = "flagged", "Flagged, waiting for a person"  # worse, and the project does not act by itself
    PASSED = "passed", "Watch ended, no harm found"
    EXPIRED = "expired", "Ended without enough traffic"
    ENDED = "ended", "Ended by a person"


class LiveCheck(models.Model):
    """A sequential comparison on live traffic: a canary against production, or a newly promoted production
    against the version it replaced (its traffic before the move). Each look updates `evidence`; the rule and
    its error rates are in flywheel.registry.sequential."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="live_checks")
    kind = models.CharField(max_length=16, choices=LiveCheckKind.choices)
    subject = models.ForeignKey(ModelVersion, on_delete=models.CASCADE, related_name="+")  # canary / new
    baseline = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="+")  # production / old
    status = models.CharField(max_length=16, choices=LiveCheckStatus.choices, default=LiveCheckStatus.RUNNING)
    started_at = models.DateTimeField()
    ends_at = models.DateTimeField()  # the canary's longest run, or the watch's window
    # The watch's baseline: the replaced version's traffic in [baseline_from, started_at).
    baseline_from = models.DateTimeField(null=True, blank=True)
    rules = models.JSONField(default=dict, blank=True)  # the settings it runs under, frozen at its start
    evidence = models.JSONField(default=dict, blank=True)  # the last look: counts, rates, p-values, why
    looks = models.PositiveIntegerField(default=0)
    decided_at = models.DateTimeField(null=True, blank=True)
    decided_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    event = models.ForeignKey(AliasEvent, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    class Meta:
        ordering = ["-started_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["project", "kind"], condition=models.Q(status="running"),
                                    name="registry_livecheck_one_running"),
        ]


class LiveRollupMember(models.Model):
    """What each trajectory adds to the rollup now: its bucket (project, string, hour) and its counts. A refresh
    subtracts a changed trajectory's old contribution and adds its new one, so its work follows the changed
    trajectories, never a bucket's size. A narrow table of its own rather than columns of the trajectory:
    writing a trajectory's row rewrites every index of that wide table (its text search's among them), a few
    hundred µs each. Plain values, no foreign keys: the rollup is derived data."""

    trajectory_id = models.BigIntegerField(primary_key=True)
    project_id = models.BigIntegerField()
    model_version = models.CharField(max_length=200, blank=True, default="")
    hour = models.DateTimeField()
    failed = models.BooleanField(default=False)
    triaged = models.BooleanField(default=False)
    signals = models.JSONField(default=list, blank=True)  # the signal kinds it carries (triaged only), sorted
    tokens = models.BigIntegerField(null=True, blank=True)
    latency = models.BigIntegerField(null=True, blank=True)
    tokens_in = models.BigIntegerField(null=True, blank=True)  # both or neither
    tokens_out = models.BigIntegerField(null=True, blank=True)
    gpu_ms = models.BigIntegerField(null=True, blank=True)
    # The trajectory's state counted: the later of its updated_at and triaged_at. A refresh that reads it
    # again with nothing newer skips it without reading its signals.
    seen_at = models.DateTimeField()


class LiveRollupState(models.Model):
    """The rollup's durable watermark (one row): trajectories whose `updated_at` or `triaged_at` passed it since
    the last refresh have buckets to recompute (flywheel.registry.live). Also what the last refresh did, for
    the bench and the pages."""

    watermark = models.DateTimeField(null=True, blank=True)  # None: never ran (the first run reads everything)
    ran_at = models.DateTimeField(null=True, blank=True)
    last_trajectories = models.PositiveIntegerField(default=0)  # dirty trajectories the last run found
    last_buckets = models.PositiveIntegerField(default=0)  # buckets it recomputed
    last_ms = models.PositiveIntegerField(default=0)
