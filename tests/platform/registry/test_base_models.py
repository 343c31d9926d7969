"""Registering a base model: what a folder must hold (config, tokenizer, weights, chat template), checked by
the real Celery worker on its own disk before anything is saved, with a field error naming each missing part;
where the folder may lie (the project's own folder under the models directory, or a shared one, links
followed), refused in one sentence that tells nothing of what exists elsewhere; the Models page that explains
it; and the compose file that brings the models folder to both workers."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import yaml
from django.core.exceptions import ValidationError
from django.urls import reverse
from django.utils.html import escape

from flywheel.celery import app as celery_app
from flywheel.registry import services
from flywheel.registry.model_folder import OUTSIDE, PARTS, folder_problems
from flywheel.registry.models import AliasAssignment, BaseModel, ModelVersion

REPO = Path(__file__).resolve().parents[3]
SYNCED = re.compile(r"Task flywheel\.registry\.sync\[[^\]]+\] succeeded")


def _copy(tiny_model: Path, where: Path) -> Path:
    shutil.copytree(tiny_model, where)
    return where


@pytest.fixture
def models(settings, project) -> Path:
    """The project's own folder under the models directory, where its base models may be registered from."""
    folder = Path(settings.FLYWHEEL_MODELS_DIR) / project.slug
    folder.mkdir(parents=True, exist_ok=True)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def tiny_here(tiny_model, models) -> Path:
    """The tiny model, copied into the project's folder (a link out of it would be refused)."""
    return _copy(tiny_model, models / "tiny")


def _without(folder: Path, part: str) -> Path:
    """The tiny model's folder with one part taken out."""
    if part == "config":
        (folder / "config.json").unlink()
    elif part == "tokenizer":
        (folder / "tokenizer.json").unlink()
    elif part == "weights":
        (folder / "model.safetensors").unlink()
    elif part == "chat_template":
        (folder / "chat_template.jinja").unlink()
    return folder


# What each part's error starts with: the part's name, so a person sees what is missing.
NAMED = {"config": "No config.json", "tokenizer": "No tokenizer", "weights": "No weights",
         "chat_template": "No chat template"}


# --- the check itself, on this machine's disk ---------------------------------------------------------------


def test_the_tiny_model_holds_every_part(tiny_model):
    assert folder_problems(str(tiny_model)) == {}


@pytest.mark.parametrize("part", [p.key for p in PARTS])
def test_a_folder_missing_a_part_is_refused_naming_it(tiny_model, tmp_path, part):
    folder = _without(_copy(tiny_model, tmp_path / "m"), part)
    problems = folder_problems(str(folder))
    assert list(problems) == [part]
    assert problems[part].startswith(NAMED[part])


def test_the_other_shapes_of_each_part_are_accepted(tiny_model, tmp_path):
    folder = _copy(tiny_model, tmp_path / "m")
    # The chat template inside tokenizer_config.json instead of its own file.
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    # A SentencePiece tokenizer, and sharded weights with their index.
    (folder / "tokenizer.json").rename(folder / "tokenizer.model")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00001.safetensors"}}))
    assert folder_problems(str(folder)) == {}


