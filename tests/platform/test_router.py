"""The reference router (flywheel.router) between an agent and a stand-in vLLM, reading the split from the live
test server: the canary's share of traffic as set (a binomial test whose error rate is stated), `model`
rewritten on the way in and on the way out (the real OpenAI client, streaming too), the last good split kept
while the platform cannot be read, 503 with no production, a canary started on the platform picked up at the
next refresh, hostile upstream answers met with an error and no crash, and the command itself without Django."""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from scipy.stats import binomtest

from flywheel import router as flywheel_router
from flywheel.accounts.services import api_key_revoke
from flywheel.registry import canary
from tests.platform.registry.worlds import versions_with_adapters
from tests.standin import StandIn, serving

REPO = Path(__file__).resolve().parents[2]
UPSTREAM_NAME = "served-by-upstream"  # what the stand-in says in `model`: the router must replace it


# --- a stand-in vLLM ------------------------------------------------------------------------------------------------


class Upstream(StandIn):
    """OpenAI-compatible enough: answers what it was asked for in the content (so a test sees the `model` it
    got) and its own name in `model`; `server.mode` makes it hostile."""

    def setup(self):
        super().setup()
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as vLLM's server does

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.body())
        self.server.requests.append({"path": self.path, "body": body, "authorization":
                                     self.headers.get("Authorization")})
        mode = self.server.mode
        content = f"answered as {body.get('model')}"
        if mode == "ok" and body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()  # no length: the stream ends when the connection closes (HTTP/1.0)
            for i, piece in enumerate(content.split(" ")):
                chunk = {"id": "c1", "object": "chat.completion.chunk", "model": UPSTREAM_NAME,
                         "choices": [{"index": 0, "delta": {"content": (" " if i else "") + piece},
                                      "finish_reason": None}]}
                self.wfile.write(b": keep-alive\n\n" if i == 1 else b"")
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        elif mode == "ok":
            self.answer(200, {"id": "c1", "object": "chat.completion", "created": 1, "model": UPSTREAM_NAME,
                              "choices": [{"index": 0, "finish_reason": "stop",
                                           "message": {"role": "assistant", "content": content}}],
                              "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}})
        elif mode == "error":
            self.answer(400, {"object": "error", "message": "maximum context length exceeded", "model": UPSTREAM_NAME})
        elif mode == "html":
            self.answer(200, b"<html><script>alert(1)</script></html>", content_type="text/html")
        elif mode == "list":
            self.answer(200, [1, 2, 3])
        elif mode == "cut":  # promises more than it sends, then hangs up
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "5000")
            self.end_headers()
            self.wfile.write(b'{"id": "c1", "choi')
            self.close_connection = True
        elif mode == "hang_up":
            self.close_connection = True
        elif mode == "slow":
            time.sleep(self.server.slow_s)
            self.answer(200, {"model": UPSTREAM_NAME})
        elif mode == "bad_stream":  # events that are not objects, bytes that are not UTF-8, then cut
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b"data: 42\n\ndata: {not json\n\ndata: \xff\xfe\x00\n\n")
            self.wfile.write(b'data: {"model": "x", "choices": []}\n\n')
            self.wfile.flush()
            self.close_connection = True


@pytest.fixture
def upstream():
    with serving(Upstream, requests=[], mode="ok", slow_s=0.0) as server:
        yield server


# --- the platform ---------------------------------------------------------------------------------------------------


@pytest.fixture
def models(project, user, tmp_path):
    """v1 in production (the base alone); v2 with an adapter, passed the gate against v1."""
    return versions_with_adapters(project, user, tmp_path)


def start_router(platform_url, key, upstream_url, **options):
    options = {"refresh_s": 0.2, "seed": 0, "upstream_timeout": 5.0, "platform_timeout": 2.0, "listen": "127.0.0.1:0",
               **options}
    return flywheel_router.build(platform=platform_url, key=key, upstream=upstream_url, **options).start()


