"""Indexes the review list needs at a million rows, beyond those the model declares.

- the effective outcome (a reviewer's outcome wins over the agent's): an expression index, so the outcome
  filter and the capped per-outcome counts are index scans; on PostgreSQL it INCLUDEs the two columns
  so that counts are index-only scans;
- trajectories with a tool error: a partial index, small because errors are the minority;
- text in messages: a pg_trgm GIN index on search_text, so `LIKE '%needle%'` does not read every row.
  PostgreSQL only; on SQLite (one machine, small data) text search scans.

The SQL is raw because the model cannot declare INCLUDE, opclasses and an extension portably; the
expression must stay identical to `selectors.EFFECTIVE_OUTCOME`. Indexes are built CONCURRENTLY on
PostgreSQL, so migrating a live database does not lock out ingestion."""

from django.db import migrations

TABLE = "trajectories_trajectory"
EFFECTIVE = "COALESCE(NULLIF(reviewed_outcome, ''), outcome)"


def statements(vendor: str, *, concurrently: bool = True) -> list[str]:
    """The SQL that builds the indexes (bench/pages.py runs it without CONCURRENTLY on a fresh table)."""
    if vendor != "postgresql":
        return [
            f"CREATE INDEX IF NOT EXISTS traj_project_effoutcome_id ON {TABLE} (project_id, ({EFFECTIVE}), id DESC)",
            f"CREATE INDEX IF NOT EXISTS traj_project_toolerr_id ON {TABLE} (project_id, id DESC) WHERE has_tool_error",
        ]
    c = "CONCURRENTLY " if concurrently else ""
    return [
        "CREATE EXTENSION IF NOT EXISTS pg_trgm",
        f"CREATE INDEX {c}IF NOT EXISTS traj_project_effoutcome_id ON {TABLE} "
        f"(project_id, ({EFFECTIVE}), id DESC) INCLUDE (reviewed_outcome, outcome)",
        f"CREATE INDEX {c}IF NOT EXISTS traj_project_toolerr_id ON {TABLE} (project_id, id DESC) WHERE has_tool_error",
        f"CREATE INDEX {c}IF NOT EXISTS traj_search_trgm ON {TABLE} USING gin (search_text gin_trgm_ops)",
    ]


def forwards(apps, schema_editor):
    for sql in statements(schema_editor.connection.vendor):
        schema_editor.execute(sql)


def backwards(apps, schema_editor):
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    for name in ("traj_search_trgm", "traj_project_toolerr_id", "traj_project_effoutcome_id"):
        schema_editor.execute(f"DROP INDEX {concurrently}IF EXISTS {name}")


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [("trajectories", "0002_upload")]

    operations = [migrations.RunPython(forwards, backwards, elidable=False)]
