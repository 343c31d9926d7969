"""Live metrics' rollup (flywheel.registry.live): the indexes its refresh reads. `updated_at` and `triaged_at`:
the trajectories that changed since its watermark (an ingest or a replay, a review, a triage); (project,
model_version, coalesce(started_at, created_at)): one bucket's trajectories (a model_version string in one
hour). Built CONCURRENTLY on PostgreSQL, like the review indexes, so that migrating a live database does not
lock out ingestion."""

from django.db import migrations

TABLE = "trajectories_trajectory"


def statements(vendor: str, *, concurrently: bool = True) -> list[str]:
    c = "CONCURRENTLY " if concurrently and vendor == "postgresql" else ""
    return [
        f"CREATE INDEX {c}IF NOT EXISTS traj_updated_at ON {TABLE} (updated_at)",
        f"CREATE INDEX {c}IF NOT EXISTS traj_triaged_at ON {TABLE} (triaged_at)",
        f"CREATE INDEX {c}IF NOT EXISTS traj_project_model_at ON {TABLE} "
        f"(project_id, model_version, (COALESCE(started_at, created_at)))",
    ]


def forwards(apps, schema_editor):
    for sql in statements(schema_editor.connection.vendor):
        schema_editor.execute(sql)


def backwards(apps, schema_editor):
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    for name in ("traj_updated_at", "traj_triaged_at", "traj_project_model_at"):
        schema_editor.execute(f"DROP INDEX {concurrently}IF EXISTS {name}")


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction
    dependencies = [("trajectories", "0010_triage_policy_requested_deletes")]
    operations = [migrations.RunPython(forwards, backwards, elidable=False)]
