"""The cluster workload (pgq only: no peer replicates across databases).

Three local nodes, each with its own PostgreSQL; for W = 1, 2, 3 the latency
of a single synchronous add (one client, sequential) and the throughput of
8 concurrent producers; W = 3 asynchronous throughput; get + ack across
nodes (consumers on node 2 draining jobs added on node 1, through
federation); the closed loop of issue "Speed that scales" on node 1, N
client threads sharing one ``pgq.Client``, one call in flight each:
``add_job(..., replicate=3)``, and get + ack of 3-copy jobs from a
prefilled queue (N = 1, 10, 50; 1 and 4 in smoke runs); and, through node
1's RESP port (``pgq node start --resp``), the closed loop of ``ADDJOB
queue body 0 REPLICATE 3`` with N connections, one request in flight each
(issue "Any language"). Medians over the rounds. ``only`` picks rows by
name, as ``--only`` does for the other workloads.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pgq
from pgq.localcluster import LocalCluster, free_port

from .contenders import pgq_client, resp_client
from .contenders.common import BODY, closed_loop
from .report import REPLICATED, REPLICATED_GET_ACK
from .runner import CLIENTS, RESP_CONNECTIONS, closed_loop_key, resp_key

PRODUCERS = 8
PYTHON_ROWS = ("W=1 sync", "W=2 sync", "W=3 sync", "W=3 async", "get+ack across nodes")


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


def resp_rows(smoke: bool) -> dict[str, int]:
    """The RESP rows' names and their connections."""
    return {resp_key(REPLICATED, n): n for n in ((4,) if smoke else RESP_CONNECTIONS)}


def closed_rows(smoke: bool) -> dict[str, tuple[str, int]]:
    """The closed-loop rows' names, each with its operation and its client threads."""
    return {closed_loop_key(what, n, True): (what, n)
            for what in (REPLICATED, REPLICATED_GET_ACK) for n in ((1, 4) if smoke else CLIENTS)}


def _serving_resp(port: int) -> list[str]:
    """A node launcher that adds ``--resp 127.0.0.1:port`` to ``pgq node
    start``: LocalNode runs ``[*launcher, "node", "start", ...]`` and has no
    option for a node's extra arguments, so this runs pgq's CLI itself with
    the arguments it is given and ``--resp`` after them (so it is no
    launcher for ``LocalNode.start_postgres``, which the bench never calls)."""
    code = ("import sys; from pgq.cli import main; "
            f"main(sys.argv[1:] + ['--resp', '127.0.0.1:{port}'], prog_name='pgq')")
    return [sys.executable, "-c", code]


def _python_round(first: str, second: str, client: pgq.Client, round_no: int, smoke: bool,
                  wanted: Callable[[str], bool], rows: dict[str, list[dict[str, float | None]]],
                  log: Callable[[str], None]) -> None:
    """One round of the Python client's rows (those ``wanted``)."""
    adds = 20 if smoke else 300
    seconds = 1.0 if smoke else 5.0
    for replicate in (1, 2, 3):
        if not wanted(f"W={replicate} sync"):
            continue
        samples = _latency(client, f"lat-{round_no}-{replicate}", adds, replicate)
        rate = _throughput(first, f"tp-{round_no}-{replicate}", seconds, replicate, False)
        rows.setdefault(f"W={replicate} sync", []).append(
            {"p50_ms": statistics.median(samples) * 1000, "p99_ms": _pct(samples, 0.99) * 1000,
             "rate": rate})
        log(f"cluster round {round_no + 1} W={replicate} sync: p50 "
            f"{statistics.median(samples) * 1000:.2f} ms, {rate:,.0f} adds/s")
    if wanted("W=3 async"):
        rate = _throughput(first, f"async-{round_no}", seconds, 3, True)
        rows.setdefault("W=3 async", []).append({"rate": rate})
        log(f"cluster round {round_no + 1} W=3 async: {rate:,.0f} adds/s")
    if wanted("get+ack across nodes"):
        rate = _across_nodes(first, second, f"across-{round_no}", 200 if smoke else 5000)
        rows.setdefault("get+ack across nodes", []).append({"rate": rate})
        log(f"cluster round {round_no + 1} get+ack across nodes: {rate:,.0f} jobs/s")


