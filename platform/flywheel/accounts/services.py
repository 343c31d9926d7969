"""Writes for projects, memberships and API keys: one function per domain action."""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from dataclasses import dataclass

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from flywheel.accounts.models import ApiKey, Membership, Project, Role, Scope, WorkerHeartbeat
from flywheel.accounts.signals import project_created

KEY_PREFIX = "fw"


def hash_api_key(raw_key: str) -> str:
    return hashlib.sha256(raw_key.encode()).hexdigest()


SLUG_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$")


@transaction.atomic
def project_create(
    *, slug: str, name: str = "", owner: AbstractBaseUser | None = None, description: str = ""
) -> Project:
    if not SLUG_RE.fullmatch(slug):
        raise ValueError(
            f"invalid project slug {slug!r}: use 1-64 lower-case letters, digits and inner hyphens (e.g. support-agent)"
        )
    project = Project.objects.create(slug=slug, name=name or slug, description=description)
    project_created.send(sender=Project, project=project)  # the failures app seeds its taxonomy
    if owner is not None:
        Membership.objects.create(user=owner, project=project, role=Role.MAINTAINER)
    return project


class MembershipError(ValueError):
    """A membership change that is refused, with a message a maintainer can act on."""


def _check_keeps_a_maintainer(*, project: Project, user: AbstractBaseUser, new_role: str | None) -> None:
    """A project always keeps one maintainer, or nobody could manage it from the UI again."""
    if new_role == Role.MAINTAINER:
        return
    maintainers = Membership.objects.select_for_update().filter(project=project, role=Role.MAINTAINER)
    ids = list(maintainers.values_list("user_id", flat=True))
    if ids == [user.pk]:
        raise MembershipError(
            f"{user.get_username()} is the last maintainer of {project.slug}; make someone else maintainer first."
        )


@transaction.atomic
def membership_set(*, project: Project, user: AbstractBaseUser, role: str) -> Membership:
    """Add `user` to `project` with `role`, or change their role."""
    role = Role(role)
    _check_keeps_a_maintainer(project=project, user=user, new_role=role)
    membership, _ = Membership.objects.update_or_create(project=project, user=user, defaults={"role": role})
    return membership


@transaction.atomic
def membership_add(*, project: Project, username: str, role: str) -> Membership:
    """Add an existing user, named by username, to `project`. Accounts themselves are made by an admin."""
    User = get_user_model()
    user = User.objects.filter(**{User.USERNAME_FIELD: username.strip()}).first()
    if user is None:
        raise MembershipError(f"there is no user named {username.strip()!r}; an admin creates accounts.")
    already = MembershipError(
        f"{user.get_username()} is already a member of {project.slug}; change their role instead."
    )
    if Membership.objects.filter(project=project, user=user).exists():
        raise already
    # The check above only words the common case; two adds at once both pass it, and the unique constraint
    # decides. The insert runs in a savepoint so that the transaction stays usable after the refusal.
    try:
        with transaction.atomic():
            return Membership.objects.create(project=project, user=user, role=Role(role))
    except IntegrityError:
        raise already from None


@transaction.atomic
def membership_remove(*, project: Project, user: AbstractBaseUser) -> None:
    _check_keeps_a_maintainer(project=project, user=user, new_role=None)
    Membership.objects.filter(project=project, user=user).delete()


@dataclass(frozen=True)
class IssuedKey:
    api_key: ApiKey
    raw_key: str  # returned once, never stored


def api_key_create(
    *,
    project: Project,
    name: str,
    scopes: list[str] | None = None,
    created_by: AbstractBaseUser | None = None,
) -> IssuedKey:
    scopes = sorted({Scope(s).value for s in (scopes or [Scope.INGEST, Scope.READ])})
    prefix = secrets.token_hex(4)
    raw_key = f"{KEY_PREFIX}_{prefix}_{secrets.token_urlsafe(32)}"
    api_key = ApiKey.objects.create(
        project=project,
        name=name,
        prefix=prefix,
        digest=hash_api_key(raw_key),
        scopes=scopes,
        created_by=created_by,
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
        WorkerHeartbeat.objects.filter(pk=heartbeat.pk).update(
            seen_at=timezone.now(), tasks_seen=F("tasks_seen") + 1
        )
        heartbeat.refresh_from_db()
    return heartbeat


def worker_report(*, hostname: str, queues: list[str], gpus: int) -> WorkerHeartbeat:
    """A worker that started: the queues it consumes and the GPUs it has, replacing what it said before."""
    heartbeat, _ = WorkerHeartbeat.objects.update_or_create(
        hostname=hostname, defaults={"seen_at": timezone.now(), "queues": sorted(queues), "gpus": gpus})
    return heartbeat


def gpus_visible() -> int:
    """The GPUs this process may use: FLYWHEEL_WORKER_GPUS when the operator set it, else CUDA_VISIBLE_DEVICES
    (up to its first entry that names no device, as CUDA reads it), else the devices the NVIDIA driver lists,
    else 0. Read from the environment and /proc, without loading CUDA: a worker's main process must not
    initialise CUDA before it forks its pool."""
    if settings.FLYWHEEL_WORKER_GPUS is not None:
        return max(0, settings.FLYWHEEL_WORKER_GPUS)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = 0
        for entry in visible.split(","):
            if not entry.strip() or entry.strip().startswith("-"):
                break
            count += 1
        return count
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def project_lock(*, project: Project) -> None:
    """Hold the project's row lock until the current transaction ends: the one lock every writer that must
    see the project still as it read it takes (alias moves and the registry's sync, the leakage guard's
    check-and-save). Call it inside `transaction.atomic()`, before anything else of the project is locked."""
    Project.objects.select_for_update().filter(pk=project.pk).first()
