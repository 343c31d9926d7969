"""The judge_api_key column sealed at rest (flywheel.sealed): a text column, and the values already stored sealed."""

from django.db import migrations

import flywheel.sealed


def seal(apps, schema_editor):
    flywheel.sealed.seal_stored(apps.get_model("evals", "OnlineEvalSettings"), "judge_api_key")


def unseal(apps, schema_editor):
    flywheel.sealed.unseal_stored(apps.get_model("evals", "OnlineEvalSettings"), "judge_api_key", schema_editor.connection)


class Migration(migrations.Migration):

    dependencies = [
        ('evals', '0007_evalrun_queued_without_heartbeat'),
    ]

    operations = [
        migrations.AlterField(
            model_name='onlineevalsettings',
            name='judge_api_key',
            field=flywheel.sealed.SealedField(blank=True, default='', max_length=500),
        ),
        migrations.RunPython(seal, unseal),
    ]
