"""`flywheel_client.wrap` around the real `openai` client, talking to a stand-in OpenAI server (a tool call, then
a final answer), recording into the live test server: the conversation arrives whole, with its tool calls, once
it is finished; a continuation updates it; a Flywheel that is away never fails the agent's calls."""

from __future__ import annotations

import json
import logging
import socket
import time

import openai
import pytest
from flywheel_client import Flywheel, wrap

from flywheel.trajectories.models import Trajectory

TOOLS = [{"type": "function", "function": {
    "name": "get_order", "description": "Look an order up.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}}]
USAGE = {"prompt_tokens": 30, "completion_tokens": 7, "total_tokens": 37}


def completion(message: dict, finish_reason: str) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1_700_000_000, "model": "support-v3",
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}], "usage": USAGE}


def openai_stand_in(request):
    """Calls get_order for a question about an order, answers from the tool's result, else says goodbye."""
    messages = request.body["messages"]
    if messages[-1]["role"] == "tool":
        order = json.loads(messages[-1]["content"])
        return 200, {}, completion({"role": "assistant", "content": f"Order {order['id']} {order['status']}."}, "stop")
    if "order" in messages[-1]["content"]:
        return 200, {}, completion({"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_order", "arguments": json.dumps({"order_id": "A1"})}}]}, "tool_calls")
    return 200, {}, completion({"role": "assistant", "content": "You're welcome."}, "stop")


def agent_turn(client, messages: list) -> str:
    """A tool-calling agent's loop, as people write it: the reply object itself goes back into the history."""
    while True:
        reply = client.chat.completions.create(model="support", messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply)
        if not reply.tool_calls:
            return reply.content
        for call in reply.tool_calls:
            order_id = json.loads(call.function.arguments)["order_id"]
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": json.dumps({"id": order_id, "status": "shipped"})})


