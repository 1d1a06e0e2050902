"""Helpers shared by contender processes (no pgq import: peers use them too)."""

from __future__ import annotations

import json
import statistics
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

BODY = b"0123456789abcdef"  # 16-byte bodies, as the workloads specify


def stamped() -> bytes:
    """A 16-byte body carrying the time it was made (for latency)."""
    return struct.pack("!d", time.time()) + b"pgqbench"


def age_of(body: bytes) -> float:
    return time.time() - struct.unpack("!d", bytes(body[:8]))[0]


def percentiles(samples: list[float]) -> dict[str, float | None]:
    if not samples:
        return {"p50": None, "p99": None}
    ordered = sorted(samples)
    return {"p50": statistics.median(ordered), "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]}


def closed_loop(clients: int, seconds: float, setup: Callable[[int], Any],
                call: Callable[[Any], Any], teardown: Callable[[Any], Any] = lambda _: None
                ) -> dict[str, Any]:
    """``clients`` threads, each with one request in flight: ``call(state)``
    in a loop for ``seconds`` (``state = setup(i)`` per thread); the rate and
    the latency of one call."""
    import threading

    states = [setup(i) for i in range(clients)]
    latencies: list[list[float]] = [[] for _ in range(clients)]
    start = threading.Barrier(clients + 1)
    stop = [0.0]

    def loop(i: int) -> None:
        mine, state = latencies[i], states[i]
        start.wait()
        while True:
            began = time.perf_counter()
            if began >= stop[0]:
                return
            call(state)
            mine.append(time.perf_counter() - began)

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    began = time.perf_counter()
    stop[0] = began + seconds
    start.wait()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    for state in states:
        teardown(state)
    flat = [x for mine in latencies for x in mine]
    return {"jobs": len(flat), "seconds": elapsed, **percentiles(flat)}


def repeated(rates: list[float], n: int) -> dict[str, Any]:
    """The result of repeated burn-downs: every round's rate; the headline
    rate is the last round's (the one that decays, if any)."""
    return {"jobs": n, "seconds": n / rates[-1], "rates": rates, "first": rates[0],
            "last": rates[-1]}


def burn_repeated_with(burn: Callable[..., dict[str, Any]], dsn: str, n: int, batch: int,
                       consumers: int, repeats: int, hold: bool = False) -> dict[str, Any]:
    """``repeats`` runs of a contender's ``burn`` in a row on one database;
    with ``hold``, another session keeps a transaction open for the whole
    run (the xmin horizon held: nothing dead can be removed)."""
    import psycopg  # here, not at the top: peers import this module too

    holder = psycopg.connect(dsn) if hold else None
    if holder is not None:
        holder.execute("SELECT txid_current()")
    try:
        rates = []
        for _ in range(repeats):
            done = burn(dsn, n, batch, consumers)
            rates.append(done["jobs"] / done["seconds"])
    finally:
        if holder is not None:
            holder.close()
    return repeated(rates, n)


def main(workloads: dict[str, Callable[..., dict[str, Any]]]) -> None:
    params = json.loads(sys.argv[1])
    workload = params.pop("workload")
    if workload not in workloads:
        print(json.dumps({"error": f"workload {workload} not supported"}))
        sys.exit(0)
    result = workloads[workload](**params)
    print(json.dumps(result))
