"""The trainer's outbound guard (trainer.outbound), fed by FLYWHEEL_OUTBOUND_ALLOWLIST in its environment as
the platform starts it: environment servers and the llm_judge endpoint are reached only where allowed,
checked on the resolved address, with no redirect followed. Real sockets against stand-in servers."""

from __future__ import annotations

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
