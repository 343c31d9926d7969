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


def _status_path(slug: str) -> Path:
    return Path(settings.VAR_DIR) / "demo-status" / f"{slug}.json"


def demo_status_set(*, project: Project, text: str | None) -> None:
    """What the worker is doing to seed the demo project, for its pages to say ("building the demo model:
    step 300 of 1000"); None when it is done. A file beside the database: `make run`'s web process and
    workers share the var folder."""
    import json
    import os

    path = _status_path(project.slug)
    if text is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"text": text}))
    tmp.replace(path)  # a reader never sees half a file


def demo_status_of(*, project: Project) -> str | None:
    """The demo's seeding step, while the worker seeds it."""
    import json

    try:
        return str(json.loads(_status_path(project.slug).read_text())["text"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def demo_model_dir() -> Path:
    return Path(settings.FLYWHEEL_MODELS_DIR) / "tiny-demo"


def registry_demo_seed(*, project: Project) -> bool:
    """Queue the build of the demo model unless the project has it; True when queued."""
    from flywheel.registry.tasks import demo_model_task

    if BaseModel.objects.filter(project=project, name=DEMO_MODEL_NAME).exists():
        return False
    outbox.send_on_commit(demo_model_task, project.pk)
    return True


# The demo model as shipped: the trainer's tiny model (`trainer.tiny.build_tiny`, seed 0, 1000 steps), built
# once and kept in the repository, so that every machine starts the demo from the same weights. A build
# follows the CPU's numerics (an AVX2-only machine builds other weights from the same seed), and the demo's
# recipe and figures were measured on these. `tiny.json` records how it was built.
SHIPPED_DEMO_MODEL = Path(__file__).resolve().parent / "demo_model"


def build_demo_model(folder: Path, *, progress=None, rebuild: bool = False) -> Path:
    """The demo's model in `folder`, once: a copy of the shipped model, or with `rebuild` (or none shipped) the
    trainer's tiny CPU model built here. `progress(text)` hears how far a build is."""
    from trainer.tiny import build_tiny

    if not (folder / "tiny.json").exists():
        # Made aside and renamed: a worker stopped halfway leaves no folder that looks finished.
        tmp = folder.with_name(folder.name + ".building")
        shutil.rmtree(tmp, ignore_errors=True)
        if (SHIPPED_DEMO_MODEL / "tiny.json").exists() and not rebuild:
            if progress:
                progress("Copying the demo model to the models folder.")
            shutil.copytree(SHIPPED_DEMO_MODEL, tmp)
        else:
            steps = 1000

            def log(event: dict) -> None:
                if progress and event.get("event") == "step":
                    progress(f"Building the demo model on the worker: step {event['step']} of {steps}.")

            if progress:
                progress("Building the demo model on the worker: starting.")
            build_tiny(tmp, steps=steps, log=log)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    return folder


def demo_model_build(*, project_id: int) -> str:
    """Build the demo model into FLYWHEEL_MODELS_DIR/tiny-demo (once per machine) and register it."""
    from flywheel.registry.services import base_model_register

    project = Project.objects.get(pk=project_id)
    if BaseModel.objects.filter(project=project, name=DEMO_MODEL_NAME).exists():
        return "registered already"
    folder = build_demo_model(demo_model_dir(),
                              progress=lambda text: demo_status_set(project=project, text=text))
    owner = project.memberships.filter(role="maintainer").select_related("user").first()
    user = owner.user if owner else None
    base_model_register(project=project, name=DEMO_MODEL_NAME, path=str(folder), user=user)
    from flywheel.training.demo import loop_demo_seed

    try:
        loop_demo_seed(project=project, model_dir=folder, user=user,
                       progress=lambda text: demo_status_set(project=project, text=text))
    finally:
        demo_status_set(project=project, text=None)
    return "registered"
