"""Live evidence (flywheel.trajectories.vouch): whether the router vouched for the version a trajectory names
(`vouch`, or why not), the request id its token names (`vouch_request`), and who sent it (`ingested_by`). The
columns have constant defaults, which PostgreSQL adds without rewriting the table; the index of request ids
covers only trajectories that carry one, and is built CONCURRENTLY on PostgreSQL so that migrating a live
database does not lock out ingestion."""

from django.db import migrations, models

TABLE = "trajectories_trajectory"
INDEX = "traj_project_vouch_request"


def create_index(apps, schema_editor):
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(f"CREATE INDEX {concurrently}IF NOT EXISTS {INDEX} ON {TABLE} (project_id, vouch_request) "
                          "WHERE NOT (vouch_request = '')")


def drop_index(apps, schema_editor):
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(f"DROP INDEX {concurrently}IF EXISTS {INDEX}")


VOUCH_CHOICES = [
    ("", "No evidence token"), ("vouched", "Vouched for"), ("malformed", "Not an evidence token"),
    ("bad_mac", "Not signed with the project's evidence key"), ("other_version", "Signed for another version"),
    ("expired", "Its token had expired"), ("future", "Its token is dated in the future"),
    ("replayed", "Its token vouched for another trajectory, or was sent by another key"),
]


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction
    dependencies = [("trajectories", "0012_supervised_runs")]
    operations = [
        migrations.AddField(
            model_name="trajectory",
            name="ingested_by",
            field=models.CharField(blank=True, db_default="", default="", max_length=32),
        ),
        migrations.AddField(
            model_name="trajectory",
            name="vouch",
            field=models.CharField(blank=True, choices=VOUCH_CHOICES, db_default="", default="", max_length=16),
        ),
        migrations.AddField(
            model_name="trajectory",
            name="vouch_request",
            field=models.CharField(blank=True, db_default="", default="", max_length=64),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="trajectory",
                    index=models.Index(condition=~models.Q(vouch_request=""), fields=["project", "vouch_request"],
                                       name=INDEX),
                ),
            ],
            database_operations=[migrations.RunPython(create_index, drop_index, elidable=False)],
        ),
    ]
