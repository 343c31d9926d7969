"""Management commands: create_project, create_api_key (the key on its last line) and seed_demo."""

import json
import subprocess
import sys
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from flywheel.accounts.models import ApiKey, Membership, Project
from flywheel.accounts.selectors import api_key_authenticate


def run(*args):
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_create_project_makes_the_owner_maintainer(make_user):
    make_user("olga")
    output = run("create_project", "support-agent", "--owner", "olga")
    assert "Created project support-agent" in output
    membership = Membership.objects.get(project__slug="support-agent")
    assert (membership.user.username, membership.role) == ("olga", "maintainer")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["create_project", "x", "--owner", "nobody"], "no user named 'nobody'"),
        (["create_project", "Bad Slug!", "--owner", "olga"], "invalid project slug"),
        (["create_project", "taken", "--owner", "olga"], "exists already"),
        (["create_api_key", "--project", "missing"], "no project with slug 'missing'"),
        (["create_api_key", "--project", "taken", "--scopes", "ingest,admin"], "unknown scope(s) admin"),
    ],
)
def test_commands_fail_with_a_message(make_user, make_project, args, message):
    make_user("olga")
    make_project("taken")
    with pytest.raises(CommandError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run(*args)


def test_create_api_key_prints_the_key_on_its_last_line(make_project):
    project = make_project("acme")
    output = run("create_api_key", "--project", "acme")
    raw = output.strip().splitlines()[-1]
    key = api_key_authenticate(raw_key=raw)
    assert key is not None and key.project == project
    assert key.scopes == ["ingest", "read"]


def test_create_api_key_takes_scopes(make_project):
    make_project("acme")
    raw = run("create_api_key", "--project", "acme", "--scopes", "ingest").strip().splitlines()[-1]
    assert api_key_authenticate(raw_key=raw).scopes == ["ingest"]


def test_the_command_line_key_works_through_a_real_process(subprocess_env, make_project):
    # Through `manage.py` itself, as the README shows it: the last line of stdout is the key.
    make_project("acme")
    result = subprocess.run(
        [sys.executable, "manage.py", "create_api_key", "--project", "acme", "--scopes", "read"],
        capture_output=True, text=True, env=subprocess_env, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    raw = result.stdout.rstrip("\n").split("\n")[-1]
    assert api_key_authenticate(raw_key=raw).scopes == ["read"]


def test_seed_demo_is_idempotent(db, settings, tmp_path):
    settings.VAR_DIR = tmp_path
    first = run("seed_demo")
    assert "12 trajectories created" in first
    second = run("seed_demo")
    assert "0 trajectories created, 12 updated" in second
    stored = json.loads((tmp_path / "local-login.json").read_text())
    # The same login and key are printed each time, and they work.
    for output in (first, second):
        assert f"password {stored['password']}" in output
        assert output.strip().splitlines()[-1].endswith(stored["api_key"])
    assert Project.objects.filter(slug="demo").count() == 1
    assert ApiKey.objects.count() == 1
    assert ApiKey.objects.get().last_used_at is None  # seeding is not a use of the key
    assert api_key_authenticate(raw_key=stored["api_key"]).project.slug == "demo"
    from django.contrib.auth import get_user_model

    admin = get_user_model().objects.get(username="admin")
    assert admin.is_superuser and admin.check_password(stored["password"])
    project = Project.objects.get(slug="demo")
    outcomes = sorted(project.trajectories.values_list("outcome", flat=True))
    assert outcomes.count("failure") >= 5 and outcomes.count("success") >= 3
    assert project.trajectories.filter(has_tool_error=True).count() >= 4