@pytest.fixture
def routers():
    started = []

    def start(*args, **options):
        server = start_router(*args, **options)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def call(url, path, body=None, headers=None, method=None):
    """(status, headers, JSON body) of one request; an HTTP error is an answer like any other."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method or ("POST" if data else "GET"),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.headers, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, json.loads(exc.read())


def chat(text="Where is order A1?", **fields):
    return {"model": "agent-model", "messages": [{"role": "user", "content": text}], **fields}


def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.05)
    return value


# --- the split --------------------------------------------------------------------------------------------------


def test_the_serving_endpoint_answers_the_split_the_webhook_carries(live_server, project, models, make_api_key,
                                                                    api_client):
    v1, v2 = models
    key = make_api_key(project, scopes=["read"])
    assert call(live_server.url, "/api/v1/serving", headers={"Authorization": f"Bearer {key}"})[2] == {
        "production": {"version": 1, "adapter": f"{project.slug}-v1", "adapter_path": None,
                       "base_model_path": v1.base.path},
        "canary": None, "holdback": None}
    canary.canary_start(project=project, version=v2, weight=0.25)
    answer = api_client.get("/api/v1/serving", key=key)
    assert answer.status_code == 200
    assert answer.json()["canary"] == {"version": 2, "adapter": f"{project.slug}-v2", "adapter_path": v2.adapter_path,
                                       "base_model_path": v1.base.path, "weight": 0.25}
    assert api_client.get("/api/v1/serving", key=None).status_code == 401


def test_the_canary_gets_its_share_of_traffic(live_server, project, models, make_api_key, upstream, routers):
    """2,000 requests at a 10% canary: the count of canary answers must pass an exact two-sided binomial test
    at alpha 1e-4 (a correct router fails it once in 10,000 seeds; one that sends 15% or ignores the weight
    fails it for every seed: at 15% the expected count is 7.5 standard deviations away). The same with a
    sticky key per request (a hash of the key, not a draw), and one key always lands on one arm."""
    canary.canary_start(project=project, version=models[1], weight=0.1)
    server = routers(live_server.url, make_api_key(project, scopes=["read"]), upstream.url)
    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)

    def adapter(headers=None):
        connection.request("POST", "/v1/chat/completions", json.dumps(chat()),
                           {"Content-Type": "application/json", **(headers or {})})
        answer = connection.getresponse()
        assert answer.status == 200
        return json.loads(answer.read())["model"]

    n = 2000
    drawn = [adapter() for _ in range(n)]
    keyed = [adapter({"X-Flywheel-Route-Key": f"session-{i}"}) for i in range(n)]
    canary_name = f"{project.slug}-v2"
    assert set(drawn) == set(keyed) == {f"{project.slug}-v1", canary_name}
    for answers in (drawn, keyed):
        assert binomtest(answers.count(canary_name), n, 0.1).pvalue > 1e-4, answers.count(canary_name)
    assert len({adapter({"X-Flywheel-Route-Key": "one-session"}) for _ in range(20)}) == 1
    # What the upstream was asked for is what the agent was told answered.
    assert [r["body"]["model"] for r in upstream.requests[:n]] == drawn
    connection.close()


def test_during_the_watch_the_replaced_version_keeps_its_holdback(live_server, project, models, make_api_key,
                                                                   upstream, routers, user):
    """After a promotion the watch runs with a holdback (5% by default): the serving split names the replaced
    version with that weight, and the router sends it that share (the same exact binomial test as the canary's,
    1,000 requests), so the watch compares the two at the same hours. The watch's end takes the holdback away."""
    from flywheel.registry import services
    from flywheel.registry.models import LiveCheck, RegistrySettings

    v1, v2 = models
    RegistrySettings.objects.update_or_create(project=project, defaults={"watch_holdback": 0.2})
    services.model_promote(project=project, version=v2, user=user, reason="passed the gate")
    key = make_api_key(project, scopes=["read"])
    split = call(live_server.url, "/api/v1/serving", headers={"Authorization": f"Bearer {key}"})[2]
    assert split["production"]["version"] == 2 and split["canary"] is None
    assert (split["holdback"]["version"], split["holdback"]["adapter"], split["holdback"]["weight"]) == (
        1, f"{project.slug}-v1", 0.2)
    assert flywheel_router.parse_split(split)["holdback"]["weight"] == 0.2
    server = routers(live_server.url, key, upstream.url)
    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)

    def adapter():
        connection.request("POST", "/v1/chat/completions", json.dumps(chat()), {"Content-Type": "application/json"})
        answer = connection.getresponse()
        assert answer.status == 200
        return json.loads(answer.read())["model"]

    n = 1000
    drawn = [adapter() for _ in range(n)]
    held = drawn.count(f"{project.slug}-v1")
    assert set(drawn) == {f"{project.slug}-v1", f"{project.slug}-v2"}
    assert binomtest(held, n, 0.2).pvalue > 1e-4, held
    connection.close()
    LiveCheck.objects.filter(project=project, kind="watch").update(status="passed")
    assert call(live_server.url, "/api/v1/serving", headers={"Authorization": f"Bearer {key}"})[2]["holdback"] is None
    with pytest.raises(flywheel_router.SplitUnreadable, match="more than all traffic"):
        flywheel_router.parse_split({**split, "canary": {**split["holdback"], "weight": 0.9}})


