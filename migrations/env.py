"""Alembic environment for schema ``pgq``.

Invariants:

* The whole upgrade runs in one transaction under a session advisory lock, so
  several processes migrating the same database at once are serialised and the
  losers find the work done.
* Alembic's version table lives in schema ``pgq`` (``pgq.alembic_version``),
  next to the objects it versions; the schema is created here first because
  alembic writes that table before the first revision runs.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import text

from pgq.schema import metadata

MIGRATION_LOCK_KEY = 0x70677100  # "pgq\0": one advisory lock for all migrators


def run_migrations_online() -> None:
    connection = context.config.attributes["connection"]
    connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
    try:
        connection.execute(text("CREATE SCHEMA IF NOT EXISTS pgq"))
        connection.commit()
        context.configure(
            connection=connection,
            target_metadata=metadata,
            version_table_schema="pgq",
            include_schemas=True,
            transaction_per_migration=False,
        )
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()
    finally:
        connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY})
        connection.commit()


if context.is_offline_mode():
    raise SystemExit("pgq migrations run online only: use `pgq migrate --dsn ...`")
run_migrations_online()
