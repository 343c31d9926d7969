"""Uploads get a lease (who runs them, until when) and a queued time, so that a retry is safe and the sweep
sends again what never reached a worker. Rows waiting now count as queued since they were created; rows in
`processing` keep the 15 minutes their run had before it was called stuck."""

from datetime import timedelta

from django.db import migrations, models


def forwards(apps, schema_editor):
    Upload = apps.get_model("trajectories", "Upload")
    Upload.objects.filter(queued_at__isnull=True).update(queued_at=models.F("created_at"))
    for upload in Upload.objects.filter(status="processing", started_at__isnull=False).only("started_at"):
        Upload.objects.filter(pk=upload.pk).update(lease_expires_at=upload.started_at + timedelta(minutes=15))


class Migration(migrations.Migration):
    dependencies = [("trajectories", "0006_started_at_backfill")]

    operations = [
        migrations.AddField(
            model_name="upload",
            name="lease_expires_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="upload",
            name="lease_owner",
            field=models.CharField(blank=True, default="", max_length=255),
        ),
        migrations.AddField(
            model_name="upload",
            name="queued_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddIndex(
            model_name="upload",
            index=models.Index(
                condition=models.Q(("status__in", ["queued", "processing"])),
                fields=["status", "queued_at"],
                name="upload_waiting",
            ),
        ),
        # Backwards: the columns go, nothing to undo.
        migrations.RunPython(forwards, migrations.RunPython.noop, elidable=True),
    ]
