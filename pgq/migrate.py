"""Applying the alembic migrations of schema ``pgq`` to a database.

:func:`migrate` is the only way pgq creates or changes its schema (the CLI's
``pgq migrate`` calls it; the client calls it for the embedded server).
:data:`SCHEMA_VERSION` is the revision this library's SQL is written for; a
test keeps it equal to the newest alembic revision, so a client can check a
database with one cheap query instead of importing alembic.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from .backoff import doubling
from .errors import SchemaNotReadyError, first_line

__all__ = ["SCHEMA_VERSION", "migrate", "schema_version", "check_schema"]

SCHEMA_VERSION = "0020"

# Alembic keeps its migration context in module globals: two migrations in
# one process must not overlap (processes are serialised by an advisory lock).
_in_process = threading.Lock()


def _alembic_config() -> Any:
    import importlib

    from alembic.config import Config

    migrations = importlib.import_module("pgq.migrations")  # installed from migrations/
    config = Config()
    config.set_main_option("script_location", str(Path(str(migrations.__file__)).parent))
    return config


def head_revision() -> str:
    """The newest revision shipped with this library, read from the scripts."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
    assert head is not None
    return head


def migrate(dsn: str, revision: str = "head", lock_wait: float = 60.0) -> str:
    """Upgrade the database at ``dsn`` to ``revision``; return the revision it is at.

    Safe to run concurrently from several processes (an advisory lock
    serialises them) and idempotent. A database already at the newest
    revision costs one query (alembic is not even imported). A statement
    that cannot take its lock within 2 s (another session's long
    transaction) makes the upgrade roll back and try again, for up to
    ``lock_wait`` seconds, rather than stall every call behind it.
    """
    from .connecting import first_connection

    if revision == "head":
        _, version = first_connection([dsn], schema_version)
        if version == SCHEMA_VERSION:
            return version
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    engine = create_engine(
        "postgresql+psycopg://", creator=lambda: psycopg.connect(dsn), poolclass=NullPool
    )
    from alembic.util.exc import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    config = _alembic_config()
    try:
        with _in_process:
            _upgrade(engine, config, revision, lock_wait)
    except CommandError as exc:  # a revision this library does not know: a newer pgq's
        raise SchemaNotReadyError(
            f"cannot migrate the database to {revision}: {exc}. If a newer pgq migrated it, "
            "upgrade pgq here too (pip install -U pgq-disque)") from exc
    except SQLAlchemyError as exc:  # the database refused (no CREATE right, say)
        cause = getattr(exc, "orig", None) or exc
        first = first_line(cause)
        raise SchemaNotReadyError(
            f"the database refused the migration: {first} (a role that owns the database, or "
            "may CREATE in it, must run `pgq migrate` once)") from exc
    finally:
        engine.dispose()
    return first_connection([dsn], schema_version)[1] or ""


def _upgrade(engine: Any, config: Any, revision: str, lock_wait: float) -> None:
    """``alembic upgrade``, tried again while a lock it needs is held elsewhere."""
    from alembic import command
    from sqlalchemy.exc import OperationalError

    deadline = time.monotonic() + lock_wait
    attempt = 0
    while True:
        try:
            with engine.connect() as connection:
                config.attributes["connection"] = connection
                command.upgrade(config, revision)
            return
        except OperationalError as exc:
            if not isinstance(exc.orig, psycopg.errors.LockNotAvailable):
                raise
            if time.monotonic() >= deadline:
                raise SchemaNotReadyError(
                    f"the migration waited {lock_wait:g} s for a lock on pgq's tables that "
                    f"another session holds ({first_line(exc.orig)}): end that session's "
                    "long transaction (pg_stat_activity shows it), or run `pgq migrate` "
                    "when the queue is quiet") from exc
            time.sleep(min(doubling(0.5, attempt, 5.0), max(deadline - time.monotonic(), 0)))
            attempt += 1


def schema_version(conn: psycopg.Connection) -> str | None:
    """The revision the database is at, or None if pgq was never migrated there."""
    from .statements import HAS_SCHEMA, SCHEMA_AND_NODE

    if not conn.execute(HAS_SCHEMA).fetchone()[0]:  # type: ignore[index]
        return None
    return conn.execute(SCHEMA_AND_NODE).fetchone()[0]  # type: ignore[index,no-any-return]


def check_schema(version: str | None, dsn_hint: str = "DSN") -> None:
    """Raise :class:`SchemaNotReadyError` unless ``version`` is what this library needs."""
    if version == SCHEMA_VERSION:
        return
    if version is None:
        raise SchemaNotReadyError(
            f"the database has no pgq schema: run `pgq migrate --dsn {dsn_hint}` "
            "or pgq.migrate(dsn) once (or pass migrate=True to the client)"
        )
    if version > SCHEMA_VERSION:  # revisions are zero-padded numbers: they sort as text
        raise SchemaNotReadyError(
            f"the database's pgq schema is at revision {version}, newer than this library's "
            f"{SCHEMA_VERSION}: a newer pgq migrated it; upgrade pgq here too "
            "(pip install -U pgq-disque)")
    raise SchemaNotReadyError(
        f"the database's pgq schema is at revision {version}, this library needs "
        f"{SCHEMA_VERSION}: run `pgq migrate --dsn {dsn_hint}` or pgq.migrate(dsn)"
    )
