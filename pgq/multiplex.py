"""One statement on several connections at once, without a thread per write.

A synchronous replicated add writes its copies into W-1 peers' databases
at once (:mod:`pgq.peers`). With a helper thread per write, the hand-offs
cost more than the writes: measured here, two peer copies of a lone add
took 1.16-1.33 ms at p50 and 0.53-0.62 ms of the client's CPU through
threads and a connection pool, and 0.62-0.74 ms and 0.13-0.18 ms of CPU
sent from the calling thread and waited for together with ``poll()``
(psycopg's pipeline mode, tried before, spent more Python per call than
the hand-off it saved). So :func:`start` and :func:`run` drive libpq's
asynchronous interface (``psycopg.pq``) directly from the calling thread:
send on every connection, then one ``poll()`` over their sockets until
each has its answer or the deadline passes. On an event loop,
:func:`fly` does the same for one connection in its own task.

Invariants:

* Each :class:`Flight` is one statement in autocommit mode on a
  connection nobody else uses meanwhile; its outcome is its rows (loaded
  by psycopg's adapters, as a cursor would) or its exception, never raised.
* Nothing waits past the deadline: a flight without its answer by then
  ends with :class:`TimeoutError` and its connection is closed (the server
  rolls the statement back when it notices, or commits it if it had
  already: the caller treats the peer as failed either way).
* Nothing is sent once the deadline has passed (a statement then would
  run with nobody waiting for its answer); a flight counts as sent
  (:attr:`Flight.sent`) only once its statement went out.
* A connection is reusable after its flight only if it is idle, outside
  any transaction (:attr:`Flight.reusable`).
* A statement is prepared once per connection and parameter types (as
  psycopg does), with its ``%(name)s`` / ``%(name)b`` placeholders turned
  into ``$n``; the prepare goes out in the same flight, before the
  statement, the first time.
"""

from __future__ import annotations

import functools
import math
import re
import select
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import psycopg
from psycopg import pq
from psycopg.adapt import PyFormat, Transformer
from psycopg.errors import error_from_result

__all__ = ["Prepared", "Flight", "start", "run", "fly"]

_PLACEHOLDER = re.compile(rb"%\((\w+)\)([sbt])|%%")
_FORMATS = {b"s": PyFormat.AUTO, b"b": PyFormat.BINARY, b"t": PyFormat.TEXT}
FLUSH_POLL = 0.01  # seconds (see fly)
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

    def usable(self) -> bool:
        """Whether this idle connection may take a statement: open, and its
        socket silent. An idle connection's server sends nothing unasked
        but its end (a restart, ``idle_session_timeout``, an operator's
        ``pg_terminate_backend``): one that has something to read, or whose
        peer hung up, is not used (it would fail its write, and a failed
        write backs the peer off). One poll() of the socket, no wait."""
        if self.conn.closed:
            return False
        poller = select.poll()
        poller.register(self.conn.pgconn.socket, _READ)
        return not poller.poll(0)


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
        self.sent = False  # the statement went out: the peer may have run it
        self.deadline = math.inf  # set by start(): no statement goes out after it

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
            self.sent = True  # (a prepare writes nothing)
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
        elif time.monotonic() >= self.deadline:  # prepared in the last look: too late
            self.finish(TimeoutError("no time left to send"), broken=True)
        else:
            self.send()

    def finish(self, outcome: Any, broken: bool = False) -> None:
        self.outcome, self.done, self.broken = outcome, True, broken


def start(flights: Sequence[Flight], deadline: float) -> None:
    """Send each flight's statement (its prepare first if needed), unless
    ``deadline`` has passed: a statement sent then would run with nobody
    waiting for its answer."""
    for flight in flights:
        flight.deadline = deadline
        if time.monotonic() >= deadline:
            flight.finish(TimeoutError("no time left to send"))
            continue
        try:
            flight.send()
        except Exception as exc:
            flight.finish(exc, broken=True)


def run(flights: Sequence[Flight], deadline: float,
        wakeup: tuple[int, Callable[[], tuple[list[Flight], bool]]] | None = None) -> None:
    """Drive every started flight (:func:`start`) to its outcome, or to
    TimeoutError at ``deadline`` (time.monotonic()); see the module doc.
    Answers already received by then count: each flight's socket is read
    once more before it is given up on.

    ``wakeup``: a file descriptor that becomes readable when more flights
    may be ready to join (connections that opened meanwhile), and the call
    that starts them: it returns them, and whether more may come."""
    live: dict[int, Flight] = {}
    poller = select.poll()

    def join(more: Sequence[Flight]) -> None:
        for flight in more:
            if not flight.done:
                live[flight.fileno] = flight
                poller.register(flight.fileno, _events(flight))

    join(flights)
    waking = wakeup is not None
    if wakeup is not None:
        poller.register(wakeup[0], _READ)
    while live or waking:
        left = deadline - time.monotonic()
        ready = poller.poll(max(left, 0) * 1000)
        if left <= 0:  # the last look: whatever is readable now
            ready = [(fd, 0) for fd in live]
        for fd, _event in ready:
            if wakeup is not None and fd == wakeup[0]:
                more, waking = wakeup[1]()
                if not waking:
                    poller.unregister(fd)
                join(more)
                continue
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
        if left <= 0:
            break
    for flight in live.values():
        flight.finish(TimeoutError("no answer in time"), broken=True)


def _events(flight: Flight) -> int:
    return _READ | _WRITE if flight.flushing else _READ


async def fly(flight: Flight, deadline: float) -> None:
    """One flight on an event loop: sent (unless ``deadline`` has passed)
    and driven to its outcome, or to TimeoutError at ``deadline``, its
    socket read once more before it is given up on."""
    start([flight], deadline)
    try:
        while not flight.done:
            left = deadline - time.monotonic()
            if left > 0:
                # Flushing, libpq also wants what the server sends meanwhile:
                # anyio waits for one direction, so the wait is cut short to
                # read between writes.
                with anyio.move_on_after(min(left, FLUSH_POLL) if flight.flushing else left):
                    await (anyio.wait_writable if flight.flushing else anyio.wait_readable)(
                        flight.fileno)
            flight.ready()
            if left <= 0 and not flight.done:
                flight.finish(TimeoutError("no answer in time"), broken=True)
    except Exception as exc:
        flight.finish(exc, broken=True)
