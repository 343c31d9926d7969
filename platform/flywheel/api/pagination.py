"""Keyset pagination, the one way the API pages a list: newest first, `limit` at a time; the answer's
`next_cursor` goes back as `cursor` and is null on the last page. Pages stay consistent while rows arrive
(an offset would shift under them)."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from ninja import Field, Schema
from ninja.errors import HttpError

from flywheel.api.text import Text

MAX_LIMIT = 500


class PageQuery(Schema):
    cursor: Text | None = Field(
        None, description="From `next_cursor` of the previous page", json_schema_extra={"pattern": "^[0-9]*$"}
    )
    limit: int = Field(50, ge=1, le=MAX_LIMIT)


def cursor_value(cursor: str | None) -> int | None:
    """The id a cursor stands for; 400 for one this API never gave out."""
    if not cursor:
        return None
    # ASCII digits only: int() also takes " 12" and "١٢", which no next_cursor ever was.
    if not (cursor.isascii() and cursor.isdigit()):
        raise HttpError(400, "cursor is not one this API gave out.")
    return int(cursor)


def keyset_page(queryset: QuerySet, *, cursor: str | None, limit: int) -> tuple[list[Any], str | None]:
    """One page of `queryset`, newest (highest id) first, after the row `cursor` names."""
    after = cursor_value(cursor)
    if after is not None:
        queryset = queryset.filter(pk__lt=after)
    rows = list(queryset.order_by("-pk")[: limit + 1])
    if len(rows) > limit:
        return rows[:limit], str(rows[limit - 1].pk)
    return rows, None
