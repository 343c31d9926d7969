"""What a base model's folder must hold, and the check of one folder, run by a worker on its own disk.

Pure Python over the file system (no Django, no torch): a Celery worker answers it from its main process in
milliseconds, without loading a model. The Models page shows `PARTS` as the explanation of the form, so
the page and the check cannot drift.

A folder is looked at only inside the folders a project may use (`roots`: its own under the models directory,
and a shared one where the operator keeps one), with every symbolic link followed first: a path outside them
gets one sentence, the same whether anything exists there or not, so registering a model cannot be used to
learn which folders exist on the workers."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

OUTSIDE = "is not a usable model folder under the models directory."


@dataclass(frozen=True)
class Part:
    key: str
    name: str  # as an error message starts: "No <name>: ..."
    holds: str  # what the folder must hold for it, as the form explains it


PARTS: tuple[Part, ...] = (
    Part("config", "config.json", "the model's configuration, naming its model_type"),
    Part("tokenizer", "tokenizer",
         "the tokenizer's files: tokenizer.json, or tokenizer.model (SentencePiece), or vocab.json with merges.txt"),
    Part("weights", "weights",
         "the weights as *.safetensors or pytorch_model*.bin; a sharded model with its index file and every "
         "shard the index names"),
    Part("chat_template", "chat template",
         "a chat template: chat_template in tokenizer_config.json, or a chat_template.jinja file"),
)

LFS_POINTER = b"version https://git-lfs"
SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit


def _read_json(file: Path) -> tuple[object | None, str]:
    try:
        return json.loads(file.read_text(encoding="utf-8")), ""
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return None, f"{file.name} is not readable JSON ({exc})"


def _config_problem(folder: Path) -> str:
    file = folder / "config.json"
    if not file.is_file():
        return "No config.json: the folder has no model configuration."
    config, error = _read_json(file)
    if error:
        return f"config.json: {error}."
    if not isinstance(config, dict) or not config.get("model_type"):
        return "config.json names no model_type: transformers cannot tell which architecture to build."
    return ""


def _tokenizer_problem(folder: Path) -> str:
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file():
        return ""
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        return ""
    return ("No tokenizer: the folder holds no tokenizer.json, no tokenizer.model and no vocab.json with "
            "merges.txt.")


def _weight_file_problem(file: Path) -> str:
    """A weight file that is not one: a Git LFS pointer (cloned without `git lfs pull`) or a cut safetensors."""
    try:
        with file.open("rb") as fh:
            head = fh.read(max(len(LFS_POINTER), 8))
            if head.startswith(LFS_POINTER):
                return (f"No weights: {file.name} is a Git LFS pointer, not the weights (run `git lfs pull` in "
                        "the folder).")
            if file.suffix == ".safetensors":
                if len(head) < 8:
                    return f"No weights: {file.name} is too short to be a safetensors file."
                (length,) = struct.unpack("<Q", head[:8])
                if length > SAFETENSORS_MAX_HEADER or 8 + length > file.stat().st_size:
                    return f"No weights: {file.name} is cut short or not a safetensors file."
                fh.seek(8)
                json.loads(fh.read(length))
    except OSError as exc:
        return f"No weights: {file.name} cannot be read ({exc.strerror or exc})."
    except ValueError:
        return f"No weights: {file.name} has no readable safetensors header."
    return ""


def _weights_problem(folder: Path) -> str:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if not index.is_file():
            continue
        data, error = _read_json(index)
        if error:
            return f"No weights: {error}."
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            return f"No weights: {index_name} has no weight_map."
        shards = sorted(set(map(str, weight_map.values())))
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            return (f"No weights: {index_name} names {len(shards)} shards, and {len(missing)} are missing "
                    f"({', '.join(missing[:3])}{', …' if len(missing) > 3 else ''}).")
        for name in shards:
            if problem := _weight_file_problem(folder / name):
                return problem
        return ""
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        return "No weights: the folder holds no *.safetensors and no pytorch_model*.bin file."
    for file in files:
        if problem := _weight_file_problem(file):
            return problem
    return ""


def _chat_template_problem(folder: Path) -> str:
    if (folder / "chat_template.jinja").is_file():
        return ""
    file = folder / "tokenizer_config.json"
    if file.is_file():
        config, error = _read_json(file)
        if error:
            return f"No chat template: {error}."
        if isinstance(config, dict) and config.get("chat_template"):
            return ""
    return ("No chat template: neither chat_template.jinja nor a chat_template in tokenizer_config.json; a base "
            "model without one cannot be prompted with a conversation (use the instruct variant).")


CHECKS = {"config": _config_problem, "tokenizer": _tokenizer_problem, "weights": _weights_problem,
          "chat_template": _chat_template_problem}


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def lies_in(path: str, roots: Sequence[str], *, resolve: bool) -> bool:
    """Whether absolute `path` lies in one of `roots`: as written (`..` segments folded, nothing read from the
    disk) or, with `resolve`, with every symbolic link along it and along each root followed (realpath)."""
    norm = os.path.realpath if resolve else os.path.normpath
    try:
        return any(_under(norm(path), norm(str(root))) for root in roots)
    except OSError:  # a link this process may not read (/proc/1/root): it leads nowhere it may look
        return False


def folder_problems(path: str, *, roots: Sequence[str] | None = None) -> dict[str, str]:
    """What keeps the folder at `path` (on this machine) from being a base model the trainer can load:
    {part key: a sentence naming the part}, empty when nothing does. `folder` is the key when there is no
    folder at all, or when `path`, its links followed, lies in none of `roots` (then nothing else is looked at,
    and the sentence is `OUTSIDE` whatever is there). `roots` None: any folder (code that made the folder)."""
    folder = Path(path)
    if not folder.is_absolute():
        return {"folder": f"{path!r} is not an absolute path."}
    if roots is not None and not lies_in(path, roots, resolve=True):
        return {"folder": f"{path} {OUTSIDE}"}
    try:
        if not folder.is_dir():
            return {"folder": f"{path} is not a folder."}
    except OSError as exc:
        return {"folder": f"{path} cannot be read ({exc.strerror or exc})."}
    problems = {}
    for part in PARTS:
        try:
            problem = CHECKS[part.key](folder)
        except OSError as exc:  # a permission error half-way through reads as such, not as a crash
            problem = f"No {part.name}: the folder cannot be read ({exc.strerror or exc})."
        if problem:
            problems[part.key] = problem
    return problems
