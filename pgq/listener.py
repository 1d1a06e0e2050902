"""One LISTEN connection for the blocked GETs of an :class:`pgq.AsyncClient`,
and who a notification wakes.

Without it every blocked GET registers as a waiter and LISTENs on its own
pooled connection, and UNLISTENs and unregisters when it returns: four
statements per blocked call. And every blocked consumer of a queue wakes
and claims on every add: with 4 consumer tasks on one client, the
steady-state bench made 0.95 claims and 3.4 statements per job, and the
client's one thread spent about 0.57 ms of CPU per job.

Here the blocked GETs of one client share one connection that a task of
the client (started by ``async with AsyncClient(...)``, or by the fronts'
task group) owns, or, for :class:`pgq.Client`, a thread started by its
first blocked GET (:class:`SyncSharedListener`). It registers
the queues they wait on (``pgq.waiters``, which decides whether an add
notifies at all) and LISTENs once, and reads the notifications as they
come. A GET holds a :class:`Ticket` while it blocks.

Invariants:

* **A notification wakes one ticket** of its queue, the one waiting
  longest (Disque serves blocked clients in order too). A GET that then
  claims a full COUNT passes the wake on (:meth:`SharedListener.pass_on`):
  there may be more jobs. A GET that claims less left the queue empty.
* **No lost wakeup.** A ticket's queues are registered and LISTENed
  (committed) before :meth:`SharedListener.subscribe` returns, and its GET
  claims once more after that; a notification that arrives before the GET
  waits leaves the ticket woken, so the wait returns at once. A ticket
  that leaves woken without having waited for it (a timeout, a cancel, or
  woken during its last claim) passes the wake on.
* **Notifications never pile up.** The task reads the connection all the
  time it is registered, and drops the registration (UNLISTEN, and its
  ``pgq.waiters`` rows) once no GET has waited for ``linger`` seconds, so
  adds stop notifying a client with nobody blocked.
* **QSTAT counts GETs, not clients.** The registration's rows say how many
  GETs wait on each queue (``pgq.waiters.gets``), written by the task at
  most every ``PUBLISH_EVERY`` seconds when the count changed
  (:class:`BlockedCounts`): a QSTAT may lag a blocked GET by that much.
* **A failing listener degrades to polling**, never to an error: its
  tickets are woken (their GETs claim again, on the pool, which reports an
  unreachable database as usual), and a ticket it could not register
  waits by sleeping (``Ticket.failed``), as does one that the listener
  could not register within its GET's time left (a GET that came while the
  listener waited to try again waited for that, past its TIMEOUT). The task reconnects and registers again on
  the next subscription, and wakes the tickets that waited through the
  failure once more (a job added meanwhile notified nobody).

:class:`Wakeups`, :class:`Linger` and :class:`BlockedCounts` are the rule (no I/O);
:class:`SharedListener` runs it with anyio and psycopg, and
:class:`SyncSharedListener` with a thread.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import psycopg

from . import statements as sql
from .contracts import JOBS_CHANNEL

__all__ = ["Ticket", "Wakeups", "SharedListener", "SyncSharedListener", "take_notifications"]

log = logging.getLogger("pgq")

LINGER = 1.0  # seconds a registration outlives the last blocked GET (no churn between GETs)
PUBLISH_EVERY = 0.25  # seconds between two writes of the blocked GETs' counts
RETRY = 1.0  # seconds between attempts to reconnect a failed listener


@dataclass(eq=False)
class Ticket:
    """A blocked GET's place in line. ``ready`` and ``event`` are
    :class:`anyio.Event` for :class:`SharedListener`, :class:`threading.Event`
    for :class:`SyncSharedListener`."""

    queues: tuple[str, ...]
    ready: Any  # set once its queues are registered (or the listener failed)
    event: Any  # set when woken
    woken: bool = False  # a notification (or a passed-on wake) is for it, not consumed yet
    failed: bool = False  # its queues could not be registered: it polls


class Wakeups:
    """Who a notification wakes (no I/O): tickets in arrival order.
    ``event`` makes a ticket's events (anyio's or threading's)."""

    def __init__(self, event: Callable[[], Any] = threading.Event) -> None:
        self.tickets: list[Ticket] = []
        self._event = event

    def join(self, queues: Sequence[str]) -> Ticket:
        ticket = Ticket(tuple(queues), ready=self._event(), event=self._event())
        self.tickets.append(ticket)
        return ticket

    def join_early(self, queues: Sequence[str], registered: set[str] | None) -> Ticket | None:
        """A ticket for a GET about to make its first claim, if its queues
        are ``registered`` already (None: no connection; then None): every
        job added from now on wakes some ticket, so once the claim found
        nothing the GET can wait without claiming again (:meth:`listened`)."""
        if registered is None or not set(queues) <= registered:
            return None
        ticket = self.join(queues)
        ticket.ready.set()
        return ticket

    @staticmethod
    def listened(ticket: Ticket) -> bool | None:
        """The reply to :class:`pgq.protocol.Listen` for an early ticket:
        False (no need to claim again) unless it was woken meanwhile."""
        if ticket.woken:
            ticket.woken = False  # the claim that follows consumes it
            return None
        return False

    def registered(self, registered: set[str]) -> list[Ticket]:
        """The tickets whose queues are all ``registered`` (to set ready)."""
        return [t for t in self.tickets if set(t.queues) <= registered]

    def reregistered(self, queues: set[str]) -> list[Ticket]:
        """``queues`` are registered again after the listener failed: the
        tickets that waited on them meanwhile (ready already), woken, so
        that their GETs claim once more. A job added between their last
        claim and this registration notified nobody, and waited for the
        GET's next poll (found by a read-only review). A ticket ready
        otherwise (its GET polls: the listener could not register it in
        its time) gets one claim more, nothing worse."""
        woken = [t for t in self.tickets if t.ready.is_set() and not queues.isdisjoint(t.queues)]
        for ticket in woken:
            ticket.woken = True
        return woken

    def queues(self) -> set[str]:
        return {q for t in self.tickets for q in t.queues}

    def notified(self, queue: str) -> Ticket | None:
        """A job became ready in ``queue``: wake its longest-waiting ticket
        not woken yet (None if every ticket of the queue is awake)."""
        return self._wake(lambda t: queue in t.queues)

    def pass_on(self, queues: Sequence[str]) -> Ticket | None:
        """A woken GET took a full COUNT: wake the next ticket of its queues."""
        wanted = set(queues)
        return self._wake(lambda t: not wanted.isdisjoint(t.queues))

    def leave(self, ticket: Ticket) -> Ticket | None:
        """``ticket``'s GET returns; an unconsumed wake goes to the next one
        (once: leaving twice is leaving)."""
        if ticket not in self.tickets:
            return None
        self.tickets.remove(ticket)
        return self.pass_on(ticket.queues) if ticket.woken else None

    def all(self) -> list[Ticket]:
        """Every ticket, woken (the listener failed: all claim again); one
        not registered yet is failed too (it polls)."""
        for ticket in self.tickets:
            ticket.woken = True
            ticket.failed = ticket.failed or not ticket.ready.is_set()
        return list(self.tickets)

    def _wake(self, matches: Callable[[Ticket], bool]) -> Ticket | None:
        for ticket in self.tickets:
            if not ticket.woken and matches(ticket):
                ticket.woken = True
                return ticket
        return None


