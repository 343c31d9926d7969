"""Clustering a small project: the group size follows the number of failures, so that a few dozen failures of a
few causes get suggestions (the small labeled fixture, `small_failures` of bench/clustering_fixture.py), and
both demo projects show suggestions, each with a label and representatives, after one run."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from sklearn import metrics

from flywheel.failures.clustering import engine, services
from flywheel.failures.clustering.models import ClusteringRun
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.models import Trajectory, TriagePolicy
from flywheel.trajectories.triage import detect, triage_project
from flywheel.trajectories.triage_policy import DEFAULT_UNSAFE_RULES, policy_spec

# (failures, causes, seed) over the range the fixture covers. Measured: every set scores homogeneity and ARI
# 1.0, every cause found. Before group sizes followed the number of failures and argument names were part of
# the structure, (30, 5, 0) gave 3 groups (homogeneity 0.58, ARI 0.44, 2 of 5 causes found) and (30, 4, 1)
# gave 3 (ARI 0.62, 3 of 4); the larger sets scored 1.0 already.
SMALL_SETS = [(30, 5, 0), (30, 4, 1), (36, 4, 2), (45, 3, 3), (60, 5, 4)]


def _signals(record: dict[str, Any]) -> list[dict[str, Any]]:
    spec = policy_spec(TriagePolicy(pk=1, unsafe=DEFAULT_UNSAFE_RULES, version=1))
    found = detect(messages=record["messages"], tools=record["tools"], unsafe_spec=spec, feedback=record.get("feedback"))
    return [{"kind": str(s.kind), "message_index": s.message_index, "detail": s.detail} for s in found]


def _alone(labels: list[int]) -> list[int]:
    """Labels with each failure in no group as a group of its own: noise is not a suggestion."""
    return [label if label >= 0 else -1 - i for i, label in enumerate(labels)]


def _causes_found(truth: list[str], groups: list[list[str]]) -> set[str]:
    """Causes with a group that holds at least half of their failures and is mostly made of them."""
    totals = Counter(truth)
    found = set()
    for members in groups:
        cause, count = Counter(members).most_common(1)[0]
        if count * 2 > len(members) and count * 2 >= totals[cause]:
            found.add(cause)
    return found


@pytest.mark.parametrize(
    ("n", "size"),
    [(2, 2), (7, 2), (11, 2), (12, 3), (25, 3), (31, 3), (32, 4), (39, 4), (40, 5), (499, 5), (600, 6)]
    + [(10_000, 100), (50_000, 100)],
)
def test_the_group_size_follows_the_number_of_failures(n, size):
    assert engine.min_cluster_size_for(n) == size
    samples = engine.min_samples_for(size)
    assert 2 <= samples <= size and samples == max(2, size // 2)


@pytest.mark.parametrize(("n", "k", "seed"), SMALL_SETS)
def test_a_small_labeled_set_is_grouped_by_cause(fx, embedder, n, k, seed):
    data = fx.small_failures(n, seed=seed, causes=list(fx.SMALL_CAUSES)[:k])
    truth = [cause for cause, _ in data]
    assert len(set(truth)) == k and min(Counter(truth).values()) >= 3  # uneven, but each cause can be a group
    signatures = [engine.signature(r["messages"], _signals(r)) for _, r in data]
    labels = engine.cluster(engine.features(signatures, embedder)).tolist()
    groups = [[t for t, lab in zip(truth, labels, strict=True) if lab == g] for g in sorted(set(labels) - {-1})]
    assert _causes_found(truth, groups) == set(truth)
    assert metrics.homogeneity_score(truth, _alone(labels)) >= 0.9
    assert metrics.adjusted_rand_score(truth, _alone(labels)) >= 0.8


def _run(project, user=None, **filters) -> ClusteringRun:
    run = services.clustering_run_start(project=project, user=user, run_filter=services.RunFilter(**filters))
    return services.clustering_run_process(run_id=run.pk)


def _assert_shown(run: ClusteringRun) -> list:
    """The run's suggestions, each asserted to be one a reviewer can read: a label and representatives."""
    assert run.status == "done", run.error
    suggestions = list(run.suggestions.all())
    assert suggestions
    for s in suggestions:
        assert s.label.strip() and s.size == len(s.trajectory_ids) >= 2
        assert s.representative_ids and set(s.representative_ids) <= set(s.trajectory_ids)
        assert [e["id"] for e in s.examples] == s.representative_ids and all(e["request"] or e["step"] for e in s.examples)
    return suggestions


