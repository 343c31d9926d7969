"""Writes for the taxonomy, failure modes and their assignments: one function per domain action, called by
the pages, the API, the queue and the tests alike. Permission checks live in the views and the API; these
functions trust their caller, but every trajectory they touch is taken from the mode's own project."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import EmptyResultSet, ValidationError
from django.db import IntegrityError, connection, transaction
from django.db.models import QuerySet
from django.utils import timezone
from django.utils.text import slugify

from flywheel.accounts.models import Project
from flywheel.failures.history import modes_of, review_changes_record
from flywheel.failures.models import (
    FailureMode,
    FailureModeAssignment,
    FailureModeStatus,
    ReviewChange,
    ReviewField,
    TaxonomyCategory,
)
from flywheel.trajectories.models import FailureCategory, Trajectory

MAX_NAME_CHARS = FailureMode._meta.get_field("name").max_length
MAX_CATEGORY_NAME_CHARS = TaxonomyCategory._meta.get_field("name").max_length
MAX_TEXT_CHARS = 10_000

# What each seeded category means, shown on the taxonomy page until a maintainer rewrites it.
SEED_DESCRIPTIONS = {
    FailureCategory.FORMAT: "The output is malformed: arguments that are not JSON, a wrong answer format.",
    FailureCategory.WRONG_TOOL: "The agent called a tool that does not fit the step.",
    FailureCategory.WRONG_ARGUMENTS: "The right tool, called with wrong or schema-breaking arguments.",
    FailureCategory.HALLUCINATED_API: "A call to a tool or API the agent was never given.",
    FailureCategory.BAD_PLANNING: "Loops, missing steps, or an episode that ends without an answer.",
    FailureCategory.UNSAFE_ACTION: "An action the project's policy forbids.",
    FailureCategory.RETRIEVAL_ERROR: "The agent looked up the wrong thing or misread what it found.",
    FailureCategory.OTHER: "Anything the other categories do not cover.",
}


def taxonomy_seed(*, project: Project) -> int:
    """Give `project` the field's categories it lacks (all of them for a new project); returns how many were
    added. Safe to run twice or concurrently: the unique (project, key) constraint decides."""
    existing = set(TaxonomyCategory.objects.filter(project=project).values_list("key", flat=True))
    rows = [
        TaxonomyCategory(
            project=project, key=value, name=label, description=SEED_DESCRIPTIONS[value], position=position
        )
        for position, (value, label) in enumerate(FailureCategory.choices)
        if value not in existing
    ]
    TaxonomyCategory.objects.bulk_create(rows, ignore_conflicts=True)
    return len(rows)


def _clean_text(value: str, *, field: str, what: str, max_chars: int, required: bool = False) -> str:
    value = (value or "").strip()
    if required and not value:
        raise ValidationError({field: f"{what} is required."})
    if len(value) > max_chars:
        raise ValidationError({field: f"{what} is at most {max_chars:,} characters."})
    if "\x00" in value:  # PostgreSQL's text cannot hold NUL: the write would fail with a 500 instead
        raise ValidationError({field: f"{what} cannot contain a NUL character."})
    return value


def _category_get(*, project: Project, category_key: str) -> TaxonomyCategory:
    category = TaxonomyCategory.objects.filter(project=project, key=category_key).first()
    if category is None and not TaxonomyCategory.objects.filter(project=project).exists():
        taxonomy_seed(project=project)  # a project made outside project_create (admin, fixtures)
        category = TaxonomyCategory.objects.filter(project=project, key=category_key).first()
    if category is None:
        keys = ", ".join(TaxonomyCategory.objects.filter(project=project).values_list("key", flat=True))
        raise ValidationError({"category": f"No category {str(category_key)[:40]!r} in this project; one of {keys}."})
    return category


def taxonomy_category_create(*, project: Project, name: str, description: str = "", key: str = "") -> TaxonomyCategory:
    """Add a category to the project's taxonomy; its key is made from the name unless given."""
    if not TaxonomyCategory.objects.filter(project=project).exists():
        taxonomy_seed(project=project)
    name = _clean_text(name, field="name", what="A category name", max_chars=MAX_CATEGORY_NAME_CHARS, required=True)
    description = _clean_text(description, field="description", what="A description", max_chars=MAX_TEXT_CHARS)
    key = slugify(key or name).replace("-", "_")[:32]
    if not key:
        raise ValidationError({"key": "A category key needs letters or digits."})
    position = (TaxonomyCategory.objects.filter(project=project).order_by("-position").values_list("position", flat=True).first() or 0) + 1
    try:
        with transaction.atomic():
            return TaxonomyCategory.objects.create(
                project=project, key=key, name=name, description=description, position=position
            )
    except IntegrityError:
        raise ValidationError({"key": f"The taxonomy already has a category {key!r}."}) from None


def taxonomy_category_update(*, category: TaxonomyCategory, name: str, description: str = "") -> TaxonomyCategory:
    """Rename or describe a category. Its key stays: API clients and suggestions refer to it."""
    category.name = _clean_text(
        name, field="name", what="A category name", max_chars=MAX_CATEGORY_NAME_CHARS, required=True
    )
    category.description = _clean_text(description, field="description", what="A description", max_chars=MAX_TEXT_CHARS)
    category.save(update_fields=["name", "description"])
    return category


