"""The date range filter's index with the id in it: a range of days is then an index-only scan whose ids
are sorted for the page, instead of a heap fetch per row in the range (bench/pages.py: 7 days of a
million-row project, ~78,000 rows)."""

from django.db import migrations

TABLE = "trajectories_trajectory"


def statements(vendor: str, *, concurrently: bool = True) -> list[str]:
    c = "CONCURRENTLY " if concurrently and vendor == "postgresql" else ""
    include = " INCLUDE (id)" if vendor == "postgresql" else ""
    columns = "(project_id, started_at)" if include else "(project_id, started_at, id)"
    return [f"CREATE INDEX {c}IF NOT EXISTS traj_project_started_id ON {TABLE} {columns}{include}"]


def forwards(apps, schema_editor):
    for sql in statements(schema_editor.connection.vendor):
        schema_editor.execute(sql)


def backwards(apps, schema_editor):
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(f"DROP INDEX {concurrently}IF EXISTS traj_project_started_id")


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [("trajectories", "0004_review_agent_model_index")]

    operations = [migrations.RunPython(forwards, backwards, elidable=False)]
