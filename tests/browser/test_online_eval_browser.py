"""The online evaluation page as a maintainer sees it: scores per version, the lowest-scored trajectories
(hostile content shown as text, with the CSP off so that escaping alone must hold), and the settings form
with its field errors."""

from __future__ import annotations

import os

import pytest

from tests.platform.evals.conftest import refund_record

pytestmark = pytest.mark.django_db(transaction=True)

REFUND_50 = [{"name": "refund", "arguments": {"order_id": {"any": True}, "amount": {"range": [49.99, 50.01]}}}]


def test_online_evaluation_page(open_page, make_user, make_project):
    from flywheel.environments.services import task_set_create
    from flywheel.evals import online, promotion
    from flywheel.trajectories.ingest import ingest_trajectories
    from flywheel.trajectories.models import Trajectory

    user = make_user("maint")
    project = make_project("acme", owner=user)
    task_set = task_set_create(project=project, name="Refund tasks", user=user)
    ingest_trajectories(project=project, records=[refund_record("source", amount=500.0)])
    promotion.trajectory_promote(trajectory=Trajectory.objects.get(external_id="source"), target=task_set, user=user,
                                 data={"message_index": 4, "expect": "calls", "expected_calls": REFUND_50})
    online.online_settings_set(project=project, data={"enabled": True, "sample_rate": 1.0, "max_per_hour": 200,
                                                      "threshold": 0.5, "task_set": task_set.pk})
    hostile = "<img src=x onerror=alert(1)> refund 50.00 on A-1001"
    records = [{**refund_record(f"v2-{i}", amount=50.0 if i % 4 else 500.0), "model_version": "support-v2"}
               for i in range(8)]
    records += [{**refund_record(f"v1-{i}", amount=500.0 if i % 2 else 50.0), "model_version": "support-v1"}
                for i in range(6)]
    records.append({**refund_record("hostile", amount=500.0, request=hostile), "model_version": "<b>v3</b>"})
    assert ingest_trajectories(project=project, records=records).accepted == len(records)
    assert online.online_eval_process(project_id=project.pk) == len(records)

    page = open_page(user, bypass_csp=True)
    page.goto(f"/p/{project.slug}/online-eval/")
    assert page.locator("#online-state").inner_text().startswith("on since")
    rows = page.locator("#version-scores tbody tr")
    assert rows.count() == 3
    v2 = page.locator('#version-scores tr[data-version="support-v2"]')
    assert v2.locator('[data-cell="n"]').inner_text() == "8"
    assert v2.locator('[data-cell="pass"]').inner_text().startswith("0.750")
    assert page.get_by_text("<b>v3</b>").count() >= 1  # shown as text
    hostile_row = page.locator("#lowest tbody tr", has_text="onerror")
    assert "<img src=x onerror=alert(1)>" in hostile_row.inner_text()
    assert page.log.dialogs == [] and page.log.page_errors == []
    os.makedirs("/tmp/e5", exist_ok=True)
    page.screenshot(path="/tmp/e5/online_eval.png", full_page=True)

    page.fill("#oe-rate", "two")
    page.click("#online-settings button[type=submit]")
    error = page.locator('[data-field="sample_rate"]')
    assert "from 0 to 1" in error.inner_text()
    page.screenshot(path="/tmp/e5/online_eval_error.png", full_page=True)
    page.fill("#oe-rate", "0.2")
    page.click("#online-settings button[type=submit]")
    assert page.locator("#oe-rate").input_value() == "0.2"
    assert online.settings_of(project=project).sample_rate == 0.2