def _resp_round(port: int, node_pid: int, round_no: int, smoke: bool, wanted: Callable[[str], bool],
                rows: dict[str, list[dict[str, float | None]]], log: Callable[[str], None]) -> None:
    """One round of the RESP rows (those ``wanted``): closed loop, ADDJOB
    ... REPLICATE 3 on node 1's RESP port (with the share of a core node
    1's process used meanwhile)."""
    for name, connections in resp_rows(smoke).items():
        if not wanted(name):
            continue
        operation = resp_client.add(f"resp-{round_no}-{connections}", b"0123456789abcdef", replicate=3)
        cpu, began = resp_client.cpu_seconds(node_pid), time.perf_counter()
        done = resp_client.closed_loop(port, connections, 0.5 if smoke else 5.0, operation)
        used, elapsed = resp_client.cpu_seconds(node_pid), time.perf_counter() - began
        rate = done["jobs"] / done["seconds"]
        rows.setdefault(name, []).append({
            "p50_ms": done["p50"] * 1000, "p99_ms": done["p99"] * 1000, "rate": rate,
            "client_cpu": done["client_cpu"],
            "server_cpu": (used - cpu) / elapsed if used is not None and cpu is not None else None})
        log(f"cluster round {round_no + 1} {name}: {rate:,.0f} adds/s, p50 {done['p50'] * 1000:.2f} ms")


def _prefill(client: pgq.Client, dsn: str, queue: str, n: int, log: Callable[[str], None]) -> None:
    """``n`` 3-copy jobs in ``queue``, and fresh statistics for the planner."""
    began = time.perf_counter()
    for start in range(0, n, 1000):
        client.add_jobs(queue, [BODY] * min(1000, n - start), replicate=3)
    pgq_client.analyze(dsn)
    log(f"cluster: prefilled {queue} with {n:,} 3-copy jobs in {time.perf_counter() - began:.1f} s")


def _closed_call(client: pgq.Client, dsn: str, what: str, queue: str, smoke: bool,
                 log: Callable[[str], None]) -> Callable[[pgq.Client], Any]:
    """A closed-loop row's call: one replicated add, or (``queue`` prefilled
    first) one get + ack of a 3-copy job."""
    if what == REPLICATED:
        return lambda c: c.add_job(queue, BODY, replicate=3)
    _prefill(client, dsn, queue, 2_000 if smoke else 60_000, log)
    return lambda c: pgq_client.get_ack(c, queue)


def _closed_round(dsn: str, round_no: int, smoke: bool, wanted: Callable[[str], bool],
                  rows: dict[str, list[dict[str, float | None]]], log: Callable[[str], None]) -> None:
    """One round of the closed-loop rows (those ``wanted``) on node 1: N
    threads share one Client, each with one call in flight; each row on a
    fresh queue."""
    for name, (what, clients) in closed_rows(smoke).items():
        if not wanted(name):
            continue
        queue = f"closed-{'add' if what == REPLICATED else 'get'}-{round_no}-{clients}"
        with pgq.Client(dsn, pool_size=max(10, clients)) as client:
            call = _closed_call(client, dsn, what, queue, smoke, log)
            done = closed_loop(clients, 0.5 if smoke else 5.0, setup=lambda i: client, call=call)
        rate = done["jobs"] / done["seconds"]
        rows.setdefault(name, []).append(
            {"p50_ms": done["p50"] * 1000, "p99_ms": done["p99"] * 1000, "rate": rate})
        unit = "adds/s" if what == REPLICATED else "jobs/s"
        log(f"cluster round {round_no + 1} {name}: {rate:,.0f} {unit}, p50 {done['p50'] * 1000:.2f} ms")


def run_cluster(smoke: bool, rounds: int, log: Callable[[str], None],
                only: list[str] | None = None) -> dict[str, Any]:
    def wanted(name: str) -> bool:
        return not only or any(o in name for o in only)

    if not any(wanted(name) for name in (*PYTHON_ROWS, *closed_rows(smoke), *resp_rows(smoke))):
        return {}
    rows: dict[str, list[dict[str, float | None]]] = {}
    cluster = LocalCluster(3, prefix="pgq-bench-cluster-")
    port = free_port()
    cluster.nodes[0].launcher = _serving_resp(port)
    try:
        cluster.start()
        node = cluster.nodes[0].process
        assert node is not None
        resp_client.wait_answering(port, resp_client.exited(node))
        first, second = cluster.nodes[0].dsn, cluster.nodes[1].dsn
        with pgq.Client(first) as client:
            client.add_job("warm", b"x", replicate=3)  # connections, prepared statements
            for round_no in range(rounds):
                _python_round(first, second, client, round_no, smoke, wanted, rows, log)
                _closed_round(first, round_no, smoke, wanted, rows, log)
                _resp_round(port, node.pid, round_no, smoke, wanted, rows, log)
    finally:
        cluster.close()
    return {name: {key: _median([r[key] for r in runs]) for key in runs[0]}
            for name, runs in rows.items()}


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None
