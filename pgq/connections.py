"""Turning a caller's ``conn=`` argument into the psycopg connection under it.

pgq runs its statements on the caller's own connection so that they commit or
roll back with the caller's business writes. Accepted:

* sync: :class:`psycopg.Connection`, SQLAlchemy ``Connection`` or ORM
  ``Session`` on the ``postgresql+psycopg`` driver;
* async: :class:`psycopg.AsyncConnection`, SQLAlchemy ``AsyncConnection`` or
  ``AsyncSession`` on the ``postgresql+psycopg`` driver.

A SQLAlchemy session is asked for its connection, and a SQLAlchemy
connection's transaction is begun if none is open (so that its ``commit()``
commits pgq's statements too); pgq never commits, rolls back or flushes it.
The statements run with tuple rows and server-side parameters whatever the
connection's row and cursor factories (pgq.driver).
Anything else raises :class:`~pgq.errors.InvalidTypeError` saying what is
accepted.
"""

from __future__ import annotations

from typing import Any

import psycopg

from .errors import InvalidTypeError

__all__ = ["sync_connection", "async_connection"]

_SYNC_HELP = (
    "conn must be a psycopg.Connection, or a SQLAlchemy Connection/Session using the "
    "'postgresql+psycopg' driver"
)
_ASYNC_HELP = (
    "conn must be a psycopg.AsyncConnection, or a SQLAlchemy AsyncConnection/AsyncSession "
    "using the 'postgresql+psycopg' driver"
)


def _driver_connection(sa_connection: Any) -> Any:
    # SQLAlchemy begins its transaction on its own execute() only: pgq's
    # statements ran in a server transaction SQLAlchemy did not know of,
    # its commit() did nothing, and the pool rolled them back (an add or an
    # ack "committed" and lost; found by a read-only review).
    if not sa_connection.in_transaction():
        sa_connection.begin()
    fairy = sa_connection.connection
    return getattr(fairy, "driver_connection", None)


def sync_connection(conn: object) -> psycopg.Connection[Any]:
    """The psycopg connection behind ``conn`` (see module doc)."""
    if isinstance(conn, psycopg.Connection):
        return conn
    if isinstance(conn, psycopg.AsyncConnection):
        raise InvalidTypeError(f"{_SYNC_HELP}; use pgq.AsyncClient for async connections")
    try:
        from sqlalchemy.engine import Connection as SAConnection
        from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
        from sqlalchemy.ext.asyncio import AsyncSession as SAAsyncSession
        from sqlalchemy.orm import Session as SASession
        from sqlalchemy.orm import scoped_session
    except ImportError:  # pragma: no cover - SQLAlchemy is a dependency
        raise InvalidTypeError(_SYNC_HELP) from None
    if isinstance(conn, scoped_session):  # Flask-SQLAlchemy's db.session: its Session
        conn = conn()
    if isinstance(conn, (SAAsyncSession, SAAsyncConnection)):
        raise InvalidTypeError(f"{_SYNC_HELP}; use pgq.AsyncClient for an {type(conn).__name__}")
    if isinstance(conn, SASession):
        conn = conn.connection()
    if isinstance(conn, SAConnection):
        raw = _driver_connection(conn)
        if isinstance(raw, psycopg.Connection):
            return raw
        if isinstance(raw, psycopg.AsyncConnection):  # a Session of AsyncSession.run_sync
            raise InvalidTypeError(f"{_SYNC_HELP}; this one runs on an async psycopg "
                                   "connection: use pgq.AsyncClient (outside run_sync)")
        raise InvalidTypeError(f"{_SYNC_HELP}; this one uses {type(raw).__module__}")
    raise InvalidTypeError(f"{_SYNC_HELP}, not {type(conn).__name__}")


async def async_connection(conn: object) -> psycopg.AsyncConnection[Any]:
    """The psycopg async connection behind ``conn`` (see module doc)."""
    if isinstance(conn, psycopg.AsyncConnection):
        return conn
    if isinstance(conn, psycopg.Connection):
        raise InvalidTypeError(f"{_ASYNC_HELP}; use pgq.Client for sync connections")
    try:
        from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
        from sqlalchemy.ext.asyncio import AsyncSession as SAAsyncSession
        from sqlalchemy.ext.asyncio import async_scoped_session
    except ImportError:  # pragma: no cover
        raise InvalidTypeError(_ASYNC_HELP) from None
    if isinstance(conn, async_scoped_session):
        conn = conn()
    if isinstance(conn, SAAsyncSession):
        conn = await conn.connection()
    if isinstance(conn, SAAsyncConnection):
        if not conn.in_transaction():  # as _driver_connection
            await conn.begin()
        raw = (await conn.get_raw_connection()).driver_connection
        if isinstance(raw, psycopg.AsyncConnection):
            return raw
        raise InvalidTypeError(f"{_ASYNC_HELP}; this one uses {type(raw).__module__}")
    raise InvalidTypeError(f"{_ASYNC_HELP}, not {type(conn).__name__}")
