"""A team's own environment server: registered by URL only where the operator allows
(FLYWHEEL_ENV_URL_ALLOWLIST, and the outbound guard for its address) and only once it answers /reset; a task
set on it takes promoted tasks that run there, a job's row check accepts them, and the trainer evaluates the
tiny model against it.

The server is a stand-in on 127.0.0.1 speaking the trainer's http environment protocol
(trainer.envs.http_env), scoring with the task's own verifier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse

from flywheel import outbound
from flywheel.environments import services
from flywheel.environments.models import EnvironmentServer
from flywheel.evals.promotion import PromotionRefused, trajectory_promote
from flywheel.training.services import rows_check
from tests.standin import StandIn, serving

REPO = Path(__file__).resolve().parents[3]


class _EnvServer(StandIn):
    """POST /reset, /step, /verify: one-turn episodes scored by the task's verifier."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        from trainer.verifiers import score

        body = json.loads(self.body() or b"{}")
        sessions = self.server.sessions
        self.server.calls.append(self.path)
        if self.server.broken:
            return self._answer(200, b"<html>not an environment</html>")
        if self.path == "/reset":
            sid = uuid.uuid4().hex
            sessions[sid] = {"task": body["task"], "message": None}
            return self._answer(200, json.dumps({"session_id": sid}).encode())
        session = sessions.get(body.get("session_id"))
        if session is None:
            return self._answer(404, b'{"error": "no such session"}')
        if self.path == "/step":
            session["message"] = body["message"]
            return self._answer(200, json.dumps({"observations": [], "done": True}).encode())
        task = session["task"]
        result = score(task["verifier"], session["message"] or "", tools=task.get("tools"))
        answer = {"reward": result.reward, "passed": result.passed, "failure": result.failure}
        return self._answer(200, json.dumps(answer).encode())

    def _answer(self, status: int, data: bytes) -> None:
        self.answer(status, data)


@pytest.fixture
def env_server(settings):
    with serving(_EnvServer, sessions={}, calls=[], broken=False) as server:
        settings.FLYWHEEL_ENV_URL_ALLOWLIST = [server.url + "/"]
        settings.FLYWHEEL_OUTBOUND_ALLOWLIST = ["127.0.0.1"]
        yield server


def _register(client, project, **data):
    return client.post(reverse("environment_server_register", args=[project.slug]), data)


def test_a_maintainer_registers_a_listed_server_that_answers_reset(project, user, client_for, env_server):
    response = _register(client_for(user), project, name="Team gym", url=env_server.url)
    assert response.status_code == 302
    server = EnvironmentServer.objects.get(project=project)
    assert (server.name, server.url, server.checked_at is not None) == ("Team gym", env_server.url, True)
    assert env_server.calls == ["/reset"]
    page = client_for(user).get(reverse("environment_servers", args=[project.slug])).content.decode()
    assert "Team gym" in page and env_server.url in page


@pytest.mark.parametrize("url, allow, outbound_list, message", [
    ("http://127.0.0.1:{port}", [], ["127.0.0.1"], "is not in FLYWHEEL_ENV_URL_ALLOWLIST"),
    ("http://127.0.0.1:{port}/other", ["http://127.0.0.1:{port}/gym/"], ["127.0.0.1"],
     "is not in FLYWHEEL_ENV_URL_ALLOWLIST"),
    ("http://127.0.0.1:{port}", ["http://127.0.0.1:{port}"], [],
     "127.0.0.1 is a loopback address, which FLYWHEEL_OUTBOUND_ALLOWLIST does not list"),
    ("http://169.254.169.254", ["http://169.254.169.254"], [], "169.254.169.254 is a link-local address"),
    ("ftp://127.0.0.1:{port}", ["ftp://127.0.0.1:{port}"], ["127.0.0.1"], "Enter an http:// or https:// URL"),
])
def test_a_url_the_operator_does_not_allow_is_a_field_error(project, user, client_for, env_server, settings, url,
                                                            allow, outbound_list, message):
    port = env_server.server_address[1]
    settings.FLYWHEEL_ENV_URL_ALLOWLIST = [a.format(port=port) for a in allow]
    settings.FLYWHEEL_OUTBOUND_ALLOWLIST = outbound_list
    response = _register(client_for(user), project, name="gym", url=url.format(port=port))
    html = response.content.decode()
    assert response.status_code == 422 and message in html and 'data-field="url"' in html
    assert not EnvironmentServer.objects.exists() and env_server.calls == []


def test_a_server_that_does_not_answer_reset_is_not_registered(project, user, env_server, settings):
    closed = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    url = f"http://127.0.0.1:{closed.server_address[1]}"
    closed.server_close()
    settings.FLYWHEEL_ENV_URL_ALLOWLIST = [url, env_server.url]
    with pytest.raises(ValidationError) as exc:
        services.environment_server_register(project=project, name="down", url=url)
    assert list(exc.value.message_dict) == ["url"]
    assert f"did not answer POST {url}/reset: ConnectionRefusedError" in exc.value.message_dict["url"][0]
    env_server.broken = True
    with pytest.raises(ValidationError, match="not a JSON object with a .session_id."):
        services.environment_server_register(project=project, name="broken", url=env_server.url)
    assert not EnvironmentServer.objects.exists()


