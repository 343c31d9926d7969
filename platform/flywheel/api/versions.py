"""Versioned things, named one way across the API: a task set's or an eval suite's version is the pair
(collection id, version number within it), as the pages show it (`holdout v2`); a model version is its
number. `version_of` finds such a pair in the key's project; `version_ref` answers one."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError

from flywheel.evals import selectors


def version_of(*, project: Any, model: type, collection: int | None, number: int | None, field: str,
               required: bool = False) -> Any:
    """The version `number` of the `model` (TaskSet or EvalSuite) `collection` of `project`, read from the
    body fields `field` (the collection's id) and `field`_version (the number). None when neither is sent
    and it is not `required`; otherwise a 422 naming the field at fault."""
    version_field = f"{field}_version"
    label = model.LABEL
    if collection is None and number is None:
        if required:
            raise ValidationError({field: f"Name the {label} (its id) and its version ({version_field}: a number)."})
        return None
    if collection is None:
        raise ValidationError({field: f"Name the {label} whose version {number} you mean (its id)."})
    if number is None:
        raise ValidationError({version_field: f"Name the version of {label} {collection} (a number, e.g. 1)."})
    found = selectors.collection_get(project=project, model=model, pk=collection)
    if found is None:
        raise ValidationError({field: f"No {label} {collection} in project '{project.slug}'."})
    version = selectors.version_get(collection=found, number=number)
    if version is None:
        last = found.versions.order_by("-number").values_list("number", flat=True).first()
        hint = f" (its newest is {last})" if last else " (it has none yet: promote into it first)"
        raise ValidationError({version_field: f"{label.capitalize()} {collection} has no version {number}{hint}."})
    return version


def version_ref(version: Any) -> tuple[int | None, int | None]:
    """(collection id, number) of a task set's or suite's version; (None, None) for none."""
    if version is None:
        return None, None
    owner_id = getattr(version, "task_set_id", None) or version.suite_id
    return owner_id, version.number
