"""An index for the agent + model version filter pair ("this agent on model v3"): each column alone is
common, so neither single-column index narrows their intersection enough at a million rows."""

from django.db import migrations

TABLE = "trajectories_trajectory"


def statements(vendor: str, *, concurrently: bool = True) -> list[str]:
    c = "CONCURRENTLY " if concurrently and vendor == "postgresql" else ""
    return [f"CREATE INDEX {c}IF NOT EXISTS traj_project_agent_model_id ON {TABLE} (project_id, agent, model_version, id DESC)"]


def forwards(apps, schema_editor):
    for sql in statements(schema_editor.connection.vendor):
        schema_editor.execute(sql)


def backwards(apps, schema_editor):
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(f"DROP INDEX {concurrently}IF EXISTS traj_project_agent_model_id")


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [("trajectories", "0003_review_indexes")]

    operations = [migrations.RunPython(forwards, backwards, elidable=False)]