def test_model_is_rewritten_both_ways_for_the_openai_client(live_server, project, models, make_api_key, upstream,
                                                            routers):
    canary.canary_start(project=project, version=models[1], weight=0.5)
    server = routers(live_server.url, make_api_key(project, scopes=["read"]), upstream.url)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="agent-key", max_retries=0)
    served = {f"{project.slug}-v1", f"{project.slug}-v2"}
    for _ in range(10):
        answer = client.chat.completions.create(model="agent-model", messages=[{"role": "user", "content": "hi"}])
        assert answer.model in served
        assert answer.choices[0].message.content == f"answered as {answer.model}"
    # The caller's key goes on to vLLM (no --inbound-key, no --upstream-key).
    assert upstream.requests[-1]["authorization"] == "Bearer agent-key"
    # An agent that sends back the `model` it was answered by, with its route key, stays on that version.
    for session in ("session-a", "session-b", "session-c"):
        first = client.chat.completions.create(model="agent-model", user=session,
                                               messages=[{"role": "user", "content": "hi"}]).model
        again = [client.chat.completions.create(model=first, user=session,
                                                messages=[{"role": "user", "content": "hi"}]).model for _ in range(3)]
        assert again == [first] * 3
    # An adapter that no longer serves is routed like any other name; so is the body's `user` as a sticky key.
    old = {client.chat.completions.create(model=f"{project.slug}-v9", messages=[{"role": "user", "content": "x"}],
                                          user="end-user-7").model for _ in range(5)}
    assert len(old) == 1 and old <= served
    listed = {m.id for m in client.models.list()}
    assert listed == served


def test_a_request_naming_a_version_it_was_not_assigned_is_refused(live_server, project, models, make_api_key,
                                                                   upstream, routers):
    """The audit's reproduction: with the canary at 1%, 1000 requests naming the canary's adapter all reached it.
    Now each is 403 and none reaches the upstream; a route key assigned the canary may name it, one assigned
    production may not; an operator who allows pinning gets the old behaviour, without evidence tokens."""
    canary.canary_start(project=project, version=models[1], weight=0.01)
    key = make_api_key(project, scopes=["read", "route"])
    server = routers(live_server.url, key, upstream.url)
    canary_name, production_name = f"{project.slug}-v2", f"{project.slug}-v1"
    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)

    def ask(model, headers=None):
        connection.request("POST", "/v1/chat/completions", json.dumps(chat(model=model)),
                           {"Content-Type": "application/json", **(headers or {})})
        answer = connection.getresponse()
        return answer.status, answer.getheader("X-Flywheel-Evidence"), json.loads(answer.read())

    answers = [ask(canary_name) for _ in range(1000)]
    assert {status for status, _, _ in answers} == {403}
    assert answers[0][2]["error"]["type"] == "version_not_assigned"
    assert f"names {canary_name}, a version this request was not assigned" in answers[0][2]["error"]["message"]
    assert upstream.requests == []
    # While a canary serves, a request without a route key was assigned nothing it could name: production neither.
    assert ask(production_name)[0] == 403
    # Route keys: find one the split sends to the canary and one it sends to production, by asking.
    placed = {}
    for i in range(2000):
        status, _, body = ask("agent-model", {"X-Flywheel-Route-Key": f"user-{i}"})
        placed.setdefault(body["model"], f"user-{i}")
        if len(placed) == 2:
            break
    assert ask(canary_name, {"X-Flywheel-Route-Key": placed[canary_name]})[0] == 200
    assert ask(canary_name, {"X-Flywheel-Route-Key": placed[production_name]})[0] == 403
    assert ask(production_name, {"X-Flywheel-Route-Key": placed[production_name]})[0] == 200
    connection.close()

    pinning = routers(live_server.url, key, upstream.url, allow_pinning=True)
    status, token, body = call_full(pinning.url, chat(model=canary_name))
    assert (status, body["model"], token, "flywheel" in body) == (200, canary_name, None, False)
    status, token, body = call_full(pinning.url, chat())
    assert status == 200 and token is not None and body["flywheel"]["evidence"] == token  # routed: vouched


