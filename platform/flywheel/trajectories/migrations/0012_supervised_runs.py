"""Uploads and triage re-runs become supervised runs (flywheel.runs): an upload's `attempts` is `attempt`, a
triage re-run counts its attempts too, both name the worker that holds them, and an upload's run writes a
heartbeat with its lease. A queued re-run forgets the heartbeat of an earlier attempt, since the sweep sends
again only the queued runs no worker has begun."""

from django.db import migrations, models


def forwards(apps, schema_editor):
    TriageRun = apps.get_model("trajectories", "TriageRun")
    TriageRun.objects.filter(status="queued", heartbeat_at__isnull=False).update(heartbeat_at=None)


class Migration(migrations.Migration):
    dependencies = [("trajectories", "0011_live_rollup")]

    operations = [
        migrations.RenameField(model_name="upload", old_name="attempts", new_name="attempt"),
        migrations.AddField(model_name="triagerun", name="attempt", field=models.PositiveIntegerField(default=0)),
        migrations.AddField(
            model_name="triagerun", name="worker", field=models.CharField(blank=True, default="", max_length=200)
        ),
        migrations.AddField(model_name="upload", name="heartbeat_at", field=models.DateTimeField(blank=True, null=True)),
        migrations.AddField(
            model_name="upload", name="worker", field=models.CharField(blank=True, default="", max_length=200)
        ),
        migrations.RunPython(forwards, migrations.RunPython.noop),
    ]
