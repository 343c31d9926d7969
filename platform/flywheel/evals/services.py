"""Writes on eval suites and, through the same functions, on task sets: create, version, freeze, remove.

A "collection" is an `EvalSuite` or an `environments.TaskSet`; its rows are `collection.items`. Every change
to a collection's rows ends in `version_create`, which writes a new immutable version (rows + content
hash). Adding rows is promotion's job (`flywheel.evals.promotion`), the one way in.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from flywheel.accounts.models import Project
from flywheel.evals import leakage
from flywheel.evals import rows as row_shape
from flywheel.evals.models import EvalSuite, SuiteKind


def clean_name(name: str) -> str:
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": "Give it a name."})
    if len(name) > 120:
        raise ValidationError({"name": "At most 120 characters."})
    return name


def suite_create(*, project: Project, name: str, kind: str = SuiteKind.REGRESSION, description: str = "",
                 user: Any = None) -> EvalSuite:
    name = clean_name(name)
    if kind not in SuiteKind.values:
        raise ValidationError({"kind": f"Choose one of {', '.join(SuiteKind.values)}."})
    try:
        with transaction.atomic():
            return EvalSuite.objects.create(project=project, name=name, kind=kind, description=description,
                                            created_by=user)
    except IntegrityError:
        raise ValidationError({"name": f"This project already has an eval suite named {name!r}."}) from None


def version_create(*, collection: Any, user: Any = None, note: str = "") -> Any:
    """A new immutable version of the collection's current rows. Call inside the change's transaction."""
    with transaction.atomic():
        # The collection row's lock serialises version numbers between two concurrent changes.
        type(collection).objects.select_for_update().filter(pk=collection.pk).first()
        rows = [item.row() for item in collection.items.order_by("pk")]
        last = collection.versions.order_by("-number").first()
        version = collection.versions.create(
            number=(last.number if last else 0) + 1, rows=rows, size=len(rows),
            content_hash=row_shape.content_hash(rows), note=note[:300], created_by=user,
        )
        # The hash is of what the export serves: the rows as the database gives them back.
        stored = row_shape.content_hash(type(version).objects.get(pk=version.pk).rows)
        if stored != version.content_hash:
            version.content_hash = stored
            version.save(update_fields=["content_hash"])
        return version


def version_freeze(*, version: Any, user: Any = None) -> Any:
    """Mark a version fit for a job, after checking its rows against the other side once more: rows added
    there since this version was made may leak into it. Raises LeakageError listing the conflicts."""
    if version.frozen:
        return version
    collection = getattr(version, "suite", None) or version.task_set
    leakage.leakage_check(
        project=collection.project, side=collection.SIDE,
        candidates=[leakage.candidate_from_row(row) for row in version.rows],
    )
    version.frozen_at = timezone.now()
    version.frozen_by = user
    version.save(update_fields=["frozen_at", "frozen_by"])
    return version


def item_remove(*, item: Any, user: Any = None) -> Any:
    """Remove a row from its collection; returns the new version (older versions keep it)."""
    collection = getattr(item, "suite", None) or item.task_set
    with transaction.atomic():
        row_id = item.row_id
        item.delete()
        return version_create(collection=collection, user=user, note=f"removed {row_id}")
