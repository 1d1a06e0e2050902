"""Connections to other nodes' databases: where a client writes copies itself.

A synchronous replicated add whose peers advertised their databases
(``pgq.nodes.dsn``, learnt by the node process over the bus) stores its
copies there directly, all peers at once, before committing its own row
(:func:`pgq.commands._add_direct`); the drivers run that step, a
:class:`pgq.protocol.PeerWrite`, through the classes here. A few
connections per peer DSN, opened when first needed and closed with the
client.

Invariants:

* A write is one statement in autocommit mode: its own transaction,
  committed (durably, unless the client is in turbo mode) when the
  statement returns. Its rows count only then.
* A peer write never raises: a failure (refused, unreachable, an error, no
  answer within the timeout) is returned as that peer's exception, and the
  command decides (it goes through the node process instead).
* A peer that hangs cannot hold a caller longer than the timeout: the sync
  writes are sent from the calling thread and waited for together, up to
  the timeout (:mod:`pgq.multiplex`), and a connection given up on is
  closed; the async ones are tasks the caller stops waiting for. Nor can
  a hung write hold a peer's server for long: it ends a statement after
  ``STATEMENT_TIMEOUT`` (and a lock wait after ``LOCK_TIMEOUT``), shorter
  than a caller's timeout, so a write the caller gave up on has most likely
  been rolled back by then; and every connection has TCP keepalives and a
  TCP user timeout, so one to a peer that went silent fails within seconds
  and is not used again.
* A peer's connections unused for ``IDLE_POOL`` seconds are closed (peers come and go, and
  change their DSN when they restart).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import anyio
import psycopg

from . import multiplex
from .protocol import PeerUnreached
from .statements import SESSION_OPTIONS, TURBO_OPTIONS

__all__ = ["PeerPools", "AsyncPeerPools", "PeerTimeout"]

log = logging.getLogger("pgq")

Writes = tuple[tuple[str, str, Mapping[str, Any]], ...]

# Per peer: a caller's writes are short, and a client's callers share them
# through the replicated batch (pgq.commands), so few connections suffice.
PEER_POOL_SIZE = 4
# What a connection to a peer may take, and how soon a dead one is noticed
# (libpq keepalive and TCP user timeout settings, seconds / milliseconds).
CONNECT_TIMEOUT = 3
KEEPALIVES = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
              "keepalives_count": 2, "tcp_user_timeout": 5000}
# Milliseconds: below pgq.commands.DIRECT_TIMEOUT (2 s), which callers wait.
STATEMENT_TIMEOUT = 1500
LOCK_TIMEOUT = 1000
IDLE_POOL = 60.0


class PeerTimeout(Exception):
    """A peer's database did not answer a direct write in time."""


def _kwargs(turbo: bool, application_name: str) -> dict[str, Any]:
    return {"autocommit": True, "prepare_threshold": 5, "application_name": application_name,
            "options": SESSION_OPTIONS + (TURBO_OPTIONS if turbo else "")
                       + f" -c statement_timeout={STATEMENT_TIMEOUT} -c lock_timeout={LOCK_TIMEOUT}",
            "connect_timeout": CONNECT_TIMEOUT, **KEEPALIVES}


P = TypeVar("P")


def _take_idle(pools: dict[str, P], used: dict[str, float], now: float) -> list[P]:
    """Take out the pools no write used for IDLE_POOL seconds, and forget
    their use: the caller closes them. All at once, with nothing awaited in
    between (the async caller) or under the lock (the sync one): taken one
    by one with a close awaited after each, two concurrent writes (a
    client's replicated batches in flight) took the same idle pools, and the
    second one's ``del`` raised KeyError in the middle of their adds (an
    ADDJOB through the RESP port failed so in a full bench run)."""
    idle = [dsn for dsn, at in used.items() if now - at > IDLE_POOL]
    for dsn in idle:
        del used[dsn]
    return [pools.pop(dsn) for dsn in idle if dsn in pools]


