"""The HTTP environment against the reference workplace server: the same episodes and rewards as in
process (GRPO steps included), retries, time-outs, bounded concurrency, protocol errors, and a failing
server turning into an error event that names the task."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from trainer.config import GRPOConfig, JobSpec, write_jsonl
from trainer.envs import make_env, replay
from trainer.envs.http_env import EnvServerError, HttpEnv
from trainer.envs.http_server import start
from trainer.envs.workplace import generate_tasks
from trainer.loop import train_grpo
from trainer.rollout.episodes import start_episodes
from trainer.runner import JobFailed
from trainer.tracking import EventLog

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server():
    srv = start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def tasks() -> list[dict]:
    return generate_tasks(40, seed=3, split="train")


def over_http(task: dict, url: str, **env) -> dict:
    return {**task, "env": {**task["env"], "type": "http", "url": url, **env}}


def test_solutions_play_the_same_over_http(server, tasks):
    for task in tasks[:12]:
        wrong = [task["solution"][0], "<tool_call>{\"name\": \"delete_task\", \"arguments\": {\"task_id\": \"T1\"}}"
                 "</tool_call>", "No."]
        for completions in (task["solution"], wrong, ["<tool_call>{broken</tool_call>"]):
            local_messages, local = replay(task, completions)
            remote_messages, remote = replay(over_http(task, server.url), completions)
            assert remote_messages == local_messages
            assert (remote.reward, remote.passed, remote.failure) == (local.reward, local.passed, local.failure)
            remote_checks, local_checks = dict(remote.checks), dict(local.checks)
            episode, local_episode = remote_checks.pop("episode"), local_checks.pop("episode", None)
            assert remote_checks == local_checks and episode.pop("server") == server.url
            # The workplace's own account of the episode (turns, call errors) comes back whole.
            assert episode == (local_episode or {"turns": 1})


def grpo(tiny_model: Path, job_dir: Path, rows: list[dict], steps: int = 2) -> tuple[list[dict], list]:
    job_dir.mkdir()
    write_jsonl(job_dir / "train.jsonl", rows)
    config = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=4, max_new_tokens=40, max_steps=steps,
                        learning_rate=1e-2, eval_on_start=False, r=4, alpha=8, num_threads=1, seed=5)
    spec = JobSpec(model=str(tiny_model), job_dir=job_dir, train=job_dir / "train.jsonl", config=config, mlflow=False)
    events = EventLog(None)
    seen: list = []

    def record(ep):  # the verifier's reward, unchanged; kept with the transcript it scored
        seen.append((ep.row["id"], ep.messages, ep.score.reward, ep.score.passed, ep.score.failure))
        return ep.reward

    train_grpo(spec, events, reward_fn=record)
    return [e for e in events.events if e["event"] == "step"], seen


def test_grpo_through_the_server_gets_the_in_process_rewards(tiny_model, tmp_path, server, tasks):
    rows = generate_tasks(8, seed=21, split="train", difficulty="single")
    local_steps, local = grpo(tiny_model, tmp_path / "local", rows)
    remote_steps, remote = grpo(tiny_model, tmp_path / "http", [over_http(r, server.url) for r in rows])
    assert len(local) == len(remote) == 2 * 2 * 4
    assert remote == local  # every episode: the same transcript, reward, pass and failure
    assert len({r for _, _, r, _, _ in local}) > 1  # the rewards varied, so the steps trained on something
    for a, b in zip(local_steps, remote_steps, strict=True):
        for key in ("reward_mean", "reward_std", "train_success_rate", "loss", "grad_norm", "turns"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key


def closed_port_url() -> str:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    srv.server_close()
    return url


def test_a_failing_server_is_an_error_event_naming_the_task(tiny_model, tmp_path, tasks):
    url = closed_port_url()
    write_jsonl(tmp_path / "train.jsonl", [over_http(t, url, retries=1) for t in tasks[:4]])
    spec = JobSpec(model=str(tiny_model), job_dir=tmp_path, train=tmp_path / "train.jsonl", mlflow=False,
                   config=GRPOConfig(num_prompts_per_step=1, num_generations_per_prompt=2, max_steps=1,
                                     eval_on_start=False, r=4, alpha=8, num_threads=1))
    events = EventLog(None)
    with pytest.raises(JobFailed):
        train_grpo(spec, events)
    error = events.events[-1]
    assert error["event"] == "error" and error["step"] == 1
    message = error["message"]
    assert "EnvServerError: task 'wp-" in message and f"environment server {url}: POST /reset" in message
    assert "failed after 2 attempts" in message and "ConnectionRefusedError" in message


class Flaky(BaseHTTPRequestHandler):
    """Forwards to the reference server, but loses the answer to the first /step of every session (the
    step was applied; the client sees a 502); hangs on /verify when told to; counts requests."""

    upstream = ""
    hang = False
    requests: list[str] = []
    refused: set[str] = set()
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with self.lock:
            self.requests.append(self.path)
        sid = json.loads(body).get("session_id")
        if self.path == "/verify" and self.hang:
            time.sleep(1.0)
        request = urllib.request.Request(self.upstream + self.path, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request) as response:
            data = response.read()
        if self.path == "/step" and sid not in self.refused:
            self.refused.add(sid)
            return self.answer(502, b'{"error": "bad gateway"}')
        self.answer(200, data)

    def answer(self, status: int, data: bytes):
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def flaky(server):
    Flaky.upstream, Flaky.hang, Flaky.requests, Flaky.refused = server.url, False, [], set()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    srv.handle_error = lambda request, address: None  # the hung /verify writes to a client that gave up
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_retries_and_time_outs(flaky, tasks):
    _, url = flaky
    # A first call that adds a record: applying it twice would leave two.
    task = next(t for t in tasks if t["solution"][0]["tool_calls"][0]["function"]["name"] in ("create_task", "create_event"))
    messages, score = replay(over_http(task, url, timeout_s=5), task["solution"])
    assert score.passed and messages == replay(task, task["solution"])[0]
    # The first step's answer was lost after the server applied it; the retry carried the same turn, so the
    # server answered it from its record instead of applying it twice (a second create_task would fail the
    # state verifier, and a second observation would differ from the in-process one).
    assert Flaky.requests.count("/step") == len(task["solution"]) + 1 and Flaky.requests.count("/reset") == 1

    Flaky.hang = True
    env = HttpEnv(over_http(task, url, timeout_s=0.2, retries=1))
    env.reset()
    env.step(task["solution"][0])
    with pytest.raises(EnvServerError, match=rf"task '{task['id']}': .* POST /verify failed after 2 attempts: "
                                             r"timed out after 0\.2 s"):
        env.score()


class Slow(BaseHTTPRequestHandler):
    """Answers /reset after a pause, counting the requests in flight."""

    active = peak = 0
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        with self.lock:
            Slow.active += 1
            Slow.peak = max(Slow.peak, Slow.active)
        time.sleep(0.05)
        with self.lock:
            Slow.active -= 1
        data = json.dumps({"session_id": "s"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_episodes_run_concurrently_within_the_servers_bound(tiny_model):
    from trainer.models import load_tokenizer

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        # A path of its own: the bound is kept per URL for the process, and an earlier test's server may have
        # had this port (and another bound).
        url = f"http://127.0.0.1:{srv.server_address[1]}/slow-{uuid.uuid4().hex}/"
        row = {"id": "slow-1", "messages": [{"role": "user", "content": "hi"}], "tools": [],
               "env": {"type": "http", "url": url, "max_concurrency": 3}}
        episodes = start_episodes([row, {**row, "id": "slow-2"}], 6, load_tokenizer(str(tiny_model)), make_env)
        assert len(episodes) == 12 and all(ep.env.session_id == "s" for ep in episodes)
        assert Slow.peak == 3  # concurrent (more than one at a time), never more than the row allows
    finally:
        srv.shutdown()
        srv.server_close()


class Broken(BaseHTTPRequestHandler):
    answers: dict[str, tuple[int, bytes]] = {}

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        status, data = self.answers[self.path]
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("answers, call, message", [
    ({"/reset": (200, b"{}")}, "reset", r"POST /reset the answer has no \"session_id\""),
    ({"/reset": (400, b'{"error": "no initial_state"}')}, "reset", r"POST /reset answered HTTP 400 \(.*no initial_state"),
    ({"/reset": (200, b"not json")}, "reset", r"POST /reset the answer is not JSON"),
    ({"/step": (200, b'{"observations": [], "done": "yes"}')}, "step", r"POST /step \"done\" must be true or false"),
    ({"/verify": (200, b'{"reward": "high"}')}, "score", r"POST /verify \"reward\" must be a number"),
    ({"/verify": (200, b'{"reward": 0, "failure": "bad_vibes"}')}, "score", r"POST /verify \"failure\" must be null or"),
])
def test_protocol_errors_name_the_task_and_the_field(answers, call, message):
    Broken.answers = {"/reset": (200, b'{"session_id": "s"}'), **answers}
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Broken)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        env = HttpEnv({"id": "t-9", "messages": [], "env": {"type": "http", "retries": 0,
                                                            "url": f"http://127.0.0.1:{srv.server_address[1]}"}})
        with pytest.raises(EnvServerError, match=r"^task 't-9': environment server http://127\.0\.0\.1:\d+: " + message):
            env.reset()
            if call != "reset":
                env.step("Done.") if call == "step" else env.score()
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("env, message", [
    ({"type": "http"}, r"env\.url must be an http:// or https:// URL, got None"),
    ({"type": "http", "url": "file:///etc/passwd"}, r"env\.url must be an http"),
    ({"type": "http", "url": "http://x", "timeout_s": 0}, r"env\.timeout_s must be a number >= 0\.001"),
    ({"type": "http", "url": "http://x", "max_concurrency": 1.5}, r"env\.max_concurrency must be an integer >= 1"),
])
def test_a_bad_http_row_names_the_field(env, message):
    with pytest.raises(ValueError, match=r"task 't-1': " + message):
        make_env({"id": "t-1", "messages": [], "env": env})


def test_the_reference_server_from_the_command_line(tasks):
    proc = subprocess.Popen([sys.executable, "-m", "trainer.envs.http_server", "--port", "0"], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = json.loads(proc.stdout.readline())
        assert line["event"] == "listening"
        task = tasks[1]
        _, score = replay(over_http(task, line["url"]), task["solution"])
        assert score.passed and score.reward == 1.0
    finally:
        proc.terminate()
        proc.wait(timeout=10)
