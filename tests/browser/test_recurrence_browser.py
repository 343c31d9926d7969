"""A failure mode that came back, in real Chromium: its page says when and by which version it was fixed,
why it reopened and which trajectories match (hostile text shown as text, no script runs), and its rate per
version arrives from the registry's fragment. Screenshots go to $FLYWHEEL_SCREENSHOTS when set."""

from __future__ import annotations

import os

import pytest
from playwright.sync_api import expect

from flywheel.failures import recurrence
from flywheel.failures.models import RecurrenceMatch
from flywheel.failures.services import failure_mode_assign, failure_mode_create, failure_mode_update
from flywheel.registry import services
from flywheel.registry.models import LiveRollup
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.models import Trajectory

pytestmark = pytest.mark.django_db(transaction=True)

HOSTILE = "<img src=x onerror=alert(1)> refund order 7"


def _shot(page, name):
    folder = os.environ.get("FLYWHEEL_SCREENSHOTS")
    if folder:
        page.screenshot(path=os.path.join(folder, f"{name}.png"), full_page=True)


def test_a_reopened_modes_page_shows_its_recurrence_and_its_rate_per_version(open_page, make_user, make_project, tmp_path):
    owner = make_user("rita")
    project = make_project("shop", owner=owner)
    base = tmp_path / "tiny"
    base.mkdir()
    (base / "config.json").write_text("{}")
    services.base_model_register(project=project, name="tiny", path=str(base), user=owner)
    records = [{"external_id": f"m-{i}", "model_version": "shop-v1", "outcome": "failure",
                "messages": [{"role": "user", "content": f"Book a flight on 12/0{i}/2026"}]} for i in range(5)]
    records += [{"external_id": f"r-{i}", "model_version": "shop-v1", "outcome": "failure",
                 "messages": [{"role": "user", "content": HOSTILE}]} for i in range(3)]
    assert ingest_trajectories(project=project, records=records).accepted == 8
    members = Trajectory.objects.filter(project=project, external_id__startswith="m-")
    mode = failure_mode_create(project=project, name="Flight dates in the wrong format", category_key="wrong_arguments",
                               user=owner)
    failure_mode_assign(failure_mode=mode, trajectories=members, user=owner)
    failure_mode_update(failure_mode=mode, name=mode.name, category_key="wrong_arguments", status="fixed")
    mode.refresh_from_db()
    back = list(Trajectory.objects.filter(project=project, external_id__startswith="r-"))
    for t, similarity in zip(back, (0.93, 0.91, 0.9), strict=True):
        RecurrenceMatch.objects.create(failure_mode=mode, trajectory=t, rule="similarity", similarity=similarity,
                                       model_version=t.model_version)
    recurrence.failure_mode_reopen(failure_mode=mode, evidence={
        "rules": ["similarity"], "similarity": {"matches": 3, "min_matches": 3, "threshold": 0.87, "members": 5},
        "trajectory_ids": [t.pk for t in back],
        "reason": "3 new failures since the fix are as close to its members as they are to each other (at least 3 "
                  "reopen it)"})
    LiveRollup.objects.create(project=project, model_version="shop-v1", hour="2026-11-20T10:00:00Z",
                              trajectories=120, failures=16)

    page = open_page(owner)
    page.goto(f"/p/shop/failures/{mode.pk}/")
    panel = page.locator("#fm-recurrence")
    expect(panel).to_contain_text("Came back after its fix")
    expect(panel).to_contain_text("by v1")
    expect(panel.locator("tr[data-trajectory]")).to_have_count(3)
    expect(panel).to_contain_text("<img src=x onerror=alert(1)>")  # shown as text
    versions = page.locator("#fm-versions")
    expect(versions.locator('tr[data-version="1"]')).to_contain_text("8")  # 5 members + 3 matches
    expect(versions.locator('tr[data-version="1"]')).to_contain_text("50%")  # of 16 failures
    _shot(page, "failure-mode-reopened")
    assert page.log.dialogs == [] and page.log.page_errors == [] and page.log.failed_requests == []
