"""The clustering engine on plain data: signatures, features, HDBSCAN groups against known causes, c-TF-IDF
labels, and the two decisions that persist (attach to a mode, skip a dismissed group)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sklearn import metrics

from flywheel.failures.clustering import engine
from flywheel.trajectories.models import TriagePolicy
from flywheel.trajectories.triage import detect
from flywheel.trajectories.triage_policy import DEFAULT_UNSAFE_RULES, policy_spec


def _signals(record: dict) -> list[dict]:
    spec = policy_spec(TriagePolicy(pk=1, unsafe=DEFAULT_UNSAFE_RULES, version=1))
    found = detect(messages=record["messages"], tools=record["tools"], unsafe_spec=spec, feedback=record.get("feedback"))
    return [{"kind": str(s.kind), "message_index": s.message_index, "detail": s.detail} for s in found]


def _signature(fx, cause: str, i: int = 0) -> engine.Signature:
    record = fx.failure(cause, i)
    return engine.signature(record["messages"], _signals(record))


def test_a_tool_error_points_at_the_call_it_answers_with_the_request_and_the_error(fx):
    sig = _signature(fx, "refund_unknown_order")
    assert sig.tool == "issue_refund"
    assert sig.step.startswith("issue_refund {")
    assert "not found" in sig.result or "does not exist" in sig.result or "unknown order" in sig.result or "no order" in sig.result
    assert "refund" in sig.request.lower()
    assert sig.kinds == ("tool_error",)
    assert sig.checks == ("tool_result",)


def test_the_most_telling_signal_wins_and_its_failed_check_is_named(fx):
    # A schema violation and the tool error after it: the call that broke the schema is the failing step.
    sig = _signature(fx, "flight_date_format")
    assert sig.tool == "search_flights"
    assert set(sig.kinds) == {"schema_violation", "tool_error"}
    assert "schema:date" in sig.checks and "schema" in sig.checks
    # An unsafe call outranks everything.
    unsafe = _signature(fx, "sql_destructive")
    assert unsafe.kinds == ("unsafe_action",) and unsafe.tool == "run_sql"
    assert any(c.startswith("unsafe:") for c in unsafe.checks)


def test_without_a_located_signal_the_last_assistant_turn_fails_in_the_context_of_the_last_tool_result(fx):
    sig = _signature(fx, "currency_wrong_answer")  # negative feedback: no message index
    assert sig.kinds == ("negative_feedback",)
    assert sig.tool == "convert_currency"  # the tool whose result the answer misread
    assert '"rate"' in sig.result
    assert sig.step and not sig.step.startswith("convert_currency")  # the answer's text
    bare = engine.signature([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "bye"}], [])
    assert (bare.request, bare.step, bare.result, bare.tool) == ("hi", "bye", "", "")


def test_signatures_survive_malformed_messages():
    sig = engine.signature([None, {"role": "tool", "content": {"x": 1}}, "junk"], [{"kind": "tool_error", "message_index": 1, "detail": None}])
    assert sig.result == json.dumps({"x": 1}) and sig.kinds == ("tool_error",)
    assert engine.signature("not a list", []).text == ""


def test_normalize_replaces_numbers_ids_and_addresses():
    assert engine.normalize("Order ORD-48213 for ana@example.com  cost 19.99") == "Order ORD- 0 for email cost 0"


def test_features_are_unit_length_and_weigh_the_failing_step(fx, embedder):
    a, b = _signature(fx, "refund_unknown_order", 1), _signature(fx, "refund_unknown_order", 2)
    c = _signature(fx, "stock_timeout", 1)
    vectors = engine.features([a, b, c], embedder)
    assert vectors.shape == (3, 2 * embedder.dim + engine.STRUCT_DIM)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2] + 0.2  # same cause closer than another


def test_clusters_separate_known_causes(fx, embedder):
    causes = ["refund_unknown_order", "refund_over_total", "weather_undeclared_tool", "sql_syntax_error", "stock_timeout", "kb_policy_invented"]
    data = fx.failures(20 * len(causes), seed=3, causes=causes)
    signatures = [engine.signature(r["messages"], _signals(r)) for _, r in data]
    truth = [c for c, _ in data]
    labels = engine.cluster(engine.features(signatures, embedder))
    assert metrics.homogeneity_score(truth, labels) >= 0.9
    assert metrics.adjusted_rand_score(truth, labels) >= 0.6
    # Two causes on the same tool with the same signal kind are told apart by their errors.
    refunds = {c: {labels[i] for i, t in enumerate(truth) if t == c} - {-1} for c in causes[:2]}
    assert refunds[causes[0]] and refunds[causes[1]] and not refunds[causes[0]] & refunds[causes[1]]


def test_too_few_failures_make_no_cluster():
    assert (engine.cluster(np.eye(6, dtype=np.float32)) == -1).all()


def test_ctfidf_ranks_the_words_that_set_a_class_apart():
    docs = [
        ["refund failed order not found", "refund order not found again"],
        ["flight date invalid format", "flight date format rejected"],
        ["order refund flight date"],  # shares words with both
    ]
    terms = engine.ctfidf_terms(docs, top=2)
    assert set(terms[0]) <= {"found", "refund", "order", "failed", "again"} and "found" in terms[0]
    assert "format" in terms[1]


def test_describe_labels_a_cluster_by_tool_signal_and_terms_and_picks_central_representatives(fx, embedder):
    causes = ["stock_timeout", "sql_syntax_error"]
    data = fx.failures(24, seed=5, causes=causes)
    signatures = [engine.signature(r["messages"], _signals(r)) for _, r in data]
    vectors = engine.features(signatures, embedder)
    labels = np.array([causes.index(c) for c, _ in data])
    clusters = engine.describe(signatures, vectors, labels)
    assert [len(c.members) for c in clusters] == [12, 12]
    stock = next(c for c in clusters if c.tool == "get_stock_price")
    assert stock.label.startswith("get_stock_price · ")
    # The tool is named once: the terms after it are the cluster's own words, not the tool's name again.
    terms = stock.label.split(" · ")[2].split(", ")
    assert terms and not {"get_stock_price", "get", "stock", "price"} & {t.lower() for t in terms}, stock.label
    assert stock.signal in ("no_final_answer", "tool_error") and stock.signals == {"no_final_answer": 12, "tool_error": 12}
    assert len(stock.representatives) == engine.REPRESENTATIVES and set(stock.representatives) <= set(stock.members)
    sims = vectors[stock.members] @ stock.centroid
    assert vectors[stock.representatives[0]] @ stock.centroid == pytest.approx(sims.max(), abs=1e-6)


def test_failures_that_cluster_with_a_modes_members_are_attached_to_it(fx, embedder):
    members = [_signature(fx, "order_lookup_loop", i) for i in range(15)]
    other_mode = [_signature(fx, "sql_syntax_error", i) for i in range(15)]
    # Two new failures of the first mode's cause (too few to make a group of 14 alone), and a new cause.
    new = [_signature(fx, "order_lookup_loop", 100 + i) for i in range(2)] + [_signature(fx, "ticket_bad_json", i) for i in range(12)]
    vectors = engine.features(members + other_mode + new, embedder)
    labels, attached = engine.cluster_with_modes(vectors[30:], {7: vectors[:15], 9: vectors[15:30]})
    assert attached == {7: [0, 1]}
    assert (labels[:2] == -2).all()
    assert (labels[2:] >= 0).mean() > 0.8 and len(set(labels[2:].tolist()) - {-1}) >= 1  # the new cause: new group(s)
    plain, none = engine.cluster_with_modes(vectors[30:], {})
    assert engine.min_cluster_size_for(14) == 3
    assert none == {} and (plain[:2] == -1).all()  # without the mode, two are noise


def test_a_dismissed_group_matches_by_centroid_or_by_members():
    centre = engine.unit(np.array([1.0, 0.2, 0.0], dtype=np.float32))
    close = engine.DismissedGroup(centroid=engine.unit(np.array([1.0, 0.21, 0.0], dtype=np.float32)), members=frozenset())
    far = engine.DismissedGroup(centroid=engine.unit(np.array([0.0, 1.0, 0.0], dtype=np.float32)), members=frozenset({1, 2, 3}))
    assert engine.matches_dismissed(centre, [10, 11], [close])
    assert not engine.matches_dismissed(centre, [10, 11], [far])
    assert engine.matches_dismissed(centre, [1, 2, 10, 11], [far])  # half its members were dismissed
    assert not engine.matches_dismissed(centre, [1, 10, 11, 12], [far])
