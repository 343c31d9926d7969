"""Writes for projects, memberships and API keys: one function per domain action."""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from flywheel.accounts.models import ApiKey, Membership, Project, Role, Scope, WorkerHeartbeat

KEY_PREFIX = "fw"


def hash_api_key(raw_key: str) -> str:
    return hashlib.sha256(raw_key.encode()).hexdigest()


SLUG_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$")


@transaction.atomic
def project_create(*, slug: str, name: str = "", owner: AbstractBaseUser | None = None, description: str = "") -> Project:
    if not SLUG_RE.fullmatch(slug):
        raise ValueError(
            f"invalid project slug {slug!r}: use 1-64 lower-case letters, digits and inner hyphens (e.g. support-agent)"
        )
    project = Project.objects.create(slug=slug, name=name or slug, description=description)
    if owner is not None:
        Membership.objects.create(user=owner, project=project, role=Role.MAINTAINER)
    return project


def membership_set(*, project: Project, user: AbstractBaseUser, role: str) -> Membership:
    membership, _ = Membership.objects.update_or_create(project=project, user=user, defaults={"role": Role(role)})
    return membership


def membership_remove(*, project: Project, user: AbstractBaseUser) -> None:
    Membership.objects.filter(project=project, user=user).delete()


@dataclass(frozen=True)
class IssuedKey:
    api_key: ApiKey
    raw_key: str  # returned once, never stored


def api_key_create(
    *, project: Project, name: str, scopes: list[str] | None = None, created_by: AbstractBaseUser | None = None
) -> IssuedKey:
    scopes = sorted({Scope(s).value for s in (scopes or [Scope.INGEST, Scope.READ])})
    prefix = secrets.token_hex(4)
    raw_key = f"{KEY_PREFIX}_{prefix}_{secrets.token_urlsafe(32)}"
    api_key = ApiKey.objects.create(
        project=project, name=name, prefix=prefix, digest=hash_api_key(raw_key), scopes=scopes, created_by=created_by
    )
    return IssuedKey(api_key=api_key, raw_key=raw_key)


def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])
    return api_key


def worker_heartbeat_request() -> None:
    """Queue a heartbeat task once the current transaction commits (a worker never sees a missing row)."""
    from flywheel.accounts.tasks import worker_heartbeat  # tasks import this module

    transaction.on_commit(lambda: worker_heartbeat.delay())


def worker_heartbeat_record(*, hostname: str) -> WorkerHeartbeat:
    heartbeat, created = WorkerHeartbeat.objects.get_or_create(
        hostname=hostname, defaults={"seen_at": timezone.now(), "tasks_seen": 1}
    )
    if not created:
        WorkerHeartbeat.objects.filter(pk=heartbeat.pk).update(seen_at=timezone.now(), tasks_seen=F("tasks_seen") + 1)
        heartbeat.refresh_from_db()
    return heartbeat
