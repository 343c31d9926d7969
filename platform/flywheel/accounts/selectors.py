"""Reads: which projects a user sees, a project's members and keys, which project a key belongs to."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import F, QuerySet
from django.utils import timezone

from flywheel.accounts.models import ApiKey, Membership, Project, WorkerHeartbeat
from flywheel.accounts.services import hash_api_key


def projects_for_user(*, user: AbstractBaseUser) -> QuerySet[Project]:
    return Project.objects.filter(memberships__user=user).distinct()


def membership_get(*, user: AbstractBaseUser, project: Project) -> Membership | None:
    if not user.is_authenticated:
        return None
    return Membership.objects.filter(user=user, project=project).first()


def api_key_authenticate(*, raw_key: str) -> ApiKey | None:
    """The active key matching `raw_key`, or None. Touches last_used_at at most once a minute."""
    if not raw_key:
        return None
    api_key = (
        ApiKey.objects.select_related("project")
        .filter(digest=hash_api_key(raw_key), revoked_at__isnull=True)
        .first()
    )
    if api_key is not None:
        now = timezone.now()
        if api_key.last_used_at is None or (now - api_key.last_used_at).total_seconds() > 60:
            ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=now)
    return api_key


def memberships_for_user(*, user: AbstractBaseUser) -> QuerySet[Membership]:
    """The user's memberships with their projects, for the project list."""
    return Membership.objects.filter(user=user).select_related("project").order_by("project__slug")


def members_for_project(*, project: Project) -> QuerySet[Membership]:
    return Membership.objects.filter(project=project).select_related("user").order_by("user__username")


def api_keys_for_project(*, project: Project) -> QuerySet[ApiKey]:
    """Active keys first, newest first within each group."""
    return (
        ApiKey.objects.filter(project=project)
        .select_related("created_by")
        .order_by(F("revoked_at").desc(nulls_first=True), "-created_at")
    )


def api_key_get(*, project: Project, key_id: int) -> ApiKey | None:
    """A key of this project, or None (a key of another project is as good as missing)."""
    return ApiKey.objects.filter(project=project, pk=key_id).first()


def worker_last_seen() -> WorkerHeartbeat | None:
    return WorkerHeartbeat.objects.order_by("-seen_at").first()
