"""The trainer's outbound guard (trainer.outbound), fed by FLYWHEEL_OUTBOUND_ALLOWLIST in its environment as
the platform starts it: environment servers and the llm_judge endpoint are reached only where allowed,
checked on the resolved address, with no redirect followed, each request within its deadline, never to a URL
with credentials in it. Real sockets against stand-in servers."""

from __future__ import annotations

import json
import time
from contextlib import ExitStack

import pytest

from tests.standin import StandIn, serving
from trainer import outbound
from trainer.envs.http_env import EnvServerError, HttpEnv
from trainer.verifiers import configure_llm_judge, score


class _Stub(StandIn):
    """A stand-in environment server and judge: /reset, /step, /verify and /v1/chat/completions."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.body()
        self.server.received.append(self.path)
        if self.server.redirect_to:
            return self.redirect(307, self.server.redirect_to + self.path)
        answer = {"/reset": {"session_id": "s1"}, "/verify": {"reward": 1.0},
                  "/step": {"observations": [], "done": True},
                  "/v1/chat/completions": {"choices": [{"message": {"content": '{"score": 1, "reason": "ok"}'}}]},
                  }.get(self.path, {})
        self.answer(200, answer)


@pytest.fixture
def make_stub():
    with ExitStack() as stack:
        yield lambda redirect_to=None: stack.enter_context(serving(_Stub, received=[], redirect_to=redirect_to))


@pytest.fixture
def allow(monkeypatch):
    """`allow("127.0.0.1")`: the policy the trainer reads from its environment, as a subprocess of the platform."""
    monkeypatch.setattr(outbound, "_policy_source", outbound.env_policy)  # not the platform's settings

    def set_list(value: str) -> None:
        monkeypatch.setenv(outbound.ALLOWLIST_VAR, value)

    set_list("")
    return set_list


def _env(url: str) -> HttpEnv:
    return HttpEnv({"id": "t-1", "messages": [{"role": "user", "content": "hi"}],
                    "env": {"type": "http", "url": url, "retries": 0, "timeout_s": 5}})


@pytest.mark.parametrize("url, why", [
    ("http://127.0.0.1:{port}", "127.0.0.1 is a loopback address"),
    ("http://localhost:{port}", "localhost resolves to 127.0.0.1, a loopback address"),
    ("http://169.254.169.254", "169.254.169.254 is a link-local address"),
    ("http://10.20.30.40:8000", "10.20.30.40 is a private address"),
])
def test_an_environment_server_on_a_refused_address_is_never_called(allow, make_stub, url, why):
    stub = make_stub()
    with pytest.raises(EnvServerError, match=rf"^task 't-1': environment server .*: POST /reset not sent: .*{why}, "
                                             "which FLYWHEEL_OUTBOUND_ALLOWLIST does not list"):
        _env(url.format(port=stub.server_address[1])).reset()
    assert stub.received == []


def test_a_listed_environment_server_plays_an_episode(allow, make_stub):
    stub = make_stub()
    allow("127.0.0.1")
    env = _env(f"http://127.0.0.1:{stub.server_address[1]}")
    env.reset()
    env.step("done")
    assert env.score().passed and stub.received == ["/reset", "/step", "/verify"]


def test_an_environment_servers_redirect_is_not_followed(allow, make_stub):
    inner = make_stub()
    outer = make_stub(redirect_to=f"http://127.0.0.1:{inner.server_address[1]}")
    allow("127.0.0.0/8")
    with pytest.raises(EnvServerError, match=r"POST /reset not sent: .*answered HTTP 307 .*redirects are not followed"):
        _env(f"http://127.0.0.1:{outer.server_address[1]}").reset()
    assert outer.received == ["/reset"] and inner.received == []


def test_the_judge_endpoint_goes_through_the_guard(allow, make_stub):
    stub = make_stub()
    configure_llm_judge(endpoint=f"http://127.0.0.1:{stub.server_address[1]}/v1", model="judge")
    try:
        with pytest.raises(outbound.OutboundRefused, match="127.0.0.1 is a loopback address"):
            score({"type": "llm_judge", "rubric": "polite"}, "Thanks!")
        assert stub.received == []
        allow("127.0.0.1")
        assert score({"type": "llm_judge", "rubric": "polite"}, "Thanks!").passed
        assert stub.received == ["/v1/chat/completions"]
        configure_llm_judge(endpoint="http://169.254.169.254/v1", model="judge")
        with pytest.raises(outbound.OutboundRefused, match="169.254.169.254 is a link-local address"):
            score({"type": "llm_judge", "rubric": "polite"}, "Thanks!")
    finally:
        configure_llm_judge(endpoint=None)


def test_the_policy_from_the_environment(allow, monkeypatch):
    allow("10.0.0.0/8, gpu-box ,*.internal")
    policy = outbound.current_policy()
    assert policy.refusal("x", outbound.ipaddress.ip_address("10.1.1.1")) is None
    assert policy.refusal("gpu-box", outbound.ipaddress.ip_address("192.168.0.9")) is None
    assert policy.refusal("a.b.internal", outbound.ipaddress.ip_address("192.168.0.9")) is None
    assert "private" in policy.refusal("other", outbound.ipaddress.ip_address("192.168.0.9"))
    monkeypatch.setenv(outbound.PUBLIC_VAR, "false")
    assert "public address" in outbound.current_policy().refusal("x", outbound.ipaddress.ip_address("1.1.1.1"))


class _Drip(StandIn):
    """An environment server and judge that answer at once with their headers, then one byte every 0.2 s."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.body()
        payload = json.dumps({"session_id": "s1", "pad": "x" * 40}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        try:
            for i in range(len(payload)):
                self.wfile.write(payload[i:i + 1])
                self.server.sent += 1
                time.sleep(0.2)
        except OSError:
            pass


def test_an_environment_server_and_a_judge_that_drip_end_at_their_deadline(allow):
    allow("127.0.0.1")
    with serving(_Drip, sent=0) as server:
        env = HttpEnv({"id": "t-1", "messages": [{"role": "user", "content": "hi"}],
                       "env": {"type": "http", "url": server.url + "?token=t0k", "retries": 0, "timeout_s": 1}})
        with pytest.raises(EnvServerError, match=r"POST /reset failed after 1 attempt: timed out after 1 s") as caught:
            env.reset()
        assert "t0k" not in str(caught.value)
        configure_llm_judge(endpoint=server.url + "/v1", model="judge", timeout=1.0)
        try:
            with pytest.raises(TimeoutError, match="no complete answer within 1 s"):
                score({"type": "llm_judge", "rubric": "polite"}, "Thanks!")
        finally:
            configure_llm_judge(endpoint=None)
        assert server.sent < 30  # of some 60 bytes each answer had to give: both left early


def test_a_url_with_credentials_is_never_sent_to(allow, make_stub):
    stub = make_stub()
    allow("127.0.0.1")
    with pytest.raises(EnvServerError, match="may not carry a user name or password") as caught:
        _env(f"http://alice:hunter2@127.0.0.1:{stub.server_address[1]}").reset()
    assert "hunter2" not in str(caught.value) and stub.received == []
