"""The triage state index, (project, triage_version): a project's untriaged trajectories (version 0, what the
triage task and the sweep look for) and those triaged under an older policy (a re-run's work) are index
ranges, not a scan of the project. Built CONCURRENTLY on PostgreSQL, like the review indexes, so that
migrating a live database does not lock out ingestion; bench/pages.py builds it with `statements`."""

from django.db import migrations

TABLE = "trajectories_trajectory"


def statements(vendor: str, *, concurrently: bool = True) -> list[str]:
    c = "CONCURRENTLY " if concurrently and vendor == "postgresql" else ""
    return [f"CREATE INDEX {c}IF NOT EXISTS traj_project_triage ON {TABLE} (project_id, triage_version)"]


def forwards(apps, schema_editor):
    for sql in statements(schema_editor.connection.vendor):
        schema_editor.execute(sql)


def backwards(apps, schema_editor):
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(f"DROP INDEX {concurrently}IF EXISTS traj_project_triage")


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction
    dependencies = [("trajectories", "0008_triage")]
    operations = [migrations.RunPython(forwards, backwards, elidable=False)]