def taxonomy_category_delete(*, category: TaxonomyCategory) -> None:
    """Delete a category no failure mode uses; one in use is refused with the modes that use it."""
    with transaction.atomic():
        names = list(category.failure_modes.order_by("name").values_list("name", flat=True)[:6])
        if names:
            shown = ", ".join(names[:5]) + (", …" if len(names) > 5 else "")
            raise ValidationError(
                {"category": f"{category.name} is used by failure modes ({shown}); move them to another category first."}
            )
        category.delete()


def failure_mode_create(
    *,
    project: Project,
    name: str,
    category_key: str,
    description: str = "",
    user: AbstractBaseUser | None,
    status: str = FailureModeStatus.OPEN,
) -> FailureMode:
    name = _clean_text(name, field="name", what="A failure mode's name", max_chars=MAX_NAME_CHARS, required=True)
    description = _clean_text(description, field="description", what="A description", max_chars=MAX_TEXT_CHARS)
    if status not in FailureModeStatus.values:
        raise ValidationError({"status": f"Unknown status {str(status)[:40]!r}; one of {', '.join(FailureModeStatus.values)}."})
    category = _category_get(project=project, category_key=category_key)
    try:
        with transaction.atomic():
            mode = FailureMode.objects.create(
                project=project, name=name, description=description, category=category, status=status, created_by=user
            )
            if status == FailureModeStatus.FIXED:  # recorded as fixed from the start: by what serves now
                from flywheel.failures import recurrence

                recurrence.failure_mode_fixed_set(failure_mode=mode, by="person",
                                                  version_number=recurrence.production_version_number(project))
            return mode
    except IntegrityError:
        raise ValidationError({"name": f"This project already has a failure mode named {name!r}."}) from None


def failure_mode_update(
    *, failure_mode: FailureMode, name: str, category_key: str, description: str = "", status: str
) -> FailureMode:
    failure_mode.name = _clean_text(
        name, field="name", what="A failure mode's name", max_chars=MAX_NAME_CHARS, required=True
    )
    failure_mode.description = _clean_text(
        description, field="description", what="A description", max_chars=MAX_TEXT_CHARS
    )
    if status not in FailureModeStatus.values:
        raise ValidationError({"status": f"Unknown status {str(status)[:40]!r}; one of {', '.join(FailureModeStatus.values)}."})
    becomes_fixed = status == FailureModeStatus.FIXED and failure_mode.status != FailureModeStatus.FIXED
    failure_mode.status = status
    failure_mode.category = _category_get(project=failure_mode.project, category_key=category_key)
    try:
        with transaction.atomic():
            failure_mode.save()
            if becomes_fixed:
                # A person says it is fixed: by whatever serves production now; production's traffic from
                # here on is watched for its return (flywheel.failures.recurrence).
                from flywheel.failures import recurrence

                recurrence.failure_mode_fixed_set(
                    failure_mode=failure_mode, by="person",
                    version_number=recurrence.production_version_number(failure_mode.project),
                )
    except IntegrityError:
        raise ValidationError({"name": f"This project already has a failure mode named {failure_mode.name!r}."}) from None
    return failure_mode


TrajectorySelection = Iterable[Trajectory | int] | QuerySet[Trajectory]


def _ids_sql(*, project: Project, trajectories: TrajectorySelection) -> tuple[str, list[Any]] | None:
    """SQL selecting the ids of `trajectories` that belong to `project`, with its parameters; None for a
    selection of nothing (no ids, or a queryset Django knows is empty), which SQL's `IN ()` cannot say.

    A queryset (the list's filter, "all N matching") stays a subquery: its ids never travel through Python."""
    if isinstance(trajectories, QuerySet):
        qs = trajectories.filter(project=project).order_by().values("id")
    else:
        ids = {t.pk if isinstance(t, Trajectory) else int(t) for t in trajectories}
        qs = Trajectory.objects.filter(project=project, id__in=ids).order_by().values("id")
    try:
        sql, params = qs.query.sql_with_params()
    except EmptyResultSet:
        return None
    return sql, list(params)


