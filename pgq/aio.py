""":class:`AsyncClient`: the async pgq client, for asyncio (anyio-compatible).

Same methods, arguments, semantics and invariants as :class:`pgq.Client`,
each a coroutine. It runs the very same command generators
(:mod:`pgq.commands`) through :class:`pgq.driver.AsyncDriver`.

The connection pool opens on first use (or in ``async with``), so the client
can be created outside a running event loop. The embedded server, if used, is
started by the constructor (a blocking step of about a second the first time).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import anyio
import psycopg
from psycopg_pool import AsyncConnectionPool, PoolClosed, PoolTimeout

from . import cancelsafe, commands, tracing
from .backoff import doubling
from .combine import AsyncCombiner
from .connecting import first_connection_async
from .core import SWEEP_PARAMS, ClientCore, CommandFactory, pool_closed_error, translate_database_error
from .driver import AsyncDriver
from .dsn import connection_settings
from .errors import DatabaseUnavailableError, NoReplError
from .job import Job
from .listener import SharedListener, Ticket
from .migrate import SCHEMA_VERSION as SCHEMA
from .migrate import check_schema
from .migrate import migrate as run_migrations
from .peers import AsyncPeerPools
from .statements import HAS_SCHEMA, SCHEMA_AND_NODE, SESSION_OPTIONS, SWEEP, TURBO_OPTIONS

__all__ = ["AsyncClient"]

T = TypeVar("T")
log = logging.getLogger("pgq")


class _Reconnect(Exception):
    """The pooled connection broke: retry the call on another one."""


class _Lease:
    """The pooled connection one command runs on. While the command waits
    outside a transaction with nothing to hear on that connection (a blocked
    GET on the shared listener, a poll), the connection is back in the pool
    (:meth:`lend`, called by the driver), and the command takes one again to
    go on, from the client's pool of that moment (a failover may have
    replaced the first). A blocked GET held its connection for its whole
    wait: ten blocked GETJOBs of the RESP port (a pool of ten) stopped every
    ADDJOB."""

    def __init__(self, pool: AsyncConnectionPool, conn: psycopg.AsyncConnection[Any],
                 current: Callable[[], AsyncConnectionPool | None],
                 returned: Callable[[], None] = lambda: None) -> None:
        self.pool = pool  # the pool `conn` came from, and goes back to
        self.returned = returned  # told each time: the node answers (ClientCore._busy_pool)
        self.conn: psycopg.AsyncConnection[Any] | None = conn
        self.current = current
        self.resumed = time.monotonic()  # when it last took a connection

    async def lend(self, waiting: Callable[[], Awaitable[object]]) -> psycopg.AsyncConnection[Any]:
        """Run ``waiting()`` with the connection back in the pool; the
        connection to go on with (maybe another one)."""
        cancelled = await self.release()
        if cancelled is not None:
            raise cancelled  # nothing claimed yet: the wait had not begun
        await waiting()
        self.resumed = time.monotonic()  # a failure to go on counts from now
        pool = self.current()
        if pool is None:
            raise DatabaseUnavailableError("the client was closed while this call waited")
        self.pool, self.conn = pool, await pool.getconn()
        return self.conn

    async def release(self) -> BaseException | None:
        """Give the connection back, whoever cancels the task meanwhile;
        asyncio's cancellation that arrived is returned, for the caller to
        raise with what the command returned (raised here, in a finally, it
        dropped a claim's jobs)."""
        conn, self.conn = self.conn, None
        if conn is None:
            return None
        _, cancelled = await cancelsafe.finish(self.pool.putconn, conn)
        self.returned()
        return cancelled


async def _release_then_raise(lease: _Lease, error: BaseException | None = None) -> None:
    """Give a failed call's connection back; asyncio's cancellation that
    arrived meanwhile goes on in place of the error (retried, the call ran
    on uncancelled), with the jobs the error carried (pgq.cancelsafe)."""
    cancelled = await lease.release()
    if cancelled is not None:
        jobs = None if error is None else cancelsafe.undelivered(error)
        if jobs is not None:
            cancelsafe.attach(cancelled, jobs)
        raise cancelled


class AsyncClient(ClientCore):
    """An async client of one pgq node (see :class:`pgq.Client`)."""

    def __init__(self, dsn: str | list[str] | None = None, **options: Any) -> None:
        super().__init__(dsn, options)
        self._pool: AsyncConnectionPool | None = None
        # Other nodes' databases, for direct copies (pgq.peers).
        self._peers = AsyncPeerPools(turbo=self.options.turbo,
                                     application_name=self.options.application_name)
        # Group commit: concurrent calls of this client's tasks share
        # statements and commits (see pgq.combine).
        self._adds: AsyncCombiner[commands.AddCall] = AsyncCombiner(
            lambda client, calls: client._run(lambda s: commands.add_batch(s, calls)),
            weigh=commands.call_bytes, limit=commands.BATCH_BYTES)
        self._replicated: AsyncCombiner[commands.AddCall] = AsyncCombiner(
            lambda client, calls: client._run(lambda s: commands.add_replicated_batch(s, calls)),
            parallel=commands.REPLICATED_FLUSHES, weigh=commands.call_bytes,
            limit=commands.BATCH_BYTES)
        self._claims: AsyncCombiner[commands.ClaimCall] = AsyncCombiner(
            lambda client, calls: client._run(lambda s: commands.claim_batch(s, calls)),
            delivers=True)
        self._acks: AsyncCombiner[list[str]] = AsyncCombiner(
            lambda client, calls: client._run(lambda s: commands.ack_batch(s, calls)))
        # Blocked GETs share one LISTEN connection (pgq.listener), served by
        # a task of `async with`; a client opened otherwise LISTENs per GET.
        self._listener: SharedListener | None = None
        # The task serving it, and the cancel scope that stops it.
        self._listening: tuple[asyncio.Task[None], anyio.CancelScope] | None = None
        self._opening = anyio.Lock()
        self._switching = anyio.Lock()
        self._closed = False

    # ------------------------------------------------------------ plumbing

    async def open(self) -> None:
        """Open the pool, migrate if asked, and read the node's ID (idempotent)."""
        async with self._opening:
            if self._pool is not None:
                return
            if self._closed:
                raise DatabaseUnavailableError("this AsyncClient is closed")
            # As in pgq.Client: fail fast, with the cause, on the first contact.
            index, (version, node_id) = await first_connection_async(
                self._dsns, self._read_node, timeout=self.first_connect_timeout)
            self.use_dsn(index)
            if self.should_migrate and version != SCHEMA:
                await anyio.to_thread.run_sync(run_migrations, self._dsn)
                _, (version, node_id) = await first_connection_async([self._dsn], self._read_node)
            check_schema(version)
            self._node_id = node_id
            pool = await self._open_pool()
            if self._closed:  # closed while this opened: the pool would never be closed
                await cancelsafe.complete(pool.close)
                raise DatabaseUnavailableError("this AsyncClient is closed")
            self._pool = pool

    async def _open_pool(self) -> AsyncConnectionPool:
        pool = AsyncConnectionPool(
            self._dsn, min_size=1, max_size=self.options.pool_size, open=False,
            kwargs={"autocommit": True,
                    "prepare_threshold": 5 if self.options.prepare else None,
                    **connection_settings(
                        self._dsn, SESSION_OPTIONS + (TURBO_OPTIONS if self.options.turbo else ""),
                        self.options.application_name)},
            timeout=self.pool_timeout,
            name=f"pgq-async-{id(self):x}",
        )
        await pool.open(wait=False)
        return pool

    async def _fail_over(self, failed: AsyncConnectionPool) -> bool:
        """Switch to the next DSN (once per failure, whatever the tasks)."""
        async with self._switching:
            if self._pool is not failed:
                return True
            if self._closed or not self.next_dsn():
                return False  # closed: a pool opened now would never be closed
            log.warning("pgq: node database unreachable, failing over to %s:%s",
                        self._host, self._port)
            self._pool = await self._open_pool()
        await cancelsafe.complete(failed.close, 1.0)
        return True

    @staticmethod
    async def _read_node(conn: psycopg.AsyncConnection[Any],
                         _lease: _Lease | None = None) -> tuple[str | None, str]:
        if not (await (await conn.execute(HAS_SCHEMA)).fetchone())[0]:  # type: ignore[index]
            return None, ""
        version, node_id = await (await conn.execute(SCHEMA_AND_NODE)).fetchone()  # type: ignore[misc]
        return version, node_id or ""

    async def _housekeeping(self, conn: psycopg.AsyncConnection[Any]) -> None:
        if self.sweep_due():
            try:
                cursor = await conn.execute(SWEEP, SWEEP_PARAMS, prepare=self.options.prepare or None)
                self.swept(await cursor.fetchone())
            except psycopg.OperationalError:
                raise
            except psycopg.Error as exc:
                log.warning("pgq sweep failed: %s", exc)

    async def _run_on_pool(self, work: Any) -> Any:
        deadline = time.monotonic() + self.options.reconnect_timeout
        attempt = 0
        while True:
            pool = self._pool
            if pool is None:
                raise DatabaseUnavailableError("this client is closed")
            lease: _Lease | None = None
            try:
                returned = self._returned  # before this call waits in line
                lease = _Lease(pool, await pool.getconn(), lambda: self._pool, self._connection_returned)
                try:
                    value = await work(lease.conn, lease)
                except PoolTimeout:  # no connection to go on with after a lent wait
                    await _release_then_raise(lease)
                    raise
                except psycopg.OperationalError as exc:  # PoolClosed too: a failover meanwhile
                    conn = lease.conn
                    broken = conn is None or conn.closed or conn.broken
                    await _release_then_raise(lease)
                    if broken:
                        raise _Reconnect() from exc
                    raise
                except BaseException as exc:
                    await _release_then_raise(lease, exc)
                    raise
                cancelled = await lease.release()
                if cancelled is not None:  # asyncio's, during the release: on with it
                    raise cancelsafe.attach(cancelled, value)  # a claim's jobs are put back
                return value
            except (_Reconnect, PoolTimeout) as exc:
                cause = exc.__cause__ or exc
                if lease is not None:  # a call that waited long is not out of time for that
                    deadline = max(deadline, lease.resumed + self.options.reconnect_timeout)
                if time.monotonic() >= deadline:
                    raise self.unavailable(cause, pool.get_stats()) from cause
                if isinstance(exc, PoolTimeout) and self._busy_pool(pool.get_stats(), pool.max_size,
                                                                   returned):
                    continue  # the node answers: back in line, no failover
                if isinstance(exc, PoolTimeout) and await self._fail_over(pool):
                    if work is not self._read_node:  # a new node: its id and schema
                        version, self._node_id = await self._run_on_pool(self._read_node)
                        check_schema(version)
                    continue
                await pool.check()
                await anyio.sleep(doubling(0.05, attempt, 1.0))
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

    async def _run(self, make: CommandFactory[T], conn: object = None,
                   ticket: Ticket | None = None) -> T:
        if conn is not None:
            from .connections import async_connection

            raw = await async_connection(conn)  # a wrong type refused before any I/O, as Client does
            if self._pool is None:
                await self.open()
            try:
                return await AsyncDriver(raw, prepare=False).run(make(self.session(owned=False)))
            except psycopg.Error as exc:
                typed = translate_database_error(exc)
                if typed is None:
                    raise
                raise typed from exc
        if self._pool is None:
            await self.open()

        early = [ticket]  # joined before the first attempt: a retry's driver must not take it

        async def work(pooled: psycopg.AsyncConnection[Any], lease: _Lease) -> T:
            await self._housekeeping(pooled)
            joined, early[0] = early[0], None
            driver = AsyncDriver(pooled, prepare=self.options.prepare,
                                 housekeeping=self._housekeeping, shield=True, peers=self._peers,
                                 listener=self._listener, ticket=joined, lend=lease.lend)
            return await driver.run(make(self.session(owned=True)))

        return await self._run_on_pool(work)  # type: ignore[no-any-return]

    # ------------------------------------------------------------ lifecycle

    async def close(self) -> None:
        """Close the client's connections (the embedded server keeps running),
        its shared LISTEN connection too."""
        self._closed = True
        # Whoever cancels the closing task (a framework's shutdown, a
        # timeout), the pools close: left open, their connections and
        # worker tasks leaked.
        await cancelsafe.complete(self._close)

    async def _close(self) -> None:
        try:
            await self._stop_listening()
        finally:
            pool, self._pool = self._pool, None
            if pool is not None:
                await pool.close()
            await self._peers.close()

    async def __aenter__(self) -> AsyncClient:
        await self.open()
        if self._listening is None:
            # A task of its own, not a task group entered here: a client may
            # be left in another task than it was entered in (an async
            # pytest fixture, a framework's startup and shutdown hooks), and
            # a task group's cancel scope refuses that ("Attempted to exit
            # cancel scope in a different task"), which left the listener
            # running. psycopg's async connections run on asyncio only.
            listener = SharedListener(self._connect_listener)
            self._listener = listener
            scope = anyio.CancelScope()
            task = asyncio.get_running_loop().create_task(self._run_listener(listener, scope),
                                                          name="pgq-listener")
            self._listening = (task, scope)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _run_listener(self, listener: SharedListener, scope: anyio.CancelScope) -> None:
        try:
            with scope:  # entered and left in this task; cancelled by close()
                await listener.run()
        except Exception:  # SharedListener degrades to polling; never expected
            log.exception("pgq: the shared LISTEN connection stopped; blocked GETs poll")
        finally:
            if self._listener is listener:
                self._listener = None

    async def _stop_listening(self) -> None:
        listening, self._listening = self._listening, None
        if listening is not None:
            task, scope = listening
            scope.cancel()  # anyio's cancellation: the listener's shielded cleanup runs
            await asyncio.wait([task])  # never raises the task's outcome

    async def _serve_listener(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve the shared LISTEN connection of this client's blocked GETs
        until cancelled: what ``async with`` starts, and a server that owns
        its task group and opens the client lazily (pgq.fronts)."""
        listener = SharedListener(self._connect_listener)
        self._listener = listener
        task_status.started()
        try:
            await listener.run()
        finally:
            if self._listener is listener:
                self._listener = None

    async def _connect_listener(self) -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(
            self._dsn, autocommit=True, connect_timeout=max(1, int(self.pool_timeout)),
            **connection_settings(self._dsn, SESSION_OPTIONS, self.options.application_name))

    # ------------------------------------------------------------ commands

    async def add_job(self, queue: str, body: bytes | str, *, replicate: int | None = None,
                      delay: float = 0, retry: float | None = None, ttl: float | None = None,
                      maxlen: int | None = None, asynchronous: bool = False,
                      timeout: float | None = None, priority: int = 0,
                      key: str | None = None, conn: object = None) -> str:
        """ADDJOB (see :meth:`pgq.Client.add_job`)."""
        call = self.add_call(queue, [body], replicate=replicate, delay=delay, retry=retry,
                             ttl=ttl, maxlen=maxlen, asynchronous=asynchronous, timeout=timeout,
                             priority=priority, key=key)
        return (await self._add(call, conn))[0]

    async def add_jobs(self, queue: str, bodies: Iterable[bytes | str], *,
                       replicate: int | None = None, delay: float = 0,
                       retry: float | None = None, ttl: float | None = None,
                       maxlen: int | None = None, asynchronous: bool = False,
                       timeout: float | None = None, priority: int = 0,
                       conn: object = None) -> list[str]:
        """Bulk add (see :meth:`pgq.Client.add_jobs`)."""
        call = self.add_call(queue, bodies, replicate=replicate, delay=delay, retry=retry,
                             ttl=ttl, maxlen=maxlen, asynchronous=asynchronous, timeout=timeout,
                             priority=priority)
        return await self._add(call, conn)

    async def _add(self, call: commands.AddCall, conn: object) -> list[str]:
        with tracing.span(f"pgq add {call.queue}", "PRODUCER", queue=call.queue) as span:
            ids = await self._add_untraced(call, conn)
            tracing.set_ids(span, ids)
            return ids

    async def _add_untraced(self, call: commands.AddCall, conn: object) -> list[str]:
        """As :meth:`pgq.Client._add`: batched when it can be; through the
        next node when this one's process is down."""
        make = self.add_command(call)
        for others in range(len(self._dsns) - 1, -1, -1):
            pool = self._pool  # the one this attempt runs on (see pgq.Client._add_untraced)
            try:
                return await self._add_once(call, make, conn)
            except NoReplError as exc:
                if not (exc.node_down and not exc.added and others and conn is None):
                    raise
                log.warning("pgq: %s; adding through the next node", exc)
                failed = pool if pool is not None else self._pool  # None: opened by the attempt
                assert failed is not None
                await self._fail_over(failed)
                version, self._node_id = await self._run_on_pool(self._read_node)
                check_schema(version)
        raise AssertionError("unreachable")

    async def _add_once(self, call: commands.AddCall, make: CommandFactory[list[str]],
                        conn: object) -> list[str]:
        """As :meth:`pgq.Client._add_once`."""
        batches = commands.batches_for(call, self._cluster)
        if conn is None and call.bodies and batches:
            if self._pool is None:
                await self.open()
            for name in batches:
                combiner = self._replicated if name == "replicated" else self._adds
                outcome = await combiner.submit(call, self)
                if outcome is not commands.REROUTE:
                    return outcome  # type: ignore[no-any-return]
        return await self._run(make, conn)

    async def get_job(self, *queues: str, count: int = 1, timeout: float | None = None,
                      nohang: bool = False, withcounters: bool = False,
                      conn: object = None) -> list[Job]:
        """GETJOB (see :meth:`pgq.Client.get_job`)."""
        request = self.get_request(queues, count=count, timeout=timeout, nohang=nohang,
                                   withcounters=withcounters)
        with tracing.span("pgq get", "CONSUMER") as span:
            if conn is not None:
                got: list[Job] = await self._run(request.command(), conn)
            else:
                if self._pool is None:
                    await self.open()
                listener = self._listener
                early = listener.join_early(queues) if listener and not request.nohang else None
                try:
                    got = await self._claims.submit(request.call, self)  # one claim for many callers
                    if isinstance(got, commands.Due) or not got:  # none (Due: and when one is due)
                        claimed = got if isinstance(got, commands.Due) else True
                        if request.nohang:
                            got = []
                        else:
                            got = await self._run(request.command(claimed=claimed), ticket=early)
                            if len(got) >= count and listener is not None:
                                listener.pass_on(queues)  # a full COUNT after a wake: maybe more
                except asyncio.CancelledError as exc:
                    await self._give_back(cancelsafe.undelivered(exc))
                    raise
                finally:
                    if early is not None:
                        assert listener is not None
                        listener.leave(early)
            tracing.set_ids(span, [j.id for j in got])
            return got

    async def _give_back(self, jobs: object) -> None:
        """Put back in their queue the jobs a claim took for a caller that
        asyncio cancelled before it got them (pgq.cancelsafe): left leased,
        they waited out their retry, and a retry-0 job was never delivered
        at all. As ENQUEUE (no nack counted: no consumer saw them), the
        retry-0 ones included (commands.give_back_jobs)."""
        if not isinstance(jobs, list) or not jobs:
            return
        ids = [job.id for job in jobs if isinstance(job, Job)]
        try:
            # (complete: asyncio's cancellation that arrived meanwhile goes on)
            await cancelsafe.complete(self._run, self.ids_command("give_back_jobs", tuple(ids)))
        except Exception as exc:  # the cancellation goes on; the lease brings them back
            log.warning("pgq: could not put back %d jobs claimed for a cancelled GET "
                        "(they are queued again when their retry runs out): %s", len(ids), exc)

    async def wait_replicated(self, ids: Iterable[str], timeout: float = 5.0) -> None:
        """Wait until jobs added with ``asynchronous=True`` or inside a transaction
        have their W copies; raises NoReplError on timeout (the jobs stay queued
        and the node keeps replicating them)."""
        return await self._run(self.wait_replicated_command(ids, timeout))

    async def ack_job(self, *ids: str | Job, conn: object = None) -> int:
        """ACKJOB (see :meth:`pgq.Client.ack_job`)."""
        with tracing.span("pgq ack", "CLIENT") as span:
            if conn is not None:
                return await self._run(self.ids_command("ack_jobs", ids), conn)
            checked = self.job_ids(ids)
            tracing.set_ids(span, checked)
            if self._pool is None:
                await self.open()
            return await self._acks.submit(checked, self)  # type: ignore[no-any-return]

    async def fast_ack(self, *ids: str | Job, conn: object = None) -> int:
        """FASTACK (see :meth:`pgq.Client.fast_ack`)."""
        return await self._run(self.ids_command("fast_ack_jobs", ids), conn)

    async def nack_job(self, *ids: str | Job, delay: float = 0, conn: object = None) -> int:
        """NACK: put delivered jobs back in the queue (after ``delay`` seconds:
        a back-off, a pgq extension); returns how many."""
        return await self._run(self.nack_command(ids, delay), conn)

    async def dead_letter(self, *ids: str | Job, reason: str = "", conn: object = None) -> int:
        """Give up on jobs: acknowledged everywhere, kept in ``pgq.dead_letters``
        with their body and ``reason``; returns how many were moved."""
        return await self._run(self.dead_letter_command(ids, reason), conn)

    async def dead_letters(self, queue: str | None = None, *, after: int = 0,
                     count: int = 100) -> list[dict[str, Any]]:
        """A page of dead letters, oldest first (pass the last ``seq`` as ``after``)."""
        return await self._run(self.dead_letters_command(queue, after, count))

    async def requeue_dead_letters(self, queue: str | None = None, *, ids: Iterable[str] | None = None,
                             count: int = 1000, ttl: float | None = None) -> list[str]:
        """Add dead letters back as new jobs (same queue and body, new IDs) and
        remove them from ``pgq.dead_letters``, atomically; returns the new IDs."""
        return await self._run(self.requeue_dead_letters_command(queue, ids, count, ttl))

    async def working(self, id: str | Job, conn: object = None) -> int | float:
        """WORKING (see :meth:`pgq.Client.working`)."""
        return await self._run(self.working_command(id), conn)

    async def wait_job(self, id: str | Job, timeout: float | None = None) -> bool:
        """See :meth:`pgq.Client.wait_job`."""
        return await self._run(self.wait_job_command(id, timeout))

    async def store_result(self, id: str | Job, value: bytes | None = None, *,
                           error: str | None = None, keep: float = 86400.0) -> None:
        """See :meth:`pgq.Client.store_result`."""
        await self._run(self.store_result_command(id, value, error, keep))

    async def wait_result(self, id: str | Job, timeout: float | None = None
                          ) -> tuple[bytes | None, str | None] | None:
        """See :meth:`pgq.Client.wait_result`."""
        return await self._run(self.wait_result_command(id, timeout))

    async def show(self, id: str | Job) -> dict[str, Any] | None:
        """SHOW (see :meth:`pgq.Client.show`)."""
        return await self._run(self.show_command(id))

    async def del_job(self, *ids: str | Job, conn: object = None) -> int:
        """DELJOB (see :meth:`pgq.Client.del_job`)."""
        return await self._run(self.ids_command("del_jobs", ids), conn)

    async def enqueue(self, *ids: str | Job, conn: object = None) -> int:
        """ENQUEUE (see :meth:`pgq.Client.enqueue`)."""
        return await self._run(self.ids_command("enqueue_jobs", ids), conn)

    async def dequeue(self, *ids: str | Job, conn: object = None) -> int:
        """DEQUEUE (see :meth:`pgq.Client.dequeue`)."""
        return await self._run(self.ids_command("dequeue_jobs", ids), conn)

    async def qlen(self, queue: str) -> int:
        """QLEN (see :meth:`pgq.Client.qlen`)."""
        return await self._run(self.qlen_command(queue))

    async def qpeek(self, queue: str, count: int) -> list[Job]:
        """QPEEK (see :meth:`pgq.Client.qpeek`)."""
        return await self._run(self.qpeek_command(queue, count))

    async def qstat(self, queue: str) -> dict[str, Any] | None:
        """QSTAT (see :meth:`pgq.Client.qstat`)."""
        return await self._run(self.qstat_command(queue))

    async def qscan(self, cursor: int = 0, *, count: int = 100, minlen: int | None = None,
                    maxlen: int | None = None,
                    importrate: int | None = None) -> tuple[int, list[str]]:
        """QSCAN (see :meth:`pgq.Client.qscan`)."""
        return await self._run(self.qscan_command(cursor, count=count, minlen=minlen,
                                                  maxlen=maxlen, importrate=importrate))

    async def jscan(self, cursor: int = 0, *, count: int = 100, queue: str | None = None,
                    states: Iterable[str] = (), reply: str = "id") -> tuple[int, list[Any]]:
        """JSCAN (see :meth:`pgq.Client.jscan`)."""
        return await self._run(self.jscan_command(cursor, count=count, queue=queue,
                                                  states=states, reply=reply))

    async def pause(self, queue: str, *flags: str) -> str:
        """PAUSE (see :meth:`pgq.Client.pause`)."""
        return await self._run(self.pause_command(queue, flags))

    async def hello(self) -> dict[str, Any]:
        """HELLO (see :meth:`pgq.Client.hello`)."""
        return await self._run(commands.hello)

    async def cluster_meet(self, address: str) -> None:
        """CLUSTER MEET (see :meth:`pgq.Client.cluster_meet`)."""
        return await self._run(self.cluster_meet_command(address))

    async def cluster_leaving(self, leaving: bool) -> None:
        """CLUSTER LEAVING (see :meth:`pgq.Client.cluster_leaving`)."""
        return await self._run(self.cluster_leaving_command(leaving))

    async def info(self) -> dict[str, Any]:
        """INFO (see :meth:`pgq.Client.info`)."""
        from . import __version__

        return await self._run(lambda session: commands.info(session, __version__))

    async def sweep(self) -> tuple[int, int, int]:
        """Run the timer/expiry sweep now (see :meth:`pgq.Client.sweep`)."""
        return await self._run(commands.sweep)
