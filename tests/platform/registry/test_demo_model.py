"""The demo model is shipped: seeding copies the same weights on every machine (a build follows the CPU's
numerics), and the copy is a model folder the platform accepts and the trainer loads."""

from __future__ import annotations

import hashlib

from flywheel.registry.demo import SHIPPED_DEMO_MODEL, build_demo_model
from flywheel.registry.model_folder import folder_problems

# The weights the demo's recipe and its efficacy figures were measured on (README, "Does the loop deliver").
SHIPPED_SHA256 = "594de562e8bd011d29ea6d3c261e5ce949441b10c62264f8df725afa341191ef"


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_seeding_copies_the_shipped_model_and_it_loads(tmp_path):
    assert _sha256(SHIPPED_DEMO_MODEL / "model.safetensors") == SHIPPED_SHA256
    said = []
    folder = build_demo_model(tmp_path / "tiny-demo", progress=said.append)
    assert said == ["Copying the demo model to the models folder."]  # copied, not built
    shipped = sorted(p.name for p in SHIPPED_DEMO_MODEL.iterdir())
    assert sorted(p.name for p in folder.iterdir()) == shipped
    assert all(_sha256(folder / name) == _sha256(SHIPPED_DEMO_MODEL / name) for name in shipped)
    assert folder_problems(str(folder)) == {}
    assert not (tmp_path / "tiny-demo.building").exists()
    # Once there, it is kept.
    assert build_demo_model(folder, progress=said.append) == folder and len(said) == 1

    from trainer.models import load_model

    model, tokenizer = load_model(str(folder))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Show task T3"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt and sum(p.numel() for p in model.parameters()) > 100_000


def test_the_demo_model_lies_where_its_project_registers_models(make_project):
    """`make run` registers the demo model from the models directory's folder of the demo project, where the
    project's maintainers could register it themselves."""
    from flywheel.registry.demo import demo_model_dir
    from flywheel.registry.model_folder import lies_in
    from flywheel.registry.services import model_roots
    from flywheel.training.demo import LOOP_SLUG

    project = make_project(LOOP_SLUG)
    assert lies_in(str(demo_model_dir(project.slug)), model_roots(project=project), resolve=False)
    assert not lies_in(str(demo_model_dir(project.slug)), model_roots(project=make_project("other")), resolve=False)
