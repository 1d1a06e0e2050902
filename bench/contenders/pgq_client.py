"""Contender: pgq, through its AsyncClient (GETJOB / ACKJOB), its Client,
its Worker, and through its RESP port (``pgq serve --resp``, Disque's
protocol, driven by the raw client of :mod:`.resp_client`)."""

from __future__ import annotations

import time
from typing import Any

import anyio
import psycopg

import pgq

from . import http_client, resp_client
from .common import BODY, age_of, burn_repeated_with, closed_loop, main, percentiles, stamped

QUEUE = "bench"


def analyze(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ANALYZE")


def burn(dsn: str, n: int, batch: int, consumers: int = 2,
         max_seconds: float = 120) -> dict[str, Any]:
    with pgq.Client(dsn) as client:
        for start in range(0, n, 50_000):
            client.add_jobs(QUEUE, [BODY] * min(50_000, n - start))
    analyze(dsn)

    async def run() -> tuple[int, float]:
        done = [0]
        async with pgq.AsyncClient(dsn, pool_size=consumers + 2) as client:
            started = time.perf_counter()
            deadline = started + max_seconds

            async def consume() -> None:
                while time.perf_counter() < deadline:
                    jobs = await client.get_job(QUEUE, count=batch, nohang=True)
                    if not jobs:
                        return
                    if batch == 1:
                        await client.ack_job(jobs[0].id)
                    else:
                        await client.ack_job(*(j.id for j in jobs))
                    done[0] += len(jobs)

            async with anyio.create_task_group() as tasks:
                for _ in range(consumers):
                    tasks.start_soon(consume)
            return done[0], time.perf_counter() - started

    jobs, seconds = anyio.run(run)
    return {"jobs": jobs, "seconds": seconds}


def burn_worker(dsn: str, n: int, batch: int, consumers: int = 2, max_seconds: float = 120) -> dict[str, Any]:
    """The same burn-down through pgq.Worker (async handler, batched acks)."""
    with pgq.Client(dsn) as client:
        for start in range(0, n, 50_000):
            client.add_jobs(QUEUE, [BODY] * min(50_000, n - start))
    analyze(dsn)
    worker = pgq.Worker(dsn, concurrency=batch * consumers, batch=batch, poll_timeout=0.2)
    done = [0]
    started = time.perf_counter()

    @worker.task(QUEUE)
    async def handle(job: pgq.Job) -> None:
        done[0] += 1
        if time.perf_counter() - started > max_seconds:
            worker.stop()

    # until_empty: it ends at the first claim that finds the queue empty
    # (nohang), as the bare client's consumers do. Stopped from its handler
    # at the last job, the worker's clock also held a blocking claim on the
    # empty queue (poll_timeout, 0.2 s) and the stop flag's 50 ms poll: about
    # 6% of a 3.2 s burn-down, which the bare client's clock never paid
    # (found by a review of the bench).
    worker.run(install_signal_handlers=False, until_empty=True)
    return {"jobs": worker.stats.succeeded, "seconds": time.perf_counter() - started}


def steady(dsn: str, producers: int, consumers: int, seconds: float, batch: int = 10) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        ages: list[float] = []
        stop = time.perf_counter() + seconds
        async with pgq.AsyncClient(dsn, pool_size=producers + consumers + 2) as client:
            async def produce() -> None:
                while time.perf_counter() < stop:
                    await client.add_job(QUEUE, stamped())

            async def consume() -> None:
                while time.perf_counter() < stop:
                    jobs = await client.get_job(QUEUE, count=batch, timeout=0.2)
                    if jobs:
                        ages.extend(age_of(j.body) for j in jobs)
                        await client.ack_job(*(j.id for j in jobs))

            started = time.perf_counter()
            async with anyio.create_task_group() as tasks:
                for _ in range(producers):
                    tasks.start_soon(produce)
                for _ in range(consumers):
                    tasks.start_soon(consume)
            elapsed = time.perf_counter() - started
        return {"jobs": len(ages), "seconds": elapsed, **percentiles(ages)}

    return anyio.run(run)


def enqueue_single(dsn: str, n: int) -> dict[str, Any]:
    with pgq.Client(dsn) as client:
        client.add_job(QUEUE, BODY)
        latencies = []
        for _ in range(n):
            started = time.perf_counter()
            client.add_job(QUEUE, BODY)
            latencies.append(time.perf_counter() - started)
    return {"jobs": n, "seconds": sum(latencies), **percentiles(latencies)}


def enqueue_bulk(dsn: str, n: int) -> dict[str, Any]:
    with pgq.Client(dsn) as client:
        started = time.perf_counter()
        for start in range(0, n, 100_000):
            client.add_jobs(QUEUE, [BODY] * min(100_000, n - start))
        seconds = time.perf_counter() - started
    return {"jobs": n, "seconds": seconds}


def spark_ingest(dsn: str, n: int) -> dict[str, Any]:
    """pgq.spark.write_jobs of n rows (W=1) into the node database."""
    from pgq.spark import write_jobs

    from .spark_common import rows, session

    spark = session()
    write_jobs(rows(spark, 1000), "warm", nodes=dsn)  # a fresh JVM's first write is slow
    df = rows(spark, n)
    started = time.perf_counter()
    result = write_jobs(df, QUEUE, nodes=dsn, replicate=1)
    seconds = time.perf_counter() - started
    spark.stop()
    return {"jobs": result.jobs, "seconds": seconds}


def _prefill(dsn: str, n: int) -> None:
    """``n`` jobs in the queue, and fresh statistics for the planner."""
    with pgq.Client(dsn) as client:
        for start in range(0, n, 100_000):
            client.add_jobs(QUEUE, [BODY] * min(100_000, n - start))
    analyze(dsn)


def closed_add(dsn: str, clients: int, seconds: float, shared: bool = True) -> dict[str, Any]:
    """Closed loop: each client thread adds one job at a time (one shared
    pgq.Client, or a Client per thread)."""
    one = pgq.Client(dsn) if shared else None
    result = closed_loop(clients, seconds,
                         setup=lambda i: one if shared else pgq.Client(dsn),
                         call=lambda client: client.add_job(QUEUE, BODY),
                         teardown=lambda client: None if shared else client.close())
    if one is not None:
        one.close()
    return result


def get_ack(client: pgq.Client, queue: str) -> None:
    """One closed-loop get+ack: the next job of ``queue``, acknowledged."""
    jobs = client.get_job(queue, nohang=True)
    if not jobs:
        raise RuntimeError("the queue ran dry: prefill more")
    client.ack_job(jobs[0].id)


def closed_get_ack(dsn: str, clients: int, seconds: float, prefill: int,
                   shared: bool = True) -> dict[str, Any]:
    """Closed loop: each client thread gets one job and acks it."""
    _prefill(dsn, prefill)
    one = pgq.Client(dsn) if shared else None

    result = closed_loop(clients, seconds,
                         setup=lambda i: one if shared else pgq.Client(dsn),
                         call=lambda client: get_ack(client, QUEUE),
                         teardown=lambda client: None if shared else client.close())
    if one is not None:
        one.close()
    return result


def resp_add(dsn: str, connections: int, seconds: float) -> dict[str, Any]:
    """Closed loop through the RESP port: each connection sends ADDJOB and
    waits for its reply (given after the commit)."""
    return resp_client.served(dsn, connections, seconds, resp_client.add(QUEUE, BODY))


def resp_get_ack(dsn: str, connections: int, seconds: float, prefill: int) -> dict[str, Any]:
    """Closed loop through the RESP port: each connection sends GETJOB
    NOHANG, then ACKJOB of the job it got."""
    _prefill(dsn, prefill)
    return resp_client.served(dsn, connections, seconds, resp_client.get_ack(QUEUE))


def http_add(dsn: str, connections: int, seconds: float) -> dict[str, Any]:
    """Closed loop through the HTTP API: each connection POSTs one job and
    waits for its 201 (given after the commit)."""
    return http_client.served(dsn, connections, seconds, http_client.add(QUEUE, BODY))


def http_get_ack(dsn: str, connections: int, seconds: float, prefill: int) -> dict[str, Any]:
    """Closed loop through the HTTP API: a lease without waiting, then the
    ack of the job it got."""
    _prefill(dsn, prefill)
    return http_client.served(dsn, connections, seconds, http_client.get_ack(QUEUE))


def burn_repeated(dsn: str, n: int, batch: int, consumers: int, repeats: int,
                  hold: bool = False) -> dict[str, Any]:
    return burn_repeated_with(burn, dsn, n, batch, consumers, repeats, hold)


if __name__ == "__main__":
    main({"burn": burn, "burn_worker": burn_worker, "steady": steady,
          "enqueue_single": enqueue_single, "enqueue_bulk": enqueue_bulk,
          "spark_ingest": spark_ingest, "closed_add": closed_add,
          "closed_get_ack": closed_get_ack, "resp_add": resp_add, "resp_get_ack": resp_get_ack,
          "http_add": http_add, "http_get_ack": http_get_ack,
          "burn_repeated": burn_repeated})
