"""The loop demo's model (`make run`): the trainer's tiny CPU model, built on the worker the first time (a
few minutes on a CPU) and registered as the project's first version, so that production exists and a
training job can start from it; then the project's data is made by playing it (flywheel.training.demo).
Idempotent: found by name."""

from __future__ import annotations

import shutil
from pathlib import Path

from django.conf import settings

from flywheel import outbox
from flywheel.accounts.models import Project
from flywheel.registry.models import BaseModel

DEMO_MODEL_NAME = "tiny (demo)"


def demo_model_dir() -> Path:
    return Path(settings.FLYWHEEL_MODELS_DIR) / "tiny-demo"


def registry_demo_seed(*, project: Project) -> bool:
    """Queue the build of the demo model unless the project has it; True when queued."""
    from flywheel.registry.tasks import demo_model_task

    if BaseModel.objects.filter(project=project, name=DEMO_MODEL_NAME).exists():
        return False
    outbox.send_on_commit(demo_model_task, project.pk)
    return True


def build_demo_model(folder: Path) -> Path:
    """The demo's model in `folder`, built once: the trainer's tiny CPU model."""
    from trainer.tiny import build_tiny

    if not (folder / "tiny.json").exists():
        # Built aside and renamed: a worker stopped halfway leaves no folder that looks finished.
        tmp = folder.with_name(folder.name + ".building")
        shutil.rmtree(tmp, ignore_errors=True)
        build_tiny(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    return folder


def demo_model_build(*, project_id: int) -> str:
    """Build the demo model into FLYWHEEL_MODELS_DIR/tiny-demo (once per machine) and register it."""
    from flywheel.registry.services import base_model_register

    project = Project.objects.get(pk=project_id)
    if BaseModel.objects.filter(project=project, name=DEMO_MODEL_NAME).exists():
        return "registered already"
    folder = build_demo_model(demo_model_dir())
    owner = project.memberships.filter(role="maintainer").select_related("user").first()
    user = owner.user if owner else None
    base_model_register(project=project, name=DEMO_MODEL_NAME, path=str(folder), user=user)
    from flywheel.training.demo import loop_demo_seed

    loop_demo_seed(project=project, model_dir=folder, user=user)
    return "registered"
