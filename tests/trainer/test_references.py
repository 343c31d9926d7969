"""A promoted row's reference: stated by the reviewer, or derived from a verifier that states the whole
output; SFT imitates it, and the reference passes the row's own verifier."""

from __future__ import annotations

from trainer.envs import replay
from trainer.references import reference_messages
from trainer.sft import conversation

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"customer": {"type": "string"}}, "required": ["customer"]}}}]
ROW = {"id": "r1", "messages": [{"role": "user", "content": "Look up customer C-17"}], "tools": TOOLS,
       "verifier": {"type": "tool_call", "expected_calls": [{"name": "lookup", "arguments": {"customer": "C-17"}}]}}


def test_a_verifier_with_literal_calls_gives_a_reference_that_passes_it():
    reference = reference_messages(ROW)
    assert reference is not None and reference[0]["tool_calls"][0]["function"]["name"] == "lookup"
    _, score = replay(ROW, reference)
    assert score.passed
    messages = conversation(ROW)
    assert messages is not None and messages[:-1] == ROW["messages"] and messages[-1] == reference[0]


def test_a_matcher_is_a_rule_not_a_reference_and_a_stated_reference_wins():
    loose = {**ROW, "verifier": {"type": "tool_call", "expected_calls": [
        {"name": "lookup", "arguments": {"customer": {"regex": "C-1."}}}]}}
    assert reference_messages(loose) is None and conversation(loose) is None
    stated = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"customer": "C-17"}'}}]}
    assert reference_messages({**loose, "reference": stated}) == [stated]
    assert reference_messages({**ROW, "verifier": {"type": "exact", "expected": "42"}}) == [
        {"role": "assistant", "content": "42"}]
    assert reference_messages({**ROW, "reference": [{"role": "tool", "content": "x"}]}) is None