@dataclass
class Linger:
    """When the registration goes (no I/O): ``seconds`` after the last
    ticket left, and how long the listener may wait meanwhile."""

    seconds: float
    idle_since: float | None = None

    def over(self, wanted: bool, registered: bool, now: float) -> bool:
        """True when the registration should go now."""
        if wanted:
            self.idle_since = None
        elif registered:
            self.idle_since = now if self.idle_since is None else self.idle_since
            return now - self.idle_since >= self.seconds
        return False

    def timeout(self, wanted: bool, registered: bool) -> float:
        """How long to wait for notifications (or a change of tickets)."""
        return self.seconds if registered and not wanted else 5.0


@dataclass
class BlockedCounts:
    """How many GETs wait on each registered queue, as ``pgq.waiters.gets``
    holds it for QSTAT (no I/O): what to write now, at most every ``every``
    seconds, so that GETs that come and go by the thousand a second cost a
    few statements. A row is registered with 1."""

    every: float
    published: dict[str, int] = field(default_factory=dict)
    at: float = float("-inf")

    def due(self, tickets: Sequence[Ticket], registered: set[str],
            now: float) -> tuple[dict[str, int], float | None]:
        """(the counts to write now, seconds until held-back ones may be
        written: None when nothing is held back)."""
        counts = dict.fromkeys(registered, 0)
        for ticket in tickets:
            for queue in ticket.queues:
                if queue in counts:
                    counts[queue] += 1
        changed = {q: n for q, n in counts.items() if self.published.get(q, 1) != n}
        if not changed:
            return {}, None
        if now - self.at < self.every:
            return {}, self.every - (now - self.at)
        return changed, None

    def written(self, counts: dict[str, int], now: float) -> None:
        self.published.update(counts)
        self.at = now

    def forget(self) -> None:
        """The rows are gone (unregistered, or the connection dropped)."""
        self.published = {}


