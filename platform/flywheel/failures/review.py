"""What reviewers write on a trajectory: its outcome, comments on messages, tags. One function per action;
the htmx endpoints, the API and the tests all call these. Permission checks live in the views
(`access.project_view`), these functions trust their caller. Each change of the outcome or the tags is
recorded in the review history (`history`), in the same transaction.

Here, not in the trajectories app, because the history is this app's: trajectories sit below failures and
import nothing of it (tests/platform/test_import_layers.py)."""

from __future__ import annotations

import re

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from flywheel.failures.history import review_change_record, tags_of
from flywheel.failures.models import ReviewField
from flywheel.trajectories.models import Comment, Outcome, Tag, Trajectory

MAX_COMMENT_CHARS = 10_000
MAX_TAG_CHARS = Tag._meta.get_field("name").max_length
_MESSAGE_INDEX = re.compile(r"-?[0-9]{1,18}")  # ASCII digits: str.isdigit() also takes "²", which int() refuses


def message_index_parse(raw: str) -> int | None:
    """The message a comment is on, from a form value: "" for the whole trajectory, else an index."""
    raw = raw.strip()
    if not raw:
        return None
    if not _MESSAGE_INDEX.fullmatch(raw):
        raise ValidationError({"message_index": f"message_index {raw[:40]!r} is not a message number."})
    return int(raw)


def _no_nul(value: str, field: str, what: str) -> None:
    # PostgreSQL's text cannot hold NUL: the write would fail with a 500 instead of this message.
    if "\x00" in value:
        raise ValidationError({field: f"{what} cannot contain a NUL character."})


def trajectory_outcome_set(*, trajectory: Trajectory, outcome: str, user: AbstractBaseUser) -> Trajectory:
    """Record a reviewer's outcome; it wins over the agent's own. An empty outcome clears the review."""
    if outcome and outcome not in Outcome.values:
        raise ValidationError({"outcome": f"Unknown outcome {outcome!r}; one of {', '.join(Outcome.values)}."})
    with transaction.atomic():
        # The value before, read under the row's lock: two reviewers at once each record what they replaced.
        before = Trajectory.objects.select_for_update().values_list("reviewed_outcome", flat=True).get(pk=trajectory.pk)
        trajectory.reviewed_outcome = outcome
        trajectory.reviewed_by = user if outcome else None
        trajectory.reviewed_at = timezone.now() if outcome else None
        trajectory.save(update_fields=["reviewed_outcome", "reviewed_by", "reviewed_at", "updated_at"])
        review_change_record(trajectory=trajectory, user=user, field=ReviewField.OUTCOME, before=before, after=outcome)
    return trajectory


def trajectory_comment_add(
    *, trajectory: Trajectory, author: AbstractBaseUser, body: str, message_index: int | None = None
) -> Comment:
    """Comment on one message (by index) or, with no index, on the whole trajectory."""
    body = body.strip()
    if not body:
        raise ValidationError({"body": "A comment needs some text."})
    if len(body) > MAX_COMMENT_CHARS:
        raise ValidationError({"body": f"A comment is at most {MAX_COMMENT_CHARS:,} characters."})
    _no_nul(body, "body", "A comment")
    n_messages = len(trajectory.messages) if isinstance(trajectory.messages, list) else 0
    if message_index is not None and not 0 <= message_index < n_messages:
        raise ValidationError({"message_index": f"No message {message_index}; this trajectory has {n_messages}."})
    return Comment.objects.create(trajectory=trajectory, author=author, body=body, message_index=message_index)


def trajectory_tag_add(*, trajectory: Trajectory, name: str, user: AbstractBaseUser | None = None) -> Tag:
    """Tag the trajectory, creating the project's tag on first use."""
    name = " ".join(name.split())
    if not name:
        raise ValidationError({"name": "A tag needs a name."})
    if len(name) > MAX_TAG_CHARS:
        raise ValidationError({"name": f"A tag name is at most {MAX_TAG_CHARS} characters."})
    _no_nul(name, "name", "A tag name")
    with transaction.atomic():
        tag, _ = Tag.objects.get_or_create(project_id=trajectory.project_id, name=name)
        before = tags_of(trajectory=trajectory)
        trajectory.tags.add(tag)
        review_change_record(
            trajectory=trajectory, user=user, field=ReviewField.TAGS, before=before, after=sorted({*before, name})
        )
    return tag


def trajectory_tag_remove(*, trajectory: Trajectory, tag: Tag, user: AbstractBaseUser | None = None) -> None:
    """Untag the trajectory. The tag itself stays in the project for other trajectories."""
    with transaction.atomic():
        before = tags_of(trajectory=trajectory)
        trajectory.tags.remove(tag)
        after = [name for name in before if name != tag.name]
        review_change_record(trajectory=trajectory, user=user, field=ReviewField.TAGS, before=before, after=after)
