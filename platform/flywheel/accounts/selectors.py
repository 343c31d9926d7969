"""Reads for access control: which projects a user sees, and which project a key belongs to."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet
from django.utils import timezone

from flywheel.accounts.models import ApiKey, Membership, Project
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
