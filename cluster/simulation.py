"""The seeded simulation of a pgq cluster (``pgq simulate``).

Three to seven :class:`~.core.NodeCore` run in one process under one
virtual clock, on an in-memory :class:`~.mock_transport.Network`, each with
its node database (one database per node on one real PostgreSQL server).
Simulated clients add, get (some blocking, so that federation imports for
them), ack and nack through the real client commands (:mod:`pgq.commands`).
A synchronous replicated add writes its copies into the peers' databases
itself (direct copies, :func:`pgq.commands._add_direct`) or goes through
its node process, drawn per add; a peer database a node cannot reach
(partitioned apart, or a message drop's bad luck) fails the direct write,
another (the drop rate again) commits it but answers too late, and with
``crash`` faults a client may die between its copies and its own commit.
Everything that could vary between two runs is drawn from the seed: the
workload, the faults, message delays and losses, the nodes' and clients'
random choices, job IDs, and the time SQL sees
(``pgq.now()`` is set to the node's virtual wall clock before each step).
A run is therefore a pure function of its seed: the same seed replays the
same schedule, the same messages and the same failure.

The scheduler is a heap of timed events: each node's periodic steps (on
the periods of :data:`.core.PERIODS`), message deliveries, client
operations and faults. One event runs at a time, to completion.

Faults (``--faults``): ``drop``, ``duplicate`` and ``reorder`` of messages,
``partition`` (two groups cut apart for seconds), ``crash`` (a node
process dies: its in-memory state is lost, messages to it are lost, its
database keeps what was committed; it restarts later and reloads from the
database) and ``skew`` (a node's wall clock, and its database's, off by up
to 30 s).

Invariants, checked as the run goes and at its end:

* **no acknowledged add lost**: every at-least-once add that returned IDs
  is delivered (no fault here destroys a database, so none may be lost at
  all). An at-most-once job may be lost, as in Disque: federation moves it
  (deleted here, queued there), so a lost YOURJOBS or a crash of the
  importer loses it; keeping it until the importer confirms would deliver
  it twice when the confirmation is lost instead (seed 95 on 5 nodes);
* **at-most-once**: a ``retry=0`` job is never delivered twice;
* **one queued copy**: once re-queues settle (faults healed, consumers
  stopped, two retry periods passed), at most one node holds each
  unacknowledged job queued;
* **ACKs collected**: every acknowledged job is eventually gone from every
  node (all come back at the end);
* **no false death**: no node is declared dead by a peer while it runs and
  the network between them is perfect (no partition, loss or long delay for
  the last 20 s);
* **an acknowledged job is not delivered again**, on fault-free runs
  (``faults=()``), once ``ACK_REACHES`` passed since its ACK returned (the
  SETACKs are on their way until then); with faults Disque allows it;
* **no step raises**: a node step that fails is a bug.

A violation ends the run with the seed, the step and the last lines of
the trace.
"""

from __future__ import annotations

import collections
import datetime as dt
import hashlib
import heapq
import itertools
import random
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import psycopg

from pgq import arguments, commands, contracts
from pgq import embedded as embedded_server
from pgq import statements as client_sql
from pgq.contracts import NODE_LOCK_KEY
from pgq.driver import extract
from pgq.errors import PgqError
from pgq.migrate import SCHEMA_VERSION, schema_version
from pgq.peers import PeerTimeout
from pgq.protocol import (
    Begin,
    ClusterView,
    Commit,
    Copy,
    Housekeeping,
    Listen,
    ListenReplication,
    PeerUnreached,
    PeerWrite,
    Query,
    Result,
    Rollback,
    Session,
    Wait,
)
from pgq.schema import metadata
from pgq.statements import SESSION_OPTIONS

from . import messages as m
from .core import GOSSIP, OUTBOX_BATCH, PERIODS, CoreSettings, NodeCore
from .membership import Config
from .mock_transport import Network, NetworkFaults

__all__ = ["FAULTS", "SimOptions", "SimResult", "Violation", "SimDatabases", "Simulation",
           "run_seeds"]

FAULTS = ("drop", "duplicate", "reorder", "partition", "crash", "skew")
# Without faults, an acknowledged job reaches every holder's ack within
# milliseconds: one delivered again this long after its ACK returned was not
# collected (Disque allows it only while SETACK is on its way).
ACK_REACHES = 0.5
QUEUE = "sim"
EPOCH = 1_800_000_000.0  # virtual wall time at t = 0 (2027-01-15)
PORT = 7711
CLEAN_FOR = 20.0  # seconds of a perfect link before a death is a false one
SET_NOW = "SELECT set_config('pgq.now', %s, false)"


@dataclass
class SimOptions:
    seed: int
    nodes: int = 3
    seconds: float = 6.0  # workload and faults
    adds: int = 24
    faults: tuple[str, ...] = FAULTS
    # The share of replicated adds made asynchronous (queued at once, copied
    # in the background), drawn apart from the rest of the workload so that
    # 0 replays the seeds found before it existed.
    asynchronous: float = 0.0
    max_settle: float = 90.0  # the end phase stops as soon as everything settled
    trace_lines: int = 30


