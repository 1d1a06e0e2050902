"""The node process: runs a :class:`~.core.NodeCore` on anyio, a connection
pool and a transport (wiring only: every protocol decision is in the core).

Clients never talk to this process directly: they write jobs and *outbox
events* into the database (same transaction as the change), ring a NOTIFY
doorbell, and read the node's view of the cluster from SQL views. The
process carries those events to other nodes and applies what other nodes
tell it.

What this module adds to the core:

* a driver (:meth:`Node._run`) that executes a step's queries on the pool
  and sends the messages the step decided, after each statement returned
  (so nothing is sent before the statement that justified it committed);
* the loops that run each step on its period (:data:`.core.PERIODS`) and
  restart it after a database or network error, logging any other error:
  one failing step never stops the node;
* the doorbell (LISTEN), the inbox with back-pressure (the transport stops
  reading a peer's link while the inbox is full, so a flood costs the
  flooder), and metrics;
* the watch of the node lock (``relock``): PostgreSQL restarted under the
  node process ends the connection that held it; the node takes it again
  within a second, or stops if another node process took the database.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread
import psycopg
from psycopg_pool import AsyncConnectionPool

from pgq.contracts import DOORBELL_CHANNEL
from pgq.driver import extract
from pgq.errors import PgqError
from pgq.protocol import Query, Result
from pgq.statements import SESSION_OPTIONS

from . import messages as m
from . import sql
from .bus import Bus
from .clock import Clock, SystemClock
from .core import GOSSIP, OUTBOX_BATCH, PERIODS, CoreSettings, NodeCore, Step
from .inbox import Inbox
from .membership import Config
from .transport import Transport

__all__ = ["Node", "NodeSettings"]

log = logging.getLogger("pgq.cluster.node")
DOORBELL = DOORBELL_CHANNEL
INBOX_LIMIT = 20_000  # messages waiting to be applied: the bus stops reading beyond
INBOX_BYTES = 256 * 1024 * 1024
LOCK_CHECK_EVERY = 1.0  # seconds between two looks at the node lock


@dataclass
class NodeSettings:
    name: str
    dsn: str
    bus_host: str
    bus_port: int
    secret: bytes
    joins: list[tuple[str, int]] = field(default_factory=list)
    membership: Config = field(default_factory=Config)
    pool_size: int = 8
    metrics: str | None = None  # HOST:PORT of the Prometheus endpoint
    advertise_dsn: str = ""  # for other nodes' clients to write copies into ("": none)
    advertise_resp: str = ""  # HOST:PORT of this node's RESP front, for HELLO ("": none)


def _weight(item: tuple[str, m.Message]) -> int:
    """Roughly what an inbox item holds in memory: its job bodies, and
    about 128 bytes per job it names (an ID and its holders as Python
    strings). Bodies alone counted a SETACK or DELJOB of 100k IDs as 256
    bytes, so a full inbox could hold tens of GB (a read-only review)."""
    message = item[1]
    jobs = getattr(message, "jobs", ())
    items = getattr(message, "items", ())
    named = len(jobs) + len(getattr(message, "ids", ())) + len(items)
    # Holder lists too, about 100 bytes a name: a SETACK of 990 jobs with
    # 990 holders each held about 96 MB and weighed 127 KB, so the byte cap
    # let thousands in (found by a read-only review).
    holders = (sum(len(h) for h in getattr(message, "holders", ()))
               + sum(len(nodes) for _id, nodes in items if isinstance(nodes, tuple))
               + sum(len(job.nodes) for job in jobs))
    return 256 + 128 * named + 100 * holders + sum(len(job.body) for job in jobs)


TransportFactory = Callable[[str, Callable[..., Any]], Transport]


class Node:
    def __init__(self, settings: NodeSettings, clock: Clock | None = None,
                 rng: random.Random | None = None, listener: Any = None,
                 transport: TransportFactory | None = None,
                 relock: Callable[[], None] | None = None) -> None:
        self.settings = settings
        self._relock = relock  # takes the node lock again (blocking; None: not watched)
        self.listener = listener  # the bus socket, bound before the node started
        self.clock = clock or SystemClock()
        self.core = NodeCore(CoreSettings(settings.name, settings.bus_host, settings.bus_port,
                                          list(settings.joins), settings.membership,
                                          settings.advertise_dsn, settings.advertise_resp),
                             self.clock, rng, on_replicated=self._replicated)
        self._make_transport = transport
        self.pool: AsyncConnectionPool | None = None
        self.bus: Transport | None = None
        self.metrics: Any = None
        self._doorbell = anyio.Event()
        self._inbox: Inbox[tuple[str, m.Message]] = Inbox(INBOX_LIMIT, INBOX_BYTES, _weight)

    @property
    def node_id(self) -> str:
        return self.core.node_id

    # ------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        pool = AsyncConnectionPool(self.settings.dsn, min_size=2, max_size=self.settings.pool_size,
                                   kwargs={"autocommit": True, "application_name": "pgq-node",
                                           # generic index plans (see pgq.statements)
                                           "options": SESSION_OPTIONS},
                                   open=False, name=f"pgq-node-{self.settings.name}")
        await pool.open(wait=True, timeout=30)
        self.pool = pool
        if self.settings.metrics:
            from pgq.metrics import NodeMetrics

            self.metrics = NodeMetrics(self.settings.dsn, self._metrics_snapshot)
            self.metrics.serve(self.settings.metrics)
        try:
            await self._run(self.core.load())
            await self._run(self.core.set_meta(process_pid=str(os.getpid())))
            self.bus = self._transport()
            self.core.bus_stats = self.bus.stats.as_dict
            async with anyio.create_task_group() as tasks:
                await tasks.start(self.bus.serve)
                self._flush()  # the joins decided by load
                for loop in (self._tick_loop, self._inbox_loop, self._doorbell_loop,
                             self._outbox_loop, self._acks_loop, self._federation_loop):
                    tasks.start_soon(self._forever, loop)
                for name in ("persist", "replicate", "timers"):
                    tasks.start_soon(self._forever, self._periodic(name))
                if self._relock is not None:
                    tasks.start_soon(self._watch_lock, self._relock)
                log.info("node %s (%s) up on bus %s:%s", self.settings.name, self.node_id[:8],
                         self.settings.bus_host, self.settings.bus_port)
                task_status.started()
        finally:
            # Bounded: a stop must not wait for a database that went away
            # (the pool would wait 30 s for a connection).
            with anyio.move_on_after(1.5, shield=True):
                with contextlib.suppress(Exception):
                    await self._run(self.core.stop())
            with anyio.CancelScope(shield=True):
                await pool.close(timeout=1.0)

    def _transport(self) -> Transport:
        if self._make_transport is not None:
            return self._make_transport(self.node_id, self._on_message)
        return Bus(self.node_id, self.settings.secret, self.settings.bus_host,
                   self.settings.bus_port, self._on_message, listener=self.listener)

    async def _forever(self, loop: Any) -> None:
        name = getattr(loop, "__name__", "loop")
        while True:
            try:
                await loop()
                return
            except (psycopg.OperationalError, OSError) as exc:
                log.warning("%s: database or network error, retrying: %s", name, exc)
                await anyio.sleep(0.5)
            except Exception:
                log.exception("%s failed; restarting it", name)
                await anyio.sleep(0.5)

    async def _watch_lock(self, relock: Callable[[], None]) -> None:
        """Take the node lock again when nobody holds it (PostgreSQL restarted:
        clients read "no node process" meanwhile). Another node process
        holding it now stops this one (PgqError, out of the task group)."""
        while True:
            await anyio.sleep(LOCK_CHECK_EVERY)
            try:
                if not await self._query(Query(sql.NODE_LOCK_HELD, None, Result.VALUE)):
                    await anyio.to_thread.run_sync(relock)
                    log.warning("the node lock was lost (PostgreSQL restarted?): taken again")
            except (psycopg.OperationalError, OSError):
                continue  # the database is away: look again later
            except PgqError as exc:
                log.error("%s: stopping this node process", exc)
                raise

    def _periodic(self, name: str) -> Callable[[], Any]:
        step = getattr(self.core, name)

        async def loop() -> None:
            while True:
                await self._run(step())
                await anyio.sleep(PERIODS[name])

        loop.__name__ = f"_{name}_loop"
        return loop

    # ------------------------------------------------------------ the driver

    async def _run(self, step: Step) -> Any:
        """Run a core step: its queries on the pool, then its messages."""
        reply: Any = None
        try:
            while True:
                try:
                    request = step.send(reply)
                except StopIteration as done:
                    return done.value
                reply = await self._query(request)
                self._flush()
        finally:
            step.close()
            self._flush()

    async def _query(self, request: Query) -> Any:
        assert self.pool is not None
        async with self.pool.connection() as conn:
            cursor = await conn.execute(request.sql, request.params)
            rows = await cursor.fetchall() if cursor.description else None
            return extract(cursor, request.result, rows)

    def _flush(self) -> None:
        for change in self.core.changes:
            member, previous = change.member, change.previous
            if member.id != self.node_id and member.status != (previous.status if previous else None):
                log.info("node %s (%s) is now %s", member.name or "?", member.id[:8], member.status)
        self.core.changes.clear()
        if self.bus is None:
            # Before the bus exists (load, at start), the messages wait in
            # the core: the flush after the bus starts sends them (the joins
            # and the replication load decided were dropped here).
            return
        for host, port, message in self.core.take_outgoing():
            self.bus.send(host, port, message)

    def _replicated(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.replication.observe(seconds)

    def _metrics_snapshot(self) -> dict[str, Any]:
        """Read from the metrics thread: plain copies, no locks needed."""
        membership = self.core.membership
        statuses: dict[str, int] = {}
        for member in list(membership.members.values()) if membership else []:
            statuses[member.status] = statuses.get(member.status, 0) + 1
        return {"nodes": statuses,
                "bus": self.bus.stats.as_dict() if self.bus else
                {"messages_in": {}, "messages_out": {}, "rejected_total": 0}}

    # ------------------------------------------------------------ loops

    async def _tick_loop(self) -> None:
        while True:
            self.core.tick()
            self._flush()
            await anyio.sleep(PERIODS["tick"])

    async def _acks_loop(self) -> None:
        while True:
            self.core.collect_acks()
            self._flush()
            await anyio.sleep(PERIODS["collect_acks"])

    async def _federation_loop(self) -> None:
        while True:
            await self._run(self.core.federate())
            await anyio.sleep(self.core.federation_period())

    async def _doorbell_loop(self) -> None:
        """LISTEN for clients' doorbell; polling covers a missed one."""
        async with await psycopg.AsyncConnection.connect(self.settings.dsn, autocommit=True) as conn:
            conn.add_notify_handler(lambda _n: self._doorbell.set())
            await conn.execute(f"LISTEN {DOORBELL}")
            self._doorbell.set()  # drain whatever accumulated while we were down
            pgconn = conn.pgconn
            while True:
                await anyio.wait_readable(conn.fileno())
                # Read the notifications straight from libpq: no round trip.
                pgconn.consume_input()
                while pgconn.notifies() is not None:
                    self._doorbell.set()

    async def _outbox_loop(self) -> None:
        while True:
            with anyio.move_on_after(PERIODS["drain_outbox"]):
                await self._doorbell.wait()
            # Reset before draining: a ring from now on means events that
            # this drain may have missed; a ring before it was for events
            # committed before it, which this drain sees.
            self._doorbell = anyio.Event()
            while await self._run(self.core.drain_outbox()) >= OUTBOX_BATCH:
                pass  # a full batch: more may wait (a short one: drained)

    # ------------------------------------------------------------ messages

    async def _on_message(self, peer: str, message: m.Message) -> None:
        if isinstance(message, GOSSIP):
            step = self.core.gossip(peer, message)
            if step is not None:
                await self._run(step)
            self._flush()
            return
        if not self.core.accepts(peer, message):
            return
        # Back-pressure: the bus does not read the sender's link again
        # until the inbox has room, so a flood costs the flooder.
        await self._inbox.put((peer, message))

    async def _inbox_loop(self) -> None:
        """Apply job messages in arrival order; a run of messages of one kind
        that arrived while the previous statement ran shares one statement
        (application-level group commit: no added latency when idle)."""
        while True:
            items = await self._inbox.take()
            for run in self.core.runs(items):
                try:
                    await self._run(self.core.apply_run(run))
                except (psycopg.OperationalError, OSError):
                    raise  # _forever retries the loop; the peers retry their messages
                except Exception:
                    log.exception("handling %d %s message(s) failed", len(run), run[0][1].KIND)
