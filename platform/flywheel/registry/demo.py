"""The loop demo's model (`make run`): the trainer's tiny CPU model, shipped in the repository or built on the
worker (a few minutes on a CPU). `flywheel.seed.demo` registers it as the project's first version, so that
production exists and a training job can start from it, then makes the project's data by playing it
(flywheel.training.demo)."""

from __future__ import annotations

import shutil
from pathlib import Path

from django.conf import settings

DEMO_MODEL_NAME = "tiny (demo)"


def demo_model_dir(project_slug: str) -> Path:
    """Where the demo project's model lives: in that project's own folder under the models directory, where
    a maintainer of the project could also register it (flywheel.registry.services.model_roots)."""
    return Path(settings.FLYWHEEL_MODELS_DIR) / project_slug / "tiny-demo"


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
