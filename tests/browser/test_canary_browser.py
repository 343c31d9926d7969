"""Canary in real Chromium: a maintainer starts a canary from the Models page, sees the split, the decision's
figures and what happens next, opens the check's looks, and rolls the canary back; the history says who did
what and on which evidence. Screenshots go to $FLYWHEEL_SCREENSHOTS when set (for a person to look at)."""

from __future__ import annotations

import os

import pytest
from playwright.sync_api import expect

from flywheel.registry import canary
from flywheel.registry.models import LiveCheck, RegistrySettings
from flywheel.trajectories.ingest import ingest_trajectories
from tests.platform.registry.worlds import versions_with_adapters

pytestmark = pytest.mark.django_db(transaction=True)


def _shot(page, name):
    folder = os.environ.get("FLYWHEEL_SCREENSHOTS")
    if folder:
        page.screenshot(path=os.path.join(folder, f"{name}.png"), full_page=True)


def _traffic(project, number, n, failures, start):
    records = [{"external_id": f"v{number}-{start + i}", "model_version": f"{project.slug}-v{number}",
                "outcome": "failure" if i < failures else "success",
                "messages": [{"role": "user", "content": "<b>refund</b> order 7"}]} for i in range(n)]
    assert ingest_trajectories(project=project, records=records).accepted == n


def test_a_maintainer_starts_watches_and_rolls_back_a_canary(open_page, make_user, make_project, tmp_path):
    owner = make_user("olga")
    project = make_project("shop", owner=owner)
    v1, v2 = versions_with_adapters(project, owner, tmp_path)
    RegistrySettings.objects.create(project=project, canary_min_per_arm=200)

    page = open_page(owner)
    page.goto("/p/shop/models/")
    page.click("#canary-start-2")
    expect(page.locator(".acc-note")).to_contain_text("Canary started")
    expect(page.locator("#canary-split")).to_contain_text("canary v2 takes 10%")

    check = LiveCheck.objects.get(project=project, kind="canary")
    _traffic(project, 2, 10, 3, 0)
    _traffic(project, 1, 90, 9, 0)
    assert canary.live_check_look(check_id=check.pk) == "running"  # too little to tell yet
    _traffic(project, 2, 60, 18, 10)
    _traffic(project, 1, 540, 54, 90)
    assert canary.live_check_look(check_id=check.pk) == "flagged"  # 30% against 10%
    page.reload()
    panel = page.locator("#live-canary")
    expect(panel).to_contain_text("Flagged, waiting for a person")
    expect(panel).to_contain_text("30.0%")
    expect(panel).to_contain_text("does not act by itself")
    expect(panel).to_contain_text("Known outcomes")
    _shot(page, "models-canary-flagged")

    page.click("#live-canary >> text=the looks")
    expect(page.locator("#looks")).to_contain_text("70")
    expect(page.locator(".live-chart canvas")).to_have_count(1)  # the p-values of both looks, drawn
    _shot(page, "live-check")
    page.go_back()

    page.fill("#live-canary input[name=reason]", "failures tripled")
    page.click("#canary-rollback")
    expect(page.locator(".acc-note")).to_contain_text("Canary rolled back")
    expect(page.locator("#history")).to_contain_text("Ended: v2 no longer serves")
    expect(page.locator("#history")).to_contain_text("failures tripled")
    expect(page.locator("#history")).to_contain_text("21 failures")
    _shot(page, "models-after-rollback")

    # A full promotion starts the watch of the new production against the version it replaced.
    page.click("#version-2 button:text-is('Promote')")
    watch = page.locator("#live-watch")
    expect(watch).to_contain_text("Watch: production v2 against v1 (holdback)")
    expect(watch).to_contain_text("Not looked at yet")
    expect(page.locator("#holdback-split")).to_contain_text("v1, the version production replaced, keeps 5%")
    rules = page.locator("#live-rules")
    expect(rules.locator("#live-tolerance")).to_have_value("0.05")
    expect(rules.locator("#live-holdback")).to_have_value("0.05")
    _shot(page, "models-watch")
    assert not page.log.page_errors and not page.log.console_errors
