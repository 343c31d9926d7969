"""A canary from start to rollback on real parts: PostgreSQL and Redis in CI, a real Celery worker, the live test
server, the reference router (flywheel.router) in front of a stand-in vLLM, an agent on the real OpenAI client
recorded by `flywheel_client.wrap`, and a webhook receiver on a local port.

Production v1 serves; v2 passed the gate and starts as a canary at 10% through the API. The agent's 300
conversations go through the router, which sends each to v1's or v2's adapter; the stand-in answers a known
share of each adapter's requests with a failure (v1 1 in 10, v2 7 in 10), the agent reports how each went, and
the wrapper ingests every conversation through the REST API with the answering `model` as its model_version
and the router's evidence token in its metadata.
Then the sweeps run as beat runs them: the worker's look finds v2 worse (canary_auto on) and rolls it back. The
alias history says the rule did it with the figures it saw, the receiver got the split at each move and the
notification, the router stops sending to v2, and each version's live metrics count exactly its traffic."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
import time
import urllib.request

import openai
import pytest
from flywheel_client import Flywheel, wrap

from flywheel import router as flywheel_router
from flywheel.registry import canary, live
from flywheel.registry.models import LiveCheck, LiveRollupState, RegistrySettings
from flywheel.trajectories.models import Trajectory
from tests.platform.registry.worlds import versions_with_adapters
from tests.standin import StandIn, serving

pytestmark = pytest.mark.slow

SECRET = "canary-e2e-secret"
CONVERSATIONS = 300
FAILS_IN_TEN = {"v1": 1, "v2": 7}  # of every ten requests an adapter answers, how many fail


class Vllm(StandIn):
    """Answers as the adapter it is asked for: its n-th request fails when n % 10 < that adapter's share."""

    def setup(self):
        super().setup()
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.body())
        adapter = body["model"]
        with self.server.lock:
            n = self.server.answered.get(adapter, 0)
            self.server.answered[adapter] = n + 1
        failed = n % 10 < FAILS_IN_TEN[adapter.rsplit("-", 1)[1]]
        if failed:
            self.server.failed[adapter] = self.server.failed.get(adapter, 0) + 1
        self.answer(200, {"id": f"c-{adapter}-{n}", "object": "chat.completion", "created": int(time.time()),
                          "model": "whatever-vllm-calls-it",
                          "choices": [{"index": 0, "finish_reason": "stop", "message": {
                              "role": "assistant", "content": "Sorry, that failed." if failed else "Refunded."}}],
                          "usage": {"prompt_tokens": 20, "completion_tokens": 4, "total_tokens": 24}})


class Receiver(StandIn):
    def do_POST(self):  # noqa: N802
        self.server.received.append((dict(self.headers), self.body()))
        self.answer(204, b"")


def _signed(headers: dict, body: bytes) -> bool:
    expected = hmac.new(SECRET.encode(), headers["X-Flywheel-Timestamp"].encode() + b"." + body,
                        hashlib.sha256).hexdigest()
    return hmac.compare_digest(headers["X-Flywheel-Signature"], "sha256=" + expected)


@pytest.fixture
def stack(celery_worker, live_server, project, user, tmp_path, make_api_key):
    with serving(Receiver, received=[]) as receiver, \
            serving(Vllm, answered={}, failed={}, lock=threading.Lock()) as vllm:
        RegistrySettings.objects.create(project=project, webhook_url=receiver.url + "/flywheel", webhook_secret=SECRET,
                                        canary_auto=True, canary_min_per_arm=1000, canary_weight=0.1)
        v1, v2 = versions_with_adapters(project, user, tmp_path)
        router = flywheel_router.build(platform=live_server.url, key=make_api_key(project, scopes=["read", "route"]),
                                       upstream=vllm.url, listen="127.0.0.1:0", refresh_s=0.2, seed=7).start()
        try:
            yield {"worker": celery_worker, "url": live_server.url, "receiver": receiver, "vllm": vllm,
                   "router": router, "v1": v1, "v2": v2,
                   "promote": make_api_key(project, scopes=["read", "promote"]),
                   "ingest": make_api_key(project, scopes=["ingest"])}
        finally:
            router.stop()


def _alias_moves(receiver) -> list[dict]:
    return [json.loads(body) for headers, body in receiver.received if headers["X-Flywheel-Event"] == "alias.moved"]