def call_full(url, body, headers=None):
    """(status, X-Flywheel-Evidence, JSON body) of a chat completion."""
    status, answer_headers, payload = call(url, "/v1/chat/completions", body, headers)
    return status, answer_headers.get("X-Flywheel-Evidence"), payload


def test_route_keys_cannot_be_chosen_offline(live_server, project, models, make_api_key, upstream, routers):
    """Before, a route key's arm was sha256(key): anyone could list keys that land on the canary before sending
    one. Now it is keyed with the project's evidence key: keys chosen by the old rule land on the canary at its
    weight, like any others (a binomial test whose error rate is stated: p > 1e-4 but once in 10,000)."""
    import hashlib

    canary.canary_start(project=project, version=models[1], weight=0.1)
    server = routers(live_server.url, make_api_key(project, scopes=["read", "route"]), upstream.url)
    chosen = [k for k in (f"k-{i}" for i in range(20000))
              if int.from_bytes(hashlib.sha256(k.encode()).digest()[:8], "big") / 2**64 < 0.1][:300]
    landed = [call(server.url, "/v1/chat/completions", chat(), {"X-Flywheel-Route-Key": k})[2]["model"]
              for k in chosen]
    on_canary = landed.count(f"{project.slug}-v2")
    assert binomtest(on_canary, len(chosen), 0.1).pvalue > 1e-4, on_canary
    # Still sticky: one key, one arm.
    assert len({call(server.url, "/v1/chat/completions", chat(), {"X-Flywheel-Route-Key": chosen[0]})[2]["model"]
                for _ in range(10)}) == 1


def test_each_answer_routed_by_the_split_carries_an_evidence_token_the_platform_verifies(
        live_server, project, models, make_api_key, upstream, routers, caplog):
    from flywheel.router import evidence_parse
    from flywheel.trajectories.vouch import evidence_keys

    canary.canary_start(project=project, version=models[1], weight=0.5)
    server = routers(live_server.url, make_api_key(project, scopes=["read", "route"]), upstream.url)
    before = time.time()
    seen = set()
    for _ in range(20):
        status, token, body = call_full(server.url, chat())
        evidence = evidence_parse(token)
        assert status == 200 and body["flywheel"] == {"version": evidence.version, "evidence": token}
        assert f"{project.slug}-v{evidence.version}" == body["model"]  # it names the version that answered
        assert evidence.signed_by(evidence_keys(project.pk)[0]) and before - 1 <= evidence.at <= time.time() + 1
        seen.add(evidence.request_id)
    assert len(seen) == 20  # a request id of its own each
    # A stream: the header.
    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    connection.request("POST", "/v1/chat/completions", json.dumps(chat(stream=True)),
                       {"Content-Type": "application/json"})
    answer = connection.getresponse()
    answer.read()
    assert evidence_parse(answer.getheader("X-Flywheel-Evidence")).signed_by(evidence_keys(project.pk)[0])
    connection.close()
    # The upstream's error answer vouches for nothing.
    upstream.mode = "error"
    status, token, body = call_full(server.url, chat())
    assert (status, token, "flywheel" in body) == (400, None, False)
    upstream.mode = "ok"
    # A router whose key lacks `route` routes as well, vouches for nothing, and says why once.
    caplog.set_level(logging.INFO, logger="flywheel.router")
    plain = routers(live_server.url, make_api_key(project, scopes=["read"]), upstream.url)
    status, token, body = call_full(plain.url, chat())
    assert (status, token, "flywheel" in body) == (200, None, False)
    assert "cannot read the evidence key: the platform refused the key (HTTP 403); it needs scope `route`" in caplog.text
    assert call(plain.url, "/healthz")[2]["vouches"] is False