@dataclass
class Violation:
    seed: int
    step: int
    time: float
    invariant: str
    detail: str
    trace: list[str] = field(default_factory=list)

    def report(self) -> str:
        lines = [f"VIOLATION seed={self.seed} step={self.step} t={self.time:.4f}: "
                 f"{self.invariant}: {self.detail}",
                 f"  replay: pgq simulate --seed {self.seed}", "  trace (last steps):"]
        return "\n".join(lines + [f"    {line}" for line in self.trace])


@dataclass
class SimResult:
    seed: int
    steps: int
    virtual_seconds: float
    violations: list[Violation]
    digest: str  # of the whole trace: equal for two runs of one seed
    added: int
    delivered: int


class _Stop(Exception):
    """A violation ends the run."""


class ClientCrashed(PgqError):
    """A simulated client died in the middle of its command."""


def _dsn(node: SimNode) -> str:
    """The DSN a simulated node advertises (the simulation maps it back)."""
    return f"host={node.host} dbname=pgqsim_{node.name}"


class SimDatabases:
    """The node databases of a simulation on one PostgreSQL server, reset to
    the same state before every seed (tables truncated, sequences restarted,
    deterministic node ids), so that a seed replays whatever ran before."""

    def __init__(self, instance: embedded_server.Instance, count: int, prefix: str = "pgqsim") -> None:
        import pgq

        self.instance = instance
        self.names = [f"{prefix}_n{i + 1}" for i in range(count)]
        template = f"{prefix}_template"
        # Two simulations on the same databases would rewrite each other's
        # state (members, jobs) mid-run: one at a time, held for our life.
        self._lock = psycopg.connect(instance.admin_dsn_for("postgres"), autocommit=True)
        if not self._lock.execute("SELECT pg_try_advisory_lock(hashtext(%s))",
                                  (prefix,)).fetchone()[0]:  # type: ignore[index]
            self._lock.close()
            raise PgqError(f"another simulation is using the {prefix}_* databases of this "
                           "server: wait for it, or give this one its own server (--home)")
        with psycopg.connect(instance.admin_dsn_for("postgres"), autocommit=True) as admin:
            exists = {r[0] for r in admin.execute("SELECT datname FROM pg_database")}
            if template in exists and _version(instance.dsn_for(template)) != SCHEMA_VERSION:
                for name in [template, *self.names]:  # made by an older pgq: start again
                    admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
                exists -= {template, *self.names}
        if template not in exists:
            embedded_server.create_database(instance, template)
            pgq.migrate(instance.dsn_for(template))
            with psycopg.connect(instance.dsn_for(template), autocommit=True) as conn:
                for table in metadata.sorted_tables:  # nothing but the steps may change them
                    conn.execute(f"ALTER TABLE pgq.{table.name} SET (autovacuum_enabled = off)")
        for name in self.names:
            if name not in exists:
                embedded_server.create_database(instance, name, template)
        # Per node: its process's connection, its clients', and the one other
        # nodes' clients write direct copies on.
        self.connections: list[tuple[psycopg.Connection, psycopg.Connection,
                                     psycopg.Connection]] = []
        for name in self.names:
            dsn = instance.dsn_for(name)
            self.connections.append(tuple(  # type: ignore[arg-type]
                psycopg.connect(dsn, autocommit=True, options=SESSION_OPTIONS
                                + " -c synchronous_commit=off", prepare_threshold=0)
                for _ in range(3)))
        self._tables = ", ".join(f"pgq.{t.name}" for t in metadata.sorted_tables
                                 if t.name not in ("meta",))

    def reset(self, seed: int) -> list[str]:
        """Empty every node database; returns the node ids (from the seed)."""
        ids = []
        for i, (node_conn, client_conn, peer_conn) in enumerate(self.connections):
            node_id = hashlib.sha1(f"pgq-sim-{seed}-{i}".encode()).hexdigest()
            node_conn.execute("SELECT pg_advisory_unlock_all()")  # no node runs yet
            node_conn.execute(f"TRUNCATE {self._tables} RESTART IDENTITY")
            node_conn.execute("DELETE FROM pgq.meta")
            node_conn.execute("INSERT INTO pgq.meta (key, value) VALUES ('node_id', %s)", (node_id,))
            node_conn.execute("ALTER SEQUENCE pgq.ctime_seq RESTART")
            node_conn.execute("ALTER SEQUENCE pgq.queue_epoch RESTART")
            for conn in (node_conn, client_conn, peer_conn):
                conn.execute("RESET pgq.now")
                conn.execute("SELECT setseed(%s)", (random.Random(f"{seed}-{i}").uniform(-1, 1),))
            ids.append(node_id)
        return ids

    def close(self) -> None:
        for pair in self.connections:
            for conn in pair:
                conn.close()
        self._lock.close()


def _version(dsn: str) -> str | None:
    with psycopg.connect(dsn) as conn:
        return schema_version(conn)


