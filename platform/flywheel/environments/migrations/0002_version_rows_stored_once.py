"""Task-set versions keep their rows' digests; the rows move to evals.StoredRow, in order."""

import importlib

from django.db import migrations, models


def forwards(apps, schema_editor):
    evals_0002 = importlib.import_module("flywheel.evals.migrations.0002_version_rows_stored_once")
    evals_0002.move_rows(apps, "TaskSetVersion", "environments")


class Migration(migrations.Migration):

    dependencies = [
        ('environments', '0001_initial'),
        ('evals', '0002_version_rows_stored_once'),
    ]

    operations = [
        migrations.AddField(
            model_name='tasksetversion',
            name='row_digests',
            field=models.JSONField(default=list),
        ),
        migrations.RunPython(forwards, migrations.RunPython.noop),
        migrations.RemoveField(
            model_name='tasksetversion',
            name='rows',
        ),
    ]