def test_who_may_see_and_register(project, user, make_user, make_membership, make_project, client_for, env_server):
    viewer = make_user("viewer")
    make_membership(viewer, project, "viewer")
    services.environment_server_register(project=project, name="<b>gym</b>", url=env_server.url)
    page = client_for(viewer).get(reverse("environment_servers", args=[project.slug]))
    html = page.content.decode()
    assert page.status_code == 200 and "&lt;b&gt;gym&lt;/b&gt;" in html and "<b>gym" not in html
    assert 'id="register"' not in html  # a viewer gets no form...
    assert _register(client_for(viewer), project, name="x", url=env_server.url).status_code == 403  # ...nor a door
    server = EnvironmentServer.objects.get()
    assert client_for(viewer).post(reverse("environment_server_task_set", args=[project.slug, server.pk]),
                                   {"name": "t"}).status_code == 403
    # A reviewer makes task sets on a registered server (as the API's `review` scope does), but registers none.
    reviewer = make_user("reviewer")
    make_membership(reviewer, project, "reviewer")
    html = client_for(reviewer).get(reverse("environment_servers", args=[project.slug])).content.decode()
    assert 'id="register"' not in html and "Check again" not in html and "New task set" in html
    assert _register(client_for(reviewer), project, name="x", url=env_server.url).status_code == 403
    made = client_for(reviewer).post(reverse("environment_server_task_set", args=[project.slug, server.pk]),
                                     {"name": "reviewed"})
    assert made.status_code == 302 and server.task_sets.get().name == "reviewed"
    outsider = make_user("outsider")
    other = make_project("elsewhere", owner=outsider)
    assert client_for(outsider).get(reverse("environment_servers", args=[project.slug])).status_code == 404
    # Another project's server cannot be reached through this project's URL.
    make_membership(user, other, "maintainer")
    assert client_for(user).post(reverse("environment_server_recheck", args=[other.slug, server.pk])).status_code == 404


def test_tasks_promoted_into_its_task_set_run_on_the_server_and_are_trained_on(
        project, user, client_for, bookings, env_server, settings, tiny_model, tmp_path):
    client = client_for(user)
    assert _register(client, project, name="Team gym", url=env_server.url).status_code == 302
    server = EnvironmentServer.objects.get(project=project)
    response = client.post(reverse("environment_server_task_set", args=[project.slug, server.pk]), {"name": "Gym tasks"})
    task_set = server.task_sets.get()
    assert response.status_code == 302 and response["Location"].endswith(f"/tasks/{task_set.pk}/")

    # Promotion scores the agent's output and the reference on the server: the original fails, the reference passes.
    env_server.calls.clear()
    data = {"message_index": 1, "expect": "calls",
            "expected_calls": [{"name": "book_meeting", "arguments": {"person": "alice", "day": "tuesday"}}]}
    task, check = trajectory_promote(trajectory=bookings["b-1"], data=data, target=task_set, user=user)
    assert task.env == {"type": "http", "url": env_server.url}
    assert not check.original_score.passed and check.reference_score.passed
    assert env_server.calls == ["/reset", "/step", "/verify"] * 2

    # A job's row check takes the version's rows; a URL the operator no longer lists is refused by name.
    version = task_set.versions.get()
    assert rows_check(version.rows) == []
    settings.FLYWHEEL_ENV_URL_ALLOWLIST = []
    assert rows_check(version.rows) == [f"task {task.row_id!r}: env.url {env_server.url!r} is not an environment "
                                        "server the operator allows (FLYWHEEL_ENV_URL_ALLOWLIST)"]

    # The trainer, a subprocess fed the outbound policy as the platform feeds it, evaluates the tiny model there.
    export = client.get(reverse("taskset_export", args=[project.slug, task_set.pk, version.number]))
    suite = tmp_path / "train.jsonl"
    suite.write_bytes(export.content)
    env_server.calls.clear()
    code, events, stderr = _evaluate(tiny_model, suite, outbound.subprocess_env())
    assert code == 0, stderr[-3000:]
    cases = [e["case"] for e in events if e["event"] == "eval"]
    assert [c["id"] for c in cases] == [task.row_id] and cases[0]["n"] == 2
    assert env_server.calls.count("/verify") == 2  # both samples were scored by the server

    # The same subprocess without the operator's listing is refused before any request.
    env_server.calls.clear()
    code, events, stderr = _evaluate(tiny_model, suite, {"FLYWHEEL_OUTBOUND_ALLOWLIST": ""})
    assert code != 0 and env_server.calls == []
    assert "127.0.0.1 is a loopback address" in json.dumps(events) + stderr


