"""A queued eval run forgets the heartbeat of an earlier attempt (a retry after the reaper left it there): the
sweep (flywheel.runs) sends again only the queued runs no worker has begun."""

from django.db import migrations


def forwards(apps, schema_editor):
    EvalRun = apps.get_model("evals", "EvalRun")
    EvalRun.objects.filter(status="queued", heartbeat_at__isnull=False).update(heartbeat_at=None)


class Migration(migrations.Migration):
    dependencies = [("evals", "0006_online_evaluation")]

    operations = [migrations.RunPython(forwards, migrations.RunPython.noop)]
