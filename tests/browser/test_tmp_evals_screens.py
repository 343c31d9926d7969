import json
import pytest
from flywheel.evals import promotion
from flywheel.evals.services import suite_create
from flywheel.environments.services import task_set_create
from flywheel.environments.variants import task_variants_create
from flywheel.failures.services import failure_mode_assign, failure_mode_create
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.models import Trajectory
from flywheel.trajectories.review import trajectory_outcome_set

pytestmark = pytest.mark.django_db(transaction=True)
TOOLS = [{"type": "function", "function": {"name": "lookup_order", "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "refund", "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}, "amount": {"type": "number"}}, "required": ["order_id", "amount"]}}}]

def rec(i, amount=500.0, order=None):
    order = order or f"A-{1000+i}"
    return {"external_id": f"r-{i}", "agent": "support-bot", "outcome": "failure", "tools": TOOLS, "messages": [
        {"role": "system", "content": "You are a support agent."},
        {"role": "user", "content": f"Please refund 50.00 on order {order}, the mug arrived broken."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup_order", "arguments": json.dumps({"order_id": order})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"order_id": order, "total": 80.0})},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c2", "type": "function", "function": {"name": "refund", "arguments": json.dumps({"order_id": order, "amount": amount})}}]},
        {"role": "tool", "tool_call_id": "c2", "content": json.dumps({"ok": True})},
        {"role": "assistant", "content": "Done, refunded."}]}

def test_screens(open_page, make_user, make_project):
    owner = make_user("owner")
    project = make_project("shop", owner=owner, name="Shop support")
    ingest_trajectories(project=project, records=[rec(i, amount=50.0 if i % 3 == 0 else 500.0) for i in range(12)])
    ts = list(Trajectory.objects.filter(project=project).order_by("pk"))
    for t in ts[:9]:
        trajectory_outcome_set(trajectory=t, outcome="success" if t.external_id in ("r-0", "r-3", "r-6") else "failure", user=owner)
    suite = suite_create(project=project, name="Refund regressions", kind="regression", user=owner, description="Wrong refund amounts from production.")
    suite_create(project=project, name="Holdout March", kind="holdout", user=owner)
    tset = task_set_create(project=project, name="Refund tasks", user=owner)
    corrected = {"message_index": 4, "expect": "calls", "expected_calls": [{"name": "refund", "arguments": {"order_id": "A-1001", "amount": {"range": [49.99, 50.01]}}}]}
    promotion.trajectory_promote(trajectory=ts[1], data=corrected, target=suite, user=owner)
    d2 = {**corrected, "expected_calls": [{"name": "refund", "arguments": {"order_id": "A-1002", "amount": 50}}]}
    task, _ = promotion.trajectory_promote(trajectory=ts[2], data=d2, target=tset, user=owner)
    task_variants_create(task=task, user=owner)
    mode = failure_mode_create(project=project, name="Refunds the wrong amount", category_key="wrong_arguments", user=owner)
    failure_mode_assign(failure_mode=mode, trajectories=ts[3:8], user=owner, message_index=4)
    page = open_page(owner)
    def shot(url, name, full=True):
        page.goto(url); page.screenshot(path=f"/tmp/shots/{name}.png", full_page=full)
    shot("/p/shop/evals/", "suite_list")
    shot(f"/p/shop/evals/{suite.pk}/", "suite_detail")
    shot(f"/p/shop/evals/{suite.pk}/v/1/", "suite_version")
    shot("/p/shop/tasks/", "taskset_list")
    shot(f"/p/shop/tasks/{tset.pk}/", "taskset_detail")
    shot(f"/p/shop/tasks/{tset.pk}/v/2/", "taskset_version")
    page.goto(f"/p/shop/t/{ts[4].pk}/promote")
    page.select_option("#f-target", label="Refund regressions (regression)")
    page.fill("#f-expected-calls", json.dumps([{"name": "refund", "arguments": {"order_id": "A-1004", "amount": 50}}]))
    page.click("#run-checks"); page.screenshot(path="/tmp/shots/promote_checks.png", full_page=True)
    page.fill("#f-expected-calls", json.dumps([{"name": "refund", "arguments": {"order_id": "A-1004", "amount": {"regex": "(a)\\1"}}}]))
    page.click("#run-checks"); page.screenshot(path="/tmp/shots/promote_error.png", full_page=True)
    page.goto(f"/p/shop/t/{ts[5].pk}/promote"); page.screenshot(path="/tmp/shots/promote_fresh.png", full_page=False)
    page.goto(f"/p/shop/promote/?mode={mode.pk}")
    page.select_option("select[name=target]", label="Refund regressions (regression)")
    page.fill("#b-expected-calls", json.dumps([{"name": "refund", "arguments": {"order_id": {"regex": "^A-"}, "amount": 50}}]))
    page.click("#bulk button[type=submit]"); page.screenshot(path="/tmp/shots/bulk.png", full_page=True)
    spec = json.dumps({"type": "tool_call", "expected_calls": [{"name": "refund", "arguments": {"order_id": {"any": True}, "amount": 50}}]})
    page.goto("/p/shop/evals/calibration/?verifier=" + __import__("urllib.parse").parse.quote(spec)); page.screenshot(path="/tmp/shots/calibration.png", full_page=True)
    shot(f"/p/shop/t/{ts[4].pk}/", "trajectory_detail", full=False)
