"""Clustering runs become supervised runs (flywheel.runs): `attempts` is `attempt`, as on every kind, and a run
names the worker that holds it. A queued run forgets the heartbeat of an earlier attempt, since the sweep
sends again only the queued runs no worker has begun."""

from django.db import migrations, models


def forwards(apps, schema_editor):
    ClusteringRun = apps.get_model("clustering", "ClusteringRun")
    ClusteringRun.objects.filter(status="queued", heartbeat_at__isnull=False).update(heartbeat_at=None)


class Migration(migrations.Migration):
    dependencies = [("clustering", "0001_initial")]

    operations = [
        migrations.RenameField(model_name="clusteringrun", old_name="attempts", new_name="attempt"),
        migrations.AddField(
            model_name="clusteringrun",
            name="worker",
            field=models.CharField(blank=True, default="", max_length=200),
        ),
        migrations.RunPython(forwards, migrations.RunPython.noop),
    ]
