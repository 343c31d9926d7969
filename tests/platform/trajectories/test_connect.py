"""The "Connect your agent" page: each snippet, taken from the page as a person sees it, is run against the
live test server (curl and Python in subprocesses, the OTLP ones around a stand-in OpenAI server), and the
trajectory it sent is found in the project. Also: who sees the page, the key carried from Settings, and the
links to the page."""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from django.urls import reverse

from flywheel.trajectories import connect
from flywheel.trajectories.models import Trajectory

REPO = Path(__file__).resolve().parents[3]
SNIPPET_RE = re.compile(
    r'<pre class="snippet" id="snippet-(?P<id>\w+)" data-snippet="(?P=id)" data-language="(?P<language>\w+)">'
    r"<code>(?P<text>.*?)</code></pre>", re.S)


def shown_snippets(page: str) -> dict[str, str]:
    """Each snippet's text as the browser shows it (the page's markup, unescaped)."""
    return {m["id"]: html.unescape(m["text"]) for m in SNIPPET_RE.finditer(page)}


@pytest.fixture
def maintainer_page(live_server, project, user, client_for):
    """The page a maintainer sees after creating a key in Settings and pressing "Connect your agent with this
    key", served as if on the live server's address (the snippets name the address the request came to)."""
    client = client_for(user)
    host = urlsplit(live_server.url).netloc
    created = client.post(reverse("api_key_create", args=[project.slug]),
                          {"name": "agent", "scopes": ["ingest"]}, HTTP_HOST=host)
    assert created.status_code == 201
    raw_key = re.search(r'name="key" value="([^"]+)"', created.content.decode())[1]
    response = client.post(reverse("connect", args=[project.slug]), {"key": raw_key}, HTTP_HOST=host)
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    return response.content.decode(), raw_key


