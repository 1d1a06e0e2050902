"""Workers: run a function for every job of some queues.

::

    worker = pgq.Worker(client, concurrency=8)

    @worker.task("emails", max_nacks=5)
    def send_email(job): ...            # or `async def`

    worker.run()                        # until SIGTERM / SIGINT / worker.stop()

or ``pgq.Worker(client, queues=["emails"], handler=send_email).run()``, or
``pgq worker module:function --queue emails`` from a shell.

What a worker guarantees:

* It claims only as many jobs as it has free slots (``concurrency``), so no
  claimed job waits unstarted; sync handlers run in daemon threads kept
  between jobs (:mod:`pgq.handlerthreads`), async ones in
  ``concurrency`` long-lived runner tasks (a task per job, and a semaphore
  step per slot, cost more than a no-op handler: 21k -> 38k jobs/s here).
* Before a job's lease (its ``retry``) runs out, the worker extends it with
  WORKING, every half retry, until Disque's half-TTL rule refuses
  (TOOLATE); a job that runs that long may then be delivered again.
* Success: the job is acknowledged (batched with others). Failure (an
  exception, or the per-job ``timeout``): its traceback is logged, then NACK
  with exponential back-off (``backoff * 2**nacks``, at most
  ``max_backoff``), or, past ``max_nacks`` / ``max_deliveries`` (5 unless
  told otherwise), the job goes to the dead letters (``pgq.dead_letters``)
  with the traceback as its reason. An ``async def`` handler past its
  ``timeout`` is cancelled; a ``def`` one cannot be stopped: its thread runs
  on while the job is NACKed, so the job may run again beside it (in
  transactional mode the late run rolls back), and the thread holds a slot
  until it returns.
* ``transactional=True``: the handler receives ``(job, conn)``; its writes and
  the job's ACK commit in one transaction (a failure rolls both back). The
  connection comes from a pool of the worker (at most one per slot): a
  session setting a handler changes (``SET``) stays on it; use ``SET LOCAL``.
* Shutdown (SIGTERM, SIGINT, ``stop()``): stop claiming, let in-flight jobs
  finish within ``grace`` seconds, NACK the rest so they are queued again at
  once instead of waiting for their lease. A job whose handler ended before
  then and that is being settled (its result stored, its failure NACKed or
  dead-lettered) gets up to ``SETTLE_MAX`` seconds more; a second signal
  cuts that short too (the job then comes back after its retry).
* At-most-once jobs (retry 0) are never re-queued: a failed one is
  dead-lettered (with ``max_nacks=None, max_deliveries=None``: dropped,
  logged).
* It logs a banner when ready (queues, concurrency, node, DSN without its
  password) and one line per finished job at ``job_log_level``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import signal
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import psycopg
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from . import arguments as args
from . import tracing
from .aio import AsyncClient
from .backoff import doubling
from .client import Client
from .dsn import redact
from .errors import (
    InvalidArgumentError,
    InvalidTypeError,
    NoJobError,
    PgqError,
    SchemaNotReadyError,
    TooLateError,
)
from .handlerthreads import HandlerThreads
from .job import Job
from .leases import LeaseSchedule

__all__ = ["Worker", "TaskOptions", "WorkerStats", "DEFAULT_MAX_DELIVERIES"]

# A job that failed this many deliveries goes to the dead letters (with its
# traceback), as Celery's max_retries and DQueue's max_retries bound theirs:
# not "retry until the TTL, then vanish". max_deliveries=None restores that.
DEFAULT_MAX_DELIVERIES = 5
ACK_RETRY = 1.0  # seconds between two attempts to ACK after the database refused or was away
# Seconds a job being settled (its result stored, its failure NACKed or
# dead-lettered) may go on past the grace: the drain's end cancelled it
# mid-statement, so a success lost its result and a failure its back-off
# and its count towards the dead letters. A second signal gives it none.
SETTLE_MAX = 5.0

log = logging.getLogger("pgq.worker")

Handler = Callable[..., Any]


@dataclass(frozen=True)
class TaskOptions:
    """How one queue's jobs are handled (defaults come from the Worker)."""

    timeout: float | None = None
    max_nacks: int | None = None
    max_deliveries: int | None = None
    backoff: float = 1.0
    max_backoff: float = 300.0
    transactional: bool = False

    def __post_init__(self) -> None:
        """Checked once, here: a bad value (a string timeout, a negative
        back-off) made every job fail, or the worker crash, at run time."""
        if self.timeout is not None:
            args.seconds("timeout", self.timeout, maximum=args.MAX_TTL, allow_minimum=False)
        for name in ("max_nacks", "max_deliveries"):
            value = getattr(self, name)
            if value is not None:
                args.positive_int(name, value, maximum=2**31 - 1)
        args.seconds("backoff", self.backoff, maximum=args.MAX_TTL)
        args.seconds("max_backoff", self.max_backoff, maximum=args.MAX_TTL)
        if not isinstance(self.transactional, bool):
            raise InvalidTypeError("transactional is True or False")


def backoff_delay(options: TaskOptions, nacks: int) -> float:
    """Seconds before a job that failed ``nacks`` times is delivered again:
    ``backoff`` doubling from the first failure, at most ``max_backoff``.
    (pgq.backoff: the doubling stops before it overflows a float, which
    after about a thousand failures crashed the worker)."""
    return doubling(options.backoff, nacks - 1, options.max_backoff)


def _safe_text(text: str) -> str:
    """A handler's error as storable text: PostgreSQL text holds no NUL, and
    UTF-8 no lone surrogate (either made the worker crash while keeping the
    error, and the job came back to crash the next one)."""
    return text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass
class _Task:
    queue: str
    handler: Handler
    is_async: bool
    options: TaskOptions


@dataclass
class WorkerStats:
    """What the worker did (also exported as Prometheus metrics)."""

    claimed: int = 0
    succeeded: int = 0
    failed: int = 0
    dead: int = 0
    extended: int = 0
    interrupted: int = 0
    by_queue: dict[str, dict[str, int]] = field(default_factory=dict)

    def count(self, queue: str, outcome: str) -> None:
        setattr(self, outcome, getattr(self, outcome) + 1)
        per = self.by_queue.setdefault(queue, {})
        per[outcome] = per.get(outcome, 0) + 1


@dataclass(frozen=True)
class _Returned:
    value: Any


