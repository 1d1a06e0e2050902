"""The node's core: every protocol decision and database step, free of I/O.

:class:`NodeCore` holds the state of one node (membership, replication,
ACK collection, re-queue announcements, federation) and exposes *steps*:
generators that yield :class:`pgq.protocol.Query` requests for the node's
own database (the idiom of :mod:`pgq.commands`) and leave the messages to
send in :attr:`NodeCore.outgoing`. Nothing here reads a real clock, opens
a socket or touches a database: :mod:`.node` runs the steps with anyio, a
connection pool and a :class:`~.transport.Transport`; the simulation runs
the same steps under a virtual clock, an in-memory network and a
synchronous database connection.

Steps and when a driver runs them (:data:`PERIODS`, seconds):

* :meth:`load` once, before anything else (state of a previous run:
  identity, members, jobs still lacking copies, ACKs still to collect);
* :meth:`tick` (membership) every 0.05; :meth:`persist` every 0.25;
  :meth:`replicate` every 0.025; :meth:`collect_acks` every 0.1;
  :meth:`timers` every 0.1; :meth:`federate` every 0.1 (0.02 while
  importing: :meth:`federation_period`);
* :meth:`drain_outbox` when a client rings the doorbell, and every 0.2;
* ADVERT (this node's database DSN, for other nodes' clients to write
  copies into) to each peer that comes alive, and to every live peer each
  :data:`ADVERT_EVERY` (from :meth:`persist`); a peer's ADVERT is kept in
  memory and written with the members;
* :meth:`gossip` for every membership message, at once; job messages that
  :meth:`accepts` are queued by the driver and applied in arrival order by
  :meth:`apply_run`, a run of one kind (:meth:`runs`) in one statement.

Invariants (each step keeps them whatever the interleaving):

* A message announcing a change is produced only after the statement that
  committed the change returned (outbox drained, copies stored, acks
  recorded): nothing is announced that did not commit here.
* A step may be cut short by a crash at any yield: everything it decided
  and did not commit is recomputed by :meth:`load` (or re-sent by a peer).
* Failure detection only chooses targets; no decision about a job's safety
  depends on it.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

from pgq import contracts as c
from pgq.errors import PgqError
from pgq.protocol import Query, Result

from . import messages as m
from . import sql
from .acks import AckCollector, Outcome, take_over
from .addresses import parse_address
from .clock import Clock
from .federation import Federation, export_count
from .membership import Changed, Config, Membership, Send
from .replication import Replicator
from .requeue import ANNOUNCE_AHEAD, Requeues

__all__ = ["NodeCore", "CoreSettings", "Step", "PERIODS", "GOSSIP", "by_size", "batched_notices",
           "REPLJOB_BATCH", "BATCH_BYTES", "OUTBOX_BATCH", "MESSAGE_BATCH"]

Step = Generator[Query, Any, Any]

REPLJOB_BATCH = 500
BATCH_BYTES = 4 * 1024 * 1024  # job bodies per REPLJOB / YOURJOBS message (frames stay small)
OUTBOX_BATCH = 2000
MESSAGE_BATCH = 2000  # ids per DELJOB / SETACK message
UNPARK_BATCH = 2000  # parked copies brought back per statement (requeue.py)
PERIODS = {"tick": 0.05, "persist": 0.25, "replicate": 0.025, "collect_acks": 0.1,
           "timers": 0.1, "federate": 0.1, "drain_outbox": 0.2}
HEARTBEAT_EVERY = 1.0
ADVERT_EVERY = 30.0  # repairs a lost ADVERT; a changed DSN comes with a restart (alive again)
IMPORT_STATS_EVERY = 1.0
# How often the ACK collections in memory are checked against the
# tombstones: one whose tombstone is gone (swept at the job's TTL) ends.
ACK_PRUNE_EVERY = 60.0
# A restarted node's overdue copy timers fire this long after their
# WILLQUEUE window opens: time for the peers to see it alive again and
# send the SETACKs it missed while down.
RESTART_GRACE = 1.0

# Messages applied through the inbox, in arrival order: a run of one kind in one statement.
BATCHED = (m.ReplJob, m.GotJob, m.SetAck, m.GotAck, m.DelJob)
ONE_BY_ONE = (m.WillQueue, m.Queued, m.Working, m.Enqueue, m.NeedJobs, m.YourJobs, m.Pause)
GOSSIP = (m.Ping, m.Ack, m.PingReq, m.PushPull, m.Forget, m.Advert)


@dataclass
class CoreSettings:
    name: str
    bus_host: str
    bus_port: int
    joins: list[tuple[str, int]] = field(default_factory=list)
    membership: Config = field(default_factory=Config)
    advertise_dsn: str = ""  # this node's database, for other nodes' clients ("": none)
    advertise_resp: str = ""  # HOST:PORT of this node's RESP front, for HELLO ("": none)


def _csv(nodes: Iterable[str]) -> str:
    return ",".join(sorted(set(nodes)))


def _copy(row: sql.CopyRow) -> m.JobCopy:
    return m.JobCopy(row.id, row.queue, bytes(row.body), int(row.ctime), int(row.repl),
                     float(row.retry), float(row.delay), float(row.expires_at), int(row.nacks),
                     int(row.additional_deliveries), tuple(row.nodes or ()), int(row.priority),
                     row.key)


def _copies_params(copies: list[m.JobCopy]) -> dict[str, Any]:
    return {
        "ids": [c.id for c in copies], "queues": [c.queue for c in copies],
        "bodies": [c.body for c in copies], "ctimes": [c.ctime for c in copies],
        "repls": [c.repl for c in copies], "retries": [c.retry for c in copies],
        "delays": [c.delay for c in copies], "expires": [c.expires_at for c in copies],
        "nacks": [c.nacks for c in copies], "adds": [c.additional_deliveries for c in copies],
        "nodes": [_csv(c.nodes) for c in copies],
        "priorities": [c.priority for c in copies], "keys": [c.key for c in copies],
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


def _rows(statement: str, params: dict[str, Any] | None = None) -> Query:
    return Query(statement, params, Result.ROWS)


def _row(statement: str, params: dict[str, Any] | None = None) -> Query:
    return Query(statement, params, Result.ROW)


class NodeCore:
    """One node's protocol state and steps (see the module doc)."""

    def __init__(self, settings: CoreSettings, clock: Clock, rng: random.Random | None = None,
                 on_replicated: Callable[[float], None] | None = None) -> None:
        self.settings = settings
        self.clock = clock
        self.rng = rng or random.Random()
        self.on_replicated = on_replicated  # seconds a synchronous replication took (metrics)
        self.node_id = ""
        self.membership: Membership | None = None
        self.replicator: Replicator | None = None
        self.acks: AckCollector | None = None
        self.requeues: Requeues | None = None
        self.federation = Federation()
        self.leaving = False
        self.outgoing: list[tuple[str, int, m.Message]] = []  # (host, port, message) to send
        self.changes: list[Changed] = []  # membership changes, for the driver's log
        self._handed_over = True  # a previous run may have left handed-over jobs
        self._members_dirty = True
        self._forgotten: list[str] = []
        self._unpark: set[str] = set()  # holders whose parked copies come back (requeue.py)
        self._beat_at = float("-inf")
        self._advert_at = float("-inf")
        self._ack_prune_at = 0.0
        self._import_stats_at = float("-inf")
        self.adverts: dict[str, str] = {}  # peer id -> the DSN it advertised ("": none)
        self.resp_adverts: dict[str, str] = {}  # peer id -> its RESP address ("": none)
        self.bus_stats: Callable[[], dict[str, Any]] = dict

    # ------------------------------------------------------------ lifecycle

    def load(self) -> Step:
        """Identity, members, and what a previous run left unfinished."""
        node_id, incarnation, leaving = yield _row(sql.IDENTITY)
        self.node_id = node_id
        self.leaving = bool(leaving)
        me = m.Member(node_id, self.settings.bus_host, self.settings.bus_port,
                      min(int(incarnation) + 1, m.MAX_INCARNATION), "alive", self.leaving,
                      self.settings.name)
        self.membership = Membership(me, self.settings.membership, self.rng)
        self.replicator = Replicator(node_id, self.rng)
        self.acks = AckCollector(node_id)
        self.requeues = Requeues(node_id)
        now = self.clock.monotonic()
        joins = list(self.settings.joins)
        for row in (yield _rows(sql.LOAD_MEMBERS)):
            member_id, name, host, port, status, member_incarnation, member_leaving, dsn, resp = row
            if member_id == node_id:
                continue
            if dsn is not None:
                self.adverts[member_id] = dsn
            if resp is not None:
                self.resp_adverts[member_id] = resp
            # A member seen dead stays dead until it refutes that (a restarted
            # node raises its incarnation): loaded as alive, a node forgotten
            # while this one was down came back into every view through this
            # one's gossip. Suspects are probed again, as alive ones.
            self.membership.members[member_id] = m.Member(
                member_id, host, int(port), int(member_incarnation),
                "dead" if status == "dead" else "alive", bool(member_leaving), name)
            joins.append((host, int(port)))  # contacted at start
        yield from self.set_meta(node_name=self.settings.name, bus_host=self.settings.bus_host,
                                 bus_port=str(self.settings.bus_port),
                                 incarnation=str(me.incarnation), process_state="running",
                                 leaving="true" if self.leaving else "false")
        yield _rows(sql.HEARTBEAT)
        # Resume what a previous run left: copies still missing, acks still to collect.
        unreplicated = yield _rows(sql.UNREPLICATED, {"myself": node_id})
        yield from self._resume_replication([sql.ReplicationRow.of(r) for r in unreplicated])
        emptied = []  # collections whose every other holder was forgotten: done
        for job_id, nodes, dummy in (yield _rows(sql.PENDING_ACK_GC)):
            if not dummy and not set(nodes or ()) - {node_id}:
                emptied.append(Outcome(job_id, ()))
                continue
            self.acks.add(job_id, None if dummy and not nodes else set(nodes or ()), now,
                          everyone=self._all_known())
        yield from self._finish_gcs(emptied)
        yield _rows(sql.POSTPONE_OVERDUE_TIMERS, {"after": ANNOUNCE_AHEAD + RESTART_GRACE})
        # Copies parked on a node not known alive: it may have died, or left,
        # while this one was down (its death would never be seen now).
        alive = [node_id, *self._alive()]
        while len((yield _rows(sql.UNPARK_UNLESS_ALIVE, {"alive": alive, "limit": UNPARK_BATCH}))) \
                == UNPARK_BATCH:
            pass  # the next batch
        for host, port in joins:
            self._act(self.membership.join(host, port, now))

    def stop(self) -> Step:
        """What a node that stops cleanly records (best effort)."""
        yield from self.set_meta(process_state="stopped", heartbeat_at="-infinity")

    def set_meta(self, **values: str) -> Step:
        yield _rows(sql.SET_META, {"keys": list(values), "values": list(values.values())})

    # ------------------------------------------------------------ peers

    def _everyone(self) -> set[str]:
        return {p.id for p in self.membership.live_peers()} if self.membership else set()

    def _all_known(self) -> set[str]:
        """Every member, those declared dead too: whom a dummy ack must
        reach. Failure detection is advisory (it never decides a job's
        safety): a dummy asked only the live nodes, and completed without
        the holders declared dead, which served the job again on return."""
        assert self.membership is not None
        return set(self.membership.members) - {self.node_id}

    def _reachable(self) -> list[str]:
        """Peers that may take new copies: alive and not leaving."""
        assert self.membership is not None
        return sorted(p.id for p in self.membership.reachable())

    def _alive(self) -> list[str]:
        """Peers to ask for jobs: alive, leaving ones included (they drain by federation)."""
        assert self.membership is not None
        return sorted(p.id for p in self.membership.live_peers() if p.status == "alive")

    def send(self, node_id: str, message: m.Message) -> None:
        assert self.membership is not None
        peer = self.membership.get(node_id)
        if peer is not None and node_id != self.node_id:
            self.outgoing.append((peer.host, peer.port, message))

    def _act(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, Send):
                self.outgoing.append((action.host, action.port, action.message))
            elif isinstance(action, Changed):
                self._members_dirty = True
                self.changes.append(action)
                member, previous = action.member, action.previous
                if member.status == "left" and member.id != self.node_id:
                    self._forgotten.append(member.id)
                    self.adverts.pop(member.id, None)
                if member.status != "alive" and member.id != self.node_id:
                    self._unpark.add(member.id)  # suspect, dead or gone: see timers()
                if member.status == "alive" and member.id != self.node_id and \
                        (previous is None or previous.status != "alive"
                         or member.incarnation > previous.incarnation):
                    # A peer (re)joined (or restarted faster than it could
                    # be suspected: a higher incarnation): it may have lost
                    # what we advertised, or be new; it learns our DSN now,
                    # not in ADVERT_EVERY.
                    self.outgoing.append((member.host, member.port, self._advert()))
                    if self.acks is not None:  # and the ACKs it missed, before its timers fire
                        self.acks.peer_back(member.id, self.clock.monotonic())

    def _advert(self) -> m.Advert:
        return m.Advert(self.settings.advertise_dsn, self.settings.advertise_resp)

    def _on_advert(self, peer: str, message: m.Advert) -> None:
        if self.adverts.get(peer) != message.dsn or self.resp_adverts.get(peer) != message.resp:
            self.adverts[peer] = message.dsn
            self.resp_adverts[peer] = message.resp
            self._members_dirty = True

    def take_outgoing(self) -> list[tuple[str, int, m.Message]]:
        out, self.outgoing = self.outgoing, []
        return out

    # ------------------------------------------------------------ membership

    def tick(self) -> None:
        """Failure detection and gossip (no database)."""
        assert self.membership is not None
        self._act(self.membership.tick(self.clock.monotonic()))

    def persist(self) -> Step:
        """Members and flags to the database; heartbeat and bus stats once a second."""
        assert self.membership is not None
        now = self.clock.monotonic()
        if now - self._advert_at >= ADVERT_EVERY:
            self._advert_at = now
            for peer in self.membership.live_peers():
                self.outgoing.append((peer.host, peer.port, self._advert()))
        if self._members_dirty or self._forgotten:
            self._members_dirty = False
            members = list(self.membership.members.values())
            forgotten, self._forgotten = self._forgotten, []
            try:
                yield _rows(sql.SAVE_MEMBERS, {
                    "ids": [x.id for x in members], "names": [x.name for x in members],
                    "hosts": [x.host for x in members], "ports": [x.port for x in members],
                    "statuses": [x.status for x in members],
                    "incarnations": [x.incarnation for x in members],
                    "leavings": [x.leaving for x in members], "forgotten": forgotten,
                    "dsns": [self.adverts.get(x.id) or None for x in members],
                    "resps": [(self.settings.advertise_resp if x.id == self.node_id
                               else self.resp_adverts.get(x.id)) or None for x in members],
                    })
                if forgotten:
                    yield _rows(sql.UNHOLD_FORGOTTEN, {"forgotten": forgotten})
            except BaseException:
                # Not saved (a database error ends the step here): the next
                # persist saves again, forgotten nodes included; dropped,
                # they stayed in pgq.nodes and came back alive at restart.
                self._members_dirty = True
                self._forgotten = forgotten + self._forgotten
                raise
            me = self.membership.me
            yield from self.set_meta(incarnation=str(me.incarnation),
                                     leaving="true" if me.leaving else "false")
        if now - self._beat_at >= HEARTBEAT_EVERY:
            self._beat_at = now
            yield _rows(sql.HEARTBEAT)
            yield from self.set_meta(bus_stats=json.dumps(self.bus_stats()))
            # Only after a hand-over (or once after start): the statement
            # scans pgq.jobs, which must not happen every second on a node
            # holding a million copies.
            handed_over, self._handed_over = self._handed_over, False
            if handed_over:  # reset first: a hand-over meanwhile sets it again
                yield _rows(sql.DROP_HANDED_OVER, {"myself": self.node_id})
        if now - self._ack_prune_at >= ACK_PRUNE_EVERY:
            self._ack_prune_at = now
            yield from self._prune_ack_gcs()

    def _prune_ack_gcs(self) -> Step:
        """End the ACK collections whose tombstone is gone: the sweep drops
        a tombstone at the job's TTL, and a holder that never answers (a
        node forgotten since) kept its collection in memory for the life of
        the process, retried every 3 minutes, and reloaded at each start."""
        assert self.acks is not None
        pending = list(self.acks.pending)
        if not pending:
            return
        kept = {row[0] for row in (yield _rows(sql.ACKED_HERE, {"ids": pending}))}
        for job_id in pending:
            if job_id not in kept:
                self.acks.forget(job_id)

    # ------------------------------------------------------------ outbox

    def drain_outbox(self) -> Step:
        """Carry one batch of client events to the cluster; returns how many
        events it drained (a full batch: call again)."""
        rows = sql.outbox_rows((yield _rows(sql.DRAIN_OUTBOX_WITH_JOBS, {"limit": OUTBOX_BATCH})))
        if rows:
            yield from self._handle_outbox(rows)
        return len(rows)

    def _handle_outbox(self, rows: list[tuple[sql.OutboxEvent, sql.ReplicationRow | None]]) -> Step:
        assert self.membership is not None and self.acks is not None and self.replicator is not None
        now = self.clock.monotonic()
        to_replicate: list[sql.ReplicationRow] = []
        # Sent together after the loop: one message (one statement at the
        # peer) per peer and kind, not one per job.
        deljobs: dict[str, list[str]] = {}
        notices: list[tuple[str, str, str, str]] = []  # (peer, kind, counter, job id)
        known: dict[str, tuple[str, ...]] = {}  # job id -> every holder we know
        finished_gc: list[Any] = []
        for event, job in rows:
            kind, job_id, arg = event.kind, event.job_id, event.arg
            if kind == c.OUTBOX_REPLICATE:
                if job is not None:  # still there (not withdrawn or acked meanwhile)
                    to_replicate.append(job)
            elif kind == c.OUTBOX_ABORT:
                # The client gave up: remove partial copies, best effort. If we
                # no longer know whom we sent it to (we restarted), ask everyone.
                entry = self.replicator.forget(job_id or "", ended=True)
                for peer in entry.sent if entry else self._everyone():
                    deljobs.setdefault(peer, []).append(job_id or "")
            elif kind == c.OUTBOX_ACK:
                # Done with: no more REPLJOBs (a re-send reached a target
                # after its SETACK and stored the job again).
                self.replicator.forget(job_id or "", ended=True)
                holders = set(c.split_holders(arg)) - {self.node_id}
                if arg:
                    self.acks.add(job_id or "", holders, now)
                else:  # dummy ack: ask everyone
                    self.acks.add(job_id or "", None, now, everyone=self._all_known())
            elif kind == c.OUTBOX_FASTACK:
                self.replicator.forget(job_id or "", ended=True)
                targets = c.split_holders(arg) or sorted(self._everyone())
                for peer in targets:
                    deljobs.setdefault(peer, []).append(job_id or "")
            elif kind in (c.OUTBOX_QUEUED, c.OUTBOX_WORKING):
                counter, peers = c.split_notice(arg)
                notices += [(peer, kind, counter, job_id or "") for peer in peers]
                known[job_id or ""] = tuple(sorted({*peers, self.node_id}))
            elif kind == c.OUTBOX_PAUSE:
                for peer in self._everyone():
                    self.send(peer, m.Pause(event.queue or "", arg or "none"))
            elif kind == c.OUTBOX_MEET:
                try:
                    host, port = parse_address(arg or "")
                except PgqError:
                    continue  # checked by the CLI; a hand-written event is ignored
                self._act(self.membership.join(host, port, now))
            elif kind == c.OUTBOX_FORGET:
                self._act(self.membership.forget(arg or "", now))
                finished_gc += self.acks.forget_node(arg or "")
            elif kind == c.OUTBOX_LEAVING:
                self.leaving = arg == "yes"
                self._act(self.membership.set_leaving(self.leaving, now))
        self._send_deljobs(deljobs)
        for peer, kind, counter, ids in batched_notices(notices):
            self.send(peer, m.Queued(ids, counter, tuple(known[i] for i in ids))
                      if kind == c.OUTBOX_QUEUED else m.Working(ids))
        yield from self._finish_gcs(finished_gc)
        if to_replicate:
            yield from self._resume_replication(to_replicate)

    # ------------------------------------------------------------ replication

    def _resume_replication(self, rows: list[sql.ReplicationRow]) -> Step:
        assert self.replicator is not None
        now = self.clock.monotonic()
        for row in rows:
            self.replicator.resume(_copy(row.copy), row.state, list(row.confirmed or ()), row.repl_min,
                                   float(row.ttl_left), self.leaving, now)
        yield from self._push_replication()

    def _push_replication(self) -> Step:
        """Send the REPLJOBs due now. Targets new to a job are first
        recorded as its holders on this node's row (RECORD_HOLDERS, which
        says why); a job whose row is gone (acked, deleted) is forgotten
        and sends nothing."""
        assert self.replicator is not None
        sends = self.replicator.sends(self.clock.monotonic(), self._reachable())
        fresh = self.replicator.unrecorded()
        if fresh:
            kept = {row[0] for row in (yield _rows(sql.RECORD_HOLDERS, {
                "ids": [e.copy.id for e in fresh],
                "delivered": [_csv(e.holders(self.node_id)) for e in fresh]}))}
            for entry in fresh:
                if entry.copy.id in kept:
                    entry.recorded = set(entry.sent)
                else:
                    # acked or withdrawn; or, external (a leaving origin),
                    # handed over: its late copies are the heirs' to keep
                    self.replicator.forget(entry.copy.id, ended=not entry.external)
            gone = {e.copy.id for e in fresh} - kept
            if gone:
                sends = {peer: [c for c in copies if c.id not in gone]
                         for peer, copies in sends.items()}
        for peer, copies in sends.items():
            for batch in by_size(copies):
                self.send(peer, m.ReplJob(batch))

    def replicate(self) -> Step:
        """Widen, re-send, settle and expire pending replications."""
        assert self.replicator is not None
        settled = self.replicator.settled(self.clock.monotonic())
        if settled:  # defaulted W: enough copies, the last targets had their grace
            yield from self._replication_done(settled, sync=True)
        yield from self._push_replication()
        deljobs: dict[str, list[str]] = {}
        for entry in self.replicator.expired(self.clock.monotonic()):
            for peer in entry.sent:
                deljobs.setdefault(peer, []).append(entry.copy.id)
        self._send_deljobs(deljobs)

    def _on_gotjobs(self, items: list[tuple[str, m.GotJob]]) -> Step:
        assert self.replicator is not None
        done = []
        now = self.clock.monotonic()
        for peer, message in items:
            done += self.replicator.confirmed(peer, list(message.ids))
            self._delete_late_copies(peer, message.ids, now)
        if done:
            yield from self._replication_done([d for d in done if d.sync], sync=True)
            yield from self._replication_done([d for d in done if not d.sync], sync=False)

    def _delete_late_copies(self, peer: str, ids: tuple[str, ...] | list[str], now: float) -> None:
        """DELJOB to a peer whose copies of ended jobs landed late (see
        Replicator.late_copies)."""
        assert self.replicator is not None
        late = self.replicator.late_copies(peer, ids, now)
        if late:
            self._send_deljobs({peer: late})

    def _replication_done(self, done: list[Any], sync: bool) -> Step:
        """Record jobs that got their copies: a synchronous add is achieved
        (queued here, its client woken) or, external, handed over; others
        only record their holders."""
        if not done:
            return
        if self.on_replicated is not None and sync:
            now = self.clock.monotonic()
            for entry in done:
                self.on_replicated(now - entry.started)

        def params(entries: list[Any]) -> dict[str, Any]:
            return {
                "ids": [d.copy.id for d in entries],
                "delivered": [_csv(d.holders(self.node_id)) for d in entries],
                "confirmed": [_csv(d.confirmed_holders(self.node_id)) for d in entries],
            }

        kept = [d for d in done if not d.external]
        handed = [d for d in done if d.external]
        if kept:
            yield _rows(sql.REPLICATION_ACHIEVED if sync else sql.REPLICATION_PROGRESS, params(kept))
        if handed and sync:
            # A leaving node hands the job to one holder, which queues it.
            for entry in handed:
                self.send(entry.heir(), m.Enqueue((entry.copy.id,)))
            yield _rows(sql.HANDED_OVER, params(handed))
            self._handed_over = True

    def _on_repljobs(self, items: list[tuple[str, m.ReplJob]]) -> Step:
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
        rows = yield _rows(sql.STORE_COPIES, {**_copies_params(list(copies.values())),
                                              "myself": self.node_id})
        stored: dict[str, list[str]] = {}
        acked: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
        for kind, job_id, nodes in rows:
            for peer in sorted(senders[job_id]):
                if kind == "stored":
                    stored.setdefault(peer, []).append(job_id)
                else:
                    acked.setdefault(peer, []).append(
                        (job_id, tuple(n for n in (nodes or "").split(",") if n)))
        for peer, ids in stored.items():
            self.send(peer, m.GotJob(tuple(ids)))
        for peer, pairs in acked.items():
            self.send(peer, m.SetAck(tuple(pairs)))

    # ------------------------------------------------------------ acks

    def collect_acks(self) -> None:
        """SETACKs due to holders that have not confirmed yet (no database)."""
        assert self.acks is not None
        for peer, items in self.acks.sends(self.clock.monotonic(), self._everyone()).items():
            for i in range(0, len(items), MESSAGE_BATCH):
                self.send(peer, m.SetAck(tuple(items[i:i + MESSAGE_BATCH])))

    def _on_setacks(self, items: list[tuple[str, m.SetAck]]) -> Step:
        assert self.acks is not None and self.replicator is not None
        told: dict[str, set[str]] = {}  # job -> holders the senders know
        asked: dict[str, list[str]] = {}  # peer -> jobs it asked about
        askers: dict[str, set[str]] = {}  # job -> peers that sent the SETACK
        for peer, message in items:
            for job_id, nodes in message.items:
                told.setdefault(job_id, set()).update(nodes)
                asked.setdefault(peer, []).append(job_id)
                askers.setdefault(job_id, set()).add(peer)
        ids = list(told)
        rows = yield _rows(sql.APPLY_SETACK, {"ids": ids, "nodes": [_csv(told[i]) for i in ids],
                                              "askers": [_csv(askers[i]) for i in ids],
                                              "myself": self.node_id})
        for job_id in ids:
            self.replicator.forget(job_id, ended=True)
        known = {r[0]: bool(r[1]) for r in rows}
        for peer, job_ids in asked.items():
            self.send(peer, m.GotAck(tuple((i, known.get(i, False)) for i in dict.fromkeys(job_ids))))
        decided = take_over(self.node_id, [(r[0], bool(r[1]), r[2]) for r in rows], told, askers)
        now = self.clock.monotonic()
        for job_id, holders in decided.drive.items():
            self.acks.add(job_id, holders - {self.node_id}, now)
        if decided.drive:
            yield _rows(sql.TRACK_ACK_GC, {"ids": list(decided.drive),
                                           "nodes": [_csv(h) for h in decided.drive.values()]})
        if decided.finished:
            yield _rows(sql.APPLY_DELJOB, {"ids": decided.finished, "myself": self.node_id})

    def _on_gotacks(self, items: list[tuple[str, m.GotAck]]) -> Step:
        assert self.acks is not None
        outcomes = []
        for peer, message in items:
            for job_id, known in message.items:
                outcome = self.acks.got_ack(peer, job_id, known)
                if outcome is not None:
                    outcomes.append(outcome)
        yield from self._finish_gcs(outcomes)

    def _finish_gcs(self, outcomes: list[Any]) -> Step:
        """ACK GC done for these jobs: every holder deletes them, and so do we
        (one DELJOB per holder and one statement here, however many jobs)."""
        if not outcomes:
            return
        deljobs: dict[str, list[str]] = {}
        for outcome in outcomes:
            for holder in outcome.deljob_to:
                deljobs.setdefault(holder, []).append(outcome.job_id)
        self._send_deljobs(deljobs)
        yield _rows(sql.APPLY_DELJOB, {"ids": [o.job_id for o in outcomes], "myself": self.node_id})

    def _send_deljobs(self, deljobs: dict[str, list[str]]) -> None:
        for peer, ids in deljobs.items():
            for i in range(0, len(ids), MESSAGE_BATCH):
                self.send(peer, m.DelJob(tuple(ids[i:i + MESSAGE_BATCH])))

    def _on_deljobs(self, items: list[tuple[str, m.DelJob]]) -> Step:
        assert self.acks is not None and self.replicator is not None
        driving = {job_id for peer, message in items for job_id in message.ids
                   if self.acks.on_deljob(peer, job_id)}
        ids = [job_id for job_id in dict.fromkeys(job_id for _peer, message in items
                                                  for job_id in message.ids)
               if job_id not in driving]
        for job_id in ids:
            self.replicator.forget(job_id, ended=True)
        if ids:
            yield _rows(sql.APPLY_DELJOB, {"ids": ids, "myself": self.node_id})

    # ------------------------------------------------------------ one queued copy

    def timers(self) -> Step:
        """Announce re-queue timers due soon (WILLQUEUE), fire the due ones
        (QUEUED): :mod:`.requeue`."""
        assert self.requeues is not None
        if self._unpark:  # copies parked on holders no longer alive: one retry again
            holders = sorted(self._unpark)
            done = yield _rows(sql.UNPARK, {"holders": holders, "limit": UNPARK_BATCH})
            if len(done) < UNPARK_BATCH:
                # (not clear(): a holder suspected while the statement ran
                # was not in it)
                self._unpark.difference_update(holders)
        rows = yield _rows(sql.TIMERS, {"ahead": ANNOUNCE_AHEAD})
        holders = {job_id: tuple(nodes) for _kind, job_id, nodes, _c, _due in rows}
        soon = [(job_id, nodes, due) for kind, job_id, nodes, _c, due in rows if kind == "soon"]
        for peer, ids in self.requeues.announce(soon).items():
            self.send(peer, m.WillQueue(tuple(ids), tuple(holders[i] for i in ids)))
        notices = self.requeues.fired((job_id, nodes, counted)
                                      for kind, job_id, nodes, counted, _due in rows
                                      if kind == "fired")
        for (peer, counter), ids in notices.items():
            self.send(peer, m.Queued(tuple(ids), counter, tuple(holders[i] for i in ids)))

    def _on_willqueue(self, peer: str, message: m.WillQueue) -> Step:
        assert self.requeues is not None
        rows = yield _rows(sql.WILLQUEUE_STATE, {**self._named(message), "sender": peer,
                                                 "myself": self.node_id, "ahead": ANNOUNCE_AHEAD})
        known = {r[0] for r in rows}
        self._delete_late_copies(peer, [i for i in message.ids if i not in known],
                                 self.clock.monotonic())
        queued, acked = self.requeues.on_willqueue((r[0], r[1], r[2]) for r in rows)
        if queued:
            holders = {r[0]: tuple(r[2] or ()) for r in rows}
            self.send(peer, m.Queued(queued, "", tuple(holders[i] for i in queued)))
        if acked:
            self.send(peer, m.SetAck(acked))

    def _on_queued(self, peer: str, message: m.Queued) -> Step:
        rows = yield _rows(sql.APPLY_QUEUED, {**self._named(message), "counter": message.counter,
                                              "sender": peer, "myself": self.node_id})
        assert self.membership is not None
        sender = self.membership.get(peer)
        if sender is None or sender.status != "alive":
            # A QUEUED that waited in our inbox while its sender turned
            # suspect or dead parked copies on it after its UNPARK, and no
            # later change of that member would bring them back.
            self._unpark.add(peer)
        kept = [(job_id, tuple(nodes or ())) for job_id, still_queued, nodes in rows if still_queued]
        if kept:  # we keep them queued (tie-break): the sender must yield
            self.send(peer, m.Queued(tuple(i for i, _ in kept), "", tuple(n for _, n in kept)))
        yield from self._tell_acked(peer, message.ids)

    def _tell_acked(self, peer: str, ids: tuple[str, ...]) -> Step:
        """A holder announced jobs acknowledged here: SETACK it now, as
        Disque answers. It had missed our SETACK, whose retries back off up
        to minutes, and would have delivered the job again meanwhile."""
        acked = yield _rows(sql.ACKED_HERE, {"ids": list(ids)})
        if acked:
            self.send(peer, m.SetAck(tuple((job_id, tuple(nodes)) for job_id, nodes in acked)))

    @staticmethod
    def _named(message: m.WillQueue | m.Queued) -> dict[str, Any]:
        """A message's ids and, per id, the holders it names (comma-joined)."""
        named = message.holders or tuple(() for _ in message.ids)
        return {"ids": list(message.ids), "holders": [_csv(h) for h in named]}

    def _on_working(self, peer: str, message: m.Working) -> Step:
        yield _rows(sql.APPLY_WORKING, {"ids": list(message.ids), "sender": peer,
                                        "myself": self.node_id})
        yield from self._tell_acked(peer, message.ids)

    def _on_enqueue(self, peer: str, message: m.Enqueue) -> Step:
        yield _rows(sql.APPLY_ENQUEUE, {"ids": list(message.ids)})

    # ------------------------------------------------------------ federation

    def federation_period(self) -> float:
        """While jobs flow in, look again soon: each look may ask for the
        next batch (paced by Federation's back-off), so the import rate is
        not capped by the period. Idle, 10 looks a second."""
        return 0.02 if self.federation.stats(self.clock.monotonic()) else PERIODS["federate"]

    def federate(self) -> Step:
        """Ask for jobs where consumers wait on an empty queue; save import stats."""
        now = self.clock.monotonic()
        if not self.leaving:  # a leaving node does not import
            waited = yield _rows(sql.WAITED_QUEUES)
            for queue, length in waited:
                if length > 0:
                    continue
                for targets, count in self.federation.needs(queue, now, self._alive()):
                    for peer in targets:
                        self.send(peer, m.NeedJobs(queue, count))
            self.federation.prune({queue for queue, _ in waited}, now)
        if now - self._import_stats_at >= IMPORT_STATS_EVERY:
            self._import_stats_at = now
            stats = self.federation.stats(now)
            yield _rows(sql.SAVE_IMPORT_STATS, {
                "queues": list(stats), "nodes": [_csv(s[0]) for s in stats.values()],
                "rates": [s[1] for s in stats.values()]})

    def _on_needjobs(self, peer: str, message: m.NeedJobs) -> Step:
        if self.federation.importing(message.queue, self.clock.monotonic()):
            return  # we are importing this queue ourselves
        queued, paused = yield _row(sql.QUEUE_READY, {"queue": message.queue})
        count = export_count(message.count, int(queued))
        if paused or count == 0:
            return
        rows = yield _rows(sql.EXPORT_JOBS, {"queue": message.queue, "count": count,
                                             "myself": self.node_id, "requester": peer})
        if rows:
            for batch in by_size([_copy(sql.CopyRow(*r)) for r in rows]):
                self.send(peer, m.YourJobs(batch))

    def _on_yourjobs(self, peer: str, message: m.YourJobs) -> Step:
        if not message.jobs:
            return
        # One copy per ID, as _on_repljobs keeps: an upsert that meets a row
        # twice fails (CardinalityViolation), and a crafted YOURJOBS naming
        # a job twice ended the inbox run, skipping the honest messages
        # after it (found by a read-only review).
        jobs = list({copy.id: copy for copy in message.jobs}.values())
        rows = yield _rows(sql.IMPORT_JOBS, {**_copies_params(jobs),
                                             "myself": self.node_id, "sender": peer})
        now = self.clock.monotonic()
        for queue, count, _woken in rows:
            self.federation.imported(queue, peer, int(count), now)

    def _on_pause(self, peer: str, message: m.Pause) -> Step:
        yield _rows(sql.APPLY_PAUSE, {"queue": message.queue, "state": message.state})

    # ------------------------------------------------------------ messages

    def gossip(self, peer: str, message: m.Message) -> Step | None:
        """Apply a membership message at once; a FORGET may finish ACK GCs
        (the step returned, if any, records it)."""
        assert self.membership is not None and self.acks is not None
        if isinstance(message, m.Advert):
            # Kept even from a peer not known yet (its first gossip may come
            # later): the bus authenticated it, and only members' DSNs are
            # written (persist).
            self._on_advert(peer, message)
            return None
        # A FORGET ends the ACK GCs waiting on that node only when membership
        # honours it: not from a sender it ignores (a node forgotten less than
        # the ban ago, still running), not of this node. Such a FORGET made
        # this node stop waiting for a live holder's GOTACK and DELJOB the
        # job before that holder had the SETACK: its copy re-queued and the
        # acknowledged job was delivered again (found by a read-only review).
        honoured = isinstance(message, m.Forget) and not self.membership.ignores(peer) \
            and message.node != self.node_id
        self._act(self.membership.receive(peer, message, self.clock.monotonic()))
        if honoured:
            assert isinstance(message, m.Forget)
            return self._finish_gcs(self.acks.forget_node(message.node))
        return None

    def accepts(self, peer: str, message: m.Message) -> bool:
        """A job message to queue for :meth:`apply_run`: only from members we
        know (they gossip before anything else)."""
        assert self.membership is not None
        return isinstance(message, BATCHED + ONE_BY_ONE) and self.membership.get(peer) is not None

    @staticmethod
    def runs(items: list[tuple[str, m.Message]]) -> list[list[tuple[str, m.Message]]]:
        """Inbox messages cut into runs of one kind, in arrival order."""
        return [list(group) for _kind, group in itertools.groupby(items, key=lambda i: type(i[1]))]

    def apply_run(self, run: list[tuple[str, m.Message]]) -> Step:
        """Apply a run of messages of one kind (one statement for the batched kinds)."""
        kind = type(run[0][1])
        batch = self._batch_handlers.get(kind)
        if batch is not None:
            yield from batch(self, run)
        else:
            for peer, message in run:
                yield from self._handlers[kind](self, peer, message)

    _batch_handlers: dict[type, Any] = {
        m.ReplJob: _on_repljobs, m.GotJob: _on_gotjobs, m.SetAck: _on_setacks,
        m.GotAck: _on_gotacks, m.DelJob: _on_deljobs,
    }
    _handlers: dict[type, Any] = {
        m.WillQueue: _on_willqueue,
        m.Queued: _on_queued, m.Working: _on_working, m.Enqueue: _on_enqueue,
        m.NeedJobs: _on_needjobs, m.YourJobs: _on_yourjobs, m.Pause: _on_pause,
    }
