"""The node process: one PostgreSQL database plus the cluster protocols.

:class:`Node` wires the pure protocol state machines (:mod:`.membership`,
:mod:`.replication`, :mod:`.acks`, :mod:`.federation`) to the bus and to the
node's own database. Clients never talk to this process directly: they write
jobs and *outbox events* into the database (same transaction as the change),
ring a NOTIFY doorbell, and read the node's view of the cluster from SQL
views. The process carries those events to other nodes and applies what
other nodes tell it.

Invariants:

* Anything announced to another node was committed here first (outbox), and
  anything a peer confirms (GOTJOB, GOTACK) it committed before answering.
* Every periodic activity also works from the database after a restart:
  unreplicated jobs, pending ACK garbage collection and re-queue timers are
  reloaded, so a killed node process resumes where it was.
* A failure in one handler is logged and never stops the node.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import anyio
import psycopg
from psycopg_pool import AsyncConnectionPool

from . import messages as m
from . import sql
from pgq.errors import PgqError
from pgq.statements import SESSION_OPTIONS

from .acks import AckCollector
from .addresses import parse_address
from .bus import Bus
from .federation import Federation, export_count
from .membership import Changed, Config, Membership, Send
from .replication import Replicator

__all__ = ["Node", "NodeSettings"]

log = logging.getLogger("pgq.cluster.node")
DOORBELL = "pgq_node"
REPLJOB_BATCH = 500
BATCH_BYTES = 4 * 1024 * 1024  # job bodies per REPLJOB / YOURJOBS message (frames stay small)
INBOX_LIMIT = 20_000  # messages waiting to be applied: the bus stops reading beyond
INBOX_BYTES = 256 * 1024 * 1024
OUTBOX_BATCH = 2000
MESSAGE_BATCH = 2000  # ids per DELJOB / SETACK message


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


def _csv(nodes: Iterable[str]) -> str:
    return ",".join(sorted(set(nodes)))


def _copy(row: Any) -> m.JobCopy:
    return m.JobCopy(row[0], row[1], bytes(row[2]), int(row[3]), int(row[4]), float(row[5]),
                     float(row[6]), float(row[7]), int(row[8]), int(row[9]), tuple(row[10] or ()))


def _copies_params(copies: list[m.JobCopy]) -> dict[str, Any]:
    return {
        "ids": [c.id for c in copies], "queues": [c.queue for c in copies],
        "bodies": [c.body for c in copies], "ctimes": [c.ctime for c in copies],
        "repls": [c.repl for c in copies], "retries": [c.retry for c in copies],
        "delays": [c.delay for c in copies], "expires": [c.expires_at for c in copies],
        "nacks": [c.nacks for c in copies], "adds": [c.additional_deliveries for c in copies],
        "nodes": [_csv(c.nodes) for c in copies],
    }


def by_size(copies: list[m.JobCopy], count: int = REPLJOB_BATCH,
            size: int = BATCH_BYTES) -> list[tuple[m.JobCopy, ...]]:
    """Copies cut into messages of at most ``count`` jobs and about ``size``
    bytes of bodies (one bigger job travels alone)."""
    out: list[tuple[m.JobCopy, ...]] = []
    batch: list[m.JobCopy] = []
    weight = 0
    for copy in copies:
        if batch and (len(batch) >= count or weight + len(copy.body) > size):
            out.append(tuple(batch))
            batch, weight = [], 0
        batch.append(copy)
        weight += len(copy.body)
    if batch:
        out.append(tuple(batch))
    return out


def _weight(message: m.Message) -> int:
    """Roughly what a message holds in memory (its job bodies dominate)."""
    jobs = getattr(message, "jobs", ())
    return 256 + sum(len(job.body) for job in jobs)


def batched_notices(events: Iterable[tuple[str, str, str, str]]
                    ) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """Group QUEUED / WORKING notices ``(peer, kind, counter, job_id)`` into
    few messages ``(peer, kind, counter, ids)`` without changing what a peer
    sees for any one job.

    A message names a job at most once (the peer applies it with one UPDATE,
    so a repeated id would count a nack once), and two notices for the same
    job reach the peer in their original order: a job seen again for a peer
    first flushes everything pending for that peer.
    """
    out: list[tuple[str, str, str, tuple[str, ...]]] = []
    pending: dict[str, dict[tuple[str, str], list[str]]] = {}
    seen: dict[str, set[str]] = {}

    def flush(peer: str) -> None:
        for (kind, counter), ids in pending.pop(peer, {}).items():
            for i in range(0, len(ids), MESSAGE_BATCH):
                out.append((peer, kind, counter, tuple(ids[i:i + MESSAGE_BATCH])))
        seen.pop(peer, None)

    for peer, kind, counter, job_id in events:
        if job_id in seen.get(peer, ()):
            flush(peer)
        pending.setdefault(peer, {}).setdefault((kind, counter), []).append(job_id)
        seen.setdefault(peer, set()).add(job_id)
    for peer in list(pending):
        flush(peer)
    return out


class Node:
    def __init__(self, settings: NodeSettings, clock: Any = time.monotonic,
                 rng: random.Random | None = None, listener: Any = None) -> None:
        self.settings = settings
        self.listener = listener  # the bus socket, bound before the node started
        self.clock = clock
        self.rng = rng or random.Random()
        self.pool: AsyncConnectionPool | None = None
        self.node_id = ""
        self.membership: Membership | None = None
        self.replicator: Replicator | None = None
        self.acks: AckCollector | None = None
        self.federation = Federation()
        self.bus: Bus | None = None
        self.metrics: Any = None
        self.leaving = False
        self._handed_over = True  # a previous run may have left handed-over jobs
        self._members_dirty = True
        self._forgotten: list[str] = []
        self._announced: dict[str, float] = {}
        self._doorbell = anyio.Event()
        self._inbox: list[tuple[str, m.Message]] = []
        self._inbox_bytes = 0
        self._inbox_ready = anyio.Event()
        self._inbox_room = anyio.Event()

    # ------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        pool = AsyncConnectionPool(self.settings.dsn, min_size=2, max_size=self.settings.pool_size,
                                   kwargs={"autocommit": True, "application_name": "pgq-node",
                                           # generic index plans (see pgq.statements)
                                           "options": SESSION_OPTIONS},
                                   open=False, name=f"pgq-node-{self.settings.name}")
        await pool.open(wait=True, timeout=30)
        self.pool = pool
        self.metrics = None
        if self.settings.metrics:
            from pgq.metrics import NodeMetrics

            self.metrics = NodeMetrics(self.settings.dsn, self._metrics_snapshot)
            self.metrics.serve(self.settings.metrics)
        try:
            await self._load()
            self.bus = Bus(self.node_id, self.settings.secret, self.settings.bus_host,
                           self.settings.bus_port, self._on_message, listener=self.listener)
            async with anyio.create_task_group() as tasks:
                await tasks.start(self.bus.serve)
                now = self.clock()
                for host, port in self.settings.joins:
                    self._act(self.membership.join(host, port, now))
                for loop in (self._membership_loop, self._inbox_loop, self._doorbell_loop,
                             self._outbox_loop,
                             self._replication_loop, self._acks_loop, self._timers_loop,
                             self._federation_loop, self._persist_loop):
                    tasks.start_soon(self._forever, loop)
                log.info("node %s (%s) up on bus %s:%s", self.settings.name, self.node_id[:8],
                         self.settings.bus_host, self.settings.bus_port)
                task_status.started()
        finally:
            # Bounded: a stop must not wait for a database that went away
            # (the pool would wait 30 s for a connection).
            with anyio.move_on_after(1.5, shield=True):
                with contextlib.suppress(Exception):
                    await self._set_meta(process_state="stopped", heartbeat_at="-infinity")
            with anyio.CancelScope(shield=True):
                await pool.close(timeout=1.0)

    async def _forever(self, loop: Any) -> None:
        while True:
            try:
                await loop()
                return
            except (psycopg.OperationalError, OSError) as exc:
                log.warning("%s: database or network error, retrying: %s", loop.__name__, exc)
                await anyio.sleep(0.5)
            except Exception:
                log.exception("%s failed; restarting it", loop.__name__)
                await anyio.sleep(0.5)

    async def _load(self) -> None:
        node_id, incarnation, leaving = await self._one(sql.IDENTITY)
        self.node_id = node_id
        self.leaving = bool(leaving)
        me = m.Member(node_id, self.settings.bus_host, self.settings.bus_port,
                      int(incarnation) + 1, "alive", self.leaving, self.settings.name)
        self.membership = Membership(me, self.settings.membership, self.rng)
        self.replicator = Replicator(node_id, self.rng)
        self.acks = AckCollector(node_id)
        now = self.clock()
        for row in await self._all(sql.LOAD_MEMBERS):
            if row[0] == node_id:
                continue
            member = m.Member(row[0], row[2], int(row[3]), int(row[5]), "alive", bool(row[6]), row[1])
            self.membership.members[member.id] = member
            self.settings.joins.append((member.host, member.port))  # contacted at start
        await self._set_meta(node_name=self.settings.name, bus_host=self.settings.bus_host,
                             bus_port=str(self.settings.bus_port), incarnation=str(me.incarnation),
                             process_pid=str(os.getpid()), process_state="running",
                             leaving="true" if self.leaving else "false")
        await self._all(sql.HEARTBEAT)
        # Resume what a previous run left: copies still missing, acks still to collect.
        await self._start_replication(await self._all(sql.UNREPLICATED, {"myself": node_id}))
        for job_id, nodes, dummy in await self._all(sql.PENDING_ACK_GC):
            self.acks.add(job_id, None if dummy and not nodes else set(nodes or ()), now,
                          everyone=self._everyone())

    def _metrics_snapshot(self) -> dict[str, Any]:
        """Read from the metrics thread: plain copies, no locks needed."""
        statuses: dict[str, int] = {}
        for member in list(self.membership.members.values()) if self.membership else []:
            statuses[member.status] = statuses.get(member.status, 0) + 1
        return {"nodes": statuses,
                "bus": self.bus.stats.as_dict() if self.bus else
                {"messages_in": {}, "messages_out": {}, "rejected_total": 0}}

    # ------------------------------------------------------------ database

    async def _all(self, statement: str, params: dict[str, Any] | None = None) -> list[Any]:
        assert self.pool is not None
        async with self.pool.connection() as conn:
            cursor = await conn.execute(statement, params)
            return await cursor.fetchall() if cursor.description else []

    async def _one(self, statement: str, params: dict[str, Any] | None = None) -> Any:
        rows = await self._all(statement, params)
        return rows[0] if rows else None

    async def _set_meta(self, **values: str) -> None:
        await self._all(sql.SET_META, {"keys": list(values), "values": list(values.values())})

    # ------------------------------------------------------------ peers

    def _everyone(self) -> set[str]:
        return {p.id for p in self.membership.live_peers()} if self.membership else set()

    def _reachable(self) -> list[str]:
        """Peers that may take new copies: alive and not leaving."""
        return sorted(p.id for p in self.membership.reachable())

    def _alive(self) -> list[str]:
        """Peers to ask for jobs: alive, leaving ones included (they drain by federation)."""
        return sorted(p.id for p in self.membership.live_peers() if p.status == "alive")

    def _send(self, node_id: str, message: m.Message) -> None:
        peer = self.membership.get(node_id)
        if peer is not None and node_id != self.node_id and self.bus is not None:
            self.bus.send(peer.host, peer.port, message)

    def _act(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, Send):
                if self.bus is not None:
                    self.bus.send(action.host, action.port, action.message)
            elif isinstance(action, Changed):
                self._members_dirty = True
                if action.member.id != self.node_id and action.member.status != (
                        action.previous.status if action.previous else None):
                    log.info("node %s (%s) is now %s", action.member.name or "?",
                             action.member.id[:8], action.member.status)
                if action.member.status == "left" and action.member.id != self.node_id:
                    self._forgotten.append(action.member.id)

    # ------------------------------------------------------------ loops

    async def _membership_loop(self) -> None:
        while True:
            self._act(self.membership.tick(self.clock()))
            await anyio.sleep(0.05)

    async def _persist_loop(self) -> None:
        beat = 0.0
        while True:
            now = self.clock()
            if self._members_dirty or self._forgotten:
                self._members_dirty = False
                members = list(self.membership.members.values())
                forgotten, self._forgotten = self._forgotten, []
                await self._all(sql.SAVE_MEMBERS, {
                    "ids": [x.id for x in members], "names": [x.name for x in members],
                    "hosts": [x.host for x in members], "ports": [x.port for x in members],
                    "statuses": [x.status for x in members],
                    "incarnations": [x.incarnation for x in members],
                    "leavings": [x.leaving for x in members], "forgotten": forgotten,
                })
                me = self.membership.me
                await self._set_meta(incarnation=str(me.incarnation),
                                     leaving="true" if me.leaving else "false")
            if now - beat >= 1.0:
                beat = now
                await self._all(sql.HEARTBEAT)
                await self._set_meta(bus_stats=json.dumps(self.bus.stats.as_dict()))
                # Only after a hand-over (or once after start): the statement
                # scans pgq.jobs, which must not happen every second on a
                # node holding a million copies.
                handed_over, self._handed_over = self._handed_over, False
                if handed_over:  # reset first: a hand-over meanwhile sets it again
                    await self._all(sql.DROP_HANDED_OVER, {"myself": self.node_id})
            await anyio.sleep(0.25)

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
            with anyio.move_on_after(0.2):
                await self._doorbell.wait()
            # Reset before draining: a ring from now on means events that
            # this drain may have missed; a ring before it was for events
            # committed before it, which this drain sees.
            self._doorbell = anyio.Event()
            while True:
                rows = await self._all(sql.DRAIN_OUTBOX_WITH_JOBS, {"limit": OUTBOX_BATCH})
                if rows:
                    await self._handle_outbox(rows)
                if len(rows) < OUTBOX_BATCH:
                    break  # drained: no second, empty statement per batch

    async def _handle_outbox(self, rows: list[Any]) -> None:
        now = self.clock()
        to_replicate: list[Any] = []
        # Sent together after the loop: one message (one statement at the
        # peer) per peer and kind, not one per job.
        deljobs: dict[str, list[str]] = {}
        notices: list[tuple[str, str, str, str]] = []  # (peer, kind, counter, job id)
        finished_gc: list[Any] = []
        for row in rows:
            _seq, kind, job_id, queue, arg = row[:5]
            if kind == "replicate":
                if row[5] is not None:  # still there (not withdrawn or acked meanwhile)
                    to_replicate.append(row[5:])
            elif kind == "abort":
                # The client gave up: remove partial copies, best effort. If we
                # no longer know whom we sent it to (we restarted), ask everyone.
                entry = self.replicator.forget(job_id)
                for peer in entry.sent if entry else self._everyone():
                    deljobs.setdefault(peer, []).append(job_id)
            elif kind == "ack":
                holders = {n for n in (arg or "").split(",") if n and n != self.node_id}
                if arg:
                    self.acks.add(job_id, holders, now)
                else:  # dummy ack: ask everyone
                    self.acks.add(job_id, None, now, everyone=self._everyone())
            elif kind == "fastack":
                targets = (arg or "").split(",") if arg else list(self._everyone())
                for peer in targets:
                    deljobs.setdefault(peer, []).append(job_id)
            elif kind in ("queued", "working"):
                counter, _, holders = (arg or "").partition(":")
                notices += [(peer, kind, counter, job_id) for peer in holders.split(",") if peer]
            elif kind == "pause":
                for peer in self._everyone():
                    self._send(peer, m.Pause(queue, arg or "none"))
            elif kind == "meet":
                try:
                    host, port = parse_address(arg or "")
                except PgqError as exc:
                    log.warning("ignoring a meet request: %s", exc)
                    continue
                self._act(self.membership.join(host, port, now))
            elif kind == "forget":
                self._act(self.membership.forget(arg, now))
                finished_gc += self.acks.forget_node(arg)
            elif kind == "leaving":
                self.leaving = arg == "yes"
                self._act(self.membership.set_leaving(self.leaving, now))
        self._send_deljobs(deljobs)
        for peer, kind, counter, ids in batched_notices(notices):
            self._send(peer, m.Queued(ids, counter) if kind == "queued" else m.Working(ids))
        await self._finish_gcs(finished_gc)
        if to_replicate:
            await self._start_replication(to_replicate)

    # ------------------------------------------------------------ replication

    async def _start_replication(self, rows: list[Any]) -> None:
        now = self.clock()
        for row in rows:
            copy = _copy(row)
            state, _waiter, ttl_left, confirmed, repl_min = row[11], row[12], row[13], row[14], row[15]
            sync = state == "wait-repl"
            # External replication (W copies elsewhere, none here): the job was
            # stored while this node was leaving (no holder recorded, not even
            # us), or is a synchronous add drained while leaving.
            external = sync and (not confirmed or self.leaving)
            base = 0 if external else max(len(confirmed), 1)
            minimum = None if repl_min is None else int(repl_min) - base
            self.replicator.add(copy, copy.repl - base, sync, now, float(ttl_left),
                                minimum=minimum, external=external)
        self._push_replication()

    def _push_replication(self) -> None:
        sends = self.replicator.sends(self.clock(), self._reachable())
        for peer, copies in sends.items():
            for batch in by_size(copies):
                self._send(peer, m.ReplJob(batch))

    async def _replication_loop(self) -> None:
        while True:
            await anyio.sleep(0.025)
            settled = self.replicator.settled(self.clock())
            if settled:  # defaulted W: enough copies, the last targets had their grace
                await self._replication_done(settled, sync=True)
            self._push_replication()
            deljobs: dict[str, list[str]] = {}
            for entry in self.replicator.expired(self.clock()):
                for peer in entry.sent:
                    deljobs.setdefault(peer, []).append(entry.copy.id)
            self._send_deljobs(deljobs)

    async def _on_gotjobs(self, items: list[tuple[str, m.GotJob]]) -> None:
        done = []
        for peer, message in items:
            done += self.replicator.confirmed(peer, list(message.ids))
        if not done:
            return
        await self._replication_done([d for d in done if d.sync], sync=True)
        await self._replication_done([d for d in done if not d.sync], sync=False)

    async def _replication_done(self, done: list[Any], sync: bool) -> None:
        """Record jobs that got their copies: a synchronous add is achieved
        (queued here, its client woken) or, external, handed over; others
        only record their holders."""
        if not done:
            return
        if self.metrics is not None and sync:
            now = self.clock()
            for entry in done:
                self.metrics.replication.observe(now - entry.started)

        def params(entries: list[Any]) -> dict[str, Any]:
            return {
                "ids": [d.copy.id for d in entries],
                "delivered": [_csv(d.holders(self.node_id)) for d in entries],
                "confirmed": [_csv(d.confirmed_holders(self.node_id)) for d in entries],
            }

        kept = [d for d in done if not d.external]
        handed = [d for d in done if d.external]
        if kept:
            await self._all(sql.REPLICATION_ACHIEVED if sync else sql.REPLICATION_PROGRESS,
                            params(kept))
        if handed and sync:
            # A leaving node hands the job to one holder, which queues it.
            for entry in handed:
                self._send(sorted(entry.confirmed)[0], m.Enqueue((entry.copy.id,)))
            await self._all(sql.HANDED_OVER, params(handed))
            self._handed_over = True

    async def _on_repljobs(self, items: list[tuple[str, m.ReplJob]]) -> None:
        # One statement (one durable commit) for every copy that arrived
        # meanwhile; then each sender hears about the copies it sent.
        copies: dict[str, m.JobCopy] = {}
        senders: dict[str, set[str]] = {}
        for peer, message in items:
            for copy in message.jobs:
                if copy.id in copies:  # a re-sent copy: merge what it says of holders
                    merged = tuple(sorted(set(copies[copy.id].nodes) | set(copy.nodes)))
                    copy = m.JobCopy(**{**{k: getattr(copy, k) for k in copy.__slots__},
                                        "nodes": merged})
                copies[copy.id] = copy
                senders.setdefault(copy.id, set()).add(peer)
        rows = await self._all(sql.STORE_COPIES, {**_copies_params(list(copies.values())),
                                                  "myself": self.node_id})
        stored: dict[str, list[str]] = {}
        acked: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
        for kind, job_id, nodes in rows:
            for peer in senders[job_id]:
                if kind == "stored":
                    stored.setdefault(peer, []).append(job_id)
                else:
                    acked.setdefault(peer, []).append(
                        (job_id, tuple(n for n in (nodes or "").split(",") if n)))
        for peer, ids in stored.items():
            self._send(peer, m.GotJob(tuple(ids)))
        for peer, pairs in acked.items():
            self._send(peer, m.SetAck(tuple(pairs)))

    # ------------------------------------------------------------ acks

    async def _acks_loop(self) -> None:
        while True:
            reachable = set(self._everyone())
            for peer, items in self.acks.sends(self.clock(), reachable).items():
                for i in range(0, len(items), MESSAGE_BATCH):
                    self._send(peer, m.SetAck(tuple(items[i:i + MESSAGE_BATCH])))
            await anyio.sleep(0.1)

    async def _on_setacks(self, items: list[tuple[str, m.SetAck]]) -> None:
        senders: dict[str, set[str]] = {}  # job -> holders the senders know
        asked: dict[str, list[str]] = {}  # peer -> jobs it asked about
        askers: dict[str, set[str]] = {}  # job -> peers that sent the SETACK
        for peer, message in items:
            for job_id, nodes in message.items:
                senders.setdefault(job_id, set()).update(nodes)
                asked.setdefault(peer, []).append(job_id)
                askers.setdefault(job_id, set()).add(peer)
        ids = list(senders)
        rows = await self._all(sql.APPLY_SETACK, {"ids": ids,
                                                  "nodes": [_csv(senders[i]) for i in ids]})
        for job_id in ids:
            self.replicator.forget(job_id)
        known = {r[0]: bool(r[1]) for r in rows}
        for peer, job_ids in asked.items():
            self._send(peer, m.GotAck(tuple((i, known.get(i, False)) for i in dict.fromkeys(job_ids))))
        # Holders the sender did not know about (all of them, for a dummy
        # ack): we drive their GC ourselves. A dummy ack that reached the
        # only holder is complete at once.
        now = self.clock()
        drive_ids, drive_nodes, finished = [], [], []
        for job_id, known, local_nodes in rows:
            if not known:
                continue
            told = senders.get(job_id, set())
            extra = set(local_nodes or ()) - told - {self.node_id} - askers[job_id]
            if extra:
                holders = set(local_nodes) | told
                self.acks.add(job_id, holders - {self.node_id}, now)
                drive_ids.append(job_id)
                drive_nodes.append(_csv(holders))
            elif not told:
                finished.append(job_id)
        if drive_ids:
            await self._all(sql.TRACK_ACK_GC, {"ids": drive_ids, "nodes": drive_nodes})
        if finished:
            await self._all(sql.APPLY_DELJOB, {"ids": finished})

    async def _on_gotacks(self, items: list[tuple[str, m.GotAck]]) -> None:
        outcomes = []
        for peer, message in items:
            for job_id, known in message.items:
                outcome = self.acks.got_ack(peer, job_id, known)
                if outcome is not None:
                    outcomes.append(outcome)
        await self._finish_gcs(outcomes)

    async def _finish_gcs(self, outcomes: list[Any]) -> None:
        """ACK GC done for these jobs: every holder deletes them, and so do we
        (one DELJOB per holder and one statement here, however many jobs)."""
        if not outcomes:
            return
        deljobs: dict[str, list[str]] = {}
        for outcome in outcomes:
            for holder in outcome.deljob_to:
                deljobs.setdefault(holder, []).append(outcome.job_id)
        self._send_deljobs(deljobs)
        await self._all(sql.APPLY_DELJOB, {"ids": [o.job_id for o in outcomes]})

    def _send_deljobs(self, deljobs: dict[str, list[str]]) -> None:
        for peer, ids in deljobs.items():
            for i in range(0, len(ids), MESSAGE_BATCH):
                self._send(peer, m.DelJob(tuple(ids[i:i + MESSAGE_BATCH])))

    async def _on_deljobs(self, items: list[tuple[str, m.DelJob]]) -> None:
        ids = list(dict.fromkeys(job_id for _peer, message in items for job_id in message.ids))
        for job_id in ids:
            self.acks.forget(job_id)
            self.replicator.forget(job_id)
        await self._all(sql.APPLY_DELJOB, {"ids": ids})

    # ------------------------------------------------------------ one queued copy

    async def _timers_loop(self) -> None:
        while True:
            now_wall = time.time()
            soon = await self._all(sql.TIMERS_SOON, {"ahead": 0.5})
            willqueue: dict[str, list[str]] = {}
            for job_id, nodes, due in soon:
                if self._announced.get(job_id) == due:
                    continue
                self._announced[job_id] = due
                for peer in nodes:
                    if peer != self.node_id:
                        willqueue.setdefault(peer, []).append(job_id)
            for peer, ids in willqueue.items():
                self._send(peer, m.WillQueue(tuple(ids)))
            fired = await self._all(sql.FIRE_TIMERS)
            queued: dict[tuple[str, str], list[str]] = {}
            for job_id, _queue, nodes, counted, _woken in fired:
                self._announced.pop(job_id, None)
                counter = "additional_deliveries" if counted else ""
                for peer in nodes:
                    if peer != self.node_id:
                        queued.setdefault((peer, counter), []).append(job_id)
            for (peer, counter), ids in queued.items():
                self._send(peer, m.Queued(tuple(ids), counter))
            self._announced = {k: v for k, v in self._announced.items() if v > now_wall - 5}
            await anyio.sleep(0.1)

    async def _on_willqueue(self, peer: str, message: m.WillQueue) -> None:
        rows = await self._all(sql.WILLQUEUE_STATE, {"ids": list(message.ids)})
        queued = tuple(r[0] for r in rows if r[1] == "queued")
        acked = tuple((r[0], tuple(r[2] or ())) for r in rows if r[1] == "acked")
        if queued:
            self._send(peer, m.Queued(queued, ""))
        if acked:
            self._send(peer, m.SetAck(acked))

    async def _on_queued(self, peer: str, message: m.Queued) -> None:
        await self._all(sql.APPLY_QUEUED, {"ids": list(message.ids), "counter": message.counter,
                                           "sender": peer, "myself": self.node_id})

    async def _on_working(self, peer: str, message: m.Working) -> None:
        await self._all(sql.APPLY_WORKING, {"ids": list(message.ids)})

    async def _on_enqueue(self, peer: str, message: m.Enqueue) -> None:
        await self._all(sql.APPLY_ENQUEUE, {"ids": list(message.ids)})

    # ------------------------------------------------------------ federation

    async def _federation_loop(self) -> None:
        stats_at = 0.0
        while True:
            now = self.clock()
            if not self.leaving:  # a leaving node does not import
                for queue, length in await self._all(sql.WAITED_QUEUES):
                    if length > 0:
                        continue
                    for targets, count in self.federation.needs(queue, now, self._alive()):
                        for peer in targets:
                            self._send(peer, m.NeedJobs(queue, count))
            if now - stats_at >= 1.0:
                stats_at = now
                stats = self.federation.stats(now)
                await self._all(sql.SAVE_IMPORT_STATS, {
                    "queues": list(stats), "nodes": [_csv(s[0]) for s in stats.values()],
                    "rates": [s[1] for s in stats.values()]})
            # While jobs flow in, look again soon: each look may ask for the
            # next batch (paced by Federation's back-off), so the import rate
            # is not capped by this loop's period. Idle, 10 looks a second.
            await anyio.sleep(0.02 if self.federation.stats(now) else 0.1)

    async def _on_needjobs(self, peer: str, message: m.NeedJobs) -> None:
        if self.federation.importing(message.queue, self.clock()):
            return  # we are importing this queue ourselves
        queued, paused = await self._one(sql.QUEUE_READY, {"queue": message.queue})
        count = export_count(message.count, int(queued))
        if paused or count == 0:
            return
        rows = await self._all(sql.EXPORT_JOBS, {"queue": message.queue, "count": count,
                                                 "myself": self.node_id, "requester": peer})
        if rows:
            for batch in by_size([_copy(r) for r in rows]):
                self._send(peer, m.YourJobs(batch))

    async def _on_yourjobs(self, peer: str, message: m.YourJobs) -> None:
        if not message.jobs:
            return
        rows = await self._all(sql.IMPORT_JOBS, {**_copies_params(list(message.jobs)),
                                                 "myself": self.node_id, "sender": peer})
        now = self.clock()
        for queue, count, _woken in rows:
            self.federation.imported(queue, peer, int(count), now)

    async def _on_pause(self, peer: str, message: m.Pause) -> None:
        await self._all(sql.APPLY_PAUSE, {"queue": message.queue, "state": message.state})

    # ------------------------------------------------------------ dispatch

    async def _on_message(self, peer: str, message: m.Message) -> None:
        if isinstance(message, (m.Ping, m.Ack, m.PingReq, m.PushPull, m.Forget)):
            self._act(self.membership.receive(peer, message, self.clock()))
            if isinstance(message, m.Forget):
                await self._finish_gcs(self.acks.forget_node(message.node))
            return
        if self.membership.get(peer) is None:
            return  # jobs only from members we know (they gossip before anything else)
        if type(message) in self._handlers or type(message) in self._batch_handlers:
            # Back-pressure: the bus does not read the sender's link again
            # until the inbox has room, so a flood costs the flooder.
            while len(self._inbox) >= INBOX_LIMIT or self._inbox_bytes >= INBOX_BYTES:
                self._inbox_room = anyio.Event()
                await self._inbox_room.wait()
            self._inbox.append((peer, message))
            self._inbox_bytes += _weight(message)
            self._inbox_ready.set()

    async def _inbox_loop(self) -> None:
        """Apply job messages in arrival order; a run of messages of one kind
        that arrived while the previous statement ran shares one statement
        (application-level group commit: no added latency when idle)."""
        while True:
            await self._inbox_ready.wait()
            self._inbox_ready = anyio.Event()
            items, self._inbox = self._inbox, []
            self._inbox_bytes = 0
            self._inbox_room.set()
            for kind, group in itertools.groupby(items, key=lambda item: type(item[1])):
                run = list(group)
                batch = self._batch_handlers.get(kind)
                try:
                    if batch is not None:
                        await batch(self, run)
                    else:
                        for peer, message in run:
                            await self._handlers[kind](self, peer, message)
                except (psycopg.OperationalError, OSError):
                    raise  # _forever retries the loop; the peers retry their messages
                except Exception:
                    log.exception("handling %d %s message(s) failed", len(run), kind.KIND)

    _batch_handlers: dict[type, Any] = {
        m.ReplJob: _on_repljobs, m.GotJob: _on_gotjobs, m.SetAck: _on_setacks,
        m.GotAck: _on_gotacks, m.DelJob: _on_deljobs,
    }
    _handlers: dict[type, Any] = {
        m.WillQueue: _on_willqueue,
        m.Queued: _on_queued, m.Working: _on_working, m.Enqueue: _on_enqueue,
        m.NeedJobs: _on_needjobs, m.YourJobs: _on_yourjobs, m.Pause: _on_pause,
    }