def test_a_small_project_gets_a_suggestion_for_each_cause(db, embedder, fx, project, user):
    data = fx.small_failures(30, seed=0, causes=list(fx.SMALL_CAUSES)[:4])
    assert not ingest_trajectories(project=project, records=[r for _, r in data]).rejected
    triage_project(project_id=project.pk)
    cause_of = {r["external_id"]: cause for cause, r in data}
    truth = {pk: cause_of[ext] for pk, ext in Trajectory.objects.filter(project=project).values_list("id", "external_id")}

    run = _run(project, user)
    suggestions = _assert_shown(run)
    assert run.total == 30 and run.clusters == len(suggestions)
    groups = [[truth[t] for t in s.trajectory_ids] for s in suggestions]
    assert _causes_found(list(truth.values()), groups) == set(truth.values())
    ids = sorted(truth)
    member_of = {t: s.pk for s in suggestions for t in s.trajectory_ids}
    labels = _alone([member_of.get(t, -1) for t in ids])
    assert metrics.adjusted_rand_score([truth[t] for t in ids], labels) >= 0.8
    by_cause = {Counter(truth[t] for t in s.trajectory_ids).most_common(1)[0][0]: s for s in suggestions}
    assert by_cause["status_wrong_task"].tool == "update_task" and "update_task" in by_cause["status_wrong_task"].label


def test_the_support_demo_shows_suggestions_after_one_run(db, embedder, settings, tmp_path):
    from flywheel.seed.demo import demo_seed

    settings.VAR_DIR = tmp_path
    seed = demo_seed()
    triage_project(project_id=seed.project.pk)
    # The page's run (failed, not yet in a mode), over every day: the demo's conversations carry fixed dates.
    first = _run(seed.project, days=3650)
    assert first.total == 2  # five of its seven failures are in the seeded modes already
    # Two new failures, one of them a refund's bad enum: too few to tell a group from chance, so a group, an
    # attachment to a mode, or none are all acceptable; what is shown must be readable.
    assert first.status == "done" and all(s.size >= 1 and s.label.strip() for s in first.suggestions.all())
    # All twelve conversations, whatever their outcome and modes.
    everything = _run(seed.project, days=3650, outcome="", unassigned=False)
    assert everything.total == 12
    assert sum(s.size for s in _assert_shown(everything)) >= 6


