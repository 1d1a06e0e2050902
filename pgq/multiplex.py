"""One statement on several connections at once, from the calling thread.

A synchronous replicated add writes its copies into W-1 peers' databases
at once (:mod:`pgq.peers`). With a helper thread per write, the hand-offs
cost more than the writes: measured here, two peer copies of a lone add
took 1.16-1.33 ms at p50 and 0.53-0.62 ms of the client's CPU through
threads and a connection pool, and 0.62-0.74 ms and 0.13-0.18 ms of CPU
sent from the calling thread and waited for together with ``poll()``
(psycopg's pipeline mode, tried before, spent more Python per call than
the hand-off it saved). So :func:`run` drives libpq's asynchronous
interface (``psycopg.pq``) directly: send on every connection, then one
``poll()`` over their sockets until each has its answer or the deadline
passes.

Invariants:

* Each :class:`Flight` is one statement in autocommit mode on a
  connection nobody else uses meanwhile; its outcome is its rows (loaded
  by psycopg's adapters, as a cursor would) or its exception, never raised.
* Nothing waits past the deadline: a flight without its answer by then
  ends with :class:`TimeoutError` and its connection is closed (the server
  rolls the statement back when it notices, or commits it if it had
  already: the caller treats the peer as failed either way).
* A connection is reusable after its flight only if it is idle, outside
  any transaction (:attr:`Flight.reusable`).
* A statement is prepared once per connection and parameter types (as
  psycopg does), with its ``%(name)s`` / ``%(name)b`` placeholders turned
  into ``$n``; the prepare goes out in the same flight, before the
  statement, the first time.
"""

from __future__ import annotations

import functools
import re
import select
import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import psycopg
from psycopg import pq
from psycopg.adapt import PyFormat, Transformer
from psycopg.errors import error_from_result

__all__ = ["Prepared", "Flight", "run", "arun"]

_PLACEHOLDER = re.compile(rb"%\((\w+)\)([sbt])|%%")
_FORMATS = {b"s": PyFormat.AUTO, b"b": PyFormat.BINARY, b"t": PyFormat.TEXT}
FLUSH_POLL = 0.01  # seconds (see _fly)
_READ = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP
_WRITE = select.POLLOUT | select.POLLERR | select.POLLHUP


@functools.lru_cache(maxsize=64)
def parse(sql: str) -> tuple[bytes, tuple[str, ...], tuple[PyFormat, ...]]:
    """``sql`` with ``$n`` placeholders, the parameter names in ``$n``
    order, and each one's format (a name used twice is one parameter)."""
    names: list[str] = []
    formats: list[PyFormat] = []

    def number(match: re.Match[bytes]) -> bytes:
        if match.group(0) == b"%%":
            return b"%"
        name = match.group(1).decode()
        if name not in names:
            names.append(name)
            formats.append(_FORMATS[match.group(2)])
        return b"$%d" % (names.index(name) + 1)

    query = _PLACEHOLDER.sub(number, sql.encode())
    return query, tuple(names), tuple(formats)