class PeerPools:
    """Blocking connections to peers' databases (see the module doc);
    :meth:`write` runs a :class:`~pgq.protocol.PeerWrite` from the calling
    thread, every peer at once (:mod:`pgq.multiplex`).

    Per peer DSN, at most PEER_POOL_SIZE idle connections are kept; a write
    takes one per peer (a new one if none is idle) and gives it back after,
    unless it failed or was given up on. Missing connections are opened in
    helper threads, all at once, waited for no longer than the write's
    timeout (one that comes late is kept for the next write): a peer host
    that went silent cannot hold the caller in libpq's connect, nor keep
    the other peers from connecting. Each peer DSN has its threads of its
    own: with one set for all, the connects of a burst of writers to a
    silent host (each held for libpq's connect timeout) took every thread,
    and the connects to healthy peers waited behind them until the writes
    gave up."""

    def __init__(self, *, turbo: bool = False, application_name: str = "pgq") -> None:
        self.kwargs = _kwargs(turbo, application_name)
        self._idle: dict[str, list[multiplex.Prepared]] = {}
        self._used: dict[str, float] = {}
        self._lock = threading.Lock()
        # Per peer DSN, the threads that open its connections.
        self._connecting: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self._closed = False

    def _take_idle_one(self, dsn: str) -> multiplex.Prepared | None:
        stale: list[multiplex.Prepared] = []
        try:
            with self._lock:
                if self._closed:
                    raise psycopg.OperationalError("the client is closed")
                self._used[dsn] = time.monotonic()
                return _usable(self._idle.get(dsn, []), stale)
        finally:
            for prepared in stale:
                with contextlib.suppress(Exception):
                    prepared.conn.close()

    def _open(self, missing: list[tuple[str, str]], deadline: float,
              taken: dict[str, tuple[str, multiplex.Prepared]], results: dict[str, Any],
              fly: Callable[[], list[multiplex.Flight]], flights: list[multiplex.Flight]) -> None:
        """Open a connection for each (peer, DSN) of ``missing`` in helper
        threads, all at once, while ``flights`` run; ``fly()`` starts the
        statements of those that opened, as each arrives, until
        ``deadline``: a peer whose host drops packets fails alone."""
        with self._lock:
            closed = self._closed  # meanwhile, by another thread
            connecting = {} if closed else {dsn: self._threads(dsn) for _peer, dsn in missing}
        futures: dict[concurrent.futures.Future[multiplex.Prepared], tuple[str, str]] = {}
        pending: set[concurrent.futures.Future[multiplex.Prepared]] = set()
        if closed:
            for peer, _dsn in missing:
                results[peer] = PeerUnreached("the client is closed")
            multiplex.run(flights, deadline)
            return
        try:
            bell, ringer = socket.socketpair()
        except OSError as exc:  # no file descriptor left, say
            for peer, _dsn in missing:
                results[peer] = _unreached(exc)
            multiplex.run(flights, deadline)
            return

        def ring(_future: object) -> None:
            with contextlib.suppress(OSError):  # the write ended meanwhile
                ringer.send(b".")

        def arrived() -> tuple[list[multiplex.Flight], bool]:
            with contextlib.suppress(BlockingIOError):
                bell.recv(1024)
            for future in [f for f in pending if f.done()]:
                pending.discard(future)
                peer, dsn = futures[future]
                if future.cancelled():  # by close(), from another thread
                    results[peer] = PeerUnreached("the client is closed")
                elif (error := future.exception()) is not None:
                    results[peer] = _unreached(error)
                else:
                    taken[peer] = (dsn, future.result())
            return fly(), bool(pending)

        try:
            bell.setblocking(False)
            for peer, dsn in missing:
                try:
                    future = connecting[dsn].submit(self._connect, dsn)
                except Exception as exc:  # shut down by close(), no thread left
                    results[peer] = _unreached(exc)
                    continue
                futures[future] = (peer, dsn)
                pending.add(future)
                future.add_done_callback(ring)
            multiplex.run(flights, deadline, (bell.fileno(), arrived))
            arrived()  # those that came with the last look: too late to send
        finally:
            bell.close()
            ringer.close()
            for future in pending:
                peer, dsn = futures[future]
                if not future.cancel():  # connecting: kept for the next write if it succeeds
                    future.add_done_callback(functools.partial(self._late, dsn))
                results[peer] = PeerUnreached("no connection in time")

    def _threads(self, dsn: str) -> concurrent.futures.ThreadPoolExecutor:
        """The threads that open ``dsn``'s connections (under the lock)."""
        threads = self._connecting.get(dsn)
        if threads is None:
            threads = self._connecting[dsn] = concurrent.futures.ThreadPoolExecutor(
                max_workers=2 * PEER_POOL_SIZE, thread_name_prefix="pgq-peer")
        return threads

    def _connect(self, dsn: str) -> multiplex.Prepared:
        return multiplex.Prepared(psycopg.Connection.connect(dsn, **self.kwargs))

    def _late(self, dsn: str, future: concurrent.futures.Future[multiplex.Prepared]) -> None:
        if not future.cancelled() and future.exception() is None:
            self._give_back(dsn, future.result())

    def _give_back(self, dsn: str, prepared: multiplex.Prepared) -> None:
        with self._lock:
            if not self._closed and dsn in self._used:
                idle = self._idle.setdefault(dsn, [])
                if len(idle) < PEER_POOL_SIZE:
                    idle.append(prepared)
                    return
        prepared.conn.close()

    def write(self, sql: str, writes: Writes, timeout: float) -> dict[str, Any]:
        """Run ``sql`` on every peer of ``writes`` at once; ``{peer: rows or
        the exception}`` (see :class:`pgq.protocol.PeerWrite`)."""
        self._prune()
        deadline = time.monotonic() + timeout
        results: dict[str, Any] = {}
        taken: dict[str, tuple[str, multiplex.Prepared]] = {}
        flights: dict[str, multiplex.Flight] = {}
        try:  # whatever happens, each connection taken goes back or is closed
            missing = []
            for peer, dsn, _params in writes:
                try:
                    prepared = self._take_idle_one(dsn)
                except Exception as exc:
                    results[peer] = _unreached(exc)
                    continue
                if prepared is None:
                    missing.append((peer, dsn))
                else:
                    taken[peer] = (dsn, prepared)
            # The peers with a connection at hand get their statement at
            # once; the others follow as their connections open (a silent
            # host's connect takes the whole timeout: nobody waits for it).
            self._fly(sql, writes, taken, flights, results, deadline)
            if missing:
                self._open(missing, deadline, taken, results, lambda: self._fly(
                    sql, writes, taken, flights, results, deadline), list(flights.values()))
            else:
                multiplex.run(list(flights.values()), deadline)
        except Exception as exc:  # a write never raises: whatever went out counts as failed
            for peer, _dsn, _params in writes:
                flight = flights.get(peer)
                if flight is not None and not flight.done:
                    flight.finish(exc, broken=True)
                elif flight is None and peer not in results:
                    results[peer] = exc
        finally:
            for peer, (dsn, prepared) in taken.items():
                flight = flights.get(peer)
                if flight is not None:
                    results[peer] = _outcome(flight, timeout)
                if flight is None or flight.reusable:
                    self._give_back(dsn, prepared)
                else:  # a statement may still be in flight on it
                    prepared.conn.close()
        return results

    @staticmethod
    def _fly(sql: str, writes: Writes, taken: dict[str, tuple[str, multiplex.Prepared]],
             flights: dict[str, multiplex.Flight], results: dict[str, Any],
             deadline: float) -> list[multiplex.Flight]:
        """Start the flights of the peers taken that have none yet; returns them."""
        new = []
        for peer, _dsn, params in writes:
            if peer in taken and peer not in flights and peer not in results:
                try:
                    flights[peer] = multiplex.Flight(taken[peer][1], sql, params)
                    new.append(flights[peer])
                except Exception as exc:  # parameters psycopg cannot send: nothing went out
                    results[peer] = PeerUnreached(f"not sent: {exc}")
        multiplex.start(new, deadline)
        return new

    def _prune(self) -> None:
        """Close the connections no write used for IDLE_POOL seconds."""
        with self._lock:
            idle = _take_idle(self._idle, self._used, time.monotonic())
            gone = [self._connecting.pop(dsn) for dsn in list(self._connecting)
                    if dsn not in self._used]
        for connections in idle:
            for prepared in connections:
                prepared.conn.close()
        for threads in gone:  # a connect still running ends in its own time (_late)
            threads.shutdown(wait=False)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = list(self._idle.values()), {}
            connecting, self._connecting = list(self._connecting.values()), {}
        for connections in idle:
            for prepared in connections:
                prepared.conn.close()
        for threads in connecting:
            threads.shutdown(wait=False, cancel_futures=True)


