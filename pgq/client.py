""":class:`Client`: the blocking pgq client (Disque's commands as methods).

Invariants:

* Calls without ``conn=`` run on the client's own pool of autocommit
  connections; each call is its own transaction (or a few statements in one
  transaction when a command needs it), committed before the call returns.
* Calls with ``conn=`` run on the caller's connection and never commit, roll
  back or change its settings: the effect commits with the caller's
  transaction.
* A call on the pool that loses its connection (server restart, network) is
  retried on a fresh connection until ``reconnect_timeout``; this is safe
  because job IDs are made by the client (a repeated add is a no-op) and a
  repeated claim can only delay jobs until their retry time.
* The client is thread-safe: threads share the pool.
* A client made before ``fork()`` (a module-level client under gunicorn's
  ``--preload``, a multiprocessing fork) gets, in the child, a pool, a
  listener and peer pools of its own: the parent's connections' sockets
  are the parent's (two processes talking on one backend garble both),
  and their threads did not survive the fork. The parent's are left
  alone, never closed from the child.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import psycopg
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from . import commands, sharedpool, tracing
from .backoff import doubling
from .combine import Shared, SyncCombiner
from .connecting import first_connection
from .core import SWEEP_PARAMS, ClientCore, CommandFactory, pool_closed_error, translate_database_error
from .driver import SyncDriver
from .dsn import connection_settings
from .errors import DatabaseUnavailableError, NoReplError
from .job import Job
from .listener import SyncSharedListener, Ticket
from .migrate import SCHEMA_VERSION as SCHEMA
from .migrate import check_schema
from .migrate import migrate as run_migrations
from .peers import PeerPools
from .statements import HAS_SCHEMA, SCHEMA_AND_NODE, SESSION_OPTIONS, SWEEP, TURBO_OPTIONS

__all__ = ["Client"]

T = TypeVar("T")
log = logging.getLogger("pgq")


class _Reconnect(Exception):
    """The pooled connection broke: retry the call on another one."""


class _Lease:
    """The pooled connection one command runs on, lent back to the pool
    while the command waits with nothing on it (see pgq.aio._Lease)."""

    def __init__(self, pool: ConnectionPool, conn: psycopg.Connection[Any],
                 current: Callable[[], ConnectionPool | None],
                 returned: Callable[[], None] = lambda: None) -> None:
        self.pool = pool  # the pool `conn` came from, and goes back to
        self.returned = returned  # told each time: the node answers (ClientCore._busy_pool)
        self.conn: psycopg.Connection[Any] | None = conn
        self.current = current
        self.resumed = time.monotonic()

    def lend(self, waiting: Callable[[], object]) -> psycopg.Connection[Any]:
        self.release()
        waiting()
        self.resumed = time.monotonic()
        pool = self.current()
        if pool is None:
            raise DatabaseUnavailableError("the client was closed while this call waited")
        self.pool, self.conn = pool, pool.getconn()
        return self.conn

    def release(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            self.pool.putconn(conn)
            self.returned()


class _Combiners:
    """The group-commit queues of one database (see Client._combiners)."""

    def __init__(self) -> None:
        self.adds: SyncCombiner[commands.AddCall] = SyncCombiner(
            lambda client, calls: client._run(lambda s: commands.add_batch(s, calls)),
            weigh=commands.call_bytes, limit=commands.BATCH_BYTES, usable=_open)
        self.replicated: SyncCombiner[commands.AddCall] = SyncCombiner(
            lambda client, calls: client._run(lambda s: commands.add_replicated_batch(s, calls)),
            parallel=commands.REPLICATED_FLUSHES, weigh=commands.call_bytes,
            limit=commands.BATCH_BYTES, usable=_open)
        self.claims: SyncCombiner[commands.ClaimCall] = SyncCombiner(
            lambda client, calls: client._run(lambda s: commands.claim_batch(s, calls)),
            usable=_open)
        self.acks: SyncCombiner[list[str]] = SyncCombiner(
            lambda client, calls: client._run(lambda s: commands.ack_batch(s, calls)),
            usable=_open)


def _open(client: Client) -> bool:
    """Whether ``client`` may run a batch (its pool is not closed)."""
    return not client._closed


_SHARED: Shared[Any] = Shared(_Combiners)


def _new_pool(key: sharedpool.PoolKey, max_size: int) -> ConnectionPool:
    """A pool of connections to ``key.dsn`` with its session settings."""
    pool = ConnectionPool(
        key.dsn, min_size=1, max_size=max_size, open=False,
        kwargs={"autocommit": True,
                "prepare_threshold": 5 if key.prepare else None,
                **connection_settings(key.dsn, SESSION_OPTIONS + (TURBO_OPTIONS if key.turbo else ""),
                                      key.application_name)},
        timeout=key.timeout, max_idle=sharedpool.MAX_IDLE,
        name=f"pgq-{next(_POOL_NUMBERS)}", num_workers=1,
    )
    pool.open(wait=False)
    return pool


_POOL_NUMBERS = itertools.count(1)
_SOLO_OWNERS = itertools.count(1)  # clients with several DSNs: a pool of their own each
_LIVE: weakref.WeakSet[Client] = weakref.WeakSet()  # renewed in a forked child
_PARENTS_POOLS: list[ConnectionPool] = []  # in a forked child: left alone (see _renew_in_child)


def _renew_clients_in_child() -> None:
    for client in list(_LIVE):
        client._renew_in_child()


# After pgq.sharedpool's own hook (imported above, so registered first: the
# after-fork hooks run in the order they were registered).
os.register_at_fork(after_in_child=_renew_clients_in_child)


class Client(ClientCore):
    """A blocking client of one pgq node.

    ``Client()`` with no DSN (and no ``$PGQ_DSN``) starts or reuses the
    embedded PostgreSQL server under ``$PGQ_HOME`` and migrates it. With a
    DSN, the schema must already be migrated (``pgq migrate``) unless
    ``migrate=True``. Options: see :class:`pgq.core.ClientOptions`.
    """

    def __init__(self, dsn: str | list[str] | None = None, **options: Any) -> None:
        super().__init__(dsn, options)
        # One direct connection first: a refusal (password, unknown database)
        # or an unreachable server fails here within seconds, with libpq's
        # cause, rather than in a pool that retries for reconnect_timeout.
        index, (version, node_id) = first_connection(
            self._dsns, self._read_node, timeout=self.first_connect_timeout)
        self.use_dsn(index)
        if self.should_migrate and version != SCHEMA:
            run_migrations(self._dsn)
            _, (version, node_id) = first_connection([self._dsn], self._read_node)
        check_schema(version)
        self._node_id = node_id
        self._switching = threading.Lock()
        self._closed = False
        self._renew = False  # a forked child's first call opens its pool
        self._pool: ConnectionPool | None = self._open_pool()
        # Other nodes' databases, where synchronous replicated adds write
        # their copies themselves (pgq.peers; opened when first needed).
        self._peers = PeerPools(turbo=self.options.turbo,
                                application_name=self.options.application_name)
        # Blocked GETs share one LISTEN connection, served by a thread
        # started by the first of them (pgq.listener).
        self._listener = SyncSharedListener(self._connect_listener)
        _LIVE.add(self)

    def _renew_in_child(self) -> None:
        """After a fork, in the child: nothing of the parent's (see the
        module's invariants). Its pool is kept referenced, never used nor
        collected (its finaliser takes locks a parent thread may have held
        at the fork), and the child's opens at its first call: opened here,
        every child made a connection and two threads, used or not (a
        multiprocessing pool, a subprocess with preexec_fn, which runs the
        fork hooks too; found by a review of the first version)."""
        self._switching = threading.Lock()
        self._peers = PeerPools(turbo=self.options.turbo,
                                application_name=self.options.application_name)
        self._listener = SyncSharedListener(self._connect_listener)
        if self._pool is not None:
            _PARENTS_POOLS.append(self._pool)
            self._renew = True

    def _renewed_pool(self) -> ConnectionPool | None:
        """The pool to use: after a fork, the child's own, opened now."""
        if self._renew:
            with self._switching:
                if self._renew and not self._closed:
                    self._pool = self._open_pool()  # pgq.sharedpool forgot the parent's
                self._renew = False
        return self._pool

    def _open_pool(self) -> ConnectionPool:
        """This client's share of the process's pool for its database
        (pgq.sharedpool: clients of one database share their connections)."""
        key = sharedpool.PoolKey(self._dsn, self.options.prepare, self.options.turbo,
                                 self.options.application_name, self.pool_timeout,
                                 owner=next(_SOLO_OWNERS) if len(self._dsns) > 1 else 0)
        return sharedpool.acquire(key, self.options.pool_size, _new_pool)

    def _fail_over(self, failed: ConnectionPool | None) -> bool:
        """Switch to the next DSN (once per failure, whatever the threads)."""
        with self._switching:
            if self._pool is not failed:
                return True  # another thread switched already
            if self._closed:
                return False  # a pool opened now would never be closed
            if not self.next_dsn():
                return False
            log.warning("pgq: node database unreachable, failing over to %s:%s",
                        self._host, self._port)
            self._pool = self._open_pool()
        if failed is not None:
            sharedpool.release(failed, self.options.pool_size)
        return True

    # ------------------------------------------------------------ plumbing

    @staticmethod
    def _read_node(conn: psycopg.Connection[Any], _lease: _Lease | None = None) -> tuple[str | None, str]:
        if not conn.execute(HAS_SCHEMA).fetchone()[0]:  # type: ignore[index]
            return None, ""
        version, node_id = conn.execute(SCHEMA_AND_NODE).fetchone()  # type: ignore[misc]
        return version, node_id or ""

    def _housekeeping(self, conn: psycopg.Connection[Any]) -> None:
        if self.sweep_due():
            try:
                row = conn.execute(SWEEP, SWEEP_PARAMS, prepare=self.options.prepare or None).fetchone()
            except psycopg.OperationalError:
                raise
            except psycopg.Error as exc:  # a sweep failure must not fail the caller's call
                log.warning("pgq sweep failed: %s", exc)
            else:
                self.swept(row)

    def _run_on_pool(self, work: Any) -> Any:
        deadline = time.monotonic() + self.options.reconnect_timeout
        attempt = 0
        while True:
            pool = self._renewed_pool()
            if pool is None:
                raise DatabaseUnavailableError("this client is closed")
            lease: _Lease | None = None
            try:
                returned = self._returned  # before this call waits in line
                lease = _Lease(pool, pool.getconn(), lambda: self._pool, self._connection_returned)
                try:
                    return work(lease.conn, lease)
                except PoolTimeout:  # no connection to go on with after a lent wait
                    raise
                except psycopg.OperationalError as exc:  # PoolClosed too: a failover meanwhile
                    conn = lease.conn
                    if conn is None or conn.closed or conn.broken:
                        raise _Reconnect() from exc
                    raise
                finally:
                    lease.release()
            except (_Reconnect, PoolTimeout) as exc:
                cause = exc.__cause__ or exc
                if lease is not None:  # a call that waited long is not out of time for that
                    deadline = max(deadline, lease.resumed + self.options.reconnect_timeout)
                if time.monotonic() >= deadline:
                    raise self.unavailable(cause, pool.get_stats(), pool.max_size) from cause
                if isinstance(exc, PoolTimeout) and self._busy_pool(pool.get_stats(), pool.max_size,
                                                                   returned):
                    continue  # the node answers: back in line, no failover
                if isinstance(exc, PoolTimeout) and self._fail_over(pool):
                    if work is not self._read_node:  # a new node: its id and schema
                        version, self._node_id = self._run_on_pool(self._read_node)
                        check_schema(version)
                    continue
                pool.check()
                time.sleep(doubling(0.05, attempt, 1.0))
                attempt += 1
            except PoolClosed as exc:  # from getconn: nothing was sent
                error = pool_closed_error(pool, self._pool, exc)
                if error is None:
                    continue  # another call failed over meanwhile: on with the new pool
                raise error from exc
            except psycopg.Error as exc:
                typed = translate_database_error(exc)
                if typed is None:
                    raise
                raise typed from exc

    def _combiners(self) -> _Combiners:
        """Group commit: concurrent calls of every client of this database
        in the process (threads sharing one client, or each with its own)
        share statements and commits (see pgq.combine)."""
        # (Clients that differ in how they write share no batch: a batch runs
        # with its leader's client, its settings and its connections. So a
        # closed client's call never enters one: as the leader of a batch it
        # failed the other clients' calls with its closed pool. One that
        # was waiting when its client closed still leads, with an open
        # client of its batch: SyncCombiner's usable.)
        if self._closed:
            raise DatabaseUnavailableError("this client is closed")
        combiners: _Combiners = _SHARED.get((self._dsn, self.options.turbo, self.options.prepare,
                                             self.options.direct_copies))
        return combiners

    def _connect_listener(self) -> psycopg.Connection[Any]:
        return psycopg.Connection.connect(
            self._dsn, autocommit=True, connect_timeout=max(1, int(self.pool_timeout)),
            **connection_settings(self._dsn, SESSION_OPTIONS, self.options.application_name))

    def _run(self, make: CommandFactory[T], conn: object = None, ticket: Ticket | None = None) -> T:
        if conn is not None:
            from .connections import sync_connection

            raw = sync_connection(conn)
            try:
                return SyncDriver(raw, prepare=False).run(make(self.session(owned=False)))
            except psycopg.Error as exc:
                typed = translate_database_error(exc)
                if typed is None:
                    raise
                raise typed from exc

        early = [ticket]  # joined before the first attempt: a retry's driver must not take it

        def work(pooled: psycopg.Connection[Any], lease: _Lease) -> T:
            self._housekeeping(pooled)
            joined, early[0] = early[0], None
            driver = SyncDriver(pooled, prepare=self.options.prepare, housekeeping=self._housekeeping,
                                peers=self._peers, listener=self._listener, ticket=joined,
                                lend=lease.lend)
            return driver.run(make(self.session(owned=True)))

        return self._run_on_pool(work)  # type: ignore[no-any-return]

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close the client's connections (the embedded server keeps running)."""
        with self._switching:
            self._closed = True
            pool, self._pool = self._pool, None
        try:
            self._listener.close()
        finally:
            if pool is not None:  # else the pool's other members would never close it
                sharedpool.release(pool, self.options.pool_size)
            self._peers.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ commands

    def add_job(self, queue: str, body: bytes | str, *, replicate: int | None = None,
                delay: float = 0, retry: float | None = None, ttl: float | None = None,
                maxlen: int | None = None, asynchronous: bool = False,
                timeout: float | None = None, priority: int = 0, key: str | None = None,
                conn: object = None) -> str:
        """ADDJOB: add one job to ``queue``; returns its ID once it is durably stored.

        ``priority`` (0 to 1,000,000, default 0): higher is delivered first,
        FIFO within a priority. ``key``: an idempotency key; while a job added
        with that key is live in the queue (not yet acknowledged, deleted or
        expired), adding again adds nothing and returns that job's ID. A
        replicated job's copies carry the key, so the add is idempotent
        through any node that holds a copy.
        """
        call = self.add_call(queue, [body], replicate=replicate, delay=delay, retry=retry,
                             ttl=ttl, maxlen=maxlen, asynchronous=asynchronous, timeout=timeout,
                             priority=priority, key=key)
        return self._add(call, conn)[0]

    def add_jobs(self, queue: str, bodies: Iterable[bytes | str], *,
                 replicate: int | None = None, delay: float = 0, retry: float | None = None,
                 ttl: float | None = None, maxlen: int | None = None,
                 asynchronous: bool = False, timeout: float | None = None,
                 priority: int = 0, conn: object = None) -> list[str]:
        """Add many jobs in one round trip (COPY for large batches); IDs in body order."""
        call = self.add_call(queue, bodies, replicate=replicate, delay=delay, retry=retry,
                             ttl=ttl, maxlen=maxlen, asynchronous=asynchronous, timeout=timeout,
                             priority=priority)
        return self._add(call, conn)

    def _add(self, call: commands.AddCall, conn: object) -> list[str]:
        with tracing.span(f"pgq add {call.queue}", "PRODUCER", queue=call.queue) as span:
            ids = self._add_untraced(call, conn)
            tracing.set_ids(span, ids)
            return ids

    def _add_untraced(self, call: commands.AddCall, conn: object) -> list[str]:
        """Run an add: in a batch with other callers' when it can be, else on
        its own; when this node's process is down and nothing was kept, add
        through the next node DSN (each tried at most once)."""
        make = self.add_command(call)
        for others in range(len(self._dsns) - 1, -1, -1):
            # The pool this attempt runs on: failing over "the pool in use"
            # after it failed switched a client another caller had just
            # failed over back to the dead node (two callers of one batch).
            pool = self._renewed_pool()
            try:
                return self._add_once(call, make, conn)
            except NoReplError as exc:
                if not (exc.node_down and not exc.added and others and conn is None):
                    raise
                log.warning("pgq: %s; adding through the next node", exc)
                self._fail_over(pool)
                version, self._node_id = self._run_on_pool(self._read_node)
                check_schema(version)
        raise AssertionError("unreachable")

    def _add_once(self, call: commands.AddCall, make: CommandFactory[list[str]],
                  conn: object) -> list[str]:
        """One attempt on this node: the jobs kept here only in the adds'
        batch, synchronous replicated ones in the replicated batch, and
        whatever neither takes on its own."""
        batches = commands.batches_for(call, self._cluster)
        if conn is None and call.bodies and batches:
            combiners = self._combiners()
            for name in batches:
                combiner = combiners.replicated if name == "replicated" else combiners.adds
                outcome = combiner.submit(call, self)
                if outcome is not commands.REROUTE:
                    return outcome  # type: ignore[no-any-return]
        return self._run(make, conn)

    def get_job(self, *queues: str, count: int = 1, timeout: float | None = None,
                nohang: bool = False, withcounters: bool = False, conn: object = None) -> list[Job]:
        """GETJOB: up to ``count`` jobs from ``queues`` (left to right = priority).

        Blocks until a job is ready, or ``timeout`` seconds pass (``None`` or 0:
        forever), then returns ``[]``; with ``nohang`` never blocks.
        """
        request = self.get_request(queues, count=count, timeout=timeout, nohang=nohang,
                                   withcounters=withcounters)
        with tracing.span("pgq get", "CONSUMER") as span:
            if conn is not None:
                got: list[Job] = self._run(request.command(), conn)
            else:
                listener = self._listener
                early = None if request.nohang else listener.join_early(queues)
                try:
                    got = self._combiners().claims.submit(request.call, self)  # one claim, many callers
                    if isinstance(got, commands.Due) or not got:  # none (Due: and when one is due)
                        claimed = got if isinstance(got, commands.Due) else True
                        got = [] if request.nohang else self._run(request.command(claimed=claimed),
                                                                  ticket=early)
                        if len(got) >= count:
                            listener.pass_on(queues)  # a full COUNT after a wake: maybe more
                finally:
                    if early is not None:
                        listener.leave(early)
            tracing.set_ids(span, [j.id for j in got])
            return got

    def wait_replicated(self, ids: Iterable[str], timeout: float = 5.0) -> None:
        """Wait until jobs added with ``asynchronous=True`` or inside a transaction
        have their W copies; raises NoReplError on timeout (the jobs stay queued
        and the node keeps replicating them)."""
        return self._run(self.wait_replicated_command(ids, timeout))

    def ack_job(self, *ids: str | Job, conn: object = None) -> int:
        """ACKJOB: mark jobs done; returns how many known, unacknowledged jobs were acked."""
        with tracing.span("pgq ack", "CLIENT") as span:
            checked = self.job_ids(ids)  # validated once: the batch takes them as they are
            tracing.set_ids(span, checked)
            if conn is not None:
                return self._run(self.ids_command("ack_jobs", ids), conn)
            return self._combiners().acks.submit(checked, self)  # type: ignore[no-any-return]

    def fast_ack(self, *ids: str | Job, conn: object = None) -> int:
        """FASTACK: delete jobs now (no tombstone); returns how many were deleted."""
        return self._run(self.ids_command("fast_ack_jobs", ids), conn)

    def nack_job(self, *ids: str | Job, delay: float = 0, conn: object = None) -> int:
        """NACK: put delivered jobs back in the queue (after ``delay`` seconds:
        a back-off, a pgq extension); returns how many."""
        return self._run(self.nack_command(ids, delay), conn)

    def dead_letter(self, *ids: str | Job, reason: str = "", conn: object = None) -> int:
        """Give up on jobs: acknowledged everywhere, kept in ``pgq.dead_letters``
        with their body and ``reason``; returns how many were moved."""
        return self._run(self.dead_letter_command(ids, reason), conn)

    def dead_letters(self, queue: str | None = None, *, after: int = 0,
                     count: int = 100) -> list[dict[str, Any]]:
        """A page of dead letters, oldest first (pass the last ``seq`` as ``after``)."""
        return self._run(self.dead_letters_command(queue, after, count))

    def requeue_dead_letters(self, queue: str | None = None, *, ids: Iterable[str] | None = None,
                             count: int = 1000, ttl: float | None = None) -> list[str]:
        """Add dead letters back as new jobs (same queue, body, priority and
        key; new IDs) and remove them from ``pgq.dead_letters``, atomically;
        returns the new IDs."""
        return self._run(self.requeue_dead_letters_command(queue, ids, count, ttl))

    def working(self, id: str | Job, conn: object = None) -> int | float:
        """WORKING: postpone a job's re-queue; returns its retry time in seconds."""
        return self._run(self.working_command(id), conn)

    def wait_job(self, id: str | Job, timeout: float | None = None) -> bool:
        """Wait until a job is done with (acknowledged anywhere its ACK
        reaches this node's copy, deleted, expired or dead-lettered): True,
        also for a job done with before the call (as far back as this
        node's history keeps), or False after ``timeout`` seconds. Raises
        NoJobError if this node holds no copy of it and knows of none
        (goware/disque's Wait)."""
        return self._run(self.wait_job_command(id, timeout))

    def store_result(self, id: str | Job, value: bytes | None = None, *, error: str | None = None,
                     keep: float = 86400.0) -> None:
        """Keep a job's result (bytes), or the error that ended it, for
        ``keep`` seconds (what a worker with ``keep_results`` does)."""
        self._run(self.store_result_command(id, value, error, keep))

    def wait_result(self, id: str | Job, timeout: float | None = None
                    ) -> tuple[bytes | None, str | None] | None:
        """The result a worker stored for a job, ``(value, error)``, waiting
        up to ``timeout`` seconds (None: forever); None if none came. Read on
        this client's node: the one whose worker ran the job. A job in the
        dead letters with no result kept gives ``(None, its reason)``.
        Raises :class:`~pgq.errors.NoJobError` when the job is gone from
        this node otherwise (none will come: it ended without one, its
        result expired, or it ran on another node)."""
        return self._run(self.wait_result_command(id, timeout))

    def show(self, id: str | Job) -> dict[str, Any] | None:
        """SHOW: everything known about a job, or None."""
        return self._run(self.show_command(id))

    def del_job(self, *ids: str | Job, conn: object = None) -> int:
        """DELJOB: delete jobs in any state on this node; returns how many."""
        return self._run(self.ids_command("del_jobs", ids), conn)

    def enqueue(self, *ids: str | Job, conn: object = None) -> int:
        """ENQUEUE: queue active jobs now; returns how many."""
        return self._run(self.ids_command("enqueue_jobs", ids), conn)

    def dequeue(self, *ids: str | Job, conn: object = None) -> int:
        """DEQUEUE: take queued jobs out of their queue; returns how many."""
        return self._run(self.ids_command("dequeue_jobs", ids), conn)

    def qlen(self, queue: str) -> int:
        """QLEN: number of jobs queued in ``queue``."""
        return self._run(self.qlen_command(queue))

    def qpeek(self, queue: str, count: int) -> list[Job]:
        """QPEEK: look at queued jobs without taking them (count < 0: newest first)."""
        return self._run(self.qpeek_command(queue, count))

    def qstat(self, queue: str) -> dict[str, Any] | None:
        """QSTAT: statistics of ``queue``, or None if it does not exist."""
        return self._run(self.qstat_command(queue))

    def qscan(self, cursor: int = 0, *, count: int = 100, minlen: int | None = None,
              maxlen: int | None = None, importrate: int | None = None) -> tuple[int, list[str]]:
        """QSCAN: one page of queue names; call again with the cursor until it is 0."""
        return self._run(self.qscan_command(cursor, count=count, minlen=minlen, maxlen=maxlen,
                                            importrate=importrate))

    def jscan(self, cursor: int = 0, *, count: int = 100, queue: str | None = None,
              states: Iterable[str] = (), reply: str = "id") -> tuple[int, list[Any]]:
        """JSCAN: one page of jobs (IDs, or dicts with reply='all'); repeat until cursor 0."""
        return self._run(self.jscan_command(cursor, count=count, queue=queue, states=states,
                                            reply=reply))

    def pause(self, queue: str, *flags: str) -> str:
        """PAUSE: flags among in, out, all, none, state, bcast; returns the resulting state."""
        return self._run(self.pause_command(queue, flags))

    def hello(self) -> dict[str, Any]:
        """HELLO: this node's ID and the nodes it knows."""
        return self._run(commands.hello)

    def cluster_meet(self, address: str) -> None:
        """CLUSTER MEET: ask this node to contact the node at ``address``
        (its bus, HOST:PORT) and join its cluster (what ``pgq cluster meet``
        does). InvalidArgumentError on a database that is not a cluster node."""
        return self._run(self.cluster_meet_command(address))

    def cluster_leaving(self, leaving: bool) -> None:
        """CLUSTER LEAVING: mark this node leaving (it takes no new copies
        and hands its jobs over) or not (what ``pgq cluster leaving`` does)."""
        return self._run(self.cluster_leaving_command(leaving))

    def info(self) -> dict[str, Any]:
        """INFO: the node, its PostgreSQL server and its jobs."""
        from . import __version__

        return self._run(lambda session: commands.info(session, __version__))

    def sweep(self) -> tuple[int, int, int]:
        """Run the timer/expiry sweep now: (expired jobs, re-queued jobs, expired acks)."""
        return self._run(commands.sweep)