def _gets_params(counts: dict[str, int]) -> dict[str, list[Any]]:
    queues = sorted(counts)
    return {"queues": queues, "gets": [counts[q] for q in queues]}


def take_notifications(conn: Any) -> list[str]:
    """The queues named by the notifications that arrived on an idle
    connection, read without a round trip (a ``SELECT 1`` to make psycopg
    read them was 0.3 statements per job in the steady-state bench). Only
    notifications arrive on a connection with nothing in flight; a closed
    one raises :class:`psycopg.OperationalError` (the listener's failure path)."""
    pgconn = conn.pgconn
    pgconn.consume_input()  # raises psycopg.OperationalError if the server went away
    if pgconn.status != psycopg.pq.ConnStatus.OK:
        raise psycopg.OperationalError("the listener's connection is closed")
    encoding = conn.info.encoding
    queues = []
    while (notify := pgconn.notifies()) is not None:
        if notify.relname.decode(encoding) == JOBS_CHANNEL:
            queues.append(notify.extra.decode(encoding))
    return queues


class SharedListener:
    """The connection, and the task that reads it (see the module doc).

    ``connect`` opens a new autocommit connection to the client's current
    database. :meth:`run` is the task; the other methods are called by
    the GETs (:class:`pgq.driver.AsyncDriver`), in the same event loop.
    """

    def __init__(self, connect: Callable[[], Awaitable[psycopg.AsyncConnection[Any]]],
                 linger: float = LINGER) -> None:
        self._connect = connect
        self.linger = Linger(linger)
        self.counts = BlockedCounts(PUBLISH_EVERY)
        self.wakeups = Wakeups(anyio.Event)
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._registered: set[str] = set()
        self._received: list[str] = []
        self._changed = anyio.Event()
        self._reading: anyio.CancelScope | None = None  # the wait for notifications
        self._stopped = False  # run() ended: nothing will make a ticket ready any more

    # ------------------------------------------------------------ the GETs' side

    def join_early(self, queues: Sequence[str]) -> Ticket | None:
        """See :meth:`Wakeups.join_early`."""
        return self.wakeups.join_early(queues, None if self._conn is None else self._registered)

    def listened(self, ticket: Ticket) -> bool | None:
        """See :meth:`Wakeups.listened`."""
        return self.wakeups.listened(ticket)

    async def subscribe(self, queues: Sequence[str], within: float | None = None) -> Ticket:
        """A GET is about to block on ``queues``: its ticket, once they are
        registered and LISTENed (or the listener failed, or could not
        register them ``within`` seconds, the GET's time left:
        ``ticket.failed``, the GET polls). A GET that came while the
        listener waited to try again after a failure waited for that, past
        its TIMEOUT."""
        ticket = self.wakeups.join(queues)
        try:
            if self._stopped:  # the client is closing: the GET polls out its wait
                ticket.failed = True
                ticket.ready.set()
            elif set(ticket.queues) <= self._registered:
                ticket.ready.set()
            else:
                self._poke()
                with anyio.move_on_after(within):
                    await ticket.ready.wait()
                if not ticket.ready.is_set():
                    ticket.failed = True
        except BaseException:
            self.leave(ticket)
            raise
        return ticket

    async def wait(self, ticket: Ticket, seconds: float) -> None:
        """Until ``ticket`` is woken, or ``seconds`` pass; consumes the wake."""
        if ticket.failed:
            await anyio.sleep(seconds)
            return
        ticket.event = anyio.Event()
        if not ticket.woken:
            with anyio.move_on_after(seconds):
                await ticket.event.wait()
        ticket.woken = False

    def pass_on(self, queues: Sequence[str]) -> None:
        self._set(self.wakeups.pass_on(queues))

    def leave(self, ticket: Ticket) -> None:
        self._set(self.wakeups.leave(ticket))
        if not self.wakeups.tickets:
            self._poke()  # the linger starts

    @staticmethod
    def _set(ticket: Ticket | None) -> None:
        if ticket is not None:
            ticket.event.set()

    # ------------------------------------------------------------ the task

    async def run(self) -> None:
        """Serve until cancelled; never raises (a failure is logged, every
        ticket is woken, and the task tries again)."""
        try:
            while True:
                try:
                    await self._serve()
                except Exception as exc:  # the task must outlive any failure
                    log.warning("pgq: the blocked GETs' listener failed (%s); they poll meanwhile", exc)
                    await self._drop()
                    for ticket in self.wakeups.all():
                        ticket.ready.set()
                        ticket.event.set()
                    await anyio.sleep(RETRY)
        finally:
            # A GET waiting to be registered (or subscribing from now on)
            # waited for ever: it polls instead, bounded by its timeout.
            self._stopped = True
            for ticket in self.wakeups.all():
                ticket.failed = True
                ticket.ready.set()
                ticket.event.set()
            with anyio.CancelScope(shield=True):
                await self._close()

    async def _serve(self) -> None:
        while True:
            # A fresh event first: a subscription from here on is seen by _read.
            self._changed = anyio.Event()
            self._dispatch()  # notifications read while registering, too
            wanted = self.wakeups.queues()
            missing = wanted - self._registered
            if missing:
                await self._register(missing)
                for ticket in self.wakeups.reregistered(missing):
                    ticket.event.set()
            for ticket in self.wakeups.registered(self._registered):
                ticket.ready.set()
            now = anyio.current_time()
            if self.linger.over(bool(wanted), bool(self._registered), now):
                await self._unregister()
                continue
            counts, held = self.counts.due(self.wakeups.tickets, self._registered, now)
            if counts:
                await self._publish(counts, now)
            timeout = self.linger.timeout(bool(wanted), bool(self._registered))
            await self._read(timeout if held is None else min(timeout, held))

    async def _read(self, timeout: float) -> None:
        """Wait for notifications, a change of tickets, or ``timeout``."""
        conn = self._conn
        if conn is None or not self._registered:
            with anyio.move_on_after(timeout):
                await self._changed.wait()
            return
        if self._changed.is_set() or self._received:
            # Notifications psycopg read during the listener's own
            # statements are dispatched now: the socket has nothing more
            # to say, and they waited for the next notification, a change
            # of tickets or the timeout (found by a read-only review).
            return
        readable = False
        with anyio.move_on_after(timeout) as self._reading:
            # Nothing is in flight on the connection while it waits, so a
            # cancelled wait leaves it usable (as pgq.driver does).
            await anyio.wait_readable(conn.fileno())
            readable = True
        self._reading = None
        if readable:
            self._received.extend(take_notifications(conn))

    def _poke(self) -> None:
        """The tickets changed: the task looks again."""
        self._changed.set()
        if self._reading is not None:
            self._reading.cancel()

    def _dispatch(self) -> None:
        received, self._received = self._received, []
        for queue in received:
            self._set(self.wakeups.notified(queue))

    async def _register(self, queues: set[str]) -> None:
        with anyio.CancelScope(shield=True):
            if self._conn is None:
                self._conn = await self._connect()
                self._conn.add_notify_handler(self._notified)
            if not self._registered:
                await self._conn.execute(f"LISTEN {JOBS_CHANNEL}")
            await self._conn.execute(sql.REGISTER_WAITER, {"queues": sorted(queues)})
            self._registered |= queues

    async def _publish(self, counts: dict[str, int], now: float) -> None:
        assert self._conn is not None  # registered
        with anyio.CancelScope(shield=True):
            await self._conn.execute(sql.SET_WAITER_GETS, _gets_params(counts))
        self.counts.written(counts, now)

    async def _unregister(self, seconds: float | None = None) -> None:
        """Drop the registration; its statements are shielded from the
        task's cancellation, up to ``seconds`` (a bound: a shield inside
        the caller's own deadline made that deadline do nothing)."""
        if self._conn is not None:
            with anyio.move_on_after(seconds, shield=True) as bounded:
                await self._conn.execute(f"UNLISTEN {JOBS_CHANNEL}")
                await self._conn.execute(sql.UNREGISTER_WAITER)
            if bounded.cancelled_caught:
                raise psycopg.OperationalError("the registration could not be dropped in time")
        self._registered = set()
        self._received = []
        self.counts.forget()

    def _notified(self, notify: psycopg.Notify) -> None:
        if notify.channel == JOBS_CHANNEL:
            self._received.append(notify.payload)

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        self._registered = set()
        self.counts.forget()
        if conn is not None:
            with anyio.CancelScope(shield=True):
                await conn.close()

    async def _close(self) -> None:
        """On the client's close: leave nothing behind (best effort)."""
        if self._conn is not None and self._registered and not self._conn.broken:
            # Bounded: a locked pgq.waiters, a paused server or a silent
            # network held the client's close (and a node's stop) for good.
            # (A server that does not answer the cancel either costs psycopg's
            # own bound on it, about 10 s, since psycopg 3.3.)
            try:
                await self._unregister(seconds=1.0)
            except psycopg.Error:
                pass  # the sweep drops the registration of a closed connection
        await self._drop()