def test_the_inbound_key_is_required_and_never_passed_on(live_server, project, models, make_api_key, upstream,
                                                         routers):
    key = make_api_key(project, scopes=["read", "route"])
    server = routers(live_server.url, key, upstream.url, inbound_key="router-secret", upstream_key="vllm-secret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic router-secret"}):
        status, answer_headers, body = call(server.url, "/v1/chat/completions", chat(), headers)
        assert (status, body["error"]["type"], answer_headers["WWW-Authenticate"]) == (401, "invalid_api_key", "Bearer")
        assert call(server.url, "/v1/models", headers=headers)[0] == 401
        assert call(server.url, "/healthz", headers=headers)[2] == {"ok": True}  # nothing more to a stranger
    assert upstream.requests == []
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="router-secret", max_retries=0)
    answer = client.chat.completions.create(model="agent-model", messages=[{"role": "user", "content": "hi"}])
    assert answer.model == f"{project.slug}-v1"
    assert upstream.requests[-1]["authorization"] == "Bearer vllm-secret"  # the router's key stays with it
    assert "split" in call(server.url, "/healthz", headers={"Authorization": "Bearer router-secret"})[2]
    # Without --upstream-key, the router's own key is not passed on either.
    bare = routers(live_server.url, key, upstream.url, inbound_key="router-secret")
    assert call(bare.url, "/v1/chat/completions", chat(), {"Authorization": "Bearer router-secret"})[0] == 200
    assert upstream.requests[-1]["authorization"] is None
    # What would open the upstream's key, or the router, to anyone is refused at start.
    with pytest.raises(ValueError, match="--upstream-key needs --inbound-key"):
        start_router(live_server.url, key, upstream.url, upstream_key="vllm-secret")
    with pytest.raises(ValueError, match="without --inbound-key would serve anyone"):
        start_router(live_server.url, key, upstream.url, listen="0.0.0.0:0")


def test_a_request_body_is_bounded_and_must_say_its_length(live_server, project, models, make_api_key, upstream,
                                                          routers):
    server = routers(live_server.url, make_api_key(project, scopes=["read"]), upstream.url, max_request_bytes=2000)
    small = json.dumps(chat("x" * 100)).encode()
    large = json.dumps(chat("x" * 2000)).encode()
    for data, headers, status in ((large, {"Content-Length": str(len(large))}, 413),
                                  (small, {"Transfer-Encoding": "chunked"}, 411)):
        with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=10) as sock:
            head = "".join(f"{k}: {v}\r\n" for k, v in {"Content-Type": "application/json", **headers}.items())
            body = data if "Content-Length" in headers else b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data)
            sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + body)
            reply = b""
            while chunk := sock.recv(65536):  # the router answers, then hangs up: the body is never read
                reply += chunk
        assert reply.startswith(f"HTTP/1.1 {status} ".encode()), reply[:100]
        assert b"at most 2000 bytes" in reply
    assert upstream.requests == []
    assert call(server.url, "/v1/chat/completions", json.loads(small))[0] == 200


