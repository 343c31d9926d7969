"""Writes on task sets. Versions, freezing and removal are the same functions as for eval suites
(`flywheel.evals.services`); tasks come in by promotion (`flywheel.evals.promotion`) or as variants
(`flywheel.environments.variants`)."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from flywheel.accounts.models import Project
from flywheel.environments.models import TaskSet
from flywheel.evals.services import clean_name


def task_set_create(*, project: Project, name: str, description: str = "", user: Any = None) -> TaskSet:
    name = clean_name(name)
    try:
        with transaction.atomic():
            return TaskSet.objects.create(project=project, name=name, description=description, created_by=user)
    except IntegrityError:
        raise ValidationError({"name": f"This project already has a task set named {name!r}."}) from None
