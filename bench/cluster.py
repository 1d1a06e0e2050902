"""The cluster workload (pgq only: no peer replicates across databases).

Three local nodes, each with its own PostgreSQL; for W = 1, 2, 3 the latency
of a single synchronous add (one client, sequential) and the throughput of
8 concurrent producers; W = 3 asynchronous throughput; and get + ack across
nodes (consumers on node 2 draining jobs added on node 1, through
federation). Medians over the rounds.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import pgq
from pgq.localcluster import LocalCluster

PRODUCERS = 8


def _latency(client: pgq.Client, queue: str, n: int, replicate: int) -> list[float]:
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        client.add_job(queue, b"0123456789abcdef", replicate=replicate)
        samples.append(time.perf_counter() - started)
    return samples


def _throughput(dsn: str, queue: str, seconds: float, replicate: int, asynchronous: bool) -> float:
    done = [0]
    stop = time.perf_counter() + seconds

    def produce() -> None:
        with pgq.Client(dsn, pool_size=2) as client:
            while time.perf_counter() < stop:
                client.add_job(queue, b"0123456789abcdef", replicate=replicate,
                               asynchronous=asynchronous)
                done[0] += 1

    threads = [threading.Thread(target=produce) for _ in range(PRODUCERS)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return done[0] / (time.perf_counter() - started)


def _across_nodes(producer: str, consumer: str, queue: str, n: int) -> float:
    with pgq.Client(producer) as client:
        client.add_jobs(queue, [b"0123456789abcdef"] * n, replicate=2)
    taken = 0
    started = time.perf_counter()
    with pgq.Client(consumer) as client:
        while taken < n and time.perf_counter() - started < 120:
            jobs = client.get_job(queue, count=100, timeout=2)
            if jobs:
                client.ack_job(*(j.id for j in jobs))
                taken += len(jobs)
    return taken / (time.perf_counter() - started)


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def run_cluster(smoke: bool, rounds: int, log: Callable[[str], None]) -> dict[str, Any]:
    adds = 20 if smoke else 300
    seconds = 1.0 if smoke else 5.0
    across = 200 if smoke else 5000
    rows: dict[str, list[dict[str, float]]] = {}
    with LocalCluster(3, prefix="pgq-bench-cluster-") as cluster:
        first, second = cluster.nodes[0].dsn, cluster.nodes[1].dsn
        with pgq.Client(first) as client:
            client.add_job("warm", b"x", replicate=3)  # connections, prepared statements
            for round_no in range(rounds):
                for replicate in (1, 2, 3):
                    q = f"lat-{round_no}-{replicate}"
                    samples = _latency(client, q, adds, replicate)
                    rate = _throughput(first, f"tp-{round_no}-{replicate}", seconds, replicate, False)
                    rows.setdefault(f"W={replicate} sync", []).append(
                        {"p50_ms": statistics.median(samples) * 1000,
                         "p99_ms": _pct(samples, 0.99) * 1000, "rate": rate})
                    log(f"cluster round {round_no + 1} W={replicate} sync: p50 "
                        f"{statistics.median(samples) * 1000:.2f} ms, {rate:,.0f} adds/s")
                rate = _throughput(first, f"async-{round_no}", seconds, 3, True)
                rows.setdefault("W=3 async", []).append({"rate": rate})
                log(f"cluster round {round_no + 1} W=3 async: {rate:,.0f} adds/s")
                rate = _across_nodes(first, second, f"across-{round_no}", across)
                rows.setdefault("get+ack across nodes", []).append({"rate": rate})
                log(f"cluster round {round_no + 1} get+ack across nodes: {rate:,.0f} jobs/s")
    return {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            for name, runs in rows.items()}