def test_connections_are_bounded_and_a_silent_caller_is_hung_up_on(live_server, project, models, make_api_key,
                                                                   upstream, routers):
    server = routers(live_server.url, make_api_key(project, scopes=["read"]), upstream.url, max_connections=3,
                     client_timeout=1.0)
    # Three callers that connect and say nothing hold every slot: the fourth is answered 503 at once.
    held = [socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=10) for _ in range(3)]
    time.sleep(0.2)
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=10) as fourth:
        reply = fourth.recv(65536)
    assert reply.startswith(b"HTTP/1.1 503 ") and b"server_busy" in reply and b"Retry-After: 1" in reply
    # Silent past --client-timeout, they are hung up on, and their slots come back.
    for sock in held:
        assert sock.recv(65536) == b""  # closed by the router
        sock.close()
    assert call(server.url, "/v1/chat/completions", chat())[0] == 200
    # Slow requests hold their slots while they are served, no more.
    upstream.mode, upstream.slow_s = "slow", 1.5
    results = []
    threads = [threading.Thread(target=lambda: results.append(call(server.url, "/v1/chat/completions", chat())[0]))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=10) as extra:
        assert extra.recv(65536).startswith(b"HTTP/1.1 503 ")
    for thread in threads:
        thread.join()
    assert results == [200, 200, 200]


def test_a_stream_is_passed_on_chunk_by_chunk_with_model_rewritten(live_server, project, models, make_api_key,
                                                                   upstream, routers):
    server = routers(live_server.url, make_api_key(project, scopes=["read"]), upstream.url)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    chunks = list(client.chat.completions.create(model="agent-model", stream=True,
                                                 messages=[{"role": "user", "content": "hi"}]))
    production = f"{project.slug}-v1"
    assert len(chunks) == 3 and {c.model for c in chunks} == {production}
    assert "".join(c.choices[0].delta.content for c in chunks) == f"answered as {production}"
    # On the wire: the comment and [DONE] as the upstream sent them, the header naming the version.
    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    connection.request("POST", "/v1/chat/completions", json.dumps(chat(stream=True)),
                       {"Content-Type": "application/json"})
    answer = connection.getresponse()
    raw = answer.read().decode()
    assert answer.getheader("X-Flywheel-Model-Version") == production
    assert answer.getheader("Transfer-Encoding") == "chunked"
    assert ": keep-alive\n" in raw and raw.endswith("data: [DONE]\n\n") and UPSTREAM_NAME not in raw
    connection.close()


# --- when the platform cannot be read -----------------------------------------------------------------------------


class PlatformGate(StandIn):
    """Between the router and the live server: passes `GET /api/v1/serving` on, or fails as `server.mode` says."""

    def do_GET(self):  # noqa: N802
        if self.server.mode == "error":
            self.answer(500, b"<h1>Server Error</h1>", content_type="text/html")
        elif self.server.mode == "garbage":
            self.answer(200, {"production": "everything", "canary": None})
        else:
            request = urllib.request.Request(self.server.platform + self.path,
                                             headers={"Authorization": self.headers["Authorization"]})
            try:
                with urllib.request.urlopen(request, timeout=10) as answer:
                    self.answer(answer.status, answer.read())
            except urllib.error.HTTPError as exc:
                self.answer(exc.code, exc.read())


def test_the_last_good_split_stays_while_the_platform_cannot_be_read(live_server, project, models, make_api_key,
                                                                     upstream, routers, caplog):
    canary.canary_start(project=project, version=models[1], weight=0.5)
    key = make_api_key(project, scopes=["read"])
    expected = {f"{project.slug}-v1", f"{project.slug}-v2"}
    caplog.set_level(logging.INFO, logger="flywheel.router")
    with serving(PlatformGate, platform=live_server.url, mode="forward") as gate:
        server = routers(gate.url, key, upstream.url)
        assert {m["id"] for m in call(server.url, "/v1/models")[2]["data"]} == expected
        for mode, said in (("error", "the platform answered HTTP 500"),
                           ("garbage", "`production` has no adapter name and version number")):
            gate.mode = mode
            wait_until(lambda said=said: said in caplog.text)
            assert {call(server.url, "/v1/chat/completions", chat())[2]["model"] for _ in range(20)} == expected
        # The key revoked: the platform refuses it, the router says so and keeps routing.
        gate.mode = "forward"
        api_key_revoke(api_key=key.api_key)
        wait_until(lambda: "the platform refused the key (HTTP 401)" in caplog.text)
    # The platform gone altogether.
    wait_until(lambda: "the platform is unreachable" in caplog.text)
    status, _, health = call(server.url, "/healthz")
    assert status == 200 and health["ok"] and "unreachable" in health["platform_error"]
    assert health["split"]["canary"]["weight"] == 0.5
    assert {call(server.url, "/v1/chat/completions", chat())[2]["model"] for _ in range(20)} == expected
    # Each kind of failure said once, not at every refresh.
    assert caplog.text.count("the platform answered HTTP 500") == 1
    assert "keeping the split read at" in caplog.text


