"""Two promotions of one trajectory to opposite sides at the same moment: the guard reads the other side and
the row is saved under the project's row lock, so exactly one of them wins. PostgreSQL only: SQLite has no
row locks (it serialises whole writes instead)."""

from __future__ import annotations

import json
import threading
import time

from flywheel.evals import leakage, promotion

TOOLS = [{"type": "function", "function": {"name": "lookup_customer", "parameters": {
    "type": "object", "properties": {"customer_id": {"type": "string"}}, "required": ["customer_id"]}}}]
DATA = {"message_index": 1, "expect": "calls",
        "expected_calls": [{"name": "lookup_customer", "arguments": {"customer_id": "C-17"}}]}


def _another_session_waits_for_a_lock() -> bool:
    from django.db import connection

    with connection.cursor() as cursor:
        # Inside a transaction the activity view is a snapshot taken once: drop it to see the present.
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()")
        return cursor.fetchone()[0] > 0


def test_two_concurrent_promotions_to_opposite_sides_one_wins(
        transactional_db, needs_postgres, make_project, make_user, monkeypatch):
    from django.db import connections

    from flywheel.environments.models import Task
    from flywheel.environments.services import task_set_create
    from flywheel.evals.models import EvalCase
    from flywheel.evals.services import suite_create
    from flywheel.trajectories.ingest import ingest_trajectories
    from flywheel.trajectories.models import Trajectory

    user = make_user()
    project = make_project(owner=user)
    record = {"external_id": "race-1", "outcome": "failure", "tools": TOOLS, "messages": [
        {"role": "user", "content": "Look up customer C-17"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "lookup_customer", "arguments": json.dumps({"customer_id": "C-1"})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{}"}]}
    assert ingest_trajectories(project=project, records=[record]).accepted == 1
    trajectory = Trajectory.objects.get(project=project, external_id="race-1")
    targets = {"first": suite_create(project=project, name="Held out", kind="holdout", user=user),
               "second": task_set_create(project=project, name="Lookups", user=user)}

    checked = threading.Event()
    outcomes: dict[str, str] = {}
    real_conflicts = leakage.leakage_conflicts

    def check_then_linger(**kwargs):
        conflicts = real_conflicts(**kwargs)
        if threading.current_thread().name == "first" and not checked.is_set():
            checked.set()
            # Keep the window between the guard's read and the save open until the other promotion has
            # finished (no lock: it saw nothing either and saved) or waits for this one's lock.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and "second" not in outcomes and not _another_session_waits_for_a_lock():
                time.sleep(0.02)
        return conflicts

    def promote(name: str) -> None:
        try:
            if name == "second":
                assert checked.wait(timeout=30)
            promotion.trajectory_promote(trajectory=trajectory, data=DATA, target=targets[name], user=user)
            outcomes[name] = "saved"
        except promotion.PromotionRefused as refused:
            outcomes[name] = f"refused: {[c.rule for c in refused.check.conflicts]}"
        except BaseException as exc:  # noqa: BLE001
            outcomes[name] = f"error: {exc!r}"
        finally:
            connections.close_all()

    monkeypatch.setattr(leakage, "leakage_conflicts", check_then_linger)
    threads = [threading.Thread(target=promote, args=(name,), name=name) for name in ("first", "second")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert outcomes == {"first": "saved", "second": "refused: ['trajectory', 'prompt']"}, outcomes
    assert EvalCase.objects.filter(trajectory=trajectory).count() + Task.objects.filter(trajectory=trajectory).count() == 1
