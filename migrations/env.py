"""Alembic environment for schema ``pgq``.

Invariants:

* The whole upgrade runs in one transaction under a transaction-level
  advisory lock, so several processes migrating the same database at once
  are serialised and the losers find the work done. Everything it takes or
  sets (the lock, ``lock_timeout``) ends with that transaction: behind
  PgBouncer in transaction mode, a session lock and a plain SET, taken and
  undone in separate transactions, stayed with whichever server connection
  ran them, and every later migration waited for that lock with no timeout
  (found by a read-only review).
* Alembic's version table lives in schema ``pgq`` (``pgq.alembic_version``),
  next to the objects it versions; the schema is created first, in the same
  transaction (only when missing: a role that owns the schemas ``pgq`` and
  ``pgq_staging``, made by revision 0004, but may not create schemas in the
  database, like the embedded server's ``pgq``, can still migrate) because
  alembic writes that table before the first revision runs.
* A schema ``pgq`` that holds objects but no ``pgq.alembic_version`` is not
  ours (Skytools PgQ uses the same name): nothing is touched and the
  migration stops with :class:`~pgq.errors.SchemaNotReadyError`.
* The upgrade waits at most ``LOCK_TIMEOUT`` for each lock it takes (set
  once the advisory lock is held, which may be waited for as long as
  another migration takes). A DDL statement waiting behind a long
  transaction (a Spark read, a caller's open transaction) made every
  claim, add and ack queue behind it; now it gives up, rolls back, and
  :func:`pgq.migrate` tries again a little later.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import text

from pgq.errors import SchemaNotReadyError
from pgq.schema import metadata

MIGRATION_LOCK_KEY = 0x70677100  # "pgq\0": one advisory lock for all migrators
LOCK_TIMEOUT = "2s"


FOREIGN_OBJECTS = """
SELECT (SELECT count(*) FROM pg_class WHERE relnamespace = 'pgq'::regnamespace)
     + (SELECT count(*) FROM pg_proc WHERE pronamespace = 'pgq'::regnamespace),
       to_regclass('pgq.alembic_version') IS NOT NULL
"""


def _claim_schema(connection) -> None:  # type: ignore[no-untyped-def]
    exists = connection.execute(
        text("SELECT 1 FROM pg_namespace WHERE nspname = 'pgq'")).scalar()
    if not exists:
        connection.execute(text("CREATE SCHEMA pgq"))
        return
    objects, ours = connection.execute(text(FOREIGN_OBJECTS)).one()
    if objects and not ours:
        raise SchemaNotReadyError(
            "this database already has a schema named pgq that pgq did not create "
            f"({objects} tables and functions, no pgq.alembic_version: Skytools PgQ uses "
            "that name too). Nothing was changed. Use another database for pgq, or drop "
            "or rename that schema if it is unused (ALTER SCHEMA pgq RENAME TO ...)")


def run_migrations_online() -> None:
    connection = context.config.attributes["connection"]
    try:
        # No timeout on this wait: another migration may take a while.
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        connection.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
        _claim_schema(connection)
        context.configure(
            connection=connection,
            target_metadata=metadata,
            version_table_schema="pgq",
            include_schemas=True,
            transaction_per_migration=False,
        )
        with context.begin_transaction():  # in ours already: alembic runs inside it
            context.run_migrations()
        connection.commit()
    except BaseException:
        connection.rollback()
        raise


if context.is_offline_mode():
    raise SystemExit("pgq migrations run online only: use `pgq migrate --dsn ...`")
run_migrations_online()
