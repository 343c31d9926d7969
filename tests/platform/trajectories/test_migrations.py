"""Data migrations of the trajectories app, run on rows as older code left them."""

from __future__ import annotations

import importlib

import pytest
from django.apps import apps

from flywheel.trajectories.ingest import ingest_trajectories
from flywheel.trajectories.models import Trajectory


@pytest.mark.django_db
def test_0006_gives_trajectories_without_a_start_their_received_time(project, make_record):
    ingest_trajectories(project=project, records=[make_record("old"), make_record("dated")])
    Trajectory.objects.filter(external_id="old").update(started_at=None)  # as ingestion used to store it
    migration = importlib.import_module("flywheel.trajectories.migrations.0006_started_at_backfill")

    migration.forwards(apps, None)

    old = Trajectory.objects.get(external_id="old")
    assert old.started_at == old.created_at
    assert Trajectory.objects.get(external_id="dated").started_at.isoformat() == "2026-12-01T10:00:00+00:00"