def run_shell(script: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    import os

    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHON": sys.executable, **env})
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def run_python(env_snippet: str, code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """The env snippet in a shell, then the Python snippet with the environment it set."""
    (cwd / "agent.py").write_text(code)
    return run_shell(env_snippet + '\n"$PYTHON" agent.py\n', cwd, **env)


def test_every_snippet_is_filled_in_with_this_server_and_the_key(maintainer_page, live_server):
    page, raw_key = maintainer_page
    shown = shown_snippets(page)
    assert list(shown) == [snippet_id for snippet_id, _, _ in connect.SNIPPETS]
    assert shown["env"] == f"export FLYWHEEL_URL={live_server.url}\nexport FLYWHEEL_API_KEY={raw_key}\n"
    assert f"curl -sS --fail-with-body {live_server.url}/api/v1/trajectories " in shown["curl"]
    assert f'"{live_server.url}/api/v1/otlp/v1/traces"' in shown["otlp_genai"]
    # The API docs and the Upload page are linked from it.
    assert f'href="{reverse("api:openapi-view")}"' in page and 'href="/p/' in page and "/upload/" in page


def test_the_curl_snippet_sends_a_trajectory(maintainer_page, project, tmp_path):
    page, _ = maintainer_page
    shown = shown_snippets(page)
    out = run_shell(shown["env"] + shown["curl"], tmp_path)
    assert json.loads(out.stdout)["accepted"] == 1
    trajectory = Trajectory.objects.get(project=project, external_id="conversation-0001")
    assert trajectory.agent == "support" and trajectory.source == "api"
    assert trajectory.messages[1]["tool_calls"][0]["function"]["name"] == "get_order"
    assert trajectory.tools[0]["function"]["name"] == "get_order"


def test_the_python_snippet_sends_a_trajectory(maintainer_page, project, tmp_path):
    page, _ = maintainer_page
    shown = shown_snippets(page)
    run_python(shown["env"], shown["python"], tmp_path)
    trajectory = Trajectory.objects.get(project=project, external_id="conversation-0002")
    assert trajectory.outcome == "failure" and trajectory.feedback.startswith("The order had shipped")
    assert [m["role"] for m in trajectory.messages] == ["user", "assistant", "tool", "assistant"]


def test_the_jsonl_file_and_its_curl_send_both_trajectories(maintainer_page, project, tmp_path):
    page, _ = maintainer_page
    shown = shown_snippets(page)
    (tmp_path / "trajectories.jsonl").write_text(shown["jsonl_file"])
    out = run_shell(shown["env"] + shown["jsonl_curl"], tmp_path)
    assert json.loads(out.stdout)["accepted"] == 2
    assert set(Trajectory.objects.filter(project=project).values_list("external_id", flat=True)) == {
        "conversation-0003", "conversation-0004"}


class StandInOpenAI(BaseHTTPRequestHandler):
    """OpenAI's chat completions, as an agent's client sees them: a tool call first, then the answer once the
    tool's result is in the conversation."""

    requests: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StandInOpenAI.requests.append(body)
        if any(m.get("role") == "tool" for m in body["messages"]):
            message, finish = {"role": "assistant", "content": "Your order 1234 has shipped."}, "stop"
        else:
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_order", "arguments": '{"order_id": "1234"}'}}]}
            finish = "tool_calls"
        data = json.dumps({
            "id": f"chatcmpl-{len(StandInOpenAI.requests)}", "object": "chat.completion", "created": int(time.time()),
            "model": body["model"], "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 21, "completion_tokens": 7, "total_tokens": 28},
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def openai_server():
    StandInOpenAI.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandInOpenAI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("snippet_id", ["otlp_openinference", "otlp_genai"])
def test_an_otlp_snippet_sends_the_agents_conversation(maintainer_page, project, tmp_path, openai_server,
                                                       snippet_id):
    page, _ = maintainer_page
    shown = shown_snippets(page)
    run_python(shown["env"], shown[snippet_id], tmp_path, OPENAI_BASE_URL=openai_server, OPENAI_API_KEY="sk-test",
               OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT="")  # the snippet sets what it needs itself
    assert len(StandInOpenAI.requests) == 2  # the agent ran: a tool call, then the answer
    trajectory = Trajectory.objects.get(project=project)
    assert trajectory.source == "otlp" and trajectory.agent == "support"
    assert trajectory.model_version == "gpt-4o-mini"
    assert [m["role"] for m in trajectory.messages] == ["user", "assistant", "tool", "assistant"]
    assert trajectory.messages[0]["content"] == "Where is my order 1234?"
    assert trajectory.messages[1]["tool_calls"][0]["function"]["name"] == "get_order"
    assert "shipped" in trajectory.messages[2]["content"]
    assert trajectory.messages[3]["content"] == "Your order 1234 has shipped."
    assert trajectory.tools[0]["function"]["name"] == "get_order"


def test_the_packages_the_page_installs_are_the_ones_pinned_and_installed():
    pyproject = (REPO / "pyproject.toml").read_text()
    for snippet_id in ("otlp_openinference", "otlp_genai"):
        for package in connect.pip_line(snippet_id).split()[2:]:
            version = metadata.version(package)  # installed: the snippet's imports are what the test ran
            assert f'"{package}=={version}"' in pyproject, package


# --- who sees it, and the key ------------------------------------------------------------------------------


def test_a_viewer_sees_a_placeholder_and_is_told_who_makes_keys(project, make_user, make_membership, client_for):
    viewer = make_user("viewer")
    make_membership(viewer, project, "viewer")
    page = client_for(viewer).get(reverse("connect", args=[project.slug])).content.decode()
    shown = shown_snippets(page)
    assert shown["env"].endswith(f"export FLYWHEEL_API_KEY='{connect.KEY_PLACEHOLDER}'\n")
    assert "Ask a maintainer" in page and "http://testserver/api/v1/trajectories" in shown["curl"]


def test_a_key_of_another_project_or_revoked_is_never_shown(project, user, make_project, make_api_key, client_for):
    client = client_for(user)
    other = make_api_key(make_project("other"), scopes=["ingest"])
    response = client.post(reverse("connect", args=[project.slug]), {"key": str(other)})
    page = response.content.decode()
    assert str(other) not in page and "not an active key of this project" in page
    assert "no-store" not in response.get("Cache-Control", "")
    read_only = make_api_key(project, scopes=["read"])
    page = client.post(reverse("connect", args=[project.slug]), {"key": str(read_only)}).content.decode()
    assert "lacks the ingest scope" in page


def test_a_non_member_gets_404_and_a_stranger_the_login(project, make_user, client_for, client):
    assert client_for(make_user("outsider")).get(reverse("connect", args=[project.slug])).status_code == 404
    assert client.get(reverse("connect", args=[project.slug])).status_code == 302


def test_the_page_is_linked_from_the_nav_settings_upload_and_an_empty_dashboard(project, user, client_for):
    client = client_for(user)
    target = f'href="{reverse("connect", args=[project.slug])}"'
    for name in ("project_settings", "upload", "flywheel_dashboard", "trajectory_list"):
        assert target in client.get(reverse(name, args=[project.slug])).content.decode(), name
    dashboard = client.get(reverse("flywheel_dashboard", args=[project.slug])).content.decode()
    assert 'id="no-trajectories"' in dashboard


def test_agent_content_in_a_key_name_is_escaped(project, user, make_api_key, client_for):
    key = make_api_key(project, scopes=["read"], name="<script>alert(1)</script>")
    page = client_for(user).post(reverse("connect", args=[project.slug]), {"key": str(key)}).content.decode()
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;" in page
