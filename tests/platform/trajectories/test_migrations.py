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


@pytest.mark.django_db
def test_0010_gives_the_old_default_policy_the_requested_delete_rule_and_leaves_edited_ones(project, make_project):
    from flywheel.trajectories.models import TriagePolicy
    from flywheel.trajectories.triage_policy import DEFAULT_UNSAFE_RULES

    migration = importlib.import_module("flywheel.trajectories.migrations.0010_triage_policy_requested_deletes")
    old = TriagePolicy.objects.create(project=project, unsafe=migration.OLD_DEFAULT, version=3)
    edited_rules = [{"name": "delete_*"}, {"name": "archive_*"}]
    edited = TriagePolicy.objects.create(project=make_project("edited"), unsafe=edited_rules, version=2)

    migration.forwards(apps, None)

    old.refresh_from_db()
    edited.refresh_from_db()
    assert old.unsafe == DEFAULT_UNSAFE_RULES and old.version == 4  # re-triage sees the change
    assert edited.unsafe == edited_rules and edited.version == 2
