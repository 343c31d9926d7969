"""`make run` on SQLite: two reviewers' processes work one queue at once, each claiming and completing until
nothing is left. Every item is claimed by exactly one of them, and neither fails with "database is locked"
(every transaction takes the write lock when it begins, so claims run one after the other).

The database is this test's own file, whatever DATABASE_URL the suite runs on (as in
tests/platform/test_sqlite_concurrency.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from django.conf import settings

REPO_DIR = Path(settings.BASE_DIR)
ITEMS = 30

SETUP = textwrap.dedent(
    f"""
    from django.contrib.auth import get_user_model
    from flywheel.accounts.services import membership_set, project_create
    from flywheel.trajectories.ingest import ingest_trajectories
    project = project_create(slug="queue-sqlite")
    for name in ("a", "b"):
        membership_set(project=project, user=get_user_model().objects.create(username=name), role="reviewer")
    records = [{{"external_id": f"t-{{i}}", "messages": [{{"role": "user", "content": "hi"}}], "outcome": "failure"}}
               for i in range({ITEMS})]
    assert ingest_trajectories(project=project, records=records).accepted == {ITEMS}
    """
)

REVIEWER = textwrap.dedent(
    """
    import json, os, sys, time
    import django
    django.setup()
    from django.contrib.auth import get_user_model
    from flywheel.accounts.models import Project
    from flywheel.failures import queue
    name, go = sys.argv[1], sys.argv[2]
    project = Project.objects.get(slug="queue-sqlite")
    user = get_user_model().objects.get(username=name)
    while not os.path.exists(go):
        time.sleep(0.01)
    claimed = []
    while True:
        claim = queue.queue_claim_next(project=project, user=user)
        if claim is None:
            break
        claimed.append(claim.trajectory.pk)
        time.sleep(0.02)  # reading it: the other reviewer claims meanwhile
        queue.queue_complete(project=project, trajectory=claim.trajectory, user=user)
    print(json.dumps(claimed))
    """
)


@pytest.mark.slow  # ~17 s on two busy cores: migrating a fresh SQLite file and two Django processes
def test_two_reviewers_on_sqlite_never_claim_the_same_item(tmp_path):
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "flywheel.settings",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'flywheel.sqlite3'}",
        "CELERY_BROKER_URL": "filesystem://",
        "FLYWHEEL_VAR_DIR": str(tmp_path / "var"),
        "FLYWHEEL_TRIAGE": "false",
        "PYTHONUNBUFFERED": "1",
    }
    run = {"cwd": REPO_DIR, "env": env, "capture_output": True, "text": True, "timeout": 300}
    migrated = subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], **run)
    assert migrated.returncode == 0, migrated.stderr
    made = subprocess.run([sys.executable, "manage.py", "shell", "-c", SETUP], **run)
    assert made.returncode == 0, made.stderr

    go = tmp_path / "go"
    reviewers = [
        subprocess.Popen(
            [sys.executable, "-c", REVIEWER, name, str(go)],
            cwd=REPO_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for name in ("a", "b")
    ]
    time.sleep(0.3)  # both have set Django up: their claims overlap in time
    go.touch()
    claimed = []
    for reviewer in reviewers:
        out, err = reviewer.communicate(timeout=300)
        assert reviewer.returncode == 0, f"a reviewer failed:\n{err[-3000:]}"
        claimed.append(json.loads(out.strip().splitlines()[-1]))
    a, b = claimed
    assert not set(a) & set(b), set(a) & set(b)
    assert len(a) + len(b) == ITEMS and len(set(a) | set(b)) == ITEMS
    assert a and b, claimed  # both worked the queue at the same time
