"""Contender: the raw-SQL floor - the smallest correct SKIP LOCKED loop written
directly with psycopg: claim N rows and delete them in one transaction. It
keeps no lease, counters or history: the physical limit of this design."""

from __future__ import annotations

import time
from typing import Any

import anyio
import psycopg

from .common import BODY, age_of, burn_repeated_with, closed_loop, main, percentiles, stamped

SCHEMA = "CREATE TABLE IF NOT EXISTS raw_jobs (id bigserial PRIMARY KEY, body bytea NOT NULL)"
CLAIM = "SELECT id, body FROM raw_jobs ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED"
DELETE = "DELETE FROM raw_jobs WHERE id = ANY(%s)"


def _prepare(dsn: str, n: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
        if n:
            with conn.cursor().copy("COPY raw_jobs (body) FROM STDIN (FORMAT BINARY)") as copy:
                copy.set_types(["bytea"])
                for _ in range(n):
                    copy.write_row((BODY,))
        conn.execute("ANALYZE")


async def _claim_and_delete(conn: psycopg.AsyncConnection, batch: int) -> list[tuple]:
    async with conn.transaction():
        rows = await (await conn.execute(CLAIM, (batch,), prepare=True)).fetchall()
        if rows:
            await conn.execute(DELETE, ([r[0] for r in rows],), prepare=True)
    return rows


def burn(dsn: str, n: int, batch: int, consumers: int = 2,
         max_seconds: float = 120) -> dict[str, Any]:
    _prepare(dsn, n)

    async def run() -> tuple[int, float]:
        done = [0]
        started = time.perf_counter()
        deadline = started + max_seconds

        async def consume() -> None:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                while time.perf_counter() < deadline:
                    rows = await _claim_and_delete(conn, batch)
                    if not rows:
                        return
                    done[0] += len(rows)

        async with anyio.create_task_group() as tasks:
            for _ in range(consumers):
                tasks.start_soon(consume)
        return done[0], time.perf_counter() - started

    jobs, seconds = anyio.run(run)
    return {"jobs": jobs, "seconds": seconds}


def steady(dsn: str, producers: int, consumers: int, seconds: float, batch: int = 10) -> dict[str, Any]:
    _prepare(dsn, 0)

    async def run() -> dict[str, Any]:
        ages: list[float] = []
        stop = time.perf_counter() + seconds

        async def produce() -> None:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                while time.perf_counter() < stop:
                    await conn.execute("INSERT INTO raw_jobs (body) VALUES (%s)", (stamped(),),
                                       prepare=True)

        async def consume() -> None:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                while time.perf_counter() < stop:
                    rows = await _claim_and_delete(conn, batch)
                    if rows:
                        ages.extend(age_of(r[1]) for r in rows)
                    else:
                        await anyio.sleep(0.005)  # no notification: poll

        started = time.perf_counter()
        async with anyio.create_task_group() as tasks:
            for _ in range(producers):
                tasks.start_soon(produce)
            for _ in range(consumers):
                tasks.start_soon(consume)
        return {"jobs": len(ages), "seconds": time.perf_counter() - started, **percentiles(ages)}

    return anyio.run(run)


def enqueue_single(dsn: str, n: int) -> dict[str, Any]:
    _prepare(dsn, 0)
    latencies = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(n):
            started = time.perf_counter()
            conn.execute("INSERT INTO raw_jobs (body) VALUES (%s)", (BODY,), prepare=True)
            latencies.append(time.perf_counter() - started)
    return {"jobs": n, "seconds": sum(latencies), **percentiles(latencies)}


def enqueue_bulk(dsn: str, n: int) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
    started = time.perf_counter()
    _prepare(dsn, n)
    return {"jobs": n, "seconds": time.perf_counter() - started}


def closed_add(dsn: str, clients: int, seconds: float, shared: bool = True) -> dict[str, Any]:
    """Closed loop: each client thread inserts one row at a time on its own
    connection (autocommit, durable): what PostgreSQL itself allows."""
    _prepare(dsn, 0)
    insert = "INSERT INTO raw_jobs (body) VALUES (%s)"
    return closed_loop(clients, seconds,
                       setup=lambda i: psycopg.connect(dsn, autocommit=True),
                       call=lambda conn: conn.execute(insert, (BODY,), prepare=True),
                       teardown=lambda conn: conn.close())


def closed_get_ack(dsn: str, clients: int, seconds: float, prefill: int,
                   shared: bool = True) -> dict[str, Any]:
    """Closed loop: each client thread claims one row and deletes it in one
    durable transaction (no lease, no second commit)."""
    _prepare(dsn, prefill)

    def take(conn: psycopg.Connection) -> None:
        with conn.transaction():
            row = conn.execute(CLAIM, (1,), prepare=True).fetchone()
            if row is None:
                raise RuntimeError("the queue ran dry: prefill more")
            conn.execute(DELETE, ([row[0]],), prepare=True)

    return closed_loop(clients, seconds,
                       setup=lambda i: psycopg.connect(dsn, autocommit=True),
                       call=take, teardown=lambda conn: conn.close())


def burn_repeated(dsn: str, n: int, batch: int, consumers: int, repeats: int,
                  hold: bool = False) -> dict[str, Any]:
    return burn_repeated_with(burn, dsn, n, batch, consumers, repeats, hold)


if __name__ == "__main__":
    main({"burn": burn, "steady": steady, "enqueue_single": enqueue_single,
          "enqueue_bulk": enqueue_bulk, "closed_add": closed_add,
          "closed_get_ack": closed_get_ack, "burn_repeated": burn_repeated})
