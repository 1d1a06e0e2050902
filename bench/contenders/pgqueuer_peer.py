"""Contender: pgqueuer (https://pypi.org/project/pgqueuer/), through its
QueueManager over psycopg (the driver it documents for psycopg users).
Runs in the peers' virtualenv."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import psycopg
from pgqueuer.db import PsycopgDriver
from pgqueuer.qm import QueueManager
from pgqueuer.queries import Queries
from pgqueuer.types import QueueExecutionMode

from .common import BODY, age_of, main, percentiles, stamped

ENTRY = "bench"

# SHUTDOWN: a QueueManager takes about 4 s to return once it is told to stop
# (or, in drain mode, once it found the queue empty): its exit path waits on
# idle timers (measured on 2026-11-26: the last of 400 jobs handled at 1.1 s,
# run() returned at 5.3 s, the process idle in between). That is not queue
# throughput, and it made every pgqueuer row slower by those seconds (the
# full run's batched burn-down of 100k jobs: 10.5k jobs/s). So the clock
# stops at the last job handled (burn-down) or when the producers stop
# (steady state), counting the jobs handled until then. This leaves out the
# flush of pgqueuer's last buffered completions (at most 0.1 s), in
# pgqueuer's favour; pgq's clock runs until its last ACK is committed.
# Once the clock stopped, its managers get GRACE seconds to return and are
# then cancelled: waiting out those idle seconds measured nothing, and each
# run is a process of its own whose database is dropped after it (they
# were about 17 s of the suite's smoke run of the bench).
GRACE = 0.5


async def _end(tasks: list[asyncio.Task[Any]], managers: list[Any]) -> None:
    """Tell the managers to stop; cancel those still running after GRACE.
    A consumer that failed before that raises here (it must not look like a
    slow one)."""
    for qm in managers:
        qm.shutdown.set()
    _done, running = await asyncio.wait(tasks, timeout=GRACE)
    for task in running:
        task.cancel()
    for outcome in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(outcome, Exception):
            raise outcome


async def _connect(dsn: str) -> psycopg.AsyncConnection:
    return await psycopg.AsyncConnection.connect(dsn, autocommit=True)


async def _install(dsn: str) -> None:
    conn = await _connect(dsn)
    queries = Queries(PsycopgDriver(conn))
    if not await queries.schema_is_installed():
        await queries.install()
    await conn.close()


async def _enqueue(dsn: str, n: int, chunk: int = 10_000) -> None:
    conn = await _connect(dsn)
    queries = Queries(PsycopgDriver(conn))
    for start in range(0, n, chunk):
        size = min(chunk, n - start)
        await queries.enqueue([ENTRY] * size, [BODY] * size, [0] * size)
    await conn.execute("ANALYZE")
    await conn.close()


def burn(dsn: str, n: int, batch: int, consumers: int = 2,
         max_seconds: float = 120) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        await _install(dsn)
        await _enqueue(dsn, n)
        done = [0]
        last: list[float] = []  # when the last job was handled (see SHUTDOWN)
        managers = []

        async def consume() -> None:
            conn = await _connect(dsn)
            qm = QueueManager(Queries(PsycopgDriver(conn)))
            managers.append(qm)

            @qm.entrypoint(ENTRY)
            async def handle(job: Any) -> None:
                done[0] += 1
                if done[0] == n:
                    last.append(time.perf_counter())
                    finished.set()

            await qm.run(batch_size=batch, mode=QueueExecutionMode.drain,
                         dequeue_timeout=timedelta(seconds=0.5))

        finished = asyncio.Event()
        started = time.perf_counter()
        tasks = [asyncio.create_task(consume()) for _ in range(consumers)]
        # Until every job is handled, every consumer returned, or time is up.
        waiting = asyncio.create_task(finished.wait())
        deadline = started + max_seconds
        while not finished.is_set() and not all(task.done() for task in tasks) \
                and time.perf_counter() < deadline:
            await asyncio.wait([*tasks, waiting], timeout=deadline - time.perf_counter(),
                               return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        ended = last[0] if last else time.perf_counter()
        await _end(tasks, managers)
        return {"jobs": done[0], "seconds": ended - started}

    return asyncio.run(run())


def steady(dsn: str, producers: int, consumers: int, seconds: float, batch: int = 10) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        await _install(dsn)
        ages: list[float] = []
        stop = time.perf_counter() + seconds
        managers = []

        async def produce() -> None:
            conn = await _connect(dsn)
            queries = Queries(PsycopgDriver(conn))
            while time.perf_counter() < stop:
                await queries.enqueue(ENTRY, stamped(), 0)
            await conn.close()

        async def consume() -> None:
            conn = await _connect(dsn)
            qm = QueueManager(Queries(PsycopgDriver(conn)))
            managers.append(qm)

            @qm.entrypoint(ENTRY)
            async def handle(job: Any) -> None:
                ages.append(age_of(job.payload))

            await qm.run(batch_size=batch, dequeue_timeout=timedelta(seconds=0.2))

        started = time.perf_counter()
        workers = [asyncio.create_task(consume()) for _ in range(consumers)]
        await asyncio.gather(*(produce() for _ in range(producers)))
        elapsed, consumed = time.perf_counter() - started, len(ages)  # see SHUTDOWN
        await _end(workers, managers)
        return {"jobs": consumed, "seconds": elapsed, **percentiles(ages)}

    return asyncio.run(run())


def enqueue_single(dsn: str, n: int) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        await _install(dsn)
        conn = await _connect(dsn)
        queries = Queries(PsycopgDriver(conn))
        latencies = []
        for _ in range(n):
            started = time.perf_counter()
            await queries.enqueue(ENTRY, BODY, 0)
            latencies.append(time.perf_counter() - started)
        await conn.close()
        return {"jobs": n, "seconds": sum(latencies), **percentiles(latencies)}

    return asyncio.run(run())


def enqueue_bulk(dsn: str, n: int) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        await _install(dsn)
        started = time.perf_counter()
        conn = await _connect(dsn)
        queries = Queries(PsycopgDriver(conn))
        for start in range(0, n, 100_000):
            size = min(100_000, n - start)
            await queries.enqueue([ENTRY] * size, [BODY] * size, [0] * size)
        await conn.close()
        return {"jobs": n, "seconds": time.perf_counter() - started}

    return asyncio.run(run())


if __name__ == "__main__":
    main({"burn": burn, "steady": steady, "enqueue_single": enqueue_single,
          "enqueue_bulk": enqueue_bulk})