def test_weights_that_are_not_weights_are_named(tiny_model, tmp_path):
    folder = _copy(tiny_model, tmp_path / "lfs")
    (folder / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 9\n")
    assert "Git LFS pointer" in folder_problems(str(folder))["weights"]

    folder = _copy(tiny_model, tmp_path / "cut")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: 8 + struct.unpack("<Q", data[:8])[0] // 2])
    assert "cut short" in folder_problems(str(folder))["weights"]

    folder = _copy(tiny_model, tmp_path / "sharded")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    problem = folder_problems(str(folder))["weights"]
    assert "1 are missing" in problem and "model-00002-of-00002.safetensors" in problem


def test_a_config_without_its_architecture_and_a_missing_folder_are_named(tiny_model, tmp_path):
    folder = _copy(tiny_model, tmp_path / "m")
    (folder / "config.json").write_text('{"hidden_size": 8}')
    assert "model_type" in folder_problems(str(folder))["config"]
    (folder / "config.json").write_text("{not json")
    assert "not readable JSON" in folder_problems(str(folder))["config"]
    assert folder_problems(str(tmp_path / "absent")) == {"folder": f"{tmp_path / 'absent'} is not a folder."}


def test_a_folder_outside_the_roots_is_one_sentence_whatever_is_there(tiny_model, tmp_path):
    root = tmp_path / "models" / "acme"
    inside = _copy(tiny_model, root / "tiny")
    assert folder_problems(str(inside), roots=[str(root)]) == {}
    (root / "out").symlink_to(tiny_model)  # a good model, through a link that leaves the folder
    (root / "root").symlink_to("/root")
    (root / "gone").symlink_to(tmp_path / "nothing")
    for path in (tiny_model, "/root", "/proc/1/root", tmp_path / "nothing", root / "out", root / "root",
                 root / "gone", root / ".." / "other", root / "out" / ".." / "acme"):
        assert folder_problems(str(path), roots=[str(root)]) == {"folder": f"{path} {OUTSIDE}"}, path
    assert folder_problems(str(inside), roots=[]) == {"folder": f"{inside} {OUTSIDE}"}  # no root: nothing is


# --- on the worker, through the one door ---------------------------------------------------------------------


@pytest.fixture
def quick_check(settings):
    settings.FLYWHEEL_MODEL_CHECK_TIMEOUT_S = 3.0  # an idle worker answers in milliseconds; a loaded machine is slower


def test_the_worker_checks_a_good_folder_and_it_is_registered(project, user, tiny_here, celery_worker,
                                                              quick_check):
    version = services.base_model_register_checked(project=project, name="tiny", path=str(tiny_here), user=user)
    assert version.number == 1 and Path(version.base.path) == tiny_here
    assert AliasAssignment.objects.get(project=project, alias="production").version == version


def test_the_worker_names_every_missing_part_and_nothing_is_saved(project, tiny_model, models, celery_worker,
                                                                  quick_check):
    folder = _copy(tiny_model, models / "m")
    for part in ("tokenizer", "weights", "chat_template"):
        _without(folder, part)
    with pytest.raises(ValidationError) as exc:
        services.base_model_register_checked(project=project, name="m", path=str(folder))
    errors = exc.value.message_dict["path"]
    assert [e.split(":")[0] for e in errors] == ["No tokenizer", "No weights", "No chat template"]
    assert all("(on test-" in e for e in errors), errors  # the worker that looked is named
    assert not BaseModel.objects.exists() and not ModelVersion.objects.exists()


@pytest.mark.parametrize("part", [p.key for p in PARTS])
def test_each_missing_part_is_the_path_field_error(project, tiny_model, models, celery_worker, quick_check, part):
    folder = _without(_copy(tiny_model, models / "m"), part)
    with pytest.raises(ValidationError) as exc:
        services.base_model_register_checked(project=project, name="m", path=str(folder))
    (error,) = exc.value.message_dict["path"]
    assert error.startswith(NAMED[part])
    assert not BaseModel.objects.exists()


def test_a_path_that_is_no_folder_on_the_worker_is_refused(project, models, celery_worker, quick_check):
    with pytest.raises(ValidationError) as exc:
        services.base_model_register_checked(project=project, name="m", path=str(models / "nowhere"))
    (error,) = exc.value.message_dict["path"]
    assert error.startswith(f"{models / 'nowhere'} is not a folder. (on test-")  # the worker that looked says so


def test_a_path_outside_the_projects_folder_is_refused_without_asking_a_worker(project, models, monkeypatch):
    """Registering once told which folders exist anywhere ("/root: No config.json", "/proc/1/root cannot be
    read"): a path outside the project's folder now gets the same sentence, and no worker looks at it."""
    def no_broadcast(*args, **kwargs):
        raise AssertionError("a worker was asked")

    monkeypatch.setattr(celery_app.control, "broadcast", no_broadcast)
    for path in ("/root", "/proc/1/root", "/etc", "/no/such/folder", str(models.parent / "other-team" / "tiny"),
                 str(models / ".." / "other-team" / "tiny"), str(models.parent), str(models) + "-x/tiny"):
        with pytest.raises(ValidationError) as exc:
            services.base_model_register_checked(project=project, name="m", path=path)
        assert exc.value.message_dict == {"path": [
            f"{path} is not a usable model folder under the models directory. Put the model's folder in {models}/."]}
    assert not BaseModel.objects.exists()


def test_another_projects_folder_and_links_out_of_ones_own_are_refused_by_the_worker(
        project, make_project, tiny_model, models, celery_worker, quick_check):
    """Another project's model, whether named directly or through a link in this project's folder, is refused;
    so is a link to a folder that exists elsewhere and one to a folder that does not, in the same words."""
    make_project("other-team")
    theirs = _copy(tiny_model, models.parent / "other-team" / "tiny")
    (models / "theirs").symlink_to(theirs)
    (models / "root").symlink_to("/root")
    (models / "gone").symlink_to("/no/such/folder")
    for path in (theirs, models / "theirs", models / "root", models / "gone"):
        with pytest.raises(ValidationError) as exc:
            services.base_model_register_checked(project=project, name="m", path=str(path))
        (error,) = exc.value.message_dict["path"]
        assert error.startswith(f"{path} is not a usable model folder under the models directory."), error
    assert not BaseModel.objects.exists()
    shutil.rmtree(models.parent / "other-team")


def test_a_folder_the_operator_shares_serves_every_project(project, make_project, tiny_model, settings, models,
                                                           celery_worker, quick_check):
    settings.FLYWHEEL_MODELS_SHARED = "_shared"
    shared = _copy(tiny_model, Path(settings.FLYWHEEL_MODELS_DIR) / "_shared" / "tiny")
    try:
        for owner in (project, make_project("second-team")):
            synced = len(SYNCED.findall(celery_worker.log()))
            version = services.base_model_register_checked(project=owner, name="tiny", path=str(shared))
            assert version.base.path == str(shared)
            # The move's sync takes the worker's one slot (a solo pool answers no check meanwhile): wait for it.
            celery_worker.wait_for(lambda synced=synced: len(SYNCED.findall(celery_worker.log())) > synced)
        with pytest.raises(ValidationError) as exc:  # the page says where a model may go
            services.base_model_register_checked(project=project, name="m", path="/elsewhere/m")
        assert exc.value.message_dict["path"][0].endswith(f"Put the model's folder in {models}/ or {shared.parent}/.")
    finally:
        shutil.rmtree(shared.parent)


def test_name_and_path_are_checked_before_asking_any_worker(project, monkeypatch, tiny_model, user):
    def no_broadcast(*args, **kwargs):
        raise AssertionError("a worker was asked")

    monkeypatch.setattr(celery_app.control, "broadcast", no_broadcast)
    with pytest.raises(ValidationError) as exc:
        services.base_model_register_checked(project=project, name=" ", path="models/tiny")
    assert exc.value.message_dict == {"name": ["Name the model."],
                                      "path": ["Give an absolute path on the workers' disk, not 'models/tiny'."]}
    services.base_model_register(project=project, name="taken", path=str(tiny_model), user=user)
    with pytest.raises(ValidationError) as exc:
        services.base_model_register_checked(project=project, name="taken", path="")
    assert "already has a base model named 'taken'" in exc.value.message_dict["name"][0]
    assert "absolute path" in exc.value.message_dict["path"][0]


def test_no_answer_from_any_worker_saves_nothing_and_says_so(project, tiny_here, monkeypatch):
    # The broker is a boundary we do not own: here it delivers to no worker, or to one too old to know the check.
    monkeypatch.setattr(celery_app.control, "broadcast",
                        lambda *a, **k: [{"old@host": {"error": "No such command: flywheel_model_folder_check"}}])
    with pytest.raises(ValidationError) as exc:
        services.base_model_register_checked(project=project, name="m", path=str(tiny_here))
    assert exc.value.message_dict["path"][0].startswith("No worker answered within")
    assert not BaseModel.objects.exists()


def test_the_workers_that_load_models_decide(project, models, monkeypatch):
    """A CPU worker that lacks the folder does not block it when a GPU worker (the queue that loads models)
    has it; a GPU worker that lacks it does."""
    good = {"problems": {}, "queues": ["gpu"]}
    bad = {"problems": {"folder": "/m is not a folder."}, "queues": ["default"]}
    monkeypatch.setattr(celery_app.control, "broadcast", lambda *a, **k: [{"gpu@a": good}, {"default@b": bad}])
    assert services.model_folder_check(path="/m") == [("gpu@a", {})]
    bad_gpu = {**bad, "queues": ["gpu"]}
    monkeypatch.setattr(celery_app.control, "broadcast",
                        lambda *a, **k: [{"gpu@a": good}, {"gpu@b": bad_gpu}, {"default@c": good}])
    with pytest.raises(ValidationError) as exc:
        services.base_model_register_checked(project=project, name="m", path=str(models / "m"))
    assert exc.value.message_dict["path"] == ["/m is not a folder. (on gpu@b)"]


# --- the page ---------------------------------------------------------------------------------------------


def test_the_page_explains_the_folder_and_shows_each_missing_part(project, user, client_for, tiny_model, models,
                                                                  tiny_here, celery_worker, quick_check):
    client = client_for(user)
    page = client.get(reverse("registry_page", args=[project.slug])).content.decode()
    for part in PARTS:
        assert escape(part.holds) in page
    assert "/models" in page and "docker compose" in page and f"<code>{models}/</code>" in page

    folder = _without(_without(_copy(tiny_model, models / "m"), "weights"), "config")
    response = client.post(reverse("registry_base_register", args=[project.slug]),
                           {"name": "mine", "path": str(folder)})
    assert response.status_code == 422
    body = response.content.decode()
    assert "No config.json" in body and "No weights" in body and 'value="mine"' in body
    assert not BaseModel.objects.exists()

    response = client.post(reverse("registry_base_register", args=[project.slug]),
                           {"name": "mine", "path": str(tiny_here)})
    assert response.status_code == 302
    assert BaseModel.objects.get(project=project).name == "mine"


def test_both_workers_mount_the_models_folder_where_models_are_registered():
    services_ = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    models_dir = yaml.safe_load((REPO / "docker-compose.yml").read_text())["x-flywheel-env"]["FLYWHEEL_MODELS_DIR"]
    for name in ("worker", "gpu-worker"):
        mounts = [v for v in services_[name]["volumes"] if v.endswith(f":{models_dir}:ro")]
        assert mounts == ["${FLYWHEEL_MODELS_HOST_DIR:-./models}:/models:ro"], name