def test_a_worse_canary_is_rolled_back_by_the_decision_on_traffic_through_the_router(stack, project):
    worker, receiver, vllm, router = stack["worker"], stack["receiver"], stack["vllm"], stack["router"]
    slug = project.slug
    v1_name, v2_name = f"{slug}-v1", f"{slug}-v2"
    key = stack["promote"]

    def api(method, path, body=None):
        request = urllib.request.Request(stack["url"] + path, method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Authorization": f"Bearer {key}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.loads(answer.read())

    # v1's first move reached the receiver; the canary starts through the API, and its move says the split.
    worker.wait_for(lambda: len(_alias_moves(receiver)) == 1, timeout=60)
    started = api("POST", "/api/v1/model-versions/2/canary", {"weight": 0.1, "reason": "try v2"})
    assert started["check"]["status"] == "running" and started["move"]["weight"] == 0.1
    moves = worker.wait_for(lambda: len(_alias_moves(receiver)) == 2 and _alias_moves(receiver), timeout=60)
    assert moves[1]["alias"] == "canary" and moves[1]["production"]["adapter"] == v1_name
    assert (moves[1]["canary"]["adapter"], moves[1]["canary"]["weight"]) == (v2_name, 0.1)
    assert api("GET", "/api/v1/serving")["canary"]["adapter"] == v2_name
    flywheel_router_wait(router, 2)

    # The agent: each conversation through the router, recorded and ingested with the model that answered.
    agent = wrap(openai.OpenAI(base_url=router.url + "/v1", api_key="agent", max_retries=0), agent="refunds",
                 flywheel=Flywheel(stack["url"], stack["ingest"]))
    answered = []
    for i in range(CONVERSATIONS):
        reply = agent.chat.completions.create(model="refund-agent",
                                              messages=[{"role": "user", "content": f"Refund order {i}."}])
        answered.append(reply.model)
        agent.report(reply, outcome="failure" if "failed" in reply.choices[0].message.content else "success")
    assert agent.flush(timeout=120)
    sent = {name: answered.count(name) for name in (v1_name, v2_name)}
    assert sent == vllm.answered  # the router told the agent the adapter that answered, every time
    failures = {name: vllm.failed.get(name, 0) for name in sent}
    assert 10 <= sent[v2_name] <= 60  # 10% of 300, and both arms served (binomial: outside it < 1e-6)

    # Beat's work, done here: the check's look on the worker finds v2 worse and rolls it back.
    check = LiveCheck.objects.get(project=project, kind="canary")
    canary.live_check_sweep()
    check = worker.wait_for(lambda: LiveCheck.objects.filter(pk=check.pk).exclude(status="running").first(),
                            timeout=120)
    assert check.status == "rolled_back", check.evidence
    look = check.evidence["look"]
    assert (look["subject"]["n"], look["subject"]["failures"]) == (sent[v2_name], failures[v2_name])
    assert (look["baseline"]["n"], look["baseline"]["failures"]) == (sent[v1_name], failures[v1_name])
    assert look["worse"] and look["failure"]["p"] <= 0.025
    # It acted on evidence the router vouched for: every answer's token, copied by the wrapper, checked at ingest.
    trusted = check.evidence["trusted"]
    assert (trusted["subject"]["n"], trusted["baseline"]["n"]) == (sent[v2_name], sent[v1_name])
    assert set(Trajectory.objects.filter(project=project).values_list("vouch", flat=True)) == {"vouched"}

    history = api("GET", "/api/v1/models/history")
    end = history[0]
    assert (end["alias"], end["kind"], end["to_version"], end["actor"], end["user"]) == ("canary", "end", 2, "canary",
                                                                                        None)
    assert end["evidence"]["look"]["subject"] == look["subject"]
    assert end["reason"].startswith("Rolled back by the canary decision: failure rate")
    assert [(m["alias"], m["kind"]) for m in history] == [("canary", "end"), ("canary", "promote"),
                                                          ("production", "set")]
    assert api("GET", "/api/v1/serving")["canary"] is None

    # The receiver: three moves, in order, each signed and carrying the split; and the rule's notification.
    worker.wait_for(lambda: len(_alias_moves(receiver)) == 3
                    and any(h["X-Flywheel-Event"] == "canary.rolled_back" for h, _ in receiver.received), timeout=60)
    assert all(_signed(headers, body) for headers, body in receiver.received)
    moves = _alias_moves(receiver)
    assert [(m["alias"], m["kind"], m["actor"]) for m in moves] == [
        ("production", "set", ""), ("canary", "promote", ""), ("canary", "end", "canary")]
    assert moves[2]["canary"] is None and moves[2]["production"]["adapter"] == v1_name
    notice = next(json.loads(b) for h, b in receiver.received if h["X-Flywheel-Event"] == "canary.rolled_back")
    assert notice["subject_version"] == 2 and notice["status"] == "rolled_back"

    # The router follows: v2 serves no more.
    flywheel_router_wait(router, 1)
    after = {agent.chat.completions.create(model="refund-agent",
                                           messages=[{"role": "user", "content": f"Refund order {i}, again."}]).model
             for i in range(30)}
    assert after == {v1_name}
    assert agent.flush(timeout=60)
    sent[v1_name] += 30  # not reported: their outcome stays "unknown", and no failure is counted
    agent.close()

    # Live metrics of both versions, from the rollup the worker keeps.
    def counted():
        before = LiveRollupState.objects.values_list("ran_at", flat=True).first()
        live.rollup_sweep()
        worker.wait_for(lambda: LiveRollupState.objects.values_list("ran_at", flat=True).first() != before,
                        timeout=60)
        metrics = {n: api("GET", f"/api/v1/model-versions/{n}/live?window=1h")["metrics"]
                   for n in (1, 2)}
        return metrics if metrics[1]["trajectories"] == sent[v1_name] else None

    metrics = worker.wait_for(counted, timeout=120, interval=0.5)
    for number, name in ((1, v1_name), (2, v2_name)):
        assert (metrics[number]["trajectories"], metrics[number]["failures"]) == (sent[name], failures[name])
        assert metrics[number]["tokens_per_trajectory"] == 24 and metrics[number]["tokens_n"] == sent[name]
        assert metrics[number]["latency_n"] == sent[name]
    assert metrics[2]["failure_rate"] > 0.5 > 0.2 > metrics[1]["failure_rate"]
    print(f"\ncanary e2e: served {sent}, failures {failures}; rolled back at look {check.looks}: "
          f"{end['reason']}")  # with -s


def flywheel_router_wait(router, arms: int, timeout: float = 10.0) -> None:
    """Until the router applies a split of `arms` adapters (it re-reads the split every 0.2 s here)."""
    deadline = time.monotonic() + timeout
    while True:
        split = router.router.source.current()
        if split and len([a for a in (split["production"], split["canary"]) if a]) == arms:
            return
        assert time.monotonic() < deadline, f"the router still applies {split}"
        time.sleep(0.05)
