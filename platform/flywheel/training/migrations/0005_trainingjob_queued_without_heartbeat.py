"""A queued training job forgets the heartbeat of an earlier attempt (a retry after the reaper left it
there): the sweep (flywheel.runs) sends again only the queued jobs no worker has begun. An evaluating job
keeps its heartbeat: a worker may be measuring production for it."""

from django.db import migrations


def forwards(apps, schema_editor):
    TrainingJob = apps.get_model("training", "TrainingJob")
    TrainingJob.objects.filter(status="queued", heartbeat_at__isnull=False).update(heartbeat_at=None)


class Migration(migrations.Migration):
    dependencies = [("training", "0004_algorithms_dpo_sft_grpo")]

    operations = [migrations.RunPython(forwards, migrations.RunPython.noop)]