def _evaluate(tiny_model: Path, suite: Path, policy_env: dict[str, str]) -> tuple[int, list[dict], str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), **policy_env}
    env.pop("MLFLOW_TRACKING_URI", None)
    command = [sys.executable, "-m", "trainer", "evaluate", "--model", str(tiny_model), "--suite", str(suite),
               "--samples", "2", "--max-new-tokens", "16", "--threads", "1"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines() if line.strip()], proc.stderr


def test_a_promotion_the_server_fails_is_a_field_error(project, user, bookings, env_server):
    server = services.environment_server_register(project=project, name="gym", url=env_server.url)
    task_set = services.task_set_create(project=project, name="Gym", user=user, server=server)
    env_server.broken = True
    data = {"message_index": 1, "expect": "calls",
            "expected_calls": [{"name": "book_meeting", "arguments": {"person": "alice", "day": "tuesday"}}]}
    with pytest.raises(PromotionRefused) as exc:
        trajectory_promote(trajectory=bookings["b-1"], data=data, target=task_set, user=user)
    assert "environment server" in exc.value.check.errors["env_type"][0]
    assert not task_set.tasks.exists()


def test_the_api_registers_a_server_and_makes_a_task_set_on_it(project, env_server, api_client, make_api_key,
                                                               make_project, settings):
    # Registering is a maintainer's action on the page: `train` in the API, not `review`.
    reviewing = make_api_key(project, scopes=["read", "review"])
    assert api_client.post("/api/v1/environment-servers", {"name": "gym", "url": env_server.url},
                           key=reviewing).status_code == 403
    key = make_api_key(project, scopes=["read", "review", "train"])
    refused = api_client.post("/api/v1/environment-servers", {"name": "gym", "url": "http://10.0.0.9/"}, key=key)
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "url"]
    assert "FLYWHEEL_ENV_URL_ALLOWLIST" in refused.json()["detail"][0]["msg"] and env_server.calls == []
    made = api_client.post("/api/v1/environment-servers", {"name": "gym", "url": env_server.url}, key=key)
    assert made.status_code == 201 and env_server.calls == ["/reset"]
    server_id = made.json()["id"]
    assert [s["id"] for s in api_client.get("/api/v1/environment-servers", key=key).json()] == [server_id]
    task_set = api_client.post("/api/v1/task-sets", {"name": "on the gym", "server": server_id}, key=key)
    assert task_set.status_code == 201
    from flywheel.environments.models import TaskSet

    assert TaskSet.objects.get(pk=task_set.json()["id"]).server_id == server_id
    # Another project's server is not this project's to use, nor to list.
    other = make_api_key(make_project("other"), scopes=["read", "review"])
    assert api_client.get("/api/v1/environment-servers", key=other).json() == []
    theirs = api_client.post("/api/v1/task-sets", {"name": "x", "server": server_id}, key=other)
    assert theirs.status_code == 422 and "server" in theirs.json()["errors"]


@pytest.mark.parametrize("url, allowed", [
    ("http://envs.internal:8000/team-a", True),
    ("http://envs.internal:8000/team-a/", True),
    ("http://envs.internal:8000/team-a/gym", True),
    ("http://envs.internal:8000/team-a%2F..%2Fteam-b", False),  # slashes encoded: one segment to some servers
    ("http://envs.internal:8000/team-ab", False),  # by segments, not by characters
    ("http://envs.internal:8000/team-b", False),
    ("http://envs.internal:8000/team-a/../team-b", False),
    ("http://envs.internal:8000/team-a/%2e%2e/team-b", False),
    ("http://envs.internal:8000/team-a/%2E%2E%2Fteam-b", False),
    ("http://envs.internal:8000/team-a/%252e%252e/team-b", False),  # encoded twice
    ("http://envs.internal:8000/team-a/..;/team-b", False),
    ("http://envs.internal:8000/team-a/./gym", False),
    ("http://envs.internal:8000/team-a/..%5cteam-b", False),  # a backslash some servers read as a slash
    ("http://envs.internal:8000/team-a/gym?next=/team-b", False),
    ("http://envs.internal:8000/team-a/gym#frag", False),
    ("http://envs.internal:8001/team-a", False),
])
def test_the_allowlist_compares_plain_path_segments(settings, url, allowed):
    settings.FLYWHEEL_ENV_URL_ALLOWLIST = ["http://envs.internal:8000/team-a"]
    assert services.env_url_allowed(url) is allowed


@pytest.mark.parametrize("spelling", ["..", "%2e%2e", "%2E%2e"])
def test_a_dot_segment_url_is_refused_before_anything_is_called(project, env_server, settings, spelling):
    settings.FLYWHEEL_ENV_URL_ALLOWLIST = [env_server.url + "/team-a"]
    url = f"{env_server.url}/team-a/{spelling}/team-b"
    with pytest.raises(ValidationError) as exc:
        services.environment_server_register(project=project, name="gym", url=url)
    assert "no . or .. segment" in exc.value.message_dict["url"][0]
    assert not EnvironmentServer.objects.exists() and env_server.calls == []
