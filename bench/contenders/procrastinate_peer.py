"""Contender: procrastinate (https://pypi.org/project/procrastinate/), through
its App, PsycopgConnector and worker. procrastinate fetches one job per query
whatever the concurrency: its "batched" rows run 10 concurrent sub-workers.
Runs in the peers' virtualenv."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import procrastinate

from .common import age_of, main, percentiles, stamped

QUEUE = "bench"
PAYLOAD = "0123456789abcdef"  # procrastinate jobs carry JSON arguments


def _app(dsn: str, ages: list[float] | None = None, counter: list[int] | None = None) -> procrastinate.App:
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    @app.task(queue=QUEUE, name="noop")
    async def noop(p: str = "", t: float = 0.0) -> None:
        if counter is not None:
            counter[0] += 1
        if ages is not None:
            ages.append(time.time() - t)

    app.noop = noop  # type: ignore[attr-defined]
    return app


async def _install(app: procrastinate.App) -> None:
    await app.schema_manager.apply_schema_async()  # every run gets a fresh database


def burn(dsn: str, n: int, batch: int, consumers: int = 2,
         max_seconds: float = 120) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        done = [0]
        app = _app(dsn, counter=done)
        async with app.open_async():
            await _install(app)
            for start in range(0, n, 10_000):
                size = min(10_000, n - start)
                await app.noop.batch_defer_async(*[{"p": PAYLOAD}] * size)
            await app.connector.execute_query_async("ANALYZE")
            started = time.perf_counter()
            concurrency = 1 if batch == 1 else 10
            workers = [app.run_worker_async(queues=[QUEUE], wait=False, concurrency=concurrency,
                                            install_signal_handlers=False)
                       for _ in range(consumers)]
            try:
                await asyncio.wait_for(asyncio.gather(*workers), timeout=max_seconds)
            except TimeoutError:
                pass
            return {"jobs": done[0], "seconds": time.perf_counter() - started}

    return asyncio.run(run())


def steady(dsn: str, producers: int, consumers: int, seconds: float, batch: int = 10) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        ages: list[float] = []
        app = _app(dsn, ages=ages)
        async with app.open_async():
            await _install(app)
            stop = time.perf_counter() + seconds

            async def produce() -> None:
                while time.perf_counter() < stop:
                    body = stamped()
                    await app.noop.defer_async(p=PAYLOAD, t=time.time() - age_of(body))

            started = time.perf_counter()
            workers = [asyncio.create_task(app.run_worker_async(
                queues=[QUEUE], concurrency=batch, install_signal_handlers=False))
                for _ in range(consumers)]
            await asyncio.gather(*(produce() for _ in range(producers)))
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            return {"jobs": len(ages), "seconds": time.perf_counter() - started, **percentiles(ages)}

    return asyncio.run(run())


def enqueue_single(dsn: str, n: int) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        app = _app(dsn)
        async with app.open_async():
            await _install(app)
            latencies = []
            for _ in range(n):
                started = time.perf_counter()
                await app.noop.defer_async(p=PAYLOAD)
                latencies.append(time.perf_counter() - started)
            return {"jobs": n, "seconds": sum(latencies), **percentiles(latencies)}

    return asyncio.run(run())


def enqueue_bulk(dsn: str, n: int) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        app = _app(dsn)
        async with app.open_async():
            await _install(app)
            started = time.perf_counter()
            for start in range(0, n, 10_000):
                size = min(10_000, n - start)
                await app.noop.batch_defer_async(*[{"p": PAYLOAD}] * size)
            return {"jobs": n, "seconds": time.perf_counter() - started}

    return asyncio.run(run())


if __name__ == "__main__":
    main({"burn": burn, "steady": steady, "enqueue_single": enqueue_single,
          "enqueue_bulk": enqueue_bulk})