def failure_mode_assign(
    *,
    failure_mode: FailureMode,
    trajectories: TrajectorySelection,
    user: AbstractBaseUser | None,
    message_index: int | None = None,
    note: str = "",
) -> int:
    """Assign the mode to `trajectories` (Trajectory objects, ids, or a queryset such as the list's filter);
    returns how many were newly assigned. A trajectory that already carries the mode is left as it is, and
    one of another project is ignored. Each new assignment is recorded in the review history."""
    note = _clean_text(note, field="note", what="A note", max_chars=MAX_TEXT_CHARS)
    if message_index is not None and message_index < 0:
        raise ValidationError({"message_index": f"No message {message_index}: indexes start at 0."})
    project = failure_mode.project
    selected = _ids_sql(project=project, trajectories=trajectories)
    if selected is None:
        return 0
    ids_sql, ids_params = selected
    if message_index is not None:
        too_short = Trajectory.objects.extra(where=[f"id IN ({ids_sql})"], params=ids_params).filter(
            message_count__lte=message_index
        )
        short = too_short.values_list("id", "message_count").first()
        if short is not None:
            raise ValidationError(
                {"message_index": f"No message {message_index} in trajectory {short[0]}; it has {short[1]}."}
            )
    table = connection.ops.quote_name(FailureModeAssignment._meta.db_table)
    # One statement: the unique (mode, trajectory) constraint, not a check-then-insert, keeps a trajectory
    # from being added twice, also when two reviewers assign the same selection at once.
    sql = f"""
        INSERT INTO {table} (failure_mode_id, trajectory_id, message_index, note, assigned_by_id, assigned_at)
        SELECT %s, sel.id, %s, %s, %s, %s FROM ({ids_sql}) sel WHERE true
        ON CONFLICT (failure_mode_id, trajectory_id) DO NOTHING
        RETURNING trajectory_id
    """
    params = [failure_mode.pk, message_index, note, user.pk if user else None, timezone.now(), *ids_params]
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            added = [row[0] for row in cursor.fetchall()]
        _record_mode_changes(project=project, trajectory_ids=added, user=user, name=failure_mode.name, added=True)
    return len(added)


def failure_mode_unassign(*, failure_mode: FailureMode, trajectories: TrajectorySelection, user: AbstractBaseUser | None) -> int:
    """Take the mode off `trajectories`; returns how many carried it. Recorded in the review history."""
    project = failure_mode.project
    selected = _ids_sql(project=project, trajectories=trajectories)
    if selected is None:
        return 0
    ids_sql, ids_params = selected
    with transaction.atomic():
        links = FailureModeAssignment.objects.filter(failure_mode=failure_mode).extra(
            where=[f"trajectory_id IN ({ids_sql})"], params=ids_params
        )
        removed = list(links.values_list("trajectory_id", flat=True))
        FailureModeAssignment.objects.filter(failure_mode=failure_mode, trajectory_id__in=removed).delete()
        _record_mode_changes(project=project, trajectory_ids=removed, user=user, name=failure_mode.name, added=False)
    return len(removed)


def _record_mode_changes(
    *, project: Project, trajectory_ids: list[int], user: AbstractBaseUser | None, name: str, added: bool
) -> None:
    if not trajectory_ids:
        return
    now_modes = modes_of(trajectory_ids=trajectory_ids)
    changes = []
    for trajectory_id in trajectory_ids:
        after = now_modes.get(trajectory_id, [])
        before = sorted(set(after) - {name}) if added else sorted({*after, name})
        changes.append((trajectory_id, before, after))
    review_changes_record(project=project, user=user, field=ReviewField.MODES, changes=changes)


def failure_mode_delete(*, failure_mode: FailureMode, user: AbstractBaseUser | None) -> None:
    """Delete a mode and its assignments; each trajectory's history records the mode going."""
    with transaction.atomic():
        ids = list(failure_mode.assignments.values_list("trajectory_id", flat=True))
        FailureModeAssignment.objects.filter(failure_mode=failure_mode).delete()
        _record_mode_changes(project=failure_mode.project, trajectory_ids=ids, user=user, name=failure_mode.name, added=False)
        failure_mode.delete()


def review_change_revert(*, change: ReviewChange, user: AbstractBaseUser | None) -> None:
    """Put back what `change` replaced (the queue's undo), as a new change in the history.

    Modes and tags are reverted by their difference (what the change added goes, what it removed comes
    back), so later changes to other modes or tags stay. An outcome is reverted only while it is still the
    one the change set: a later review is not overwritten."""
    from flywheel.failures import review  # review.py imports the history, as this module does

    trajectory = Trajectory.objects.get(pk=change.trajectory_id)
    before, after = change.before, change.after
    with transaction.atomic():
        if change.field == ReviewField.OUTCOME:
            current = Trajectory.objects.select_for_update().values_list("reviewed_outcome", flat=True).get(pk=trajectory.pk)
            if current != (after or ""):
                raise ValidationError({"outcome": "The outcome was changed again since; nothing to undo."})
            review.trajectory_outcome_set(trajectory=trajectory, outcome=before or "", user=user)
        elif change.field == ReviewField.MODES:
            added, removed = set(after or []) - set(before or []), set(before or []) - set(after or [])
            for mode in FailureMode.objects.filter(project_id=trajectory.project_id, name__in=added):
                failure_mode_unassign(failure_mode=mode, trajectories=[trajectory], user=user)
            for mode in FailureMode.objects.filter(project_id=trajectory.project_id, name__in=removed):
                failure_mode_assign(failure_mode=mode, trajectories=[trajectory], user=user)
        elif change.field == ReviewField.TAGS:
            added, removed = set(after or []) - set(before or []), set(before or []) - set(after or [])
            for tag in trajectory.tags.filter(name__in=added):
                review.trajectory_tag_remove(trajectory=trajectory, tag=tag, user=user)
            for name in sorted(removed):
                review.trajectory_tag_add(trajectory=trajectory, name=name, user=user)