# The loop demo's failures: what the tiny model answered to the requests it got wrong when
# flywheel.training.demo.loop_demo_seed played it (48 requests, one sample each, seed 7), by request index.
# Recorded, because playing the model needs it built (minutes on a CPU); the other 23 answers were right.
WORKPLACE_DEMO_FAILURES: dict[int, tuple[str, dict[str, Any]] | str] = {
    1: ("reschedule_event", {"event_id": "E1", "date": "2026-03-16"}),
    2: ("update_task", {"task_id": "T5", "assignee": "Carol"}),
    4: ("update_task", {"task_id": "T4", "status": "done"}),
    5: ("update_task", {"task_id": "T5", "assignee": "Dave"}),
    6: ("create_task", {"title": "Test style guide", "project": "Harbor", "assignee": "Mike", "due": "2026-03-05"}),
    7: ("create_task", {"title": "Ship api docs", "project": "Cobalt", "assignee": "Frank"}),
    8: ("send_email", {"to": "Nina", "subject": "Design pricing doc"}),
    9: ("delete_task", {"task_id": "T1"}),
    10: ("update_task", {"task_id": "T3", "assignee": "Nina"}),
    11: ("update_task", {"task_id": "T1", "assignee": "Laura"}),
    12: ("delete_task", {"task_id": "T2"}),
    14: ("cancel_event", {"event_id": "E3"}),
    19: ("create_task", {"title": "Review test suite", "project": "Apollo", "assignee": "Peggy"}),
    23: ("send_email", {"to": "Carol", "subject": "Ship api docs"}),
    26: ("update_task", {"task_id": "T2", "due": "2026-03-16"}),
    29: ("send_email", {"to": "Oscar", "subject": "Apollo customer call"}),
    32: ("update_task", {"task_id": "T5", "assignee": "Nina"}),
    33: ("create_event", {"title": "Ember hiring panel", "date": "2026-03-25", "time": "14:00", "attendees": ["Laura", "Kevin"]}),
    38: ("update_task", {"task_id": "T2", "assignee": "Judy"}),
    40: ("update_task", {"task_id": "T2", "due": "2026-03-10"}),
    41: '<tool_call>{"name": "create_event", "arguments": {"title": "Ember launch er panel", "date": "2026-03-10", "attendees": ["Erin</tool_call>',
    43: ("create_event", {"title": "Harbor security review", "date": "2026-03-09", "time": "16:00", "attendees": ["Laura", "Erin"]}),
    44: ("delete_email", {"task_id": "T4", "status": "in_progress"}),
    45: ("create_event", {"title": "Borealis security review", "date": "2026-03-24", "time": "16:00", "attendees": ["Laura", "Judy"]}),
    46: ("create_event", {"title": "Update roadmap", "project": "Ember", "assignee": "Heidi"}),
}


def _workplace_demo_records() -> list[dict[str, Any]]:
    """The loop demo's trajectories as loop_demo_seed makes them: its 48 workplace requests (the same
    generator and seed), each followed by the model's answer, the recorded one where it failed."""
    from trainer.envs.workplace import generate_tasks

    records = []
    for i, task in enumerate(generate_tasks(48, seed=21, split="train", difficulty="single")):
        failed = WORKPLACE_DEMO_FAILURES.get(i)
        if isinstance(failed, str):
            answer: dict[str, Any] = {"role": "assistant", "content": failed}
        else:
            expected = next(m for m in task["solution"] if m.get("tool_calls"))["tool_calls"][0]["function"]
            name, arguments = failed or (expected["name"], json.loads(expected["arguments"]))
            call = {"id": "call_0_0", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
            answer = {"role": "assistant", "content": "", "tool_calls": [call]}
        records.append(
            {
                "external_id": f"workplace-req-{i}",
                "agent": "workplace-assistant",
                "model_version": "tiny v1",
                "messages": [*task["messages"], answer],
                "tools": task["tools"],
                "outcome": "failure" if failed else "success",
                "metadata": {"demo": True},
            }
        )
    return records


def test_the_loop_demo_shows_suggestions_after_one_run(db, embedder, user):
    from flywheel.training.demo import loop_project

    project = loop_project(owner=user)
    records = _workplace_demo_records()
    assert not ingest_trajectories(project=project, records=records, source="demo").rejected
    triage_project(project_id=project.pk)
    run = _run(project, user)  # the page's run: failed, in no mode, of the last 30 days
    assert run.total == len(WORKPLACE_DEMO_FAILURES) == 25
    suggestions = _assert_shown(run)
    assert len(suggestions) >= 3 and sum(s.size for s in suggestions) >= 20
    # Groups follow what was asked: each is mostly one tool, and the model's commonest mistake has its own.
    called = {
        t.pk: (t.messages[-1].get("tool_calls") or [{"function": {"name": ""}}])[0]["function"]["name"]
        for t in Trajectory.objects.filter(project=project, outcome="failure")
    }
    for s in suggestions:
        assert Counter(called[t] for t in s.trajectory_ids).most_common(1)[0][1] * 2 > s.size
    assert any(s.tool == "update_task" and "update_task" in s.label for s in suggestions)
