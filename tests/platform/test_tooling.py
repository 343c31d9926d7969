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


def test_ci_starts_the_newest_postgresql_and_makes_redis_folders_first(tmp_path):
    text = (REPO / ".ci" / "run").read_text()
    pick = re.search(r'pg_ctlcluster --skip-systemctl-redirect "\$\((.+?)\)" main start', text).group(1)
    assert "/etc/postgresql" in pick
    for version in ("9.6", "15", "16"):  # what an upgrade can leave behind
        (tmp_path / version).mkdir()
    chosen = subprocess.run(
        ["bash", "-c", pick.replace("/etc/postgresql", str(tmp_path))], capture_output=True, text=True, check=True
    )
    assert chosen.stdout.strip() == "16"
    make_dirs = text.index("mkdir -p /var/lib/redis /var/log/redis")
    assert make_dirs < text.index("redis-server --daemonize yes")


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