def test_no_production_is_a_503_saying_why(live_server, project, make_api_key, upstream, routers):
    server = routers(live_server.url, make_api_key(project, scopes=["read"]), upstream.url)
    status, headers, body = call(server.url, "/v1/chat/completions", chat())
    assert status == 503 and headers["Retry-After"] == "10"
    assert body["error"]["type"] == "no_production"
    assert body["error"]["message"] == "No model is in production in this project yet: there is nothing to route to."
    assert call(server.url, "/healthz")[0] == 503
    assert call(server.url, "/v1/models")[2] == {"object": "list", "data": []}
    assert upstream.requests == []
    # A platform never reached: 503 too, with the reason.
    unreachable = routers("http://127.0.0.1:9", "fw_nothing", upstream.url)
    status, _, body = call(unreachable.url, "/v1/chat/completions", chat())
    assert status == 503 and body["error"]["message"].startswith(
        "The router has not read the split from the platform yet (the platform is unreachable")


def test_a_canary_started_on_the_platform_is_picked_up_at_the_next_refresh(live_server, project, models,
                                                                           make_api_key, upstream, routers):
    server = routers(live_server.url, make_api_key(project, scopes=["read"]), upstream.url)
    production, canary_name = f"{project.slug}-v1", f"{project.slug}-v2"
    assert {call(server.url, "/v1/chat/completions", chat())[2]["model"] for _ in range(20)} == {production}
    promote = {"Authorization": f"Bearer {make_api_key(project, scopes=['read', 'promote'])}"}
    status, _, started = call(live_server.url, "/api/v1/model-versions/2/canary", {"weight": 0.5}, promote)
    assert status == 200, started
    wait_until(lambda: len(call(server.url, "/v1/models")[2]["data"]) == 2)
    seen = [call(server.url, "/v1/chat/completions", chat())[2]["model"] for _ in range(40)]
    assert set(seen) == {production, canary_name}  # 40 draws at 50%: both arms but once in 5e11
    status, _, _ = call(live_server.url, "/api/v1/canary/rollback", {"reason": "enough"}, promote)
    assert status == 200
    wait_until(lambda: len(call(server.url, "/v1/models")[2]["data"]) == 1)
    assert {call(server.url, "/v1/chat/completions", chat())[2]["model"] for _ in range(20)} == {production}


# --- hostile upstreams and callers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "status", "kind"), [
    ("html", 502, "upstream_error"), ("list", 502, "upstream_error"), ("cut", 502, "upstream_error"),
    ("hang_up", 502, "upstream_error"), ("slow", 504, "upstream_timeout"),
])
def test_a_hostile_upstream_answer_is_an_error_and_the_router_goes_on(live_server, project, models, make_api_key,
                                                                      upstream, routers, mode, status, kind):
    server = routers(live_server.url, make_api_key(project, scopes=["read"]), upstream.url, upstream_timeout=1.0)
    upstream.mode, upstream.slow_s = mode, 2.0
    answer = call(server.url, "/v1/chat/completions", chat())
    assert (answer[0], answer[2]["error"]["type"]) == (status, kind)
    assert "<script>" not in json.dumps(answer[2])
    upstream.mode = "ok"
    assert call(server.url, "/v1/chat/completions", chat())[2]["model"] == f"{project.slug}-v1"


