"""The Makefile and .ci/run do what the README promises (read and dry-run, nothing installed)."""

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ci_script_is_executable_valid_bash_and_points_at_the_services():
    script = REPO / ".ci" / "run"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "export DATABASE_URL=postgres://postgres@127.0.0.1:5432/flywheel" in text
    assert re.search(r"export CELERY_BROKER_URL=redis://127\.0\.0\.1:6379/\d+", text)
    assert "export CI=true" in text
    assert "pg_ctlcluster --skip-systemctl-redirect" in text and "redis-server --daemonize yes" in text
    assert "apt-get install -y chromium" in text
    assert text.rstrip().endswith("make test")


def _dry_run(target: str) -> str:
    # -B: as if nothing were built yet, so the setup recipe shows even where the stamp is fresh.
    result = subprocess.run(
        ["make", "-n", "-B", target], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
    )
    return result.stdout


def test_setup_installs_torch_first_then_the_project():
    lines = _dry_run("setup").splitlines()
    torch = next(i for i, line in enumerate(lines) if "pip install" in line and "torch==2.13.0" in line)
    project = next(i for i, line in enumerate(lines) if "pip install" in line and "-e '.[dev]'" in line)
    assert torch < project


def test_run_and_test_targets():
    assert "manage.py runlocal" in _dry_run("run")
    assert re.search(r"pytest -n \d+", _dry_run("test"))