def wait_for(condition, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "not there in time"
        time.sleep(0.05)
    return value


def test_a_finished_conversation_arrives_whole_and_its_continuation_updates_it(live_server, stand_in, project,
                                                                               make_api_key):
    server = stand_in(openai_stand_in)
    flywheel = Flywheel(live_server.url, make_api_key(project, scopes=["ingest"]))
    client = wrap(openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test"), agent="support",
                  flywheel=flywheel, metadata={"deployment": "eu-1"})
    messages = [{"role": "system", "content": "You are a support agent."},
                {"role": "user", "content": "Where is my order A1?"}]
    assert agent_turn(client, messages) == "Order A1 shipped."

    # Sent from the background thread as soon as the final answer came: no flush needed.
    trajectory = wait_for(lambda: Trajectory.objects.filter(project=project).first())
    assert trajectory.external_id.startswith("support-") and trajectory.agent == "support"
    assert trajectory.model_version == "support-v3" and trajectory.source == "api"
    assert trajectory.messages == [
        {"role": "system", "content": "You are a support agent."},
        {"role": "user", "content": "Where is my order A1?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_order", "arguments": '{"order_id": "A1"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"id": "A1", "status": "shipped"}'},
        {"role": "assistant", "content": "Order A1 shipped."},
    ]
    assert trajectory.tools == TOOLS and trajectory.tool_call_count == 1
    assert trajectory.usage == {name: 2 * value for name, value in USAGE.items()}  # two calls
    assert trajectory.latency_ms is not None and trajectory.started_at is not None
    calls = trajectory.metadata["calls"]
    assert [(c["message_index"], c["finish_reason"], c["model"]) for c in calls] == [
        (2, "tool_calls", "support-v3"), (4, "stop", "support-v3")]
    assert trajectory.metadata["deployment"] == "eu-1" and trajectory.metadata["finished"] is True

    # The user's next turn continues the same conversation: the trajectory is updated, not duplicated.
    messages.append({"role": "user", "content": "Thanks!"})
    assert agent_turn(client, messages) == "You're welcome."
    assert client.flush(timeout=15)
    trajectory = wait_for(lambda: Trajectory.objects.filter(project=project, message_count=7).first())
    assert Trajectory.objects.filter(project=project).count() == 1
    assert trajectory.messages[-2:] == [{"role": "user", "content": "Thanks!"},
                                        {"role": "assistant", "content": "You're welcome."}]

    # Another conversation is another trajectory.
    assert agent_turn(client, [{"role": "user", "content": "Is order B2 late?"}]) == "Order A1 shipped."
    client.close()
    assert Trajectory.objects.filter(project=project).count() == 2
    assert client.recorder.sent == 3 and client.recorder.dropped == 0
    assert [r.path for r in server.requests] == ["/v1/chat/completions"] * 5


def test_a_flywheel_that_is_away_never_fails_the_agents_calls(stand_in, caplog):
    server = stand_in(openai_stand_in)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    flywheel = Flywheel(f"http://127.0.0.1:{port}", "k", max_retries=0)
    caplog.set_level(logging.WARNING, logger="flywheel_client")
    with wrap(openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test"), agent="support",
              flywheel=flywheel) as client:
        assert agent_turn(client, [{"role": "user", "content": "Where is order A1?"}]) == "Order A1 shipped."
        assert client.flush(timeout=15)
    assert client.recorder.sent == 0
    assert any("1 conversation(s) not sent" in r.getMessage() for r in caplog.records), caplog.text


def test_the_agent_reports_how_a_conversation_went_and_the_trajectory_is_updated(live_server, stand_in, project,
                                                                                 make_api_key):
    server = stand_in(openai_stand_in)
    flywheel = Flywheel(live_server.url, make_api_key(project, scopes=["ingest"]))
    client = wrap(openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test"), agent="support", flywheel=flywheel)
    response = client.chat.completions.create(model="support", messages=[{"role": "user", "content": "Thanks"}])
    trajectory = wait_for(lambda: Trajectory.objects.filter(project=project).first())
    assert trajectory.outcome == "unknown"  # the wrapper cannot know

    external_id = client.report(response, outcome="failure", feedback={"rating": "thumbs_down", "comment": "rude"})
    assert external_id == trajectory.external_id
    assert client.flush(timeout=15)
    trajectory = wait_for(lambda: Trajectory.objects.filter(project=project, outcome="failure").first())
    assert trajectory.feedback == {"rating": "thumbs_down", "comment": "rude"}
    assert Trajectory.objects.filter(project=project).count() == 1  # updated in place

    assert client.report("no-such-conversation", outcome="success") is None
    with pytest.raises(ValueError, match="success, failure, unknown"):
        client.report(response, outcome="great")
    client.close()


def test_the_routers_evidence_token_goes_with_the_trajectory_and_vouches_for_it(live_server, stand_in, project, user,
                                                                               tmp_path, make_api_key):
    """Behind the router each answer carries a token for the version that gave it (`flywheel.evidence`); the
    trajectory carries the token of its last call answered by the version it names, and the platform vouches
    for it, also when the agent reports the outcome later."""
    from tests.platform.registry.worlds import evidence_token, versions_with_adapters

    versions_with_adapters(project, user, tmp_path)
    tokens = []

    def router_like(request):
        number = 1 if request.body["messages"][-1]["role"] != "tool" else 2  # the second call lands on v2
        status, headers, body = openai_stand_in(request)
        tokens.append(evidence_token(project, number))
        return status, headers, {**body, "model": f"{project.slug}-v{number}",
                                 "flywheel": {"version": number, "evidence": tokens[-1]}}

    server = stand_in(router_like)
    flywheel = Flywheel(live_server.url, make_api_key(project, scopes=["ingest"]))
    client = wrap(openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test"), agent="support", flywheel=flywheel)
    messages = [{"role": "user", "content": "Where is my order A1?"}]
    assert agent_turn(client, messages) == "Order A1 shipped."
    trajectory = wait_for(lambda: Trajectory.objects.filter(project=project).first())
    assert trajectory.model_version == f"{project.slug}-v2"
    assert trajectory.metadata["flywheel_evidence"] == tokens[1]  # v2's, not v1's
    assert [c["evidence"] for c in trajectory.metadata["calls"]] == tokens
    assert trajectory.vouch == "vouched"
    client.report(trajectory.external_id, outcome="success")
    assert client.flush(timeout=15)
    trajectory = wait_for(lambda: Trajectory.objects.filter(project=project, outcome="success").first())
    assert trajectory.vouch == "vouched"
    client.close()