class SimClock:
    """A node's clock: the simulation's time, its wall reading skewed."""

    def __init__(self, sim: Simulation, skew: float = 0.0) -> None:
        self.sim = sim
        self.skew = skew

    def monotonic(self) -> float:
        return self.sim.now

    def wall(self) -> float:
        return EPOCH + self.sim.now + self.skew


@dataclass
class SimNode:
    index: int
    name: str
    host: str
    node_id: str
    conn: psycopg.Connection  # the node process's
    client_conn: psycopg.Connection  # the simulated clients'
    peer_conn: psycopg.Connection  # where other nodes' clients write direct copies
    clock: SimClock
    core: NodeCore | None = None
    generation: int = 0  # bumped by each crash: events of an older life are void
    up: bool = False
    up_since: float = 0.0
    inbox: list[tuple[str, m.Message]] = field(default_factory=list)
    cluster_view: ClusterView = field(default_factory=ClusterView)
    now_set: dict[int, float] = field(default_factory=dict)  # connection id -> pgq.now set
    listening: set[int] = field(default_factory=set)  # blocked client commands (ids)


@dataclass
class _Delivery:
    value: str
    job_id: str
    node: str
    at: float


class Simulation:
    def __init__(self, databases: SimDatabases, options: SimOptions,
                 log: Callable[[str], None] | None = None, direct: bool | None = None) -> None:
        if not 3 <= options.nodes <= len(databases.connections):
            raise ValueError(f"nodes must be 3..{len(databases.connections)}")
        self.db = databases
        self.options = options
        self.log = log
        # Synchronous replicated adds write their copies themselves (True),
        # through the node process (False), or either, drawn per add (None).
        self.direct = direct
        self.kill_direct_clients = 0  # see _client_dies
        self.late_answers: float | None = None  # see _peer_write (None: the drop rate)
        self.sent: collections.Counter[str] = collections.Counter()  # messages, by kind
        self.rng = random.Random(options.seed)
        self.now = 0.0
        self.steps = 0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._trace: list[str] = []
        self._digest = hashlib.sha256()
        self.violations: list[Violation] = []
        faults = set(options.faults)
        self.network = Network(random.Random(self.rng.random()), NetworkFaults(
            drop=self.rng.choice([0.0, 0.01, 0.05]) if "drop" in faults else 0.0,
            duplicate=self.rng.choice([0.0, 0.02, 0.05]) if "duplicate" in faults else 0.0,
            slow=self.rng.choice([0.0, 0.03]) if "reorder" in faults else 0.0))
        self.clean_since: dict[frozenset[str], float] = {}
        ids = databases.reset(options.seed)
        self.nodes: list[SimNode] = []
        for i in range(options.nodes):
            node_conn, client_conn, peer_conn = databases.connections[i]
            skew = self.rng.uniform(-30, 30) if "skew" in faults else 0.0
            node = SimNode(i, f"n{i + 1}", f"10.0.0.{i + 1}", ids[i], node_conn, client_conn,
                           peer_conn, SimClock(self, skew))
            self.network.register(node.name, node.host, PORT)
            self.nodes.append(node)
        self.by_id = {n.node_id: n for n in self.nodes}
        # the workload's record
        self.added: dict[str, tuple[str, int]] = {}  # job id -> (value, retry)
        self.acked: set[str] = set()
        self.acked_at: dict[str, float] = {}  # job id -> when its ACK returned
        self.deliveries: dict[str, list[_Delivery]] = {}
        self.consuming = True
        self.adding = True
        self.finished = False  # set by the end phase once everything settled
        self.client_rng = random.Random(self.rng.random())

    # ------------------------------------------------------------ scheduling

    def at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), action))

    def trace(self, line: str) -> None:
        text = f"{self.now:9.4f} {line}"
        self._digest.update(text.encode())
        self._trace.append(text)
        if len(self._trace) > 4 * self.options.trace_lines:
            del self._trace[:-self.options.trace_lines]

    def violate(self, invariant: str, detail: str) -> None:
        violation = Violation(self.options.seed, self.steps, self.now, invariant, detail,
                              self._trace[-self.options.trace_lines:])
        self.violations.append(violation)
        raise _Stop()

    def run(self) -> SimResult:
        opts = self.options
        for node in self.nodes:
            self._start(node)
        self._plan_workload()
        self._plan_faults()
        self.at(opts.seconds, self._end_faults)
        try:
            self._loop(until=opts.seconds + opts.max_settle)
            if not self.violations:
                self._final_checks()
        except _Stop:
            pass
        delivered = len({d.job_id for ds in self.deliveries.values() for d in ds})
        return SimResult(opts.seed, self.steps, self.now, self.violations,
                         self._digest.hexdigest(), len(self.added), delivered)

    def next_at(self) -> float | None:
        """When the next event runs (None: nothing is scheduled)."""
        return self._heap[0][0] if self._heap else None

    def step(self) -> None:
        """Run the next event, to completion (a violation raises _Stop)."""
        t, _, action = heapq.heappop(self._heap)
        self.now = t
        self.steps += 1
        action()

    def _loop(self, until: float) -> None:
        while self._heap and not self.finished and self._heap[0][0] <= until:
            self.step()

    # ------------------------------------------------------------ nodes

    def _start(self, node: SimNode) -> None:
        node.generation += 1
        node.up = True
        node.up_since = self.now
        node.inbox.clear()
        node.now_set.clear()
        others = [(n.host, PORT) for n in self.nodes if n is not node]
        node.core = NodeCore(CoreSettings(node.name, node.host, PORT, others,
                                          Config(), advertise_dsn=_dsn(node)), node.clock,
                             random.Random(f"{self.options.seed}-{node.name}-{node.generation}"))
        self.trace(f"{node.name} start (generation {node.generation})")
        # As a node process does: its database's node lock while it runs
        # (pgq.contracts), which synchronous adders read to stop waiting.
        node.conn.execute("SELECT pg_advisory_unlock_all(), pg_advisory_lock(%s)", (NODE_LOCK_KEY,))
        self._node_step(node, node.core.load(), "load")
        generation = node.generation
        for name, period in PERIODS.items():
            offset = self.rng.uniform(0, period)
            self.at(self.now + offset, lambda n=node, s=name, g=generation: self._periodic(n, s, g))

    def _crash(self, node: SimNode) -> None:
        if not node.up:
            return
        node.up = False
        node.core = None
        node.generation += 1
        node.conn.execute("SELECT pg_advisory_unlock_all()")  # its backend would end with it
        self.trace(f"{node.name} CRASH")

    def _periodic(self, node: SimNode, name: str, generation: int) -> None:
        if not node.up or node.generation != generation or node.core is None:
            return
        core = node.core
        if name == "tick":
            core.tick()
            self._flush(node)
        elif name == "collect_acks":
            core.collect_acks()
            self._flush(node)
        elif name == "drain_outbox":
            self._drain(node)
        else:
            self._node_step(node, getattr(core, name)(), name)
        period = core.federation_period() if name == "federate" else PERIODS[name]
        self.at(self.now + period, lambda: self._periodic(node, name, generation))

    def _drain(self, node: SimNode) -> None:
        assert node.core is not None
        while node.up and self._node_step(node, node.core.drain_outbox(), "drain_outbox") \
                >= OUTBOX_BATCH:
            pass

    def _ring(self, node: SimNode) -> None:
        """A client rang the node's doorbell: it drains its outbox next."""
        generation = node.generation
        self.at(self.now + 0.0005, lambda: node.up and node.generation == generation
                and self._drain(node))

    def _node_step(self, node: SimNode, step: Generator[Query, Any, Any], name: str) -> Any:
        reply: Any = None
        try:
            while True:
                try:
                    request = step.send(reply)
                except StopIteration as done:
                    return done.value
                reply = self._query(node, node.conn, request)
        except _Stop:
            raise
        except Exception as exc:  # a database error or a bug of the core: both are findings
            self.violate("no step raises", f"{node.name} {name}: {_error(exc)}")
        finally:
            step.close()
            if node.core is not None:
                self._flush(node)

    def _query(self, node: SimNode, conn: psycopg.Connection, request: Query) -> Any:
        wall = node.clock.wall()
        if node.now_set.get(id(conn)) != wall:
            # The node's time for SQL (pgq.now()), sent with the query: one round trip.
            stamp = dt.datetime.fromtimestamp(wall, dt.UTC).isoformat()
            with conn.pipeline():
                conn.execute(SET_NOW, (stamp,), prepare=True)
                cursor = conn.execute(request.sql, request.params, prepare=True)
            node.now_set[id(conn)] = wall
        else:
            cursor = conn.execute(request.sql, request.params, prepare=True)
        rows = cursor.fetchall() if cursor.description is not None else None
        return extract(cursor, request.result, rows)

    def _flush(self, node: SimNode) -> None:
        core = node.core
        assert core is not None
        for change in core.changes:
            member = change.member
            if member.status == "dead" and member.id in self.by_id:
                self._check_death(node, self.by_id[member.id])
            if change.previous is None or change.previous.status != member.status:
                target = self.by_id.get(member.id)
                self.trace(f"{node.name} sees {target.name if target else member.id[:8]} "
                           f"{member.status}")
        core.changes.clear()
        # Stable by destination: the order of messages to one peer is the
        # core's; the order across peers must not depend on set iteration.
        for host, port, message in sorted(core.take_outgoing(), key=lambda o: (o[0], o[1])):
            self._send(node, host, port, message)

    def _send(self, sender: SimNode, host: str, port: int, message: m.Message) -> None:
        self.sent[message.KIND] += 1
        payload = m.encode(message)  # as on the wire: what a node sends must decode
        for delay, target_name in self.network.route(sender.name, host, port):
            target = self.nodes[int(target_name[1:]) - 1]
            generation = target.generation
            self.at(self.now + delay, lambda t=target, g=generation, p=payload, s=sender.node_id:
                    self._deliver(t, g, s, p))

    def _deliver(self, node: SimNode, generation: int, sender: str, payload: bytes) -> None:
        if not node.up or node.generation != generation or node.core is None:
            return  # sent to a life of the node that ended
        message = m.decode(payload)
        peer = self.by_id.get(sender)
        self.trace(f"{peer.name if peer else '?'} -> {node.name} {_describe(message)}")
        if isinstance(message, GOSSIP):
            step = node.core.gossip(sender, message)
            if step is not None:
                self._node_step(node, step, "gossip")
            self._flush(node)
        elif node.core.accepts(sender, message):
            if not node.inbox:
                self.at(self.now, lambda: self._apply_inbox(node, generation))
            node.inbox.append((sender, message))

    def _apply_inbox(self, node: SimNode, generation: int) -> None:
        if not node.up or node.generation != generation or node.core is None:
            return
        items, node.inbox = node.inbox, []
        for run in node.core.runs(items):
            self._node_step(node, node.core.apply_run(run), f"apply {run[0][1].KIND}")
            if not node.up:
                return

    def _check_death(self, observer: SimNode, target: SimNode) -> None:
        pair = frozenset((observer.name, target.name))
        clean = self.clean_since.get(pair, 0.0)
        if target.up and self.now - target.up_since >= CLEAN_FOR and self.now - clean >= CLEAN_FOR \
                and self.network.can_talk(observer.name, target.name) \
                and not self.network.faults.lossy:
            self.violate("no false death",
                         f"{observer.name} declared {target.name} dead while it answers")

    # ------------------------------------------------------------ clients

    def _session(self, node: SimNode, listen: bool = False) -> Session:
        """A client session on the node. ``listen``: a blocked GET registers
        as a waiter (what federation looks for); notifications never come,
        the command polls."""
        direct = self.direct if self.direct is not None else self.client_rng.random() < 0.5
        return Session(owned=True, node_id=node.node_id, clock=lambda: self.now,
                       can_listen=listen, poll_interval=0.05, host=node.host, port=5432,
                       cluster=node.cluster_view, replication_timeout=5.0, floors=None,
                       wall=lambda: EPOCH + self.now,
                       random_bytes=self.client_rng.randbytes, direct=direct)

    def _client(self, node: SimNode, command: Generator[Any, Any, Any], what: str,
                done: Callable[[Any], None]) -> None:
        """Run a client command on the node's database; a Wait suspends it."""
        self._resume(node, command, what, done, None)

    def _resume(self, node: SimNode, command: Generator[Any, Any, Any], what: str,
                done: Callable[[Any], None], reply: Any) -> None:
        conn = node.client_conn
        try:
            while True:
                try:
                    request = command.send(reply)
                except StopIteration as finished:
                    self._unlisten(node, command)
                    self._ring(node)  # the doorbell a client rings after outbox events
                    done(finished.value)
                    return
                if isinstance(request, Query):
                    reply = self._query(node, conn, request)
                elif isinstance(request, Wait):
                    self._ring(node)
                    self.at(self.now + request.seconds,
                            lambda: self._resume(node, command, what, done, []))
                    return
                elif isinstance(request, (Begin, Commit)):
                    conn.execute("BEGIN" if isinstance(request, Begin) else "COMMIT")
                    reply = None
                elif isinstance(request, Rollback):
                    self._rollback(node, conn)
                    reply = None
                elif isinstance(request, PeerWrite):
                    reply = self._peer_write(node, request)
                    if request.sql in (contracts.DIRECT_COPIES, contracts.DIRECT_COPY) \
                            and self._client_dies():
                        # Between the copies and the commit of its own row.
                        self.trace(f"client {what} on {node.name} CRASH after its copies")
                        self._rollback(node, conn)
                        command.close()
                        done(ClientCrashed(what))
                        return
                elif isinstance(request, Copy):
                    with conn.cursor().copy(request.sql) as copy:
                        for chunk in request.data:
                            copy.write(chunk)
                    reply = None
                elif isinstance(request, Listen):
                    conn.execute(client_sql.REGISTER_WAITER, {"queues": list(request.queues)})
                    node.listening.add(id(command))
                    reply = None
                elif isinstance(request, (ListenReplication, Housekeeping)):
                    reply = None
                else:  # pragma: no cover - a new request kind
                    raise TypeError(f"the simulation cannot run {request!r}")
        except PgqError as exc:
            self._unlisten(node, command)
            self._ring(node)
            command.close()
            done(exc)
        except _Stop:
            raise
        except Exception as exc:
            command.close()
            self.violate("no step raises", f"client {what} on {node.name}: {_error(exc)}")

    def _rollback(self, node: SimNode, conn: psycopg.Connection) -> None:
        conn.execute("ROLLBACK")
        node.now_set.pop(id(conn), None)  # a rollback undoes the pgq.now set inside it

    def _client_dies(self) -> bool:
        """Does the client of a direct add die after its copies? The next
        ``kill_direct_clients`` ones do (a story asks), and with ``crash``
        faults one in ten."""
        if self.kill_direct_clients:
            self.kill_direct_clients -= 1
            return True
        return "crash" in self.options.faults and self.client_rng.random() < 0.1

    def _peer_write(self, node: SimNode, request: PeerWrite) -> dict[str, Any]:
        """Direct copies from a client of ``node``: each peer's database takes
        its write unless the node cannot reach it (partitioned apart, or the
        network's drop rate)."""
        results: dict[str, Any] = {}
        for peer_id, dsn, params in request.writes:
            target = self.by_id.get(peer_id)
            if target is None or dsn != _dsn(target):
                # nothing sent (a real client would not connect): nothing
                # to withdraw there
                results[peer_id] = PeerUnreached(f"no node serves {dsn!r}")
            elif not self.network.can_talk(node.name, target.name) or \
                    self.client_rng.random() < self.network.faults.drop:
                self.trace(f"client on {node.name} cannot reach {target.name}'s database")
                results[peer_id] = PeerTimeout(f"{target.name} unreachable")
            else:
                results[peer_id] = self._query(target, target.peer_conn,
                                               Query(request.sql, params, Result.ROWS))
                copies = len(params["ids"]) if "ids" in params else 1  # DIRECT_COPY: one
                self.trace(f"client on {node.name} wrote {copies} copies on {target.name}")
                late = self.network.faults.drop if self.late_answers is None else self.late_answers
                if self.client_rng.random() < late:
                    # committed, but the answer came too late for the client
                    self.trace(f"client on {node.name} gave up on {target.name}'s answer")
                    results[peer_id] = PeerTimeout(f"{target.name} answered too late")
        return results

    def _unlisten(self, node: SimNode, command: Generator[Any, Any, Any]) -> None:
        """A blocked GET ended: its waiter registration goes (the driver's
        UNLISTEN; the node's clients share one connection, so the last
        waiting command of a node removes it)."""
        if id(command) in node.listening:
            node.listening.discard(id(command))
            if not node.listening:
                node.client_conn.execute(client_sql.UNREGISTER_WAITER)

    def _plan_workload(self) -> None:
        opts = self.options
        rng = random.Random(self.rng.random())
        asynchronous = random.Random(f"asynchronous-{opts.seed}")
        for n in range(opts.adds):
            t = rng.uniform(0, opts.seconds * 0.8)
            node = rng.choice(self.nodes)
            at_most_once = rng.random() < 0.1
            replicate = 1 if at_most_once else rng.choice([None, None, 1, 2, 3])
            retry = 0.0 if at_most_once else rng.choice([1.0, 2.0])
            later = replicate != 1 and asynchronous.random() < opts.asynchronous
            self.at(t, lambda v=f"v{n}", nd=node, r=replicate, rt=retry, a=later:
                    self._add(v, nd, r, rt, a))
        for _ in range(int(opts.seconds * 4)):
            t = rng.uniform(0, opts.seconds)
            node = rng.choice(self.nodes)
            count = rng.randint(1, 3)
            self.at(t, lambda nd=node, c=count: self._consume(nd, c, rng))

    def _add(self, value: str, node: SimNode, replicate: int | None, retry: float,
             asynchronous: bool = False) -> None:
        if not self.adding:
            return
        params = arguments.job_params(replicate=replicate, delay=0, retry=retry, ttl=600,
                                      maxlen=None, asynchronous=asynchronous, timeout=None)
        self.trace(f"client add {value} on {node.name} W={replicate} retry={retry:g}"
                   + (" ASYNC" if asynchronous else ""))

        def done(outcome: Any) -> None:
            if isinstance(outcome, Exception):
                self.trace(f"client add {value}: {type(outcome).__name__}")
                return
            self.added[outcome[0]] = (value, int(retry))
            self.trace(f"client add {value} = {short(outcome[0])}")

        self._client(node, commands.add_jobs(self._session(node), QUEUE, [value.encode()], params),
                     f"add {value}", done)

    def _consume(self, node: SimNode, count: int, rng: random.Random, drain: bool = False) -> None:
        if not self.consuming and not drain:
            return

        def got(jobs: Any) -> None:
            if isinstance(jobs, Exception):
                return
            for job in jobs:
                self._delivered(job.id, bytes(job.body).decode(), node)
            acks = [j.id for j in jobs if drain or rng.random() < 0.8]
            nacks = [j.id for j in jobs if j.id not in acks and rng.random() < 0.5]
            if acks:
                self._client(node, commands.ack_jobs(self._session(node), acks), "ack",
                             lambda n, ids=acks: self._acked(ids))
            if nacks:
                self._client(node, commands.nack_jobs(self._session(node), nacks), "nack",
                             lambda n: None)

        # Some consumers block for a while (a waiter: federation imports
        # for them from other nodes); the others do not wait.
        timeout = rng.choice([None, None, 0.5, 2.0]) if not drain else None
        self._client(node, commands.get_jobs(self._session(node, listen=timeout is not None),
                                             [QUEUE], count, timeout, timeout is None, False),
                     "get", got)

    def _acked(self, ids: list[str]) -> None:
        self.acked.update(ids)
        for job_id in ids:
            self.acked_at.setdefault(job_id, self.now)

    def _delivered(self, job_id: str, value: str, node: SimNode) -> None:
        self.trace(f"client got {value} ({short(job_id)}) on {node.name}")
        acked = self.acked_at.get(job_id)
        if not self.options.faults and acked is not None and self.now - acked > ACK_REACHES:
            self.violate("an acknowledged job is not delivered again",
                         f"{value} ({job_id}) acked at {acked:.3f}, delivered again on "
                         f"{node.name}{self._rows_of(job_id)}")
        past = self.deliveries.setdefault(job_id, [])
        if past and self.added.get(job_id, (None, 1))[1] == 0:
            self.violate("at-most-once", f"retry=0 job {value} ({job_id}) delivered twice: "
                         f"on {past[0].node} at {past[0].at:.3f} and on {node.name}")
        past.append(_Delivery(value, job_id, node.name, self.now))

    # ------------------------------------------------------------ faults

    def _plan_faults(self) -> None:
        opts = self.options
        rng = random.Random(self.rng.random())
        faults = set(opts.faults)
        names = [n.name for n in self.nodes]
        if "partition" in faults:
            for _ in range(rng.randint(0, 2)):
                t, length = rng.uniform(0, opts.seconds * 0.7), rng.uniform(0.5, 4.0)
                side = set(rng.sample(names, rng.randint(1, (len(names) - 1) // 2 or 1)))
                self.at(t, lambda s=side: self._partition(s))
                self.at(min(t + length, opts.seconds), self._heal)
        if "crash" in faults:
            for _ in range(rng.randint(0, 2)):
                t, length = rng.uniform(0, opts.seconds * 0.7), rng.uniform(0.2, 5.0)
                node = rng.choice(self.nodes)
                self.at(t, lambda nd=node: self._crash(nd))
                self.at(min(t + length, opts.seconds), lambda nd=node: self._restart(nd))
        for pair in itertools.combinations(names, 2):
            self.clean_since[frozenset(pair)] = 0.0

    def _partition(self, side: set[str]) -> None:
        others = {n.name for n in self.nodes} - side
        self.network.partition(side, others)
        for a in side:
            for b in others:
                self.clean_since[frozenset((a, b))] = float("inf")
        self.trace(f"PARTITION {sorted(side)} | {sorted(others)}")

    def _heal(self) -> None:
        for pair in list(self.clean_since):
            if not self.network.can_talk(*pair):
                self.clean_since[pair] = self.now
        self.network.heal()
        self.trace("HEAL")

    def _restart(self, node: SimNode) -> None:
        if not node.up:
            self._start(node)

    def _end_faults(self) -> None:
        """Faults end: heal, restart, perfect network; no more adds; then let
        re-queues settle without consumers and check there is one queued copy."""
        self.adding = False
        self.consuming = False
        self._heal()
        for node in self.nodes:
            self._restart(node)
        self.network.faults = NetworkFaults()
        settle = 2 * 2.0 + 2 * 0.5 + 1.0  # two of the longest retry, announcements, delivery
        self.at(self.now + settle, self._check_one_queued)

    def _check_one_queued(self) -> None:
        holders: dict[str, list[str]] = {}
        for node in self.nodes:
            rows = node.client_conn.execute(
                "SELECT id FROM pgq.jobs WHERE queue = %s AND state = 'queued' "
                "AND NOT EXISTS (SELECT 1 FROM pgq.acks a WHERE a.id = jobs.id) ORDER BY id",
                (QUEUE,)).fetchall()
            for (job_id,) in rows:
                holders.setdefault(job_id, []).append(node.name)
        doubled = {job: names for job, names in holders.items() if len(names) > 1}
        if doubled:
            job, names = sorted(doubled.items())[0]
            self.violate("one queued copy", f"{len(doubled)} job(s) queued on several nodes "
                                            f"once re-queues settled, e.g. {short(job)} on {names}"
                                            + self._rows_of(job))
        self.trace(f"checked: one queued copy of {len(holders)} job(s)")
        self._drain_all()

    def _drain_all(self) -> None:
        """Consumers on every node take and acknowledge everything left, until
        everything settled."""
        if self._settled():
            self.finished = True
            return
        rng = random.Random(0)
        for node in self.nodes:
            self._consume(node, 20, rng, drain=True)
        self.at(self.now + 0.25, self._drain_all)

    def _settled(self) -> bool:
        """The end: every added job delivered, every at-least-once one acked
        and gone from every node, nothing left to replicate or collect in
        memory. An at-most-once job delivered and not acked stays until its
        TTL (it is never delivered again); an ACK tombstone whose DELJOB was
        lost stays until the job's TTL too (it keeps a late copy out)."""
        if self.consuming:
            return False
        if self._at_least_once() - set(self.deliveries):
            return False
        if self._at_least_once() - self.acked:
            return False
        for node in self.nodes:
            core = node.core
            if core is None or (core.acks and core.acks.pending) or \
                    (core.replicator and core.replicator.pending):
                return False
        return not any(self._held(node) for node in self.nodes)

    def _rows_of(self, job_id: str) -> str:
        """Every node's row of one job, for a violation's report."""
        lines = []
        for node in self.nodes:
            row = node.client_conn.execute(
                "SELECT state, nodes_delivered, nodes_confirmed, deliveries, enqueues, "
                "extract(epoch FROM requeue_at - pgq.now())::numeric(8,3), "
                "extract(epoch FROM cluster_requeue_at - pgq.now())::numeric(8,3) "
                "FROM pgq.jobs WHERE id = %s", (job_id,)).fetchone()
            names = {n.node_id: n.name for n in self.nodes}
            if row is not None:
                row = (row[0], [names.get(x, x[:8]) for x in row[1] or []],
                       [names.get(x, x[:8]) for x in row[2] or []], *row[3:])
            lines.append(f"\n    {node.name}: (state, delivered, confirmed, deliveries, enqueues, "
                         f"requeue in, cluster requeue in) = {row}")
        return "".join(lines)

    def _leftovers(self) -> str:
        """What each node still holds, for a report."""
        names = {n.node_id: n.name for n in self.nodes}

        def named(ids: Any) -> list[str]:
            return [names.get(x, x[:8]) for x in ids or []]

        lines = []
        for node in self.nodes:
            jobs = node.client_conn.execute(
                "SELECT id, state, nodes_delivered FROM pgq.jobs ORDER BY id").fetchall()
            acks = node.client_conn.execute(
                "SELECT id, dummy, nodes, confirmed FROM pgq.acks ORDER BY id").fetchall()
            core = node.core
            pending_acks = [(short(k), sorted(named(v.holders)), sorted(named(v.confirmed)))
                            for k, v in core.acks.pending.items()] if core and core.acks else "-"
            pending_copies = [short(k) for k in core.replicator.pending] \
                if core and core.replicator else "-"
            lines.append(
                f"\n    {node.name}: jobs {[(short(i), st, named(n)) for i, st, n in jobs]} "
                f"acks {[(short(i), d, named(n), named(c)) for i, d, n, c in acks]} "
                f"pending acks {pending_acks} pending copies {pending_copies}")
        return "".join(lines)

    def _held(self, node: SimNode) -> int:
        """At-least-once jobs the node holds (in any state)."""
        row = node.client_conn.execute("SELECT count(*) FROM pgq.jobs WHERE retry > 0").fetchone()
        return int(row[0]) if row else 0

    def _at_least_once(self) -> set[str]:
        return {j for j, (_value, retry) in self.added.items() if retry > 0}

    def _final_checks(self) -> None:
        lost = sorted(self._at_least_once() - set(self.deliveries))
        if lost:
            value = self.added[lost[0]][0]
            self.violate("no acknowledged add lost",
                         f"{len(lost)} added job(s) never delivered, e.g. {value} ({lost[0]})")
        for node in self.nodes:
            rows = node.client_conn.execute(
                "SELECT id FROM pgq.jobs WHERE id = ANY(%s) ORDER BY id",
                (sorted(self.acked),)).fetchall()
            if rows:
                self.violate("ACKs collected", f"{node.name} still holds {len(rows)} acknowledged "
                                               f"job(s) after {self.now:.1f} s, e.g. {rows[0][0]}")
        if not self._settled():
            pending = sorted(j for j, (_v, retry) in self.added.items()
                             if retry > 0 and j not in self.acked)
            self.violate("settles", f"not settled after {self.now:.1f} s: {len(pending)} "
                                    f"job(s) not acked{self._leftovers()}")


def _error(exc: BaseException) -> str:
    """An exception and where it was raised, in a few lines."""
    import traceback

    where = traceback.extract_tb(exc.__traceback__)[-3:]
    return f"{type(exc).__name__}: {exc} (at " + " <- ".join(
        f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}" for frame in reversed(where)) + ")"


def short(job_id: str) -> str:
    """A job's name in the trace: the random tail of its ID."""
    return job_id.split("-")[2][-8:] if job_id.count("-") >= 3 else job_id[-8:]


def _describe(message: m.Message) -> str:
    ids = getattr(message, "ids", None) or [c.id for c in getattr(message, "jobs", ())] \
        or [i[0] for i in getattr(message, "items", ())]
    if not ids:
        return message.KIND
    names = " ".join(short(i) for i in ids[:4]) + (f" +{len(ids) - 4}" if len(ids) > 4 else "")
    return f"{message.KIND} [{names}]"


def run_seeds(databases: SimDatabases, seeds: list[int], nodes: int, faults: tuple[str, ...],
              on_result: Callable[[SimResult], None] | None = None, **options: Any) -> list[SimResult]:
    results = []
    for seed in seeds:
        result = Simulation(databases, SimOptions(seed=seed, nodes=nodes, faults=faults,
                                                  **options)).run()
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results
