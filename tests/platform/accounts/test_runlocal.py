"""`manage.py runlocal` (what `make run` starts): seeds, serves, runs a worker, and Ctrl-C stops all of it."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_runlocal_serves_runs_a_worker_and_stops_on_ctrl_c(subprocess_env, tmp_path):
    port = _free_port()
    log_path = tmp_path / "runlocal.log"
    # The broker of `make run` (folders under var/), this test's own: nothing else can take its heartbeat.
    env = {**subprocess_env, "CELERY_BROKER_URL": "filesystem://", "FLYWHEEL_VAR_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        # A session of its own, so that the SIGINT below reaches its group as a terminal's Ctrl-C would.
        process = subprocess.Popen(
            [sys.executable, "manage.py", "runlocal", "--port", str(port)],
            env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "Flywheel is running at" not in log_path.read_text(errors="replace"):
            assert process.poll() is None, log_path.read_text(errors="replace")
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")
            time.sleep(0.2)
        time.sleep(0.5)  # the block is one write; let it land whole
        output = log_path.read_text(errors="replace")
        assert "Celery worker is consuming tasks" in output
        # What a person needs to start comes last and together: the address, the login, the key.
        block = output[output.index("Flywheel is running at"):].splitlines()
        assert block[0].endswith(f"http://localhost:{port}/"), block
        assert block[1].startswith("  Admin login: username admin  password "), block
        assert block[2].startswith("  Demo API key (project demo"), block
        assert output.index("Celery worker is consuming tasks") < output.index("Flywheel is running at")
        assert "No hostname was supplied" not in output
        assert "building the tiny model" not in output
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as response:
            assert response.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as response:
            assert response.url.endswith("/accounts/login/?next=/")  # the project list asks for a login

        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(timeout=30) == 0, log_path.read_text(errors="replace")
        deadline = time.monotonic() + 15
        while _group_alive(process.pid):  # the web server and the worker are gone too
            assert time.monotonic() < deadline, "children of runlocal still running"
            time.sleep(0.2)
        assert log_path.read_text(errors="replace").rstrip().endswith("Stopped.")
    finally:
        if _group_alive(process.pid):
            os.killpg(process.pid, signal.SIGKILL)


def test_sigterm_stops_everything_cleanly_even_when_sent_twice(subprocess_env, tmp_path):
    # `make run` stopped with SIGTERM: make passes the signal on to its child, and a signal to the process
    # group (a service manager, `kill -- -PGID`) reaches it too, so two may arrive; the second lands while
    # the children are being stopped. Neither may leave a traceback or a child behind.
    port = _free_port()
    out_path, err_path = tmp_path / "out.log", tmp_path / "err.log"
    env = {**subprocess_env, "CELERY_BROKER_URL": "filesystem://", "FLYWHEEL_VAR_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "runlocal", "--port", str(port), "--no-seed"],
            env=env, stdout=out, stderr=err, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "Flywheel is running at" not in out_path.read_text(errors="replace"):
            assert process.poll() is None, err_path.read_text(errors="replace")
            assert time.monotonic() < deadline, out_path.read_text(errors="replace")
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) in (0, 143), err_path.read_text(errors="replace")
        deadline = time.monotonic() + 15
        while _group_alive(process.pid):  # the web server and both workers are gone too
            assert time.monotonic() < deadline, "children of runlocal still running"
            time.sleep(0.2)
        errors = err_path.read_text(errors="replace")
        assert "Traceback" not in errors and "KeyboardInterrupt" not in errors, errors
        assert out_path.read_text(errors="replace").rstrip().endswith("Stopped.")
    finally:
        if _group_alive(process.pid):
            os.killpg(process.pid, signal.SIGKILL)


ORPHAN_SCRIPT = r"""
import os, subprocess, sys, psutil
from flywheel.seed.management.commands import runlocal

runlocal._become_subreaper()
# A child that starts a sleeper and a short-lived process of its own, and exits without reaping either: what a
# worker killed mid-task leaves (the demo's player), and Celery beat's process when its worker exits first.
leaver = subprocess.run([sys.executable, "-c",
                         "import os, subprocess, time; quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
                         "s = subprocess.Popen(['sleep', '600'], **quiet); q = subprocess.Popen(['true'], **quiet); "
                         "time.sleep(0.5); print(s.pid, q.pid, flush=True); os._exit(0)"],  # no reaping at exit
                        capture_output=True, text=True, check=True)
sleeper, quick = (int(pid) for pid in leaver.stdout.split())
print("adopted", psutil.Process(sleeper).ppid() == os.getpid(), psutil.Process(quick).status())
print("found", runlocal.stop_descendants(grace_s=5))
print("left", [pid for pid in (sleeper, quick) if psutil.pid_exists(pid)])
"""


def test_stopping_stops_and_reaps_what_a_dead_child_left_behind(tmp_path):
    # In a process of its own: becoming a subreaper would change the test's process for every later test.
    env = {**os.environ, "FLYWHEEL_VAR_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "manage.py", "shell", "-c", ORPHAN_SCRIPT],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # Both became runlocal's own: the sleeper still running, the other a zombie nobody reaped.
    assert lines[-3] == "adopted True zombie", result.stdout
    assert lines[-2] == "found 2", result.stdout
    assert lines[-1] == "left []", result.stdout
