"""`manage.py runlocal` (what `make run` calls): migrate, seed the demo, then run the web server and a
Celery worker side by side in the foreground. Ctrl-C stops both; if either dies, the other is stopped too.
The worker embeds Celery beat, which runs the outbox sweep (flywheel.outbox) on its schedule.

One machine, no services: SQLite, kombu's filesystem broker and MLflow's SQLite store, all under `var/`.

Nothing started under it outlives it: it is its children's subreaper (Linux's PR_SET_CHILD_SUBREAPER), so a
process orphaned by a child that died first (Celery beat's, the demo's player when its worker was killed) becomes
its own, and is stopped and reaped with the rest instead of lingering, or lingering as a zombie where the
machine's init reaps none.

Ctrl-C (SIGINT) and SIGTERM only ask to stop: the signal handler sets a flag that the main loop reads. An
exception raised from the handler would surface wherever the signal lands (in the middle of stopping the
children, when a second signal comes) and leave a traceback and running children behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.utils import timezone

from flywheel.accounts.models import WorkerHeartbeat
from flywheel.accounts.services import worker_heartbeat_request
from flywheel.seed.announce import access_lines, seeded_lines
from flywheel.seed.demo import demo_seed
from flywheel.supervise import PR_SET_CHILD_SUBREAPER, prctl

STOP_GRACE_S = 10
DEMO_TRAFFIC_S = 60


class Command(BaseCommand):
    help = "Set up and run Flywheel on this machine: web server and Celery worker, stopped together by Ctrl-C."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default=os.environ.get("FLYWHEEL_HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("FLYWHEEL_PORT", "8000")))
        parser.add_argument("--no-seed", action="store_true", help="skip the demo project and trajectories")

    def handle(self, *args, host: str, port: int, no_seed: bool, **options) -> None:
        _check_port_free(host, port)
        _become_subreaper()
        stop = threading.Event()

        def on_signal(signum: int, frame: object) -> None:
            stop.set()

        # From here on a signal asks to stop. A shell starting us in the background may have set SIGINT to
        # "ignore"; Ctrl-C must still stop us.
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        call_command("migrate", interactive=False, verbosity=0)
        access: list[str] = []
        if not no_seed and not stop.is_set():
            seed = demo_seed()
            for line in seeded_lines(seed):
                self.stdout.write(line)
            access = access_lines(seed)
        if stop.is_set():
            self.stdout.write("Stopped before starting the web server and the workers.")
            return

        base_dir = Path(settings.BASE_DIR)
        python = sys.executable
        web = [python, "manage.py", "runserver", f"{host}:{port}", "--noreload"]
        # Two workers, as in production: `default` (with beat, -B; its schedule file is under var/) for the quick
        # work, and `gpu`, one task at a time, for what runs a model (training, evaluation, the demo model), so
        # that a training job never holds up triage or a promotion's webhook.
        worker = [
            python, "-m", "celery", "-A", "flywheel", "worker", "-B", "-Q", "default",
            "-P", "solo", "-n", "local@%h", "-l", "INFO", "--without-gossip", "--without-mingle",
        ]  # fmt: skip
        gpu_worker = [
            python, "-m", "celery", "-A", "flywheel", "worker", "-Q", "gpu",
            "-P", "solo", "-n", "gpu@%h", "-l", "INFO", "--without-gossip", "--without-mingle",
        ]  # fmt: skip
        # The workplace demo's live traffic, while a canary or a watch runs there (flywheel.seed.traffic).
        env = {**os.environ, "FLYWHEEL_DEMO_TRAFFIC_S": os.environ.get("FLYWHEEL_DEMO_TRAFFIC_S", str(DEMO_TRAFFIC_S))}
        # The children stay in our process group, so the terminal's Ctrl-C reaches all of us.
        children = {
            "web": subprocess.Popen(web, cwd=base_dir, env=env),
            "worker": subprocess.Popen(worker, cwd=base_dir, env=env),
            "gpu worker": subprocess.Popen(gpu_worker, cwd=base_dir, env=env),
        }

        url = f"http://{'localhost' if host in {'127.0.0.1', '0.0.0.0'} else host}:{port}/"
        try:
            self._announce_worker(children, stop)
            if not stop.is_set():
                # Last and together, so that what a person needs to start is not lost among the workers' logs.
                self.stdout.write("\n" + self.style.SUCCESS(f"Flywheel is running at {url}") + "\n"
                                  + "".join(f"  {line}\n" for line in access)
                                  + "  Ctrl-C stops the web server and the workers.\n")
            while not stop.is_set():
                for name, child in children.items():
                    if child.poll() is not None:
                        raise CommandError(f"the {name} process exited with status {child.returncode}; stopping")
                stop.wait(0.5)
            self.stdout.write("\nStopping the web server and the workers...")
        finally:
            _stop_all(children.values())
        self.stdout.write("Stopped.")

    def _announce_worker(self, children: dict[str, subprocess.Popen], stop: threading.Event) -> None:
        """Queue a heartbeat and wait for the worker to run it: proof the broker and the worker work."""
        asked_at = timezone.now()
        with transaction.atomic():
            worker_heartbeat_request()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not stop.is_set():
            if WorkerHeartbeat.objects.filter(seen_at__gte=asked_at).exists():
                took = (timezone.now() - asked_at).total_seconds()
                self.stdout.write(f"Celery worker is consuming tasks (heartbeat answered in {took:.1f}s).")
                return
            if any(child.poll() is not None for child in children.values()):
                return  # the main loop reports which one died
            stop.wait(0.25)
        if stop.is_set():
            return
        self.stderr.write("The Celery worker has not answered a heartbeat in 90s; see its log above.")


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise CommandError(
                f"cannot listen on {host}:{port} ({exc.strerror}); is Flywheel already running? "
                "Set FLYWHEEL_PORT to use another port."
            ) from exc


def _become_subreaper() -> None:
    prctl(PR_SET_CHILD_SUBREAPER, 1)


def _stop_all(children) -> None:
    # SIGTERM is a warm shutdown for Celery (the task in hand finishes) and a clean stop for runserver; it is
    # sent even after a terminal's Ctrl-C, for the case where only this process was signalled.
    for child in children:
        if child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    stop_descendants(grace_s=STOP_GRACE_S)


def stop_descendants(grace_s: float) -> int:
    """Terminate every process still under this one, kill what outlasts `grace_s`, and reap them all (zombies
    too); the number found. Orphans count once they are ours, which `_become_subreaper` makes them."""
    rest = psutil.Process().children(recursive=True)
    for process in rest:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(rest, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    return len(rest)
