"""Projects (one per agent), who may see them (memberships with roles) and API keys."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class Project(models.Model):
    slug = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class Role(models.TextChoices):
    VIEWER = "viewer", "Viewer"
    REVIEWER = "reviewer", "Reviewer"
    MAINTAINER = "maintainer", "Maintainer"


# A role grants everything the roles below it grant.
ROLE_RANK = {Role.VIEWER: 1, Role.REVIEWER: 2, Role.MAINTAINER: 3}


class Membership(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.VIEWER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "project"], name="membership_unique_user_project")]

    def __str__(self) -> str:
        return f"{self.user} @ {self.project} ({self.role})"

    def grants(self, role: str) -> bool:
        return ROLE_RANK[Role(self.role)] >= ROLE_RANK[Role(role)]


class Scope(models.TextChoices):
    INGEST = "ingest", "Ingest trajectories"
    READ = "read", "Read trajectories"
    REVIEW = "review", "Review: assign failure modes, work the review queue"
    TRAIN = "train", "Train: start and cancel training jobs"
    PROMOTE = "promote", "Promote: move production to a version that passed the gate, roll it back"
    # The reference router's alone: a key with it can vouch for live evidence (flywheel.trajectories.vouch).
    ROUTE = "route", "Route: the router reads the key it vouches for its answers with"


class ApiKey(models.Model):
    """A project API key. Only a SHA-256 digest of the key is stored; the key itself is shown once.

    Keys carry 256 bits of randomness, so a fast unsalted digest is safe here (unlike passwords), and
    lookups stay one indexed query per request."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)  # shown in the UI to tell keys apart
    digest = models.CharField(max_length=64, unique=True)
    scopes = models.JSONField(default=list)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.project.slug}:{self.prefix}"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None


class WorkerHeartbeat(models.Model):
    """The last time each Celery worker ran a heartbeat task or started: proof that queued work gets done, and
    what the worker has. A worker reports its queues and GPUs when it starts.

    `make run` queues one at start-up and waits for it; the project list shows when a worker was last seen; a
    job may ask for as many GPUs as the largest `gpu` queue worker reported (flywheel.training.services)."""

    hostname = models.CharField(max_length=255, unique=True)
    seen_at = models.DateTimeField()
    tasks_seen = models.PositiveIntegerField(default=0)
    queues = models.JSONField(default=list, blank=True)  # the queues it consumes, as it reported them at start
    gpus = models.PositiveSmallIntegerField(null=True, blank=True)  # None: it never reported

    class Meta:
        ordering = ["-seen_at"]

    def __str__(self) -> str:
        return f"{self.hostname} @ {self.seen_at:%Y-%m-%d %H:%M:%S}"


class RateBucket(models.Model):
    """A token bucket of the API's abuse limits (`flywheel.accounts.ratelimit`): one row per API key and per
    client address with failed keys. Rows change only through one atomic upsert, so every process (web
    workers, the Celery worker) spends from the same bucket. A row missing is a full bucket."""

    name = models.CharField(max_length=100, primary_key=True)  # "key:<api key id>" or "addr:<address>"
    tokens = models.FloatField()
    # Seconds since the epoch by the application's clock (a float keeps the refill one portable expression).
    updated_at = models.FloatField()
    granted = models.BooleanField(default=True)  # whether the last take got its tokens (the upsert returns it)

    def __str__(self) -> str:
        return f"{self.name}: {self.tokens:.2f}"
