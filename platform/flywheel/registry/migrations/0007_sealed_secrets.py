"""The webhook_secret column sealed at rest (flywheel.sealed): a text column, and the values already stored sealed."""

from django.db import migrations

import flywheel.sealed


def seal(apps, schema_editor):
    flywheel.sealed.seal_stored(apps.get_model("registry", "RegistrySettings"), "webhook_secret")


def unseal(apps, schema_editor):
    flywheel.sealed.unseal_stored(apps.get_model("registry", "RegistrySettings"), "webhook_secret", schema_editor.connection)


class Migration(migrations.Migration):

    dependencies = [
        ('registry', '0006_live_rollup'),
    ]

    operations = [
        migrations.AlterField(
            model_name='registrysettings',
            name='webhook_secret',
            field=flywheel.sealed.SealedField(blank=True, default='', max_length=200),
        ),
        migrations.RunPython(seal, unseal),
    ]
