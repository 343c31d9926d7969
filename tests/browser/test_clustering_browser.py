"""Clustering in real Chromium: a reviewer starts a run, the page follows its progress and shows the
suggestions, and one is accepted as a new failure mode; hostile agent text reads as text."""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path

import pytest
from playwright.sync_api import expect

from flywheel.failures.clustering import embedding, services
from flywheel.failures.clustering.models import ClusteringRun
from flywheel.failures.models import FailureMode
from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.models import Trajectory
from flywheel.trajectories.triage import triage_project

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
HOSTILE = "<img src=x onerror=\"window.__pwned='img'\">"


@pytest.fixture
def failures(project):
    sys.path.insert(0, str(BENCH_DIR))
    fixture = importlib.import_module("clustering_fixture")
    data = fixture.failures(24, seed=2, causes=["stock_timeout", "weather_undeclared_tool"])
    records = [r for _, r in data]
    records[0]["messages"][1]["content"] = f"{HOSTILE} What's AAPL trading at?"  # its title, shown as a representative
    assert not ingest_trajectories(project=project, records=records).rejected
    triage_project(project_id=project.pk)
    return project


def _shot(page, name):
    folder = os.environ.get("FLYWHEEL_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / name), full_page=True)


def test_a_clustering_run_is_accepted_as_a_mode(open_page, make_user, make_membership, failures):
    reviewer = make_user()
    make_membership(reviewer, failures, "reviewer")
    page = open_page(reviewer)
    page.goto(f"/p/{failures.slug}/clusters/")
    page.click("#cluster-start")
    # Queued, unless this test process's Celery worker (started by an earlier test) already took it.
    expect(page.locator("#run .run-status")).to_have_text(re.compile("^(Queued|Running|Done)$"))
    run = ClusteringRun.objects.get(project=failures)
    services.clustering_run_process(run_id=run.pk, embedder=embedding.shared_embedder())  # what a worker does
    # The page polls the run's progress and reloads with the suggestions when it ends.
    expect(page.locator(".cl-sugg")).to_have_count(2, timeout=15_000)
    expect(page.locator("#run .run-status")).to_have_text("Done")
    expect(page.locator("#run .cl-counts")).to_contain_text("24 failures")
    stock = page.locator(".cl-sugg", has_text="get_stock_price")
    expect(stock.locator(".cl-size")).to_have_text("12")
    expect(stock.locator(".cl-reps li")).to_have_count(5)
    expect(stock.locator(".cl-signals")).to_contain_text("Tool error")
    _shot(page, "clusters-suggestions.png")

    stock.locator("input[name=name]").fill("Stock quotes time out")
    stock.locator("text=Accept as new mode").click()
    decision = page.locator(".cl-sugg .cl-decision", has_text="Stock quotes time out")
    expect(decision).to_contain_text("Accepted as a new mode")
    mode = FailureMode.objects.get(project=failures, name="Stock quotes time out")
    stock_ids = set(Trajectory.objects.filter(project=failures, external_id__contains="stock_timeout").values_list("id", flat=True))
    assert set(mode.assignments.values_list("trajectory_id", flat=True)) == stock_ids
    _shot(page, "clusters-accepted.png")
    decision.locator("a").click()
    expect(page).to_have_url(f"{page.url.split('/p/')[0]}/p/{failures.slug}/failures/{mode.pk}/")
    assert page.evaluate("window.__pwned") is None
    assert not page.log.dialogs and not page.log.page_errors and not page.log.console_errors