class Prepared:
    """A connection and what was prepared on it: (sql, parameter types) ->
    statement name."""

    __slots__ = ("conn", "names")

    def __init__(self, conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
        conn.pgconn.nonblocking = 1
        self.conn = conn
        self.names: dict[tuple[str, tuple[int, ...]], bytes] = {}


class Flight:
    """One statement on one connection: its sends, its answers, its outcome."""

    def __init__(self, prepared: Prepared, sql: str, params: Mapping[str, Any]) -> None:
        self.prepared = prepared
        self.pgconn = prepared.conn.pgconn
        self.transformer = Transformer(prepared.conn)
        query, names, formats = parse(sql)
        self.values = self.transformer.dump_sequence([params[name] for name in names], formats)
        self.formats = list(self.transformer.formats or ())
        types = tuple(self.transformer.types or ())
        key = (sql, types)
        known = prepared.names.get(key)
        self.steps: list[Any] = []
        if known is None:  # prepared in this flight, kept once it succeeded
            known = b"pgq_%d" % len(prepared.names)
            self.steps.append(("prepare", query, types, key))
        self.name: bytes = known
        self.steps.append(("execute",))
        self.flushing = False
        self.failed: BaseException | None = None
        self.rows: list[Any] = []
        self.outcome: Any = None
        self.done = False
        self.broken = False  # the connection failed or was given up on

    @property
    def fileno(self) -> int:
        return self.pgconn.socket

    @property
    def reusable(self) -> bool:
        return (self.done and not self.broken and self.pgconn.status == pq.ConnStatus.OK
                and self.pgconn.transaction_status == pq.TransactionStatus.IDLE)

    def send(self) -> None:
        """Send the next step and flush what libpq could not write yet."""
        step = self.steps[0]
        if step[0] == "prepare":
            self.pgconn.send_prepare(self.name, step[1], param_types=step[2])
        else:
            self.pgconn.send_query_prepared(self.name, self.values, param_formats=self.formats)
        self.flushing = self.pgconn.flush() != 0

    def ready(self) -> None:
        """The socket is ready: flush, read, and take every complete
        answer; the next step goes out once one's answers are all in."""
        if self.flushing:
            self.flushing = self.pgconn.flush() != 0
        self.pgconn.consume_input()
        while not self.pgconn.is_busy():
            result = self.pgconn.get_result()
            if result is None:
                self._step_done()
                if self.done or self.flushing:
                    return
                continue
            self._take(result)

    def _take(self, result: pq.abc.PGresult) -> None:
        status = result.status
        if status == pq.ExecStatus.TUPLES_OK and self.steps[0][0] == "execute":
            self.transformer.set_pgresult(result)
            self.rows = self.transformer.load_rows(0, result.ntuples, tuple)
        elif status in (pq.ExecStatus.COPY_IN, pq.ExecStatus.COPY_OUT, pq.ExecStatus.COPY_BOTH):
            # Never a peer statement: no answer would ever end it here.
            raise psycopg.NotSupportedError("COPY is not run through pgq.multiplex")
        elif status not in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK,
                            pq.ExecStatus.EMPTY_QUERY):
            self.failed = self.failed or error_from_result(result, self.prepared.conn.info.encoding)

    def _step_done(self) -> None:
        step = self.steps.pop(0)
        if self.failed is None and step[0] == "prepare":
            self.prepared.names[step[3]] = self.name
        if self.failed is not None or not self.steps:
            self.finish(self.failed if self.failed is not None else self.rows)
        else:
            self.send()

    def finish(self, outcome: Any, broken: bool = False) -> None:
        self.outcome, self.done, self.broken = outcome, True, broken


def run(flights: Sequence[Flight], deadline: float) -> None:
    """Drive every flight to its outcome, or to TimeoutError at
    ``deadline`` (time.monotonic()); see the module doc."""
    live: dict[int, Flight] = {}
    poller = select.poll()
    for flight in flights:
        try:
            flight.send()
        except Exception as exc:
            flight.finish(exc, broken=True)
            continue
        live[flight.fileno] = flight
        poller.register(flight.fileno, _events(flight))
    while live:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for fd, _event in poller.poll(left * 1000):
            flight = live[fd]
            try:
                flight.ready()
            except Exception as exc:
                flight.finish(exc, broken=True)
            if flight.done:
                poller.unregister(fd)
                del live[fd]
            else:
                poller.modify(fd, _events(flight))
    for flight in live.values():
        flight.finish(TimeoutError("no answer in time"), broken=True)


def _events(flight: Flight) -> int:
    return _READ | _WRITE if flight.flushing else _READ


async def arun(flights: Sequence[Flight], deadline: float) -> None:
    """:func:`run` on an event loop: every flight sent at once, each then
    driven by its own task until ``deadline`` (time.monotonic())."""
    async with anyio.create_task_group() as tasks:
        for flight in flights:
            tasks.start_soon(_fly, flight, deadline)


async def _fly(flight: Flight, deadline: float) -> None:
    try:
        flight.send()
        while not flight.done:
            left = deadline - time.monotonic()
            if left <= 0:
                flight.finish(TimeoutError("no answer in time"), broken=True)
                return
            # Flushing, libpq also wants what the server sends meanwhile:
            # anyio waits for one direction, so the wait is cut short to
            # read between writes.
            with anyio.move_on_after(min(left, FLUSH_POLL) if flight.flushing else left):
                await (anyio.wait_writable if flight.flushing else anyio.wait_readable)(
                    flight.fileno)
            flight.ready()
    except Exception as exc:
        flight.finish(exc, broken=True)