class SyncSharedListener:
    """:class:`SharedListener` for :class:`pgq.Client` (threads): a daemon
    thread, started by the first blocked GET, owns the connection; the GETs'
    threads wait on their tickets' :class:`threading.Event`. The same rule
    and invariants; :meth:`close` stops the thread and leaves nothing
    registered. ``connect`` opens a new autocommit connection to the
    client's current database."""

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], linger: float = LINGER) -> None:
        self._connect = connect
        self.linger = Linger(linger)
        self.counts = BlockedCounts(PUBLISH_EVERY)
        self.wakeups = Wakeups(threading.Event)
        self._lock = threading.Lock()  # the tickets, and what is registered
        self._conn: psycopg.Connection[Any] | None = None  # the thread's only
        self._registered: set[str] = set()
        self._received: list[str] = []
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # A socket pair wakes the thread's poll() when the tickets change
        # (made with the thread: a client that never blocks holds no more fds).
        self._poke_in: socket.socket | None = None
        self._poke_out: socket.socket | None = None

    # ------------------------------------------------------------ the GETs' side

    def join_early(self, queues: Sequence[str]) -> Ticket | None:
        """See :meth:`Wakeups.join_early`."""
        with self._lock:
            return self.wakeups.join_early(queues, None if self._conn is None else self._registered)

    def listened(self, ticket: Ticket) -> bool | None:
        """See :meth:`Wakeups.listened`."""
        with self._lock:
            return self.wakeups.listened(ticket)

    def subscribe(self, queues: Sequence[str], within: float | None = None,
                  timeout: float = 30.0) -> Ticket:
        """As :meth:`SharedListener.subscribe` (a listener that cannot
        register within ``within`` seconds, and at most ``timeout``, leaves
        the ticket polling)."""
        ticket: Ticket | None = None
        try:  # from the join on: an interrupt anywhere after it must not leave the ticket
            with self._lock:
                if self._stopping.is_set():
                    raise psycopg.OperationalError("this client is closed")
                ticket = self.wakeups.join(queues)
                self._start()
            self._poke()
            if not ticket.ready.wait(timeout if within is None else min(within, timeout)):
                ticket.failed = True
        except BaseException:  # interrupted: the ticket must not stay registered for good
            if ticket is not None:
                self.leave(ticket)
            raise
        return ticket

    def wait(self, ticket: Ticket, seconds: float) -> None:
        """As :meth:`SharedListener.wait`."""
        if ticket.failed:
            time.sleep(seconds)
            return
        with self._lock:
            if ticket.woken:
                ticket.woken = False
                return
            ticket.event.clear()
        ticket.event.wait(seconds)
        with self._lock:
            ticket.woken = False

    def pass_on(self, queues: Sequence[str]) -> None:
        with self._lock:
            woken = self.wakeups.pass_on(queues)
        if woken is not None:
            woken.event.set()

    def leave(self, ticket: Ticket) -> None:
        with self._lock:
            woken = self.wakeups.leave(ticket)
            idle = not self.wakeups.tickets
        if woken is not None:
            woken.event.set()
        if idle:
            self._poke()  # the linger starts

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread; it drops the registration and the connection."""
        self._stopping.set()
        self._poke()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if thread is not None and not thread.is_alive():
            for end in (self._poke_in, self._poke_out):
                if end is not None:
                    end.close()

    def _start(self) -> None:
        if self._thread is None:
            self._poke_in, self._poke_out = socket.socketpair()
            self._poke_in.setblocking(False)
            self._poke_out.setblocking(False)
            self._thread = threading.Thread(target=self._run, name="pgq-listener", daemon=True)
            self._thread.start()

    def _poke(self) -> None:
        if self._poke_out is None:
            return  # no thread yet: nothing to wake
        try:
            self._poke_out.send(b"x")
        except (BlockingIOError, OSError):
            pass  # full (a poke is pending anyway) or closed

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    self._step()
                except Exception as exc:  # the thread must outlive any failure
                    log.warning("pgq: the blocked GETs' listener failed (%s); they poll meanwhile", exc)
                    self._drop()
                    with self._lock:
                        woken = self.wakeups.all()
                    for ticket in woken:
                        ticket.ready.set()
                        ticket.event.set()
                    self._stopping.wait(RETRY)
        finally:
            self._close()

    def _step(self) -> None:
        self._drain_pokes()
        with self._lock:
            received, self._received = self._received, []
            woken = [t for t in (self.wakeups.notified(q) for q in received) if t is not None]
            wanted = self.wakeups.queues()
            missing = wanted - self._registered
        for ticket in woken:
            ticket.event.set()
        if missing:
            self._register(missing)
            with self._lock:
                woken = self.wakeups.reregistered(missing)
            for ticket in woken:
                ticket.event.set()
        with self._lock:
            ready = self.wakeups.registered(self._registered)
        for ticket in ready:
            ticket.ready.set()
        now = time.monotonic()
        if self.linger.over(bool(wanted), bool(self._registered), now):
            self._unregister()
            return
        with self._lock:
            counts, held = self.counts.due(list(self.wakeups.tickets), set(self._registered), now)
        if counts and self._conn is not None:
            self._conn.execute(sql.SET_WAITER_GETS, _gets_params(counts))
            self.counts.written(counts, now)
        # poll(), not select(): select() refuses a descriptor from 1024 on,
        # common in a process that raised its limit to hold many sockets,
        # and the listener then failed and reconnected every second.
        assert self._poke_in is not None  # made with the thread
        poller = select.poll()
        poller.register(self._poke_in, select.POLLIN)
        if self._conn is not None and self._registered:
            poller.register(self._conn.fileno(), select.POLLIN)
        timeout = self.linger.timeout(bool(wanted), bool(self._registered))
        with self._lock:
            # Read during the thread's own statements: dispatched at once
            # (they waited for the next notification or the timeout).
            pending = bool(self._received)
        events = poller.poll(0 if pending else 1000 * (timeout if held is None else min(timeout, held)))
        readable = {fd for fd, _ in events}
        if self._conn is not None and self._registered and self._conn.fileno() in readable:
            queues = take_notifications(self._conn)
            with self._lock:
                self._received.extend(queues)

    def _drain_pokes(self) -> None:
        assert self._poke_in is not None  # made with the thread
        try:
            while self._poke_in.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _register(self, queues: set[str]) -> None:
        if self._conn is None:
            conn = self._connect()
            conn.add_notify_handler(self._notified)
            with self._lock:
                self._conn = conn
        assert self._conn is not None
        if not self._registered:
            self._conn.execute(f"LISTEN {JOBS_CHANNEL}")
        self._conn.execute(sql.REGISTER_WAITER, {"queues": sorted(queues)})
        with self._lock:
            self._registered |= queues

    def _unregister(self) -> None:
        if self._conn is not None:
            self._conn.execute(f"UNLISTEN {JOBS_CHANNEL}")
            self._conn.execute(sql.UNREGISTER_WAITER)
        with self._lock:
            self._registered = set()
            self._received = []
        self.counts.forget()

    def _notified(self, notify: psycopg.Notify) -> None:
        if notify.channel == JOBS_CHANNEL:
            with self._lock:
                self._received.append(notify.payload)

    def _drop(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
            self._registered = set()
        self.counts.forget()
        if conn is not None:
            conn.close()

    def _close(self) -> None:
        """On the client's close: leave nothing behind (best effort)."""
        if self._conn is not None and self._registered and not self._conn.broken:
            try:
                self._unregister()
            except psycopg.Error:
                pass
        self._drop()