class AsyncPeerPools:
    """The async mirror of :class:`PeerPools`: a task per peer takes an
    idle connection or opens one, then sends and waits for its statement
    (:func:`pgq.multiplex.fly`), all within the timeout."""

    def __init__(self, *, turbo: bool = False, application_name: str = "pgq") -> None:
        self.kwargs = _kwargs(turbo, application_name)
        self._idle: dict[str, list[multiplex.Prepared]] = {}
        self._used: dict[str, float] = {}
        self._closed = False

    async def _take_idle_one(self, dsn: str) -> multiplex.Prepared | None:
        if self._closed:
            raise psycopg.OperationalError("the client is closed")
        self._used[dsn] = time.monotonic()
        stale: list[multiplex.Prepared] = []
        prepared = _usable(self._idle.get(dsn, []), stale)  # nothing awaited: no other task takes it
        with anyio.CancelScope(shield=True):  # the connection taken is not lost meanwhile
            for connection in stale:
                with contextlib.suppress(Exception):
                    await _aclose(connection)
        return prepared

    async def _connect(self, dsn: str) -> multiplex.Prepared:
        return multiplex.Prepared(await psycopg.AsyncConnection.connect(dsn, **self.kwargs))

    async def _give_back(self, dsn: str, prepared: multiplex.Prepared, reusable: bool) -> None:
        if reusable and not self._closed and dsn in self._used:
            idle = self._idle.setdefault(dsn, [])
            if len(idle) < PEER_POOL_SIZE:
                idle.append(prepared)
                return
        await _aclose(prepared)

    async def write(self, sql: str, writes: Writes, timeout: float) -> dict[str, Any]:
        await self._prune()
        deadline = time.monotonic() + timeout
        results: dict[str, Any] = {}

        async def one(peer: str, dsn: str, params: Mapping[str, Any]) -> None:
            # Its own connection, then its own flight: a silent host's
            # connect holds no other peer's statement.
            prepared = flight = None
            try:
                try:
                    prepared = await self._take_idle_one(dsn)
                    if prepared is None:
                        with anyio.fail_after(max(deadline - time.monotonic(), 0)):
                            prepared = await self._connect(dsn)
                except TimeoutError:
                    results[peer] = PeerUnreached("no connection in time")
                    return
                except Exception as exc:
                    results[peer] = _unreached(exc)
                    return
                try:
                    flight = multiplex.Flight(prepared, sql, params)
                except Exception as exc:  # parameters psycopg cannot send: nothing went out
                    results[peer] = PeerUnreached(f"not sent: {exc}")
                    return
                await multiplex.fly(flight, deadline)
            finally:
                # Also when the caller is cancelled: a connection whose
                # statement is still in flight is closed, never left idle.
                with anyio.CancelScope(shield=True):
                    if flight is not None:
                        results[peer] = _outcome(flight, timeout)
                    if prepared is not None:
                        await self._give_back(dsn, prepared, flight is None or flight.reusable)

        async with anyio.create_task_group() as tasks:
            for peer, dsn, params in writes:
                tasks.start_soon(one, peer, dsn, params)
        return results

    async def _prune(self) -> None:
        """Close the connections no write used for IDLE_POOL seconds (see _take_idle)."""
        for connections in _take_idle(self._idle, self._used, time.monotonic()):
            for prepared in connections:
                await _aclose(prepared)

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = list(self._idle.values()), {}
        for connections in idle:
            for prepared in connections:
                await _aclose(prepared)


async def _aclose(prepared: multiplex.Prepared) -> None:
    conn = prepared.conn
    assert isinstance(conn, psycopg.AsyncConnection)
    await conn.close()


def _unreached(exc: BaseException) -> PeerUnreached:
    unreached = PeerUnreached(f"no connection: {exc}")
    unreached.__cause__ = exc
    return unreached


def _outcome(flight: multiplex.Flight, timeout: float) -> Any:
    """A flight's outcome as a peer write's: rows, the peer's error,
    PeerTimeout (sent, no answer in time: it may have committed) or
    PeerUnreached (nothing sent)."""
    outcome = flight.outcome
    if not flight.sent:  # no time was left to send it
        return PeerUnreached(f"not sent: {outcome}")
    if isinstance(outcome, TimeoutError):
        return PeerTimeout(f"no answer within {timeout:g} s")
    return outcome


def _usable(idle: list[multiplex.Prepared], stale: list[multiplex.Prepared]) -> multiplex.Prepared | None:
    """The most recently used idle connection that is still usable, taken
    out of ``idle``; those found dead on the way go to ``stale`` (closed by
    the caller)."""
    while idle:
        prepared = idle.pop()
        if prepared.usable():
            return prepared
        stale.append(prepared)
    return None