def test_an_upstream_error_passes_on_and_a_bad_stream_is_cut_not_fatal(live_server, project, models, make_api_key,
                                                                       upstream, routers):
    server = routers(live_server.url, make_api_key(project, scopes=["read"]), upstream.url)
    upstream.mode = "error"
    status, headers, body = call(server.url, "/v1/chat/completions", chat())
    assert status == 400 and body["message"] == "maximum context length exceeded"
    assert body["model"] == headers["X-Flywheel-Model-Version"] == f"{project.slug}-v1"
    upstream.mode = "bad_stream"
    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    connection.request("POST", "/v1/chat/completions", json.dumps(chat(stream=True)),
                       {"Content-Type": "application/json"})
    answer = connection.getresponse()
    raw = answer.read()  # the upstream's stream ended: so does this one, with every line passed on
    assert b"data: 42\n" in raw and b"data: {not json\n" in raw and b"\xff\xfe" in raw
    assert f'"model": "{project.slug}-v1"'.encode() in raw
    connection.close()
    # Callers' mistakes: named, and nothing reaches the upstream.
    before = len(upstream.requests)
    assert call(server.url, "/v1/chat/completions", [1, 2])[0] == 400
    assert call(server.url, "/v1/embeddings", chat())[0] == 404
    raw_connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    raw_connection.request("POST", "/v1/chat/completions", b"{not json", {"Content-Type": "application/json"})
    assert raw_connection.getresponse().status == 400
    raw_connection.close()
    assert len(upstream.requests) == before
    upstream.mode = "ok"
    assert call(server.url, "/healthz")[0] == 200
    assert call(server.url, "/v1/chat/completions", chat())[0] == 200


# --- the command ---------------------------------------------------------------------------------------------------


def test_the_router_module_needs_neither_django_nor_the_platform_package():
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('router', sys.argv[1]); "
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'django', 'flywheel', 'celery', 'ninja'}))")
    run = subprocess.run([sys.executable, "-I", "-c", code, str(REPO / "platform/flywheel/router.py")],
                         capture_output=True, text=True, timeout=60, cwd="/")
    assert (run.returncode, run.stdout.strip()) == (0, "[]"), run.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_python_m_flywheel_router_routes_from_its_environment(live_server, project, models, make_api_key, upstream):
    port = _free_port()
    env = {**os.environ, "FLYWHEEL_URL": live_server.url, "FLYWHEEL_API_KEY": make_api_key(project, scopes=["read"]),
           "FLYWHEEL_ROUTER_UPSTREAM": upstream.url}
    process = subprocess.Popen([sys.executable, "-m", "flywheel.router", "--listen", f"127.0.0.1:{port}",
                                "--refresh", "0.5", "--seed", "1"], env=env, cwd=REPO, stderr=subprocess.PIPE,
                               text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy():
            try:
                return call(url, "/healthz")[0] == 200
            except OSError:
                assert process.poll() is None, process.stderr.read()
                return False

        wait_until(healthy, timeout=60)
        assert call(url, "/v1/chat/completions", chat())[2]["model"] == f"{project.slug}-v1"
    finally:
        process.terminate()
        process.wait(timeout=10)
    log = process.stderr.read()
    assert f"router: split now production {project.slug}-v1" in log
    assert f"listening on http://127.0.0.1:{port}" in log
    missing = subprocess.run([sys.executable, "-m", "flywheel.router"], capture_output=True, text=True, timeout=60,
                             cwd=REPO, env={k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")})
    assert missing.returncode == 2 and "missing --platform, --key, --upstream" in missing.stderr
    for flags, said in ((["--listen", f"0.0.0.0:{port}"], "without --inbound-key would serve anyone"),
                        (["--upstream-key", "vllm-secret"], "--upstream-key needs --inbound-key")):
        refused = subprocess.run([sys.executable, "-m", "flywheel.router", *flags], capture_output=True, text=True,
                                 timeout=60, cwd=REPO, env=env)
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr
