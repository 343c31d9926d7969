"""Versions keep their rows' digests; each distinct row is stored once (StoredRow). Existing versions' rows
move there, in order."""

import hashlib
import json

from django.db import migrations, models


def digest(row):
    text = json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def move_rows(apps, model_name, app_label):
    StoredRow = apps.get_model("evals", "StoredRow")
    Version = apps.get_model(app_label, model_name)
    for version in Version.objects.all().iterator():
        digests = [digest(row) for row in version.rows]
        StoredRow.objects.bulk_create([StoredRow(digest=d, data=row) for d, row in zip(digests, version.rows, strict=True)],
                                      ignore_conflicts=True)
        Version.objects.filter(pk=version.pk).update(row_digests=digests)


def forwards(apps, schema_editor):
    move_rows(apps, "EvalSuiteVersion", "evals")


class Migration(migrations.Migration):

    dependencies = [
        ('evals', '0001_initial'),
    ]

    operations = [
        migrations.CreateModel(
            name='StoredRow',
            fields=[
                ('digest', models.CharField(max_length=64, primary_key=True, serialize=False)),
                ('data', models.JSONField()),
            ],
        ),
        migrations.AddField(
            model_name='evalsuiteversion',
            name='row_digests',
            field=models.JSONField(default=list),
        ),
        migrations.RunPython(forwards, migrations.RunPython.noop),
        migrations.RemoveField(
            model_name='evalsuiteversion',
            name='rows',
        ),
    ]
