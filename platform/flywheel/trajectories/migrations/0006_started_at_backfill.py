"""Trajectories stored without `started_at` get their `created_at`, the time they were first received:
what ingestion now sets, so that the date filters, which read `started_at` alone, find them too."""

from django.db import migrations
from django.db.models import F


def forwards(apps, schema_editor):
    Trajectory = apps.get_model("trajectories", "Trajectory")
    Trajectory.objects.filter(started_at__isnull=True).update(started_at=F("created_at"))


class Migration(migrations.Migration):
    dependencies = [("trajectories", "0005_review_started_index")]

    # Backwards: nothing to undo; a received time is a fair start time either way.
    operations = [migrations.RunPython(forwards, migrations.RunPython.noop, elidable=True)]
