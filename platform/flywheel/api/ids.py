"""The integers the API takes that name a row: a record's id, or a version's number within its collection.

Every path, query and body parameter that names one is typed with these, so the schema states the range of
the column it is looked up in and a value outside it is a 422 naming the parameter (and its position in a
list), refused before any query: SQLite cannot bind an integer past 64 bits at all (OverflowError), and no
row has an id below 1."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

# Every model's primary key is a BigAutoField (settings.DEFAULT_AUTO_FIELD): a signed 64-bit integer.
MAX_ID = 2**63 - 1
# Version numbers (a model version's, a task set's or an eval suite's) are PositiveIntegerFields, whose
# range Django keeps to 32 bits on every backend.
MAX_VERSION_NUMBER = 2**31 - 1

Id = Annotated[int, Field(ge=1, le=MAX_ID)]
VersionNumber = Annotated[int, Field(ge=1, le=MAX_VERSION_NUMBER)]
