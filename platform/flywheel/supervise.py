"""Running the trainer as a child of a worker: its own process group, dead with its worker, its stdout read as
events (`trainer.events`, the stdout contract), a heartbeat while it is quiet, and cancel that kills the whole group.

Training jobs and eval runs both run `python -m trainer ...` this way, with the environment `trainer_env`
allows (never the worker's secrets), and refuse what their state does not allow with `Refused`."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import selectors
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.conf import settings

from flywheel import outbound
from trainer import events

logger = logging.getLogger(__name__)


class Refused(Exception):
    """An action a supervised job's or run's state does not allow (cancel what has ended, retry what has not
    failed, confirm what is not ready, a job folder another run holds); the message says why, to a person.

    Training jobs and eval runs both raise it; pages answer it 409 on the object's own page with the reason,
    the API 409 `{"detail": reason}` (flywheel.api.errors.install)."""


# What a trainer inherits from its worker: what Python, CUDA and torch, Hugging Face offline, MLflow and TLS
# need to run. Not the platform's own settings: the worker's SECRET_KEY, DATABASE_URL, broker URL and mail
# password stay in the worker, whatever a task row or a model's code makes the trainer do.
TRAINER_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR", "TEMP", "TMP",
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING", "VIRTUAL_ENV",
    "LD_LIBRARY_PATH", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "XDG_CACHE_HOME",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS", "TOKENIZERS_PARALLELISM",
    "CC", "CXX", "COVERAGE_PROCESS_START",
})
TRAINER_ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "NCCL_", "TORCH_", "TORCHINDUCTOR_", "PYTORCH_", "TRITON_",
                        "KMP_", "HF_", "TRANSFORMERS_", "VLLM_", "MLFLOW_", "FLYWHEEL_LLM_JUDGE_")
# Under an allowed prefix, yet a credential the trainer never uses (it fetches nothing from a hub).
TRAINER_ENV_REFUSED = frozenset({"HF_TOKEN", "VLLM_API_KEY"})


def trainer_env(**extra: str) -> dict[str, str]:
    """The environment of a trainer subprocess: the worker's variables that `TRAINER_ENV_NAMES`,
    `TRAINER_ENV_PREFIXES` and the operator's FLYWHEEL_TRAINER_ENV allow, the outbound policy, no entry
    points (task rows come from users: none may name code for the trainer to import), and `extra`."""
    passed = set(getattr(settings, "FLYWHEEL_TRAINER_ENV", []) or [])
    env = {name: value for name, value in os.environ.items()
           if name in passed or (name not in TRAINER_ENV_REFUSED
                                 and (name in TRAINER_ENV_NAMES or name.startswith(TRAINER_ENV_PREFIXES)))}
    return {**env, "PYTHONUNBUFFERED": "1", "FLYWHEEL_ENV_ENTRY_POINTS": "0", **outbound.subprocess_env(), **extra}


def worker_name() -> str:
    """This worker process as the pages name it, on a job or a run it holds: host and pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


PR_SET_PDEATHSIG = 1  # prctl(2)'s options
PR_SET_CHILD_SUBREAPER = 36


def die_with_parent() -> None:
    """In the trainer's process: start its own process group (cancel kills the whole group) and die when the
    worker that started it dies, so no trainer outlives its worker."""
    os.setsid()
    exit_with_parent()


def exit_with_parent() -> None:
    """In a child's process (a `preexec_fn`): die when the worker that started it dies, even by SIGKILL
    (Linux's PR_SET_PDEATHSIG), staying in the worker's process group so that a terminal's Ctrl-C reaches it."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def prctl(option: int, value: int) -> None:
    """Linux's prctl(2) on this process; nothing where there is none (another OS: the guarantee is lost, not the run)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value)


def kill_group(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _stream(process: subprocess.Popen, *, on_line, on_tick, tick_s: float) -> None:
    """Call on_line for each stdout line, and on_tick at least every tick_s while the trainer is quiet."""
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    buffer = b""
    last_tick = time.monotonic()
    fd = process.stdout.fileno()
    while True:
        if selector.select(timeout=tick_s):
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                on_line(line)
        if time.monotonic() - last_tick >= tick_s:
            last_tick = time.monotonic()
            if on_tick():
                break
    if buffer.strip():
        on_line(buffer)
    selector.close()


def supervise(
    command: list[str], *, cwd: Path, env: dict[str, str], stderr_path: Path,
    on_event: Callable[[events.Event], None], on_start: Callable[[int], Any], on_tick: Callable[[], bool],
) -> tuple[int, bool]:
    """Run `command`, pass each event it prints (`trainer.events.parse_line`) to `on_event`, and call `on_tick` (beat the heart; True
    means cancel) every FLYWHEEL_JOB_HEARTBEAT_S. Returns (exit status, cancelled)."""
    with stderr_path.open("wb") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, cwd=cwd, env=env,
                                   preexec_fn=die_with_parent)  # noqa: PLW1509 (needed: process group, death signal)
    on_start(process.pid)
    cancelled = False

    def on_line(raw: bytes) -> None:
        try:
            event = events.parse_line(raw)
        except events.EventRefused as exc:
            # Not an event: the trainer keeps stdout for events, but a library may slip a line in.
            logger.info("trainer stdout line refused: %s", exc)
            return
        if event is not None:
            on_event(event)

    def tick() -> bool:
        nonlocal cancelled
        if on_tick():
            cancelled = True
            kill_group(process)
            return True
        return False

    try:
        _stream(process, on_line=on_line, on_tick=tick, tick_s=settings.FLYWHEEL_JOB_HEARTBEAT_S)
        status = process.wait()
    finally:
        if process.poll() is None:  # the worker is being stopped: take the trainer with it
            kill_group(process, grace_s=5)
    return status, cancelled
