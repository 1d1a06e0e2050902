"""Drivers: run a :mod:`pgq.commands` generator on one psycopg connection.

:class:`SyncDriver` and :class:`AsyncDriver` are the only places where pgq's
commands meet I/O; they are deliberately small mirrors of each other.

Invariants (see :mod:`pgq.protocol`):

* Statements run in the order the command yields them, on one connection;
  except that a driver given ``lend`` (a pooled connection) hands it back
  to its pool for a :class:`~pgq.protocol.Wait` made outside a transaction
  with no LISTEN on it, and goes on with the connection it gets back: a
  blocked GET does not hold one of the pool's connections.
* On connections pgq owns (pooled, autocommit) hot statements are prepared
  server-side; on a caller's connection psycopg's default applies.
* :class:`~pgq.protocol.Begin`/:class:`~pgq.protocol.Commit` open and close
  a transaction only when the connection is in autocommit mode; inside a
  caller's transaction they do nothing (the caller's transaction is the unit
  that commits or rolls back). A command that fails inside such a group gets
  the group rolled back before the error propagates.
* After :class:`~pgq.protocol.Listen`, the waiter registration and LISTEN are
  undone before the connection is returned, whatever happens; if the
  connection is broken there is nothing to undo (the pool discards it and the
  sweep forgets the stale waiter row). An :class:`AsyncDriver` given the
  client's shared listener (:mod:`pgq.listener`) takes a ticket there
  instead, and gives it back the same way.
* :class:`~pgq.protocol.PeerWrite` goes to the client's peer pools
  (:mod:`pgq.peers`); a driver without them is never given one (its
  session says ``direct=False``).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.lowlevel
import psycopg
from psycopg.pq import ExecStatus
from psycopg.rows import tuple_row

from . import cancelsafe
from . import statements as sql
from .contracts import JOBS_CHANNEL, REPLICATION_CHANNEL_PREFIX
from .protocol import (
    Begin,
    Command,
    Commit,
    Copy,
    Housekeeping,
    Listen,
    ListenReplication,
    PeerWrite,
    Query,
    Request,
    Result,
    Rollback,
    Wait,
)

if TYPE_CHECKING:
    from .listener import SharedListener, SyncSharedListener, Ticket
    from .peers import AsyncPeerPools, PeerPools

__all__ = ["SyncDriver", "AsyncDriver", "CHANNEL"]

T = TypeVar("T")
CHANNEL = JOBS_CHANNEL  # kept under its shipped name

TUPLES_OK = ExecStatus.TUPLES_OK

# Connections already listening on their private replication channel.
_replication_listeners: weakref.WeakSet[Any] = weakref.WeakSet()


def replication_channel(conn: Any) -> str:
    return f"{REPLICATION_CHANNEL_PREFIX}{conn.info.backend_pid}"


def _has_rows(cursor: Any) -> bool:
    """Whether the statement returned rows (even none). Read off the result's
    status: ``cursor.description`` answers the same but builds a column
    object per column first, 7 per statement here (about 4% of a lone
    get+ack's client CPU)."""
    result = cursor.pgresult
    return result is not None and result.status == TUPLES_OK


def extract(cursor: Any, result: Result, rows: list[Any] | None) -> Any:
    if result is Result.ROWS:
        return rows if rows is not None else []
    if result is Result.ROW:
        return rows[0] if rows else None
    if result is Result.VALUE:
        return rows[0][0] if rows else None
    if result is Result.ROWCOUNT:
        return cursor.rowcount
    return None


def _cursor(conn: psycopg.Connection[Any]) -> tuple[psycopg.Cursor[Any], bool]:
    """A cursor whose rows are tuples and whose parameters the server binds,
    whatever the connection's own factories: a caller's connection (conn=)
    may have a dict row factory (a row unpacked into its column names: an
    add returned the ID "existing", a claim committed then failed, leaving
    its job leased) or Django's ClientCursor (the smallest bigint inlined as
    ``-9223372036854775808::bigint`` overflows: every full-walk claim
    failed). Found by a read-only review. The flag: whether the connection's
    cursor class is psycopg's default (else pgq prepares nothing there)."""
    if conn.row_factory is tuple_row and conn.cursor_factory is psycopg.Cursor:
        return conn.cursor(), True
    return psycopg.Cursor(conn, row_factory=tuple_row), conn.cursor_factory is psycopg.Cursor


def _async_cursor(conn: psycopg.AsyncConnection[Any]) -> tuple[psycopg.AsyncCursor[Any], bool]:
    """As :func:`_cursor`, for async connections."""
    if conn.row_factory is tuple_row and conn.cursor_factory is psycopg.AsyncCursor:
        return conn.cursor(), True
    return (psycopg.AsyncCursor(conn, row_factory=tuple_row),
            conn.cursor_factory is psycopg.AsyncCursor)


class SyncDriver:
    """Runs commands on a blocking :class:`psycopg.Connection`."""

    def __init__(self, conn: psycopg.Connection[Any], *, prepare: bool = True,
                 housekeeping: Callable[[psycopg.Connection[Any]], None] | None = None,
                 peers: PeerPools | None = None, listener: SyncSharedListener | None = None,
                 ticket: Ticket | None = None,
                 lend: Callable[[Callable[[], object]], psycopg.Connection[Any]] | None = None) -> None:
        self.conn = conn
        self.lend = lend  # as in AsyncDriver (pgq.client._Lease)
        self.prepare = prepare if prepare else None
        self.housekeeping = housekeeping
        self.peers = peers
        # The client's shared LISTEN connection (pgq.listener), as in AsyncDriver.
        self.listener = listener
        self._early = ticket
        self._ticket: Ticket | None = None
        self._transactions: list[Any] = []  # open transaction contexts (nested: savepoints)
        self._listening = False
        self._replicating = False

    def run(self, command: Command[T]) -> T:
        reply: Any = None
        try:
            while True:
                try:
                    request = command.send(reply)
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]
                reply = self._handle(request)
        except BaseException as exc:
            self._abandon_transaction(exc)
            raise
        finally:
            command.close()
            self._stop_listening()

    def _handle(self, request: Request) -> Any:
        conn = self.conn
        if isinstance(request, Query):
            cursor, plain = _cursor(conn)
            # Not prepared where the caller's own cursors would not be (a
            # ClientCursor, as Django's behind PgBouncer): prepare=False.
            cursor.execute(request.sql, request.params, prepare=self.prepare if plain else False)
            rows = cursor.fetchall() if _has_rows(cursor) else None
            return extract(cursor, request.result, rows)
        if isinstance(request, Begin):
            if conn.autocommit or self._transactions:
                transaction = conn.transaction()
                transaction.__enter__()
                self._transactions.append(transaction)
            return None
        if isinstance(request, Commit):
            if self._transactions:
                self._transactions.pop().__exit__(None, None, None)
            return None
        if isinstance(request, Rollback):
            if self._transactions:
                self._transactions.pop().__exit__(psycopg.Rollback, psycopg.Rollback(), None)
            return None
        if isinstance(request, PeerWrite):
            if self.peers is None:
                raise TypeError("this driver has no peer connections (session.direct is False)")
            return self.peers.write(request.sql, request.writes, request.timeout)
        if isinstance(request, Copy):
            with conn.cursor().copy(request.sql) as copy:
                for chunk in request.data:
                    copy.write(chunk)
            return None
        if isinstance(request, Listen):
            if self.listener is not None:
                if self._early is not None:
                    self._ticket, self._early = self._early, None
                    return self.listener.listened(self._ticket)
                self._ticket = self.listener.subscribe(request.queues, request.within)
                return None
            conn.execute(sql.REGISTER_WAITER, {"queues": list(request.queues)})
            conn.execute(f"LISTEN {CHANNEL}")
            self._listening = True
            return None
        if isinstance(request, ListenReplication):
            if conn not in _replication_listeners:
                conn.execute(f"LISTEN {replication_channel(conn)}")
                _replication_listeners.add(conn)
            self._replicating = True  # this command waits for notifications on conn
            return None
        if isinstance(request, Wait):
            ticket, listener, seconds = self._ticket, self.listener, request.seconds
            if ticket is not None and listener is not None:
                self._idle(lambda: listener.wait(ticket, seconds))
                return []
            # This command's own LISTEN only: a pooled connection that once
            # waited for copies LISTENs for good, and any later wait on it
            # (wait_job, wait_result, a keyed add's) held it to the end,
            # never lent: ten such waits took a pool of ten (found by a review).
            if self._listening or self._replicating:
                # notifications that arrived between statements wait in
                # psycopg's backlog and come first
                return [(n.channel, n.payload)
                        for n in conn.notifies(timeout=seconds, stop_after=1)]
            self._idle(lambda: time.sleep(seconds))
            return []
        if isinstance(request, Housekeeping):
            if self.housekeeping is not None and not self._transactions:
                self.housekeeping(conn)
            return None
        raise TypeError(f"unknown request {request!r}")

    def _idle(self, waiting: Callable[[], object]) -> None:
        """Wait; with the connection lent back when it holds nothing."""
        # (Not `conn in _replication_listeners`: a pooled connection that
        # once waited for copies LISTENs for good, and would never be lent.)
        if self.lend is None or self._transactions or self._listening or self._replicating:
            waiting()
        else:
            self.conn = self.lend(waiting)

    def _abandon_transaction(self, exc: BaseException) -> None:
        while self._transactions:
            transaction = self._transactions.pop()
            with contextlib.suppress(Exception):
                transaction.__exit__(type(exc), exc, exc.__traceback__)

    def _stop_listening(self) -> None:
        if self._ticket is not None and self.listener is not None:
            self.listener.leave(self._ticket)
            self._ticket = None
        if not self._listening:
            return
        self._listening = False
        if self.conn.closed or self.conn.broken:
            return
        with contextlib.suppress(psycopg.Error):
            self.conn.execute(f"UNLISTEN {CHANNEL}")
            self.conn.execute(sql.UNREGISTER_WAITER)


