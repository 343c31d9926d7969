"""Verifier calibration: one turn of each labeled trajectory is scored (the case's turn, or promotion's
default turn for a written verifier), through the environment the row trains in, never "any turn passes".
Triage's detectors against labels, with their Wilson intervals: a project's, the support demo's, and a set
labeled by hand that the detectors never saw (run with `-s` to see the figures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flywheel.evals import promotion
from flywheel.evals.calibration import verifier_calibrate

pytestmark = pytest.mark.django_db

REFUND_50 = {"type": "tool_call", "expected_calls": [{"name": "refund", "arguments": {
    "order_id": {"any": True}, "amount": {"range": [49.99, 50.01]}}}]}


@pytest.fixture
def label(user):
    from flywheel.failures.review import trajectory_outcome_set

    def run(trajectory, outcome: str):
        return trajectory_outcome_set(trajectory=trajectory, outcome=outcome, user=user)

    return run


def _refund_again(record: dict, amount: float) -> dict:
    """The agent refunds a second time, `amount`, before its final answer."""
    final = record["messages"].pop()
    record["messages"] += [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c3", "type": "function", "function": {
            "name": "refund", "arguments": json.dumps({"order_id": "A-1001", "amount": amount})}}]},
        {"role": "tool", "tool_call_id": "c3", "content": json.dumps({"ok": True, "refunded": amount})},
        final,
    ]
    return record


def test_a_case_is_scored_at_its_own_turn_not_at_any_turn(ingest, refund_record, suite, label, project, user):
    bad = ingest(refund_record("bad", amount=500.0))
    case, _ = promotion.trajectory_promote(trajectory=bad, target=suite, user=user, data={
        "message_index": 4, "expect": "calls", "expected_calls": REFUND_50["expected_calls"]})
    label(bad, "failure")
    label(ingest(refund_record("good", amount=50.0)), "success")
    # Refunded 500 at the case's turn, then 50 more: a failure, though a later turn passes on its own.
    twice = ingest(_refund_again(refund_record("twice", amount=500.0), 50.0))
    label(twice, "failure")
    result = verifier_calibrate(project=project, verifier=case.verifier, source=f"case:{case.pk}")
    assert result.matrix == {"success": {"pass": 1, "fail": 0}, "failure": {"pass": 0, "fail": 2}}
    assert result.disagreements == [] and result.kappa == 1.0


def test_a_written_verifier_is_scored_at_the_turn_promotion_would_start_from(ingest, refund_record, label, project):
    # Refunded 50 first, then 500 on top: the last turn that made calls is the wrong refund.
    over = ingest(_refund_again(refund_record("over", amount=50.0), 500.0))
    label(over, "failure")
    label(ingest(refund_record("good", amount=50.0)), "success")
    result = verifier_calibrate(project=project, verifier=REFUND_50)
    assert result.matrix == {"success": {"pass": 1, "fail": 0}, "failure": {"pass": 0, "fail": 1}}
    assert result.disagreements == []


def test_a_replay_case_scores_each_trajectory_through_its_own_replay(ingest, refund_record, suite, label, project, user):
    """The case expects the lookup and then the refund: an episode of two turns, which no single turn holds."""
    bad = ingest(refund_record("bad", amount=500.0))
    expected = [{"name": "lookup_order", "arguments": {"order_id": "A-1001"}},
                {"name": "refund", "arguments": {"order_id": "A-1001", "amount": 50}}]
    case, _ = promotion.trajectory_promote(trajectory=bad, target=suite, user=user, data={
        "message_index": 2, "expect": "calls", "expected_calls": expected, "env_type": "replay",
        "observations": {"refund": json.dumps({"ok": True, "refunded": 50.0})}})
    label(bad, "failure")
    good = ingest(refund_record("good", amount=50.0))
    label(good, "success")
    result = verifier_calibrate(project=project, verifier=case.verifier, source=f"case:{case.pk}")
    assert result.matrix == {"success": {"pass": 1, "fail": 0}, "failure": {"pass": 0, "fail": 1}}
    # A different, written verifier with the case chosen is scored as written: single-turn, at the refund.
    written = verifier_calibrate(project=project, verifier=REFUND_50, source=f"case:{case.pk}")
    assert written.matrix == {"success": {"pass": 1, "fail": 0}, "failure": {"pass": 0, "fail": 1}}


def test_a_workplace_case_is_scored_by_the_final_state_of_its_episode(ingest, suite, label, project, user):
    from trainer.envs.workplace import generate_tasks

    task = generate_tasks(1, seed=0, split="train", difficulty="single")[0]  # "Assign T4 ... to Peggy."
    right = task["solution"][0]
    wrong = json.loads(json.dumps(right))
    wrong["tool_calls"][0]["function"]["arguments"] = json.dumps({"task_id": "T4", "assignee": "Kevin"})

    def record(external_id: str, turn: dict) -> dict:
        return {"external_id": external_id, "outcome": "unknown", "tools": task["tools"],
                "messages": [*task["messages"], turn, {"role": "assistant", "content": "Done."}]}

    bad, good = ingest(record("wp-bad", wrong)), ingest(record("wp-good", right))
    index = len(task["messages"])
    case, _ = promotion.trajectory_promote(trajectory=bad, target=suite, user=user, data={
        "message_index": index, "expect": "state", "expected_state": task["verifier"]["expected"],
        "env_type": "workplace", "initial_state": task["env"]["initial_state"],
        "reference_calls": [{"name": "update_task", "arguments": {"task_id": "T4", "assignee": "Peggy"}}]})
    label(bad, "failure")
    label(good, "success")
    # Written, without the case's world, a state verifier has no state to judge: said, not a crash.
    written = verifier_calibrate(project=project, verifier=case.verifier)
    assert written.n == 0 and "final state" in written.spec_errors[0]
    result = verifier_calibrate(project=project, verifier=case.verifier, source=f"case:{case.pk}")
    assert result.matrix == {"success": {"pass": 1, "fail": 0}, "failure": {"pass": 0, "fail": 1}}
    assert result.disagreements == []


# --- calibrations on a worker ------------------------------------------------------------------------------


def test_a_calibration_runs_on_a_worker_one_at_a_time_with_its_progress(ingest, refund_record, label, project, user,
                                                                        monkeypatch):
    from flywheel.evals import calibration
    from flywheel.evals.calibration_models import VerifierCalibration

    monkeypatch.setattr(calibration, "PROGRESS_EVERY", 1)
    for i, amount in enumerate([50.0, 500.0, 50.0]):
        label(ingest(refund_record(f"c-{i}", amount=amount)), "success" if amount == 50.0 else "failure")
    seen = []
    real = calibration.verifier_calibrate

    def spy(**kwargs):  # the progress the page polls, as the worker writes it
        progress = kwargs["progress"]

        def record(done, total):
            progress(done, total)
            row = VerifierCalibration.objects.get()
            seen.append((row.status, row.done, row.total))

        return real(**{**kwargs, "progress": record})

    monkeypatch.setattr(calibration, "verifier_calibrate", spy)
    run = calibration.calibration_start(project=project, verifier=REFUND_50, user=user)
    assert run.status == "queued" and run.requested_by == user
    assert calibration.calibration_start(project=project, verifier=REFUND_50) == run  # the same one, waiting
    with pytest.raises(calibration.CalibrationRefused, match=f"#{run.pk}"):
        calibration.calibration_start(project=project, verifier={"type": "exact", "expected": "x"})
    done = calibration.calibration_run_process(run_id=run.pk)
    assert seen == [("running", 0, 3), ("running", 1, 3), ("running", 2, 3)]
    assert (done.status, done.done, done.total, done.percent) == ("done", 3, 3, 100)
    assert done.result["matrix"] == {"success": {"pass": 2, "fail": 0}, "failure": {"pass": 0, "fail": 1}}
    assert calibration.calibration_run_process(run_id=run.pk).result == done.result  # a duplicate message: nothing
    assert calibration.calibration_start(project=project, verifier={"type": "exact", "expected": "x"}) != run


def test_a_calibration_that_reaches_its_time_limit_says_so(ingest, refund_record, label, project, client_for, user,
                                                           monkeypatch):
    """Celery raises SoftTimeLimitExceeded in whatever code runs when the limit passes: here, scoring."""
    from celery.exceptions import SoftTimeLimitExceeded
    from django.urls import reverse

    from flywheel.evals import calibration
    from flywheel.evals.tasks import calibration_task

    label(ingest(refund_record("c", amount=50.0)), "success")

    def stopped(*args, **kwargs):
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(promotion, "score_episode", stopped)
    run = calibration.calibration_start(project=project, verifier=REFUND_50)
    calibration_task.apply(args=[run.pk])  # the task as a worker runs it, with its limits
    run.refresh_from_db()
    assert run.status == "failed" and run.error == "It ran past its time limit of 10 min and was stopped."
    html = client_for(user).get(reverse("calibration_status", args=[project.slug, run.pk])).content.decode()
    assert "The calibration failed: It ran past its time limit" in html and "hx-get" not in html
    assert calibration.calibration_start(project=project, verifier=REFUND_50) != run  # the next one may start


def test_the_sweep_fails_a_calibration_whose_worker_stopped_and_sends_one_no_worker_took(project, monkeypatch):
    from datetime import timedelta

    from django.utils import timezone

    from flywheel.evals import calibration, tasks
    from flywheel.evals.calibration_models import VerifierCalibration

    sent = []
    monkeypatch.setattr(tasks.calibration_task, "delay", lambda run_id: sent.append(run_id))
    run = calibration.calibration_start(project=project, verifier=REFUND_50)
    VerifierCalibration.objects.filter(pk=run.pk).update(queued_at=timezone.now() - timedelta(hours=1))
    assert calibration.calibration_sweep() == 1 and sent[-1] == run.pk
    VerifierCalibration.objects.filter(pk=run.pk).update(status="running",
                                                         heartbeat_at=timezone.now() - timedelta(hours=1))
    calibration.calibration_sweep()
    run.refresh_from_db()
    assert run.status == "failed" and "stopped answering" in run.error


# --- triage detectors ------------------------------------------------------------------------------------

DETECTOR_TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
                  for name in ("lookup_order", "delete_task")]


def _turns(*tail: dict) -> list[dict]:
    return [{"role": "user", "content": "Where is A-1001? And delete task T3."}, *tail]


def _call(name: str, arguments: dict, call_id: str = "c1") -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def _result(content: str, call_id: str = "c1") -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


ANSWER = {"role": "assistant", "content": "Shipped; T3 is deleted."}
LOOKUP = [_call("lookup_order", {"order_id": "A-1001"}), _result('{"status": "shipped"}')]


@pytest.fixture
def labeled(ingest, label, project):
    """Labeled trajectories whose signals are known, triaged; returns them by name."""
    from flywheel.trajectories.triage import triage_project

    records = {
        # failures: one stops after the tool answered (and has a thumbs-down), one calls a tool it lacks, one
        # is clean (no detector can see it).
        "stops": (_turns(*LOOKUP), "failure", {"feedback": {"thumbs": "down"}}),
        "invents": (_turns(_call("cancel_order", {"order_id": "A-1001"}), _result("{}"), ANSWER), "failure", {}),
        "quiet": (_turns(*LOOKUP, ANSWER), "failure", {}),
        # successes: clean; a tool error the agent recovered from; the delete the user asked for.
        "clean": (_turns(*LOOKUP, ANSWER), "success", {}),
        "recovers": (_turns(_call("lookup_order", {"order_id": "A1001"}), _result("Error: no such order"),
                            *LOOKUP, ANSWER), "success", {}),
        "asked": (_turns(_call("delete_task", {"task_id": "T3"}), _result("{}"), ANSWER), "success", {}),
    }
    out = {}
    for name, (messages, outcome, extra) in records.items():
        out[name] = ingest({"external_id": name, "agent": "bot", "outcome": "unknown", "messages": messages,
                            "tools": DETECTOR_TOOLS, **extra})
        label(out[name], outcome)
    # Not labeled by a reviewer: out of every figure against reviewers' labels, in with recorded outcomes.
    out["unreviewed"] = ingest({"external_id": "unreviewed", "agent": "other", "outcome": "failure",
                                "messages": _turns(_call("delete_task", {"task_id": "T9"})), "tools": DETECTOR_TOOLS})
    assert triage_project(project_id=project.pk) == 7
    return out


def _rows(result) -> dict[str, tuple]:
    return {r.kind: (r.on_failures, r.on_successes, r.precision, r.recall) for r in result.rows}


def test_each_detector_against_reviewers_labels(labeled, project):
    from flywheel.evals.calibration import detector_calibrate

    result = detector_calibrate(project=project)
    assert (result.n, result.failures, result.successes, result.untriaged) == (6, 3, 3, 0)
    rows = _rows(result)
    assert rows["no_final_answer"] == (1, 0, 1.0, pytest.approx(1 / 3))
    assert rows["undeclared_tool"] == (1, 0, 1.0, pytest.approx(1 / 3))
    assert rows["negative_feedback"] == (1, 0, 1.0, pytest.approx(1 / 3))
    assert rows["tool_error"] == (0, 1, 0.0, 0.0)  # fired on a success only
    assert rows["unsafe_action"] == (0, 0, None, 0.0)  # the delete was asked for: no signal
    assert rows["any"] == (2, 1, pytest.approx(2 / 3), pytest.approx(2 / 3))
    assert list(rows)[-1] == "any" and len(rows) == 10
    # One flagged trajectory, a failure: precision 1.000, but its interval says how little that shows.
    row = next(r for r in result.rows if r.kind == "no_final_answer")
    low, high = row.precision_interval
    assert high == 1.0 and low == pytest.approx(0.2065, abs=1e-4)
    assert next(r for r in result.rows if r.kind == "unsafe_action").precision_interval is None


def test_recorded_outcomes_as_labels_and_one_agent(labeled, project):
    from flywheel.evals.calibration import detector_calibrate

    result = detector_calibrate(project=project, labels="outcome")
    assert (result.n, result.failures) == (7, 4)
    # The unreviewed failure deletes a task nobody asked for.
    assert _rows(result)["unsafe_action"] == (1, 0, 1.0, 0.25)
    other = detector_calibrate(project=project, labels="outcome", agent="other")
    assert (other.n, other.failures, _rows(other)["any"]) == (1, 1, (1, 0, 1.0, 1.0))
    assert detector_calibrate(project=project, agent="other").n == 0
    with pytest.raises(ValueError, match="labels must be one of"):
        detector_calibrate(project=project, labels="votes")


def test_the_calibration_page_shows_the_detectors(labeled, project, client_for, make_user, make_membership):
    from django.urls import reverse

    viewer = make_user("vera")
    make_membership(viewer, project, "viewer")
    url = reverse("calibration", args=[project.slug])
    page = client_for(viewer).get(url)
    html = page.content.decode()
    assert page.status_code == 200 and 'id="detectors"' in html and 'id="detectors-too-few"' in html
    row = html.split('data-detector="tool_error"')[1].split("</tr>")[0]
    assert 'data-cell="on-successes">1<' in row and 'data-cell="precision">0.000<' in row
    assert 'data-cell="precision-ci">[0.00, 0.79]<' in row  # 0 of 1: the interval spans most of [0, 1]
    row = html.split('data-detector="unsafe_action"')[1].split("</tr>")[0]
    assert 'data-cell="precision">—<' in row and 'data-cell="precision-ci">—<' in row
    assert "labeled by hand before the detectors ran on it" in html
    recorded = client_for(viewer).get(url, {"labels": "outcome", "agent": "<b>other</b>"}).content.decode()
    assert "&lt;b&gt;other&lt;/b&gt;" in recorded and "<b>other</b>" not in recorded
    assert "holds by construction" in recorded and "holds by construction" not in html
    bad = client_for(viewer).get(url, {"labels": "votes"})
    assert bad.status_code == 422 and 'data-field="labels"' in bad.content.decode()
    outsider = make_user("olga")
    assert client_for(outsider).get(url).status_code == 404


def test_the_detectors_on_the_support_demo():
    """The figures a newcomer sees after `make run` (labels: the outcomes written with each conversation)."""
    from flywheel.evals.calibration import detector_calibrate
    from flywheel.seed.demo import demo_seed
    from flywheel.trajectories.triage import triage_project

    seed = demo_seed()
    triage_project(project_id=seed.project.pk)
    result = detector_calibrate(project=seed.project, labels="outcome")
    assert (result.n, result.failures) == (11, 7)
    rows = _rows(result)
    # Every failure carries a signal. The one success flagged (demo-004) sent a malformed order id, got a tool
    # error and recovered: both signals are right about the turn, the outcome is still a success.
    assert rows == {
        "invalid_arguments": (1, 0, 1.0, 1 / 7), "undeclared_tool": (1, 0, 1.0, 1 / 7),
        "schema_violation": (2, 1, 2 / 3, 2 / 7), "tool_error": (5, 1, 5 / 6, 5 / 7),
        "unsafe_action": (1, 0, 1.0, 1 / 7),  # the refund over the limit, though the user asked for it
        "negative_feedback": (2, 0, 1.0, 2 / 7), "human_intervention": (1, 0, 1.0, 1 / 7),
        "loop": (0, 0, None, 0.0), "no_final_answer": (1, 0, 1.0, 1 / 7),  # the user's unanswered complaint
        "any": (7, 1, 7 / 8, 1.0),
    }


def _print_rows(title, result):
    print(f"\n{title}")
    for row in result.rows:
        p, r = row.precision_interval, row.recall_interval
        print(f"  {row.kind:<20} flagged {row.on_failures:>2} right, {row.on_successes:>2} wrong; precision "
              + ("—" if p is None else f"{row.precision:.3f} [{p[0]:.2f}, {p[1]:.2f}]")
              + "; recall " + ("—" if r is None else f"{row.recall:.3f} [{r[0]:.2f}, {r[1]:.2f}]"))


def test_the_support_demos_figures_with_their_intervals():
    """The support demo's labels are a person's, written with each conversation: held out, but 11 of them."""
    from flywheel.evals.calibration import detector_calibrate
    from flywheel.seed.demo import demo_seed
    from flywheel.trajectories.triage import triage_project

    seed = demo_seed()
    triage_project(project_id=seed.project.pk)
    result = detector_calibrate(project=seed.project, labels="outcome")
    _print_rows(f"support demo, {result.n} trajectories labeled with each conversation ({result.failures} failures):",
                result)
    any_row = next(r for r in result.rows if r.kind == "any")
    assert (any_row.on_failures, any_row.on_successes) == (7, 1)
    low, high = any_row.precision_interval
    assert low < 0.6 < 0.875 < high  # 7 of 8 on 11 trajectories: the interval is most of the range


REFERENCE = Path(__file__).resolve().parents[1] / "trajectories" / "data" / "triage_reference.jsonl"


def test_the_detectors_against_a_set_labeled_by_hand_that_they_never_saw():
    from flywheel.evals.calibration import detector_reference

    records = [json.loads(line) for line in REFERENCE.read_text().splitlines() if line.strip()]
    result = detector_reference(records)
    _print_rows(f"reference set, {result.n} trajectories labeled by hand ({result.failures} failures); per signal "
                "against the person's judgement that it applies, 'any' against the outcome:", result)
    assert (result.n, result.failures) == (76, 42)
    rows = {row.kind: row for row in result.rows}
    # Each row's positives are the records judged to carry that signal, whatever the detectors say.
    for kind, row in rows.items():
        if kind != "any":
            assert row.failures == sum(kind in r["judgement"]["signals"] for r in records), kind
    # Floors, so that a change that loses what the detectors find is seen: "any signal" separates failures
    # from successes far from perfectly on trajectories nobody tuned it on (precision 0.70 [0.56, 0.81],
    # recall 0.83 [0.69, 0.92] when this set was written).
    assert rows["any"].precision >= 0.6 and rows["any"].recall >= 0.75
    for kind in ("invalid_arguments", "undeclared_tool", "schema_violation", "no_final_answer"):
        assert rows[kind].recall == 1.0, kind  # facts in the calls and the ending a person sees every time


def test_a_reference_record_is_checked_field_by_field():
    from flywheel.evals.calibration import detector_reference

    good = {"id": "r1", "judgement": {"outcome": "success", "signals": []}, "trajectory": {"messages": []}}
    assert detector_reference([good]).n == 1
    for broken, field in (({**good, "judgement": {"outcome": "meh", "signals": []}}, "judgement.outcome"),
                          ({**good, "judgement": {"outcome": "failure", "signals": ["typo"]}}, "judgement.signals"),
                          ({**good, "trajectory": {"messages": "hi"}}, "trajectory.messages"),
                          ({"id": "r2"}, "judgement")):
        with pytest.raises(ValueError, match=f"reference record r[12]: {field}"):
            detector_reference([good, broken])
