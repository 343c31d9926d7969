"""The train side of the row machinery: task sets, which `flywheel.environments` registers here when it starts.

Eval suites and task sets share one row shape (`models.ItemBase`) and one set of pages, promotion, leakage
checks and calibration, all in this app. Task sets live in the environments app, which builds on this one
(its models subclass ours), so this app never imports it (tests/platform/test_import_layers.py): it reaches
task sets through what `EnvironmentsConfig.ready` registers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TrainSide:
    collection: type  # TaskSet
    item: type  # Task
    version: type  # TaskSetVersion
    server: type  # EnvironmentServer: where a task set's episodes may run
    create: Callable[..., Any]  # task_set_create(*, project, name, description, user, server=None)


_registered: list[TrainSide] = []


def train_side_register(side: TrainSide) -> None:
    _registered[:] = [side]


def train_side() -> TrainSide:
    """Task sets' models and their create service, as the environments app registered them."""
    if not _registered:
        raise RuntimeError("flywheel.environments is not installed (INSTALLED_APPS): there are no task sets")
    return _registered[0]