class AsyncDriver:
    """Runs commands on a :class:`psycopg.AsyncConnection` (mirror of :class:`SyncDriver`).

    With ``shield=True`` (pgq's own connections) each request finishes even
    if the calling task is cancelled meanwhile, by anyio or by asyncio's own
    ``Task.cancel()`` (:mod:`pgq.cancelsafe`); the cancellation takes effect
    between requests, outside pgq's own transactions. asyncio's, which must
    not be swallowed, is raised when the command ends after a claim,
    carrying the claimed jobs for the client to put back. A statement cancelled half-way would make psycopg close
    the connection and leave our waiter registration behind; statements are
    short, so the delay is milliseconds. Blocking waits are not shielded.
    """

    def __init__(self, conn: psycopg.AsyncConnection[Any], *, prepare: bool = True,
                 housekeeping: Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]] | None = None,
                 shield: bool = False, peers: AsyncPeerPools | None = None,
                 listener: SharedListener | None = None, ticket: Ticket | None = None,
                 lend: Callable[[Callable[[], Awaitable[object]]],
                                Awaitable[psycopg.AsyncConnection[Any]]] | None = None) -> None:
        self.conn = conn
        # Waits outside a transaction, with no LISTEN on this connection,
        # run through `lend`: the connection goes back to its pool meanwhile
        # and the command goes on with the one it returns (pgq.aio._Lease).
        self.lend = lend
        # The client's shared LISTEN connection for blocked GETs (pgq.listener);
        # None: this connection registers and LISTENs itself. `ticket`: one
        # joined before the command's first claim (SharedListener.join_early).
        self.listener = listener
        self._early = ticket
        self._ticket: Ticket | None = None
        self.prepare = prepare if prepare else None
        self.housekeeping = housekeeping
        self.peers = peers
        self.shield = shield
        self._transactions: list[Any] = []  # open transaction contexts (nested: savepoints)
        self._listening = False
        self._collecting = False
        self._received: list[psycopg.Notify] = []
        # asyncio's cancellation of the task, held off by a shielded request
        # until a cancellation may be taken (pgq.cancelsafe).
        self._cancelled: BaseException | None = None

    async def run(self, command: Command[T]) -> T:
        try:
            try:
                value, delivered = await self._drive(command)
            finally:
                command.close()
                await self._stop_listening()
        except BaseException as exc:
            cancelled = self._cancelled
            if cancelled is not None and cancelled is not exc:
                # asyncio's, held off, then an error (MAXLEN after the
                # commit, a broken connection the client would retry): the
                # cancellation goes on, or the task ran on uncancelled.
                raise cancelled from exc
            raise
        cancelled = self._cancelled
        if cancelled is not None:  # asyncio's, held off: it goes on now
            if delivered:
                cancelsafe.attach(cancelled, value)  # the client puts the jobs back
            raise cancelled
        return value

    async def _drive(self, command: Command[T]) -> tuple[T, bool]:
        """Run the command; its value, and whether a claim's jobs are in it."""
        reply: Any = None
        delivered = False  # a claim returned: see below
        rolled_back = False  # pgq's own transaction ended by a rollback, and no other began
        try:
            while True:
                try:
                    request = command.send(reply)
                except StopIteration as done:
                    return done.value, delivered
                if isinstance(request, Wait) or not self.shield or (
                        isinstance(request, Listen) and self.listener is not None):
                    # A wait: cancellable. Joining the shared listener is one
                    # (it waits for the listener's task to register the
                    # queues, which a locked pgq.waiters holds for as long).
                    delivered = False  # a command that waits has handed nothing out
                    self._stop_if_cancelled()
                    reply = await self._handle(request)
                    continue
                if not self._transactions and not delivered and not rolled_back:
                    # A cancellation is taken before a statement, never
                    # between one and the command's use of its reply, nor
                    # after a claim (Query.delivers) until the command ends
                    # or waits: the claimed jobs reach the caller (taken
                    # there, they went to nobody, and a retry-0 job was
                    # lost). Inside pgq's own transaction it waits for the
                    # end (short): between the direct copies and the commit
                    # of this node's rows it would leave copies behind
                    # whose origin never committed. Nor after a rollback
                    # (until another transaction begins): what follows it
                    # undoes what the transaction left elsewhere (the
                    # withdrawal of direct copies from the peers, then the
                    # record of what it missed; found by read-only reviews).
                    self._stop_if_cancelled()
                    await anyio.lowlevel.checkpoint_if_cancelled()
                reply = await self._shielded(self._handle, request)
                delivered = delivered or (isinstance(request, Query) and request.delivers)
                if isinstance(request, (Rollback, Begin)):
                    rolled_back = isinstance(request, Rollback)
        except BaseException as exc:
            await self._abandon_transaction(exc)
            raise

    async def _shielded(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run to the end whatever cancels the task; asyncio's cancellation
        (which passes anyio's shields) is kept for the next point where a
        cancellation may be taken (pgq.cancelsafe)."""
        value, cancelled = await cancelsafe.finish(fn, *args)
        self._hold_off(cancelled)
        return value

    def _hold_off(self, cancelled: BaseException | None) -> None:
        """Keep asyncio's cancellation (the first) for when one may be taken."""
        if cancelled is not None and self._cancelled is None:
            self._cancelled = cancelled

    def _stop_if_cancelled(self) -> None:
        if self._cancelled is not None:
            cancelled, self._cancelled = self._cancelled, None
            raise cancelled

    async def _handle(self, request: Request) -> Any:
        conn = self.conn
        if isinstance(request, Query):
            cursor, plain = _async_cursor(conn)
            await cursor.execute(request.sql, request.params, prepare=self.prepare if plain else False)
            rows = await cursor.fetchall() if _has_rows(cursor) else None
            return extract(cursor, request.result, rows)
        if isinstance(request, Begin):
            if conn.autocommit or self._transactions:
                transaction = conn.transaction()
                await transaction.__aenter__()
                self._transactions.append(transaction)
            return None
        if isinstance(request, Commit):
            if self._transactions:
                await self._transactions.pop().__aexit__(None, None, None)
            return None
        if isinstance(request, Rollback):
            if self._transactions:
                await self._transactions.pop().__aexit__(psycopg.Rollback, psycopg.Rollback(), None)
            return None
        if isinstance(request, PeerWrite):
            if self.peers is None:
                raise TypeError("this driver has no peer connections (session.direct is False)")
            return await self.peers.write(request.sql, request.writes, request.timeout)
        if isinstance(request, Copy):
            async with conn.cursor().copy(request.sql) as copy:
                for chunk in request.data:
                    await copy.write(chunk)
            return None
        if isinstance(request, Listen):
            if self.listener is not None:
                if self._early is not None:
                    self._ticket, self._early = self._early, None
                    return self.listener.listened(self._ticket)
                self._ticket = await self.listener.subscribe(request.queues, request.within)
                return None
            await conn.execute(sql.REGISTER_WAITER, {"queues": list(request.queues)})
            await conn.execute(f"LISTEN {CHANNEL}")
            self._collect()
            self._listening = True
            return None
        if isinstance(request, ListenReplication):
            self._collect()
            if conn not in _replication_listeners:
                await conn.execute(f"LISTEN {replication_channel(conn)}")
                _replication_listeners.add(conn)
            return None
        if isinstance(request, Wait):
            ticket, listener, seconds = self._ticket, self.listener, request.seconds
            if ticket is not None and listener is not None:
                await self._idle(lambda: listener.wait(ticket, seconds))
                return []
            if self._collecting:
                return await self._wait_for_notification(seconds)
            await self._idle(lambda: anyio.sleep(seconds))
            return []
        if isinstance(request, Housekeeping):
            if self.housekeeping is not None and not self._transactions:
                await self.housekeeping(self.conn)
            return None
        raise TypeError(f"unknown request {request!r}")

    async def _idle(self, waiting: Callable[[], Awaitable[object]]) -> None:
        """Wait; with the connection lent back when it holds nothing."""
        if self.lend is None or self._transactions or self._listening or self._collecting:
            await waiting()
        else:
            self.conn = await self.lend(waiting)

    def _collect(self) -> None:
        if not self._collecting:
            self.conn.add_notify_handler(self._received.append)
            self._collecting = True

    async def _wait_for_notification(self, seconds: float) -> list[tuple[str, str]]:
        # Wait on the socket with nothing in flight, so that a cancelled wait
        # (a timeout in the caller's task) leaves the connection usable;
        # psycopg's notifies() would have to abort a query and close it.
        if not self._received:
            readable = False
            with anyio.move_on_after(seconds):
                await anyio.wait_readable(self.conn.fileno())
                readable = True
            if readable:  # reads what arrived, runs the handler
                await self._shielded(self.conn.execute, "SELECT 1")
        received = [(n.channel, n.payload) for n in self._received]
        self._received.clear()
        return received

    async def _abandon_transaction(self, exc: BaseException) -> None:
        while self._transactions:
            transaction = self._transactions.pop()
            with contextlib.suppress(Exception):
                await self._shielded(transaction.__aexit__, type(exc), exc, exc.__traceback__)

    async def _stop_listening(self) -> None:
        if self._ticket is not None and self.listener is not None:
            self.listener.leave(self._ticket)
            self._ticket = None
        if self._collecting:
            self._collecting = False
            self.conn.remove_notify_handler(self._received.append)
        if not self._listening:
            return
        self._listening = False
        if self.conn.closed or self.conn.broken:
            return
        # Never raises a cancellation here (run() raises it, with what the
        # command returned): asyncio's is kept like a request's.
        ok, error, cancelled = await cancelsafe.settle(self._unlisten)
        self._hold_off(cancelled)
        if not ok and not isinstance(error, psycopg.Error):
            assert isinstance(error, BaseException)
            raise error

    async def _unlisten(self) -> None:
        await self.conn.execute(f"UNLISTEN {CHANNEL}")
        await self.conn.execute(sql.UNREGISTER_WAITER)
