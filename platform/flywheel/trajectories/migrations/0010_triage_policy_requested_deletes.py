"""A project still on the first default triage policy gets the new default: a delete the user asked for (by
verb and by every argument value) is excused (`unless_requested`). A policy a maintainer changed is left
as it is; the triage page's help says how to add the key."""

from django.db import migrations
from django.db.models import F

OLD_DEFAULT = [
    {"name": "delete_*"},
    {"name": "drop_*"},
    {"name": "*refund*", "arguments": {"amount": {"range": [100, None]}}},
    {"name": "*sql*", "arguments": {"query": {"regex": r"(?i)\b(drop|truncate|delete)\b"}}},
]
NEW_DEFAULT = [{"name": "delete_*", "unless_requested": True}, *OLD_DEFAULT[1:]]


def forwards(apps, schema_editor):
    TriagePolicy = apps.get_model("trajectories", "TriagePolicy")
    for policy in TriagePolicy.objects.only("pk", "unsafe"):
        if policy.unsafe == OLD_DEFAULT:
            TriagePolicy.objects.filter(pk=policy.pk).update(unsafe=NEW_DEFAULT, version=F("version") + 1)


def backwards(apps, schema_editor):
    TriagePolicy = apps.get_model("trajectories", "TriagePolicy")
    for policy in TriagePolicy.objects.only("pk", "unsafe"):
        if policy.unsafe == NEW_DEFAULT:
            TriagePolicy.objects.filter(pk=policy.pk).update(unsafe=OLD_DEFAULT, version=F("version") + 1)


class Migration(migrations.Migration):
    dependencies = [("trajectories", "0009_triage_index")]
    operations = [migrations.RunPython(forwards, backwards)]