def _json_result(value: Any) -> bytes | None:
    """A handler's return value as kept: bytes as they are, None as nothing,
    anything else as JSON (``repr`` if it is not JSON)."""
    import json

    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    try:
        return json.dumps(value, separators=(",", ":")).encode()
    except (TypeError, ValueError):
        return json.dumps(repr(value)).encode()


class _Abandoned(Exception):
    """A transactional handler's thread, given up by the worker: roll back."""


class _JobFailed(Exception):
    """A handler failed: why (one line), and its traceback (if it raised)."""

    def __init__(self, reason: str, trace: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.trace = trace


class Worker:
    """Runs handlers for the jobs of one or more queues (see the module doc)."""

    def __init__(self, client: Client | AsyncClient | str | None = None,
                 queues: Sequence[str] = (), handler: Handler | None = None, *,
                 concurrency: int = 4, batch: int = 100, grace: float = 30.0,
                 poll_timeout: float = 1.0, timeout: float | None = None,
                 max_nacks: int | None = None, max_deliveries: int | None = DEFAULT_MAX_DELIVERIES,
                 backoff: float = 1.0, max_backoff: float = 300.0,
                 transactional: bool = False, metrics: Any = None,
                 job_log_level: int | str = logging.DEBUG, keep_results: float | None = None,
                 encode_result: Callable[[Any], bytes | None] | None = None,
                 scheduler: bool = False,
                 trace_context: Callable[[Job], dict[str, str] | None] | None = None) -> None:
        if isinstance(client, (Client, AsyncClient)):
            self._dsn: Any = client._dsns if len(client._dsns) > 1 else client.dsn
        elif client is None or isinstance(client, str):
            self._dsn = client
        else:
            raise InvalidTypeError("client must be a pgq.Client, pgq.AsyncClient, a DSN or None")
        if not isinstance(concurrency, int) or isinstance(concurrency, bool) or not 1 <= concurrency <= 10_000:
            raise InvalidArgumentError("concurrency must be an int between 1 and 10000")
        if isinstance(queues, str):
            queues = [queues]
        self.concurrency = concurrency
        self.batch = args.positive_int("batch", batch, maximum=args.MAX_COUNT)
        self.grace = args.seconds("grace", grace, maximum=args.MAX_TTL)
        # > 0: a claim's timeout of 0 means "block for ever" (the worker
        # then never saw stop() while its queues were idle).
        self.poll_timeout = args.seconds("poll_timeout", poll_timeout, maximum=3600.0,
                                         allow_minimum=False)
        if keep_results is not None:
            args.seconds("keep_results", keep_results, maximum=args.MAX_TTL, allow_minimum=False)
        self.defaults = TaskOptions(timeout, max_nacks, max_deliveries, backoff, max_backoff,
                                    transactional)
        self.tasks: dict[str, _Task] = {}
        self.stats = WorkerStats()
        self.job_log_level = _log_level(job_log_level)  # one line per finished job, at this level
        self._extending: dict[str, anyio.Event] = {}  # WORKING in flight, by job
        self._settling: set[str] = set()  # failed jobs being NACKed or dead-lettered
        self._cut: dict[str, Job] = {}  # jobs whose runner was cancelled before they ended
        self._given_up: set[str] = set()  # jobs _interrupt put back or dead-lettered
        # Results (schema 0011): what a handler returns, or the error that
        # sent its job to the dead letters, kept `keep_results` seconds.
        self.keep_results = keep_results
        self.encode_result = encode_result or _json_result
        # Periodic jobs (pgq.periodic): schedules this worker declares, and
        # whether it adds the due jobs of every schedule of its database.
        self.schedules: list[Any] = []
        self.scheduler = scheduler
        # Where a job carries the trace context of the span that added it
        # (pgq.tracing): its handler's span is linked to that one.
        self.trace_context = trace_context
        self.metrics = metrics
        self._stop = threading.Event()
        self._running = False
        self._stopping: anyio.Event | None = None
        self._threads = HandlerThreads()  # where `def` handlers run (pgq.handlerthreads)
        self._async_pool: AsyncConnectionPool | None = None  # transactional handlers'
        self._sync_pool: ConnectionPool | None = None
        self._sync: Client | None = None
        self._sync_lock = threading.Lock()
        if handler is not None:
            if not queues:
                raise InvalidArgumentError("name the queues the handler serves: queues=[...]")
            for queue in queues:
                self._register(queue, handler, {})
        elif queues:
            raise InvalidArgumentError("queues need a handler (or use @worker.task(queue))")

    # ------------------------------------------------------------ setup

    def periodic(self, cron: str, *, queue: str, name: str | None = None, tz: str = "UTC",
                 body: bytes | str = b"", **options: Any) -> Callable[[Handler], Handler]:
        """Decorator: ``fn`` handles ``queue``, and a job is added to it at
        every tick of ``cron`` (in ``tz``), one per tick however many workers
        of the cluster run it (see :mod:`pgq.periodic`: the schedulers of
        every node claim each tick at one node's database, the tick home).
        Options: replicate, retry, ttl of the jobs, catch_up (seconds a
        missed tick is still added after)."""
        from .periodic import Schedule

        def register(fn: Handler) -> Handler:
            schedule_name = name or f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', queue)}"
            data = args.body_bytes(body, args.HARD_MAX_BODY_SIZE)  # bytes(5) was 5 NULs
            schedule = Schedule(schedule_name, cron, queue, data, tz, dict(options))
            if any(s.name == schedule_name for s in self.schedules):
                # Saved by name: the second replaced the first (one
                # function with two schedules kept only one of them).
                raise InvalidArgumentError(
                    f"a schedule named {schedule_name!r} is registered already: give each "
                    "schedule of one function its own name= (they are saved by name)")
            known = self.tasks.get(queue)
            if known is not None and known.handler is not fn:
                # A queue has one handler: the second schedule's jobs would
                # have run the first one's function.
                raise InvalidArgumentError(
                    f"queue {queue!r} already has a handler ({_name_of(known.handler)}): give "
                    "each periodic function its own queue, or one function several schedules")
            self.schedules.append(schedule)
            self.scheduler = True
            if known is None:
                self._register(queue, fn, {})
            return fn
        return register

    def task(self, queue: str, **options: Any) -> Callable[[Handler], Handler]:
        """Decorator: ``fn`` handles the jobs of ``queue`` (options override the
        worker's: timeout, max_nacks, max_deliveries, backoff, max_backoff,
        transactional)."""
        def register(fn: Handler) -> Handler:
            self._register(queue, fn, options)
            return fn
        return register

    def _register(self, queue: str, handler: Handler, options: dict[str, Any]) -> None:
        if not callable(handler):
            raise InvalidTypeError("a handler must be callable: fn(job) or fn(job, conn)")
        unknown = set(options) - set(TaskOptions.__dataclass_fields__)
        if unknown:
            raise InvalidArgumentError(f"unknown task option(s): {', '.join(sorted(unknown))}")
        args.queue_name(queue)
        if queue in self.tasks:
            raise InvalidArgumentError(f"queue {queue!r} already has a handler")
        self.tasks[queue] = _Task(queue, handler, _is_async(handler), replace(self.defaults, **options))

    def stop(self) -> None:
        """Ask the worker to shut down gracefully (thread-safe)."""
        self._stop.set()

    # ------------------------------------------------------------ running

    def run(self, *, install_signal_handlers: bool | None = None,
            until_empty: bool = False) -> WorkerStats:
        """Run until stopped (SIGTERM, SIGINT or ``stop()``); returns this
        run's stats (``worker.stats``: those of the run under way, or the last).

        ``until_empty``: stop by itself once no job of its queues is ready and
        none is running (tests, batch scripts); jobs not ready yet (delayed,
        or NACKed with a back-off) stay queued for a later run."""
        if install_signal_handlers is None:
            install_signal_handlers = threading.current_thread() is threading.main_thread()
        anyio.run(self.run_async, install_signal_handlers, until_empty)
        return self.stats

    async def run_async(self, install_signal_handlers: bool = False,
                        until_empty: bool = False) -> WorkerStats:
        if not self.tasks:
            raise InvalidArgumentError("nothing to do: register a handler with @worker.task(queue)")
        if self._running:
            raise InvalidArgumentError("this Worker is running already: one run at a time "
                                       "(make another Worker to serve in parallel)")
        self._running = True
        try:
            return await self._run(install_signal_handlers, until_empty)
        finally:
            self._running = False
            # A stop ends one run: the next run() serves again (it returned at
            # once, without a word, when the flag stayed set).
            self._stop.clear()

    async def _run(self, install_signal_handlers: bool, until_empty: bool) -> WorkerStats:
        self._new_run(until_empty)
        # Connections: one claims, one acks, one extends leases; failures
        # (NACK, dead letter) share the rest. Not one per slot: a worker with
        # concurrency 500 must not open 500 server backends.
        async with AsyncClient(self._dsn, pool_size=min(self.concurrency, 16) + 4) as client, \
                self._transaction_pools(client.dsn):
            self.client = client
            log.info("worker ready: queues %s, concurrency %d, node %s, %s",
                     ", ".join(self.tasks), self.concurrency, client.node_id, redact(client.dsn))
            try:
                await self._serve(install_signal_handlers)
            except anyio.get_cancelled_exc_class():
                # The run itself was cancelled (an app's shutdown cancelling
                # the task of run_async()): no drain, but nothing left behind
                # either. The jobs in flight used to go to nobody until their
                # retry (a retry-0 one for good), and the finished ones'
                # pending ACKs were dropped (so they ran again).
                with anyio.CancelScope(shield=True):
                    # (the runners' own clean-up took their jobs out of
                    # _in_flight: they are in _cut)
                    if left := {**self._cut, **self._unsettled()}:
                        await self._interrupt(left, "the worker's run was cancelled")
                    await self._flush_acks()
                raise
        return self.stats

    def _new_run(self, until_empty: bool) -> None:
        """The state of one run (in the event loop that runs it)."""
        # Each run counts its own: run() and run_jobs() returned the sums of
        # every run of the worker, so a second run_jobs(worker) said it had
        # done the first one's jobs too (Prometheus' counters, pgq.metrics,
        # are the ones that never go down).
        self.stats = WorkerStats()
        self._until_empty = until_empty
        self._stopping = anyio.Event()
        self._grace_over = anyio.Event()  # a second signal: NACK the running jobs now
        self._ready: collections.deque[Job] = collections.deque()  # claimed, not started
        self._idle: collections.deque[anyio.Event] = collections.deque()  # parked runners
        self._waking = 0  # runners woken that have not run yet (at most one)
        self._room = anyio.Event()  # a slot was freed
        self._acks: list[str] = []
        self._acks_ready = anyio.Event()
        # One ACK flush at a time: the run's last flush waits for one in
        # flight, whose IDs come back to _acks if it fails (it found _acks
        # empty, said nothing, and those jobs were never acknowledged).
        self._acking = anyio.Lock()
        self._last_flush = False  # the run's last ACK flush has begun
        self._in_flight: dict[str, Job] = {}
        self._cut = {}
        self._given_up = set()
        self._finishing: set[str] = set()  # handler returned: settled by its ACK, not _interrupt
        self._settle_scopes: set[anyio.CancelScope] = set()  # shielded settling (_settle_scope)
        self._settle_deadline = float("inf")  # past the grace: SETTLE_MAX from its end
        self._leases = LeaseSchedule()
        self._leases_changed = anyio.Event()

    async def _serve(self, install_signal_handlers: bool) -> None:
        """The run: claims, runners, ACKs, leases, schedules; then the drain."""
        async with anyio.create_task_group() as tasks:
            if install_signal_handlers:
                tasks.start_soon(self._signals)
            tasks.start_soon(self._watch_stop_flag)
            tasks.start_soon(self._flush_acks_forever)
            tasks.start_soon(self._keep_leases)
            if self.schedules:
                await anyio.to_thread.run_sync(self._save_schedules)
            if self.scheduler:
                tasks.start_soon(self._schedule_forever)
            async with anyio.create_task_group() as jobs:
                for _ in range(self.concurrency):
                    jobs.start_soon(self._runner)
                try:
                    await self._claim_until_stopped()
                    await self._drain(jobs)
                except anyio.get_cancelled_exc_class():
                    # The run itself is cancelled: the jobs being settled get
                    # SETTLE_MAX, not as long as the database takes.
                    self._bound_settling(SETTLE_MAX)
                    raise
                jobs.cancel_scope.cancel()  # the runners, idle by now
            if self._cut:  # failures whose NACK the drain's end cut off: none left leased
                await self._interrupt(dict(self._cut), "cut off as the worker stopped")
            if not await self._flush_acks():
                log.warning("worker: %d finished job(s) left unacknowledged: they will be "
                            "delivered again after their retry", len(self._acks))
            tasks.cancel_scope.cancel()

    def _save_schedules(self) -> None:
        """The schedules this worker declares, into its database (before it
        serves anything: a worker that stops at once has saved them)."""
        from . import periodic

        with periodic.look_connection(self.client.dsn) as conn:
            for schedule in self.schedules:
                periodic.save(conn, schedule)  # by the database's clock
            home = periodic.tick_home(conn)
            nodes = periodic.cluster_size(conn)
        if home is not None and not home.myself and home.dsn is None:
            log.warning(
                "worker: this node is one of %d in a cluster, and the cluster's tick home "
                "(node %s) advertised no DSN, so ticks cannot be shared: if workers on other "
                "nodes declare %s too, each adds its own job at every tick. Start the nodes "
                "with --advertise-dsn, or declare periodic tasks on one node's workers only",
                nodes, home.node[:8], ", ".join(s.name for s in self.schedules))

    async def _schedule_forever(self) -> None:
        """Add the due jobs of every schedule of the database, at every tick."""
        from . import periodic

        scheduler = periodic.Scheduler(self._sync_client())
        assert self._stopping is not None
        while not self._stopping.is_set():
            try:
                await anyio.to_thread.run_sync(scheduler.fire_due)
                wait = scheduler.next_in  # from the schedules fire_due read
            except (PgqError, psycopg.Error) as exc:
                log.warning("worker: scheduler: %s", exc)
                wait = 5.0
            with anyio.move_on_after(wait + 0.05):  # just past the tick
                await self._stopping.wait()

    async def _signals(self) -> None:
        # The receiver stays until the run ends: leaving it at the first
        # signal put the default handlers back, so a second SIGTERM (or
        # Ctrl-C) killed the worker during its grace, before its NACKs and
        # its last ACKs. A second signal ends the grace at once instead.
        # The application's own handlers are put back after the run: the
        # receiver's exit left the defaults, and a program that went on
        # after run() was killed by its next SIGTERM without its own
        # clean-up (found by a read-only review).
        previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
        try:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
                async for signum in received:
                    name = signal.Signals(signum).name
                    if not self._stopping.is_set():  # type: ignore[union-attr]
                        log.info("worker: %s received, shutting down", name)
                        self._stopping.set()  # type: ignore[union-attr]
                    else:
                        log.info("worker: %s received again: the running jobs are NACKed now", name)
                        self._grace_over.set()
                        self._bound_settling(0.0)  # and the jobs being settled are cut off
        finally:
            for signum, handler in previous.items():
                if handler is not None:  # (None: not set from Python; nothing to put back)
                    signal.signal(signum, handler)

    async def _watch_stop_flag(self) -> None:
        # stop() may be called from any thread: a threading.Event, polled
        while not self._stop.is_set():  # noqa: ASYNC110
            await anyio.sleep(0.05)
        self._stopping.set()  # type: ignore[union-attr]

    def _free(self) -> int:
        """Slots not taken by a claimed job (running or about to), nor by a
        ``def`` handler still running after its job timed out."""
        return self.concurrency - len(self._in_flight) - self._threads.abandoned

    async def _claim_until_stopped(self) -> None:
        # A claim is never cancelled (its jobs could be lost between the
        # commit and us): it waits at most poll_timeout, and the stop flag is
        # checked between claims.
        queues = list(self.tasks)
        assert self._stopping is not None
        while not self._stopping.is_set():
            if self._free() <= 0:
                self._room = anyio.Event()
                with anyio.move_on_after(self.poll_timeout):
                    await self._room.wait()
                continue
            if self._free() < self.batch:
                # Jobs finishing in this same turn of the event loop free
                # their slots too: let them, so one claim fills many slots
                # instead of a claim per slot. With a full batch of room
                # already, claim at once: the runners then work through the
                # jobs of the last claim while this one is in flight, where
                # yielding first ran them before it and the two took turns.
                await anyio.lowlevel.checkpoint()
            free = min(self._free(), self.batch)
            if free <= 0:  # a handler timed out during the checkpoint: its slot is still taken
                continue
            try:
                started = time.perf_counter()
                claimed_at = time.monotonic()  # the leases start during the claim: from before it
                got = await self.client.get_job(*queues, count=free, timeout=self.poll_timeout,
                                                withcounters=True, nohang=self._until_empty)
                self._observe("claim", time.perf_counter() - started)
            except (PgqError, psycopg.Error) as exc:  # a read-only standby after a failover...
                log.warning("worker: claim failed: %s", exc)
                await anyio.sleep(1.0)
                # Claim again: a failed claim says nothing of the queues
                # (run(until_empty=True) took it for "nothing ready" and
                # returned with the queues full; found by a read-only review).
                continue
            for job in got:
                if job.id in self._in_flight:
                    # Its lease lapsed while it ran here (a WORKING too late,
                    # a handler that blocked the loop): the run under way
                    # goes on and settles it. A second run overwrote its
                    # records, freed a slot too many, and ended unwatched.
                    log.warning("worker: job %s was delivered again while it runs here: the "
                                "run under way settles it", job.id)
                    continue
                self.stats.claimed += 1  # (a redelivery skipped above was counted once)
                self._in_flight[job.id] = job
                self._ready.append(job)
                # Its lease runs from the claim, not from its handler's
                # start: a job waiting behind others of its claim (handlers
                # busy before their first await) got its first WORKING after
                # its lease had run out, and was delivered elsewhere while
                # it ran here (found by a read-only review).
                if job.retry:
                    self._leases.add(job.id, job.retry, claimed_at)
            if got:
                self._leases_changed.set()
                self._wake_runner()
            elif self._until_empty:
                if not self._in_flight:
                    return  # nothing ready, nothing running: done
                self._room = anyio.Event()  # a job ends (and may queue another)
                with anyio.move_on_after(self.poll_timeout):
                    await self._room.wait()

    async def _runner(self) -> None:
        """Run claimed jobs one after the other, for as long as the worker runs.

        With nothing ready a runner parks until :meth:`_wake_runner` picks
        it. At most one runner is being woken at a time, and a runner that
        takes a job while more are ready wakes the next: a handler that
        never yields lets one runner run a whole claim (waking a runner per
        job, or every runner per claim, cost more than such jobs), and one
        that awaits I/O gets another runner on the next job at its first
        await, so the runners in use grow with the jobs that wait. A runner
        always looks at the ready jobs before it parks, so no job waits
        while a runner is busy or awake."""
        while True:
            while not self._ready:
                parked = anyio.Event()
                self._idle.append(parked)
                try:
                    await parked.wait()
                finally:
                    self._waking -= parked.is_set()
            job = self._ready.popleft()
            if self._ready:
                self._wake_runner()
            await self._process(job)

    def _wake_runner(self) -> None:
        """Wake an idle runner for the ready jobs, unless one is waking."""
        if self._idle and not self._waking:
            self._waking += 1
            self._idle.popleft().set()

    async def _drain(self, jobs: anyio.abc.TaskGroup) -> None:
        """Shutdown: in-flight jobs get `grace` seconds; the rest go back to
        their queue (an interruption is no failure: no nack is counted, so
        it never brings a job nearer its dead letter by ``max_nacks``)."""
        with anyio.move_on_after(self.grace):
            # a shutdown-only poll of the jobs' ends
            while self._in_flight and not self._grace_over.is_set():  # noqa: ASYNC110
                await anyio.sleep(0.05)
        if self._in_flight:
            left = self._unsettled()  # (those settling or finishing end by themselves)
            self._bound_settling(0.0 if self._grace_over.is_set() else SETTLE_MAX)
            jobs.cancel_scope.cancel()
            if left:
                log.info("worker: %d job(s) still running after %g s", len(left), self.grace)
                await self._interrupt(left, f"still running {self.grace:g} s after the worker "
                                            "was told to stop")

    def _bound_settling(self, seconds: float) -> None:
        """The jobs being settled, and those that begin to, get ``seconds``
        more: their scopes are shielded from the drain's end (see SETTLE_MAX)."""
        self._settle_deadline = min(self._settle_deadline, anyio.current_time() + seconds)
        for scope in self._settle_scopes:
            scope.deadline = min(scope.deadline, self._settle_deadline)

    @contextlib.contextmanager
    def _settle_scope(self) -> Iterator[anyio.CancelScope]:
        """Where a job is settled: shielded, until the drain bounds it
        (its ``cancelled_caught`` then says it was cut off)."""
        scope = anyio.CancelScope(shield=True, deadline=self._settle_deadline)
        self._settle_scopes.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._settle_scopes.discard(scope)

    def _unsettled(self) -> dict[str, Job]:
        """The jobs in flight but those a failure is settling (their NACK's
        back-off stands)."""
        return {i: job for i, job in self._in_flight.items()
                if i not in self._settling and i not in self._given_up
                and i not in self._finishing}

    async def _interrupt(self, left: dict[str, Job], why: str) -> None:
        """Jobs this worker will not finish (a drain's end, a cancelled run).
        Claimed but never started: no handler saw them, so an at-most-once
        one goes back too (commands.give_back_jobs).
        Started: an at-least-once job goes back as ENQUEUE does; an
        at-most-once one must not run again (a NACK left it active until its
        TTL, while the log said NACKed): to the dead letters. Shielded: a
        cancelled run still does it."""
        for job_id in left:  # handled here, once: a runner cut off meanwhile adds none
            self._cut.pop(job_id, None)
            self._given_up.add(job_id)
        # Out of the ready jobs now, before any wait: a runner woken for one
        # (the cancellation of the runners skips a task whose wake-up is
        # already due) started it while it went back to its queue, so an
        # at-most-once job could run twice (found by a read-only review).
        unstarted = {job.id for job in self._ready if job.id in left}
        self._ready = collections.deque(job for job in self._ready if job.id not in left)
        for job_id in unstarted:
            self._in_flight.pop(job_id, None)
        once = [i for i, job in left.items() if job.retry == 0 and i not in unstarted]
        back = [i for i in left if i not in once]
        log.info("worker: %d job(s) put back in their queue, %d at-most-once dead-lettered",
                 len(back), len(once))
        with anyio.CancelScope(shield=True):
            # No WORKING for them from now on, and none still in flight: one
            # landing after the job went back put it out of the queue for a
            # whole retry (as _failed waits for it too).
            for job_id in left:
                self._leases.discard(job_id)
            for job_id in left:
                if (extending := self._extending.get(job_id)) is not None:
                    await extending.wait()
            try:
                if back:
                    await self.client._run(self.client.ids_command("give_back_jobs", tuple(back)))
                if once:
                    await self.client.dead_letter(
                        *once, reason=f"interrupted: {why} (at-most-once: not delivered again)")
            except (PgqError, psycopg.Error) as exc:  # they come back after their retry
                log.warning("worker: could not put back the interrupted jobs: %s", exc)
        for job in left.values():
            self.stats.count(job.queue, "interrupted")
            self._done(job, "interrupted")

    # ------------------------------------------------------------ one job

    async def _process(self, job: Job) -> None:
        task = self.tasks[job.queue]
        succeeded, outcome = False, None
        try:
            failure: _JobFailed | None = None  # (its lease is kept from its claim: _claim_until_stopped)
            try:
                outcome = await self._traced_call(task, job)
            except _JobFailed as exc:
                failure, outcome = exc, None
            finally:
                self._leases.discard(job.id)
            if failure is not None:
                if job.id in self._given_up:
                    # Failed as the drain's end gave it up (back in its queue,
                    # or dead-lettered, and counted interrupted): a NACK now
                    # would hit the job another worker may hold by now.
                    log.info("worker: job %s of %s failed after it was given up", job.id, job.queue)
                    return
                await self._failed(task, job, failure)
                return
            if job.id in self._given_up:
                # Its handler returned while _interrupt gave it up (the drain's
                # end, as the result came in): it is back in its queue, or an
                # at-most-once one in the dead letters, and counted
                # interrupted. An at-least-once one is acknowledged, so it
                # does not run again for nothing; the dead letter stays.
                self._late_success(job, outcome)
                return
            succeeded = True  # from here a cancellation still acknowledges it
            self._finishing.add(job.id)
            kept = True
            if self.keep_results is not None and outcome is not None:
                with self._settle_scope() as settling:
                    kept = await self._keep(job, *self._result_of(job, outcome.value))
                kept = kept and not settling.cancelled_caught
            if not kept and job.retry:
                # Not acknowledged: it comes back after its retry and runs
                # again, keeping its result then (as after a crash between
                # the two). Acknowledged, it was done with no result, and
                # Tasks.result said NoJobError ("keeps none") for good. An
                # at-most-once job is acknowledged all the same: it never
                # runs again.
                log.warning("worker: job %s of %s is not acknowledged: it runs again after its "
                            "retry, to keep its result", job.id, job.queue)
                outcome = None
            if outcome is not None:  # None: transactional, acknowledged already
                self._ack_later(job.id)
            self.stats.count(job.queue, "succeeded")
            self._done(job, "succeeded")
        except anyio.get_cancelled_exc_class():
            if succeeded:  # done, cut off while its result was kept: not run again
                if outcome is not None:
                    self._ack_later(job.id)
            elif job.id not in self._given_up:
                self._cut[job.id] = job  # cut off unfinished: put back at the run's end
            raise
        finally:
            self._in_flight.pop(job.id, None)
            self._finishing.discard(job.id)
            self._room.set()

    def _late_success(self, job: Job, outcome: _Returned | None) -> None:
        if outcome is None:
            how = "acknowledged with its transaction"
        elif job.retry:
            self._ack_later(job.id)
            how = "acknowledged"
        else:
            how = "its dead letter stays"
        log.info("worker: job %s of %s finished after it was given up (%s)", job.id, job.queue, how)

    async def _traced_call(self, task: _Task, job: Job) -> _Returned | None:
        """:meth:`_call` in a span when spans are recorded. Without, no span
        at all: its context manager, even empty, cost about 2 µs a job."""
        if not tracing.enabled():
            return await self._call(task, job)
        # a job's trace context is read (a Tasks body decoded) only if spans are recorded
        links = tracing.extract_link(self._carrier(job))
        with tracing.span(f"pgq process {job.queue}", "CONSUMER", queue=job.queue,
                          links=links, messaging__message__id=job.id):
            return await self._call(task, job)

    def _carrier(self, job: Job) -> dict[str, str] | None:
        if self.trace_context is None:
            return None
        try:
            return self.trace_context(job)
        except Exception:  # a body that is not what the producer said: no link
            return None

    async def _call(self, task: _Task, job: Job) -> _Returned | None:
        """Run the handler; what it returned when the ACK is still to be sent,
        None when done (transactional: acknowledged with its writes).

        Whatever the handler raises fails its job, never the worker: its own
        TimeoutError (a socket's, asyncio.timeout's) is no timeout of ours
        (with no timeout set, reporting one raised TypeError, which ended
        the worker), and a CancelledError, SystemExit or KeyboardInterrupt
        raised by its code stopped the worker without draining it. Only a
        cancellation of this task (the worker stopping) goes through."""
        timeout = task.options.timeout
        try:
            if timeout is None:
                # No cancel scope when there is no deadline: entering and
                # leaving one cost about 6 µs a job (anyio's scopes are
                # Python), a tenth of the worker's CPU per job in the
                # batched burn-down.
                return await self._invoke(task, job)
            with anyio.move_on_after(timeout) as deadline:
                return await self._invoke(task, job)
        except anyio.get_cancelled_exc_class() as exc:
            if _cancelling():
                raise
            raise _handler_failed(exc) from exc
        except _JobFailed:  # said already (a transactional ACK that found no job)
            raise
        except BaseException as exc:  # the handler's, whatever it is
            # Any BaseException, not three kinds: a child task's SystemExit
            # arrives as a BaseExceptionGroup, and pytest's fail() is its
            # own kind; either ended the worker with nothing given back and
            # its pending ACKs lost (found by a read-only review).
            if _cancelling():
                raise
            raise _handler_failed(exc) from exc
        assert deadline.cancelled_caught
        raise _JobFailed(f"timed out after {timeout:g} s")

    async def _invoke(self, task: _Task, job: Job) -> _Returned | None:
        """The handler's call itself (see :meth:`_call`)."""
        if task.options.transactional:
            await self._call_in_transaction(task, job)
            return None
        if task.is_async:
            value = await task.handler(job)
        else:
            value = await self._threads.run(task.handler, job)
            if inspect.isawaitable(value):  # an async def behind a plain wrapper
                value = await value  # (unawaited, the job was acknowledged undone)
        return _Returned(value)

    async def _call_in_transaction(self, task: _Task, job: Job) -> None:
        """The handler's writes, its result (with ``keep_results``) and the
        job's ACK in one transaction, on a pooled connection (committed when
        the block ends, rolled back if it raises).

        A ``def`` handler runs in a thread that a timeout or a shutdown
        cannot stop: the job is NACKed meanwhile. Such a thread finds itself
        abandoned and rolls back instead of committing, or its writes would
        count twice, once more when the job runs again."""
        if task.is_async:
            assert self._async_pool is not None
            async with self._async_pool.connection() as conn:
                value = await task.handler(job, conn)
                if self.keep_results is not None:
                    await self.client._run(self.client.store_result_command(
                        job.id, *self._result_of(job, value), self.keep_results), conn=conn)
                _acked_or_roll_back(job, await self.client.ack_job(job.id, conn=conn))
            return

        abandoned = threading.Event()

        def go_on() -> None:
            if abandoned.is_set():
                raise _Abandoned(f"job {job.id} was given up (timeout or shutdown): rolled back")

        def run() -> None:
            assert self._sync_pool is not None
            client = self._sync_client()
            with self._sync_pool.connection() as conn:
                value = task.handler(job, conn)
                go_on()
                if inspect.isawaitable(value):
                    close = getattr(value, "close", None)
                    if close is not None:
                        close()  # never awaited: no warning for it
                    raise TypeError(f"the transactional handler of {job.queue!r} is a plain "
                                    "function that returned an awaitable: declare it "
                                    "'async def' (its writes were rolled back)")
                if self.keep_results is not None:
                    client._run(client.store_result_command(
                        job.id, *self._result_of(job, value), self.keep_results), conn=conn)
                _acked_or_roll_back(job, client.ack_job(job.id, conn=conn))
                go_on()

        try:
            await self._threads.run(run)
        except BaseException:
            abandoned.set()
            raise

    @contextlib.asynccontextmanager
    async def _transaction_pools(self, dsn: str) -> AsyncIterator[None]:
        """Connections for transactional handlers, for the run: an async pool
        if some are ``async def``, a sync one if some are ``def``. Opening a
        connection per job cost ~5 ms of connect and authentication: 170
        jobs/s with a no-op handler. At most one connection per slot, as
        before; none is opened until a job needs it."""
        kinds = {task.is_async for task in self.tasks.values() if task.options.transactional}
        size = self.concurrency
        if True in kinds:
            self._async_pool = AsyncConnectionPool(dsn, min_size=0, max_size=size, timeout=60.0,
                                                   open=False, name="pgq-worker-tx")
            await self._async_pool.open()
        if False in kinds:
            self._sync_pool = ConnectionPool(dsn, min_size=0, max_size=size, timeout=60.0,
                                             open=True, name="pgq-worker-tx-sync")
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                if self._async_pool is not None:
                    await self._async_pool.close()
                    self._async_pool = None
                closing = [c for c in (self._sync_pool, self._sync) if c is not None]
                self._sync_pool = self._sync = None
                for closable in closing:
                    await anyio.to_thread.run_sync(closable.close)

    def _sync_client(self) -> Client:
        """A client for the worker's blocking calls (transactional ACKs from
        handler threads, the scheduler), made once (several threads may ask
        at the same moment)."""
        with self._sync_lock:
            if self._sync is None:
                self._sync = Client(self.client.dsn, pool_size=1)
            return self._sync

    async def _keep_leases(self) -> None:
        """Extend the lease (WORKING) of every running job before it runs out."""
        while True:
            next_at = self._leases.next_at()
            self._leases_changed = anyio.Event()
            wait = None if next_at is None else max(next_at - time.monotonic(), 0.0)
            with anyio.move_on_after(wait):
                await self._leases_changed.wait()
            for job_id in self._leases.due(time.monotonic()):
                if job_id in self._leases:  # not ended while an earlier one was extended
                    await self._extend(job_id)

    async def _extend(self, job_id: str) -> None:
        # A job that fails meanwhile waits for this WORKING before its NACK
        # (_failed): sent after it, the WORKING undid the NACK's back-off.
        self._extending[job_id] = sent = anyio.Event()
        try:
            await self.client.working(job_id)
            self.stats.extended += 1
        except TooLateError:
            log.warning("worker: job %s ran past half its TTL: it may be delivered again", job_id)
            self._leases.discard(job_id)
        except NoJobError:
            self._leases.discard(job_id)
        except (PgqError, psycopg.Error) as exc:  # the next extension is scheduled: try again then
            log.warning("worker: could not extend the lease of job %s: %s", job_id, exc)
        finally:
            del self._extending[job_id]
            sent.set()

    async def _failed(self, task: _Task, job: Job, failure: _JobFailed) -> None:
        opts = task.options
        reason = failure.reason
        nacks = (job.nacks or 0) + 1
        deliveries = nacks + (job.additional_deliveries or 0)
        over = (opts.max_nacks is not None and nacks >= opts.max_nacks) or \
               (opts.max_deliveries is not None and deliveries >= opts.max_deliveries)
        policy = opts.max_nacks is not None or opts.max_deliveries is not None
        if failure.trace:
            log.warning("worker: job %s of %s failed (%s)\n%s", job.id, job.queue, reason, failure.trace)
        else:
            log.warning("worker: job %s of %s failed (%s)", job.id, job.queue, reason)
        if (extending := self._extending.get(job.id)) is not None:
            await extending.wait()
            if job.id in self._given_up:
                # The drain's end gave it up during that wait (anyio does not
                # cancel a task whose wake-up is due): settled there.
                return
        self._settling.add(job.id)  # a shutdown leaves it to this (its back-off stands)
        outcome = "failed"
        try:
            with self._settle_scope() as settling:
                outcome = await self._settle_failure(job, opts, reason, failure.trace, over, policy,
                                                     nacks)
            if settling.cancelled_caught and job.retry == 0:
                # Cut off (a second signal, or SETTLE_MAX past the grace): an
                # at-most-once job is settled with the run's other cut jobs
                # (_interrupt: dead-lettered, counted there). Swallowed by
                # the scope, the cut once left it in no queue and no dead
                # letter (found by a review). An at-least-once one comes back
                # after its retry (its NACK may have committed before the
                # cut: given back now, it would lose its back-off).
                if job.id not in self._given_up:
                    self._cut[job.id] = job
                return
        except (PgqError, psycopg.Error) as exc:
            # The database refused or is away: the job stays claimed and
            # comes back after its retry, as if this worker had died. Never
            # an error that ends the worker.
            log.warning("worker: could not record the failure of job %s (it will be delivered "
                        "again after its retry): %s", job.id, exc)
            outcome = "failed"
        finally:
            self._settling.discard(job.id)
        self.stats.count(job.queue, outcome)
        self._done(job, outcome)

    async def _settle_failure(self, job: Job, opts: TaskOptions, reason: str, trace: str,
                              over: bool, policy: bool, nacks: int) -> str:
        """Dead-letter, FASTACK or NACK a failed job; its outcome's name."""
        if over or (job.retry == 0 and policy):
            # the dead letter keeps the traceback, for whoever looks at it later
            # (both storable text already: _handler_failed made them so)
            full = f"{reason}\n{trace}" if trace else reason
            if not await self.client.dead_letter(job.id, reason=full):
                # Gone already: another delivery of it succeeded and was
                # acknowledged (its lease had lapsed). Its result stands:
                # this error overwrote it, and the job counted as dead.
                return "failed"
            if self.keep_results is not None:  # (Tasks.result also reads the dead letters)
                await self._keep(job, None, full)
            return "dead"
        if job.retry == 0:
            await self.client.fast_ack(job.id)  # at-most-once: never delivered again
            return "failed"
        await self.client.nack_job(job.id, delay=backoff_delay(opts, nacks))
        return "failed"

    def _result_of(self, job: Job, value: Any) -> tuple[bytes | None, str | None]:
        """What to keep of a handler's return value: its encoding, or (when
        it cannot be encoded or stored: the work is done all the same, and
        the job is acknowledged) why there is none. Storable is checked here
        (no I/O: the store's own checks, size and type): an encoding past
        the client's max_body_size was refused by the store, the job
        acknowledged all the same, and Tasks.result then said NoJobError
        where it says ResultNotKeptError now (found by a read-only review)."""
        assert self.keep_results is not None
        try:
            encoded = self.encode_result(value)
            if encoded is not None:
                self.client.store_result_command(job.id, encoded, None, self.keep_results)
            return encoded, None
        except Exception as exc:
            log.warning("worker: the result of job %s could not be kept: %s", job.id, exc)
            return None, _safe_text(f"{RESULT_NOT_KEPT}{type(exc).__name__}: {_str_of(exc)}")

    async def _keep(self, job: Job, value: bytes | None, error: str | None) -> bool:
        """Store a result before the ACK (a crash between them reruns the
        job, whose result then overwrites this one). False: the database
        was away (the job then runs again to keep it); True once stored, or
        refused for good."""
        assert self.keep_results is not None
        try:
            await self.client.store_result(job.id, value, error=error, keep=self.keep_results)
        except _REFUSED_FOR_GOOD as exc:
            # (no right to write pgq.results, a schema not migrated): not
            # running the job again and again until its TTL for it
            log.warning("worker: could not keep the result of job %s (it is acknowledged "
                        "without one): %s", job.id, exc)
        except (PgqError, psycopg.Error) as exc:
            # Away, or a standby after a failover (read-only), a timeout: the
            # job runs again after its retry and keeps its result then.
            log.warning("worker: could not keep the result of job %s: %s", job.id, exc)
            return False
        return True

    # ------------------------------------------------------------ acks

    def _ack_later(self, job_id: str) -> None:
        self._acks.append(job_id)
        self._acks_ready.set()

    async def _flush_acks_forever(self) -> None:
        while True:
            await self._acks_ready.wait()
            await anyio.sleep(0.005)  # let a few more finish: one ACK statement for all
            if not await self._flush_acks(last=False):
                await anyio.sleep(ACK_RETRY)

    async def _flush_acks(self, last: bool = True) -> bool:
        """ACK the finished jobs; False if the database refused or could not
        be reached. Their IDs then stay for the next flush: a worker that
        lost its database for a while goes on (the jobs may be delivered
        again meanwhile, as at-least-once allows), where the error used to
        end the worker and drop the IDs. Waits for a flush in flight.

        Once the run's last flush (``last``) has begun, the flushing task's
        own flushes stop: it cannot be cancelled in one (shielded), and with
        the database away it went on retrying after the last flush, and the
        stop waited for both (found by a read-only review)."""
        if last:
            self._last_flush = True
        with anyio.CancelScope(shield=True):  # a cancelled run's last flush still runs
            async with self._acking:
                if not last and self._last_flush:
                    return True  # the last flush has them
                done = await self._flush_acks_now()
        return done

    async def _flush_acks_now(self) -> bool:
        self._acks_ready = anyio.Event()
        # A job run again while its ACK waited is in the list twice; and an
        # ACK is at most MAX_IDS IDs: a backlog past that (ACKs failing for
        # a while) was refused whole at every try, for ever.
        ids, self._acks = list(dict.fromkeys(self._acks)), []
        while ids:
            chunk = ids[:args.MAX_IDS]
            started = time.perf_counter()
            try:
                with anyio.CancelScope(shield=True):
                    await self.client.ack_job(*chunk)
            except (PgqError, psycopg.Error) as exc:
                log.warning("worker: could not acknowledge %d job(s), trying again: %s", len(ids), exc)
                self._acks[:0] = ids
                self._acks_ready.set()
                return False
            self._observe("ack", time.perf_counter() - started)
            del ids[:len(chunk)]
        return True

    # ------------------------------------------------------------ metrics

    def _observe(self, what: str, seconds: float) -> None:
        if self.metrics is not None:
            try:
                self.metrics.observe(what, seconds)
            except Exception:  # a metrics object of the user's must not end the worker
                log.exception("worker: metrics.observe failed")

    def _done(self, job: Job, outcome: str) -> None:
        log.log(self.job_log_level, "job %s of %s %s", job.id, job.queue, outcome)
        if self.metrics is not None:
            try:
                self.metrics.job_done(job.queue, outcome)
            except Exception:
                log.exception("worker: metrics.job_done failed")


def _log_level(level: object) -> int:
    """A logging level: an int, or a name ("INFO"). Checked when the worker
    is made: a name was passed to log.log() after every job, which raised."""
    if isinstance(level, str) and isinstance(logging.getLevelName(level.upper()), int):
        return int(logging.getLevelName(level.upper()))
    if isinstance(level, int) and not isinstance(level, bool) and level >= 0:
        return level
    raise InvalidArgumentError(f"job_log_level must be a logging level (logging.INFO, or "
                               f"'INFO'), not {level!r}")


# What a result's store meets that a later try would meet too.
_REFUSED_FOR_GOOD = (psycopg.ProgrammingError, psycopg.DataError, psycopg.IntegrityError,
                     InvalidArgumentError, InvalidTypeError, SchemaNotReadyError)

# The start of a kept result's error when the job succeeded but its value
# could not be encoded (pgq.Tasks.result tells it from a failure by it).
RESULT_NOT_KEPT = "the handler returned a value that could not be kept: "


def _acked_or_roll_back(job: Job, acked: int) -> None:
    """A transactional handler's ACK found no job: its lease had lapsed and
    another delivery of it was acknowledged first. Its writes must not
    count twice: raising rolls the transaction back. Not for an at-most-once
    job: it has no other delivery (its ACK finds none when it expired
    meanwhile, and this run is its only one)."""
    if not acked and job.retry != 0:
        raise _JobFailed(f"job {job.id} was acknowledged elsewhere while this delivery ran "
                         "(its lease had lapsed): its writes were rolled back")


def _cancelling() -> bool:
    """This task is being cancelled (the worker stops), as opposed to a
    CancelledError the handler's own code raised (an awaited task that
    someone else cancelled)."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def _handler_failed(exc: BaseException) -> _JobFailed:
    # Safe from the start: the log line too (a lone surrogate in a handler's
    # error made every UTF-8 log handler fail on it).
    trace = _safe_text("".join(traceback.format_exception(exc)).rstrip())
    return _JobFailed(_safe_text(f"{type(exc).__name__}: {_str_of(exc)}"), trace)


def _str_of(exc: BaseException) -> str:
    """``str(exc)``, or a placeholder when the exception's own ``__str__``
    raises (or returns no str): formatted bare, such an error escaped the
    job's failure handling and ended the worker, its jobs left claimed."""
    try:
        text = str(exc)
    except Exception as inner:
        return f"<its message could not be made: {type(inner).__name__}>"
    return text


def _name_of(handler: Handler) -> str:
    return str(getattr(handler, "__qualname__", None) or getattr(handler, "__name__", None)
               or repr(handler))


def _is_async(handler: Handler) -> bool:
    target = handler.__call__ if not inspect.isroutine(handler) else handler  # type: ignore[operator]
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(handler)

