"""Prometheus metrics of workers and node processes.

Each process gets its own registry and HTTP endpoint (``--metrics
HOST:PORT``), so nothing leaks into an application's default registry.

* Worker: ``pgq_worker_claim_seconds`` and ``pgq_worker_ack_seconds``
  (histograms of the calls: a claim blocks up to the worker's poll_timeout
  while its queues are empty, so an idle worker's claims read about that
  long; its busy ones are the round trips), ``pgq_worker_jobs_total{queue,outcome}``.
* Node: ``pgq_queue_length``, ``pgq_queue_active``, ``pgq_jobs_in_total``,
  ``pgq_jobs_out_total`` (per queue, read from ``pgq.queue_stats`` when
  scraped), ``pgq_replication_seconds`` (histogram: new job to W copies),
  ``pgq_bus_messages_total{direction,kind}``, ``pgq_bus_rejected_total``,
  ``pgq_cluster_nodes{status}`` (alive, suspect, dead, left).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["WorkerMetrics", "NodeMetrics", "parse_listen"]

NODE_STATUSES = ("alive", "suspect", "dead", "left")  # pgq_cluster_nodes, each always sent
SCRAPE_TIMEOUT_MS = 5000  # a scrape's statement; Prometheus' own default timeout is 10 s

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def parse_listen(text: str) -> tuple[str, int]:
    """(host, port) of HOST:PORT (or :PORT, on loopback); ValueError if the
    port is not a number in 0..65535."""
    from .arguments import port_number

    host, _, port = text.rpartition(":")
    number = port_number(port)
    if number is None or number > 65535:
        raise ValueError(f"not a port: {port!r}")
    if host.startswith("[") and host.endswith("]"):  # [::1]:7780: IPv6 is written so
        host = host[1:-1]
    return host or "127.0.0.1", number


def check_free(listen: str) -> None:
    """Raise PgqError now if HOST:PORT ``listen`` cannot be served (a port
    in use), as :func:`serve` would later: a node checks it before its
    database starts, which a failure after it left running."""
    from .errors import PgqError
    from .ports import bindable

    host, port = parse_listen(listen)
    try:
        free = bindable(host, port, reuse_address=True)  # as Python's HTTP servers bind
    except OSError as exc:  # a name that does not resolve
        raise PgqError(f"cannot serve metrics on {listen}: {exc.strerror or exc}; "
                       "choose another --metrics address") from None
    if free is None:
        raise PgqError(f"cannot serve metrics on {listen}: it is in use; "
                       "choose another --metrics address")


def serve(registry: CollectorRegistry, listen: str) -> None:
    """Serve ``registry`` for Prometheus on HOST:PORT, in a thread."""
    from .errors import PgqError

    host, port = parse_listen(listen)
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as exc:  # a port in use, a name that does not resolve
        raise PgqError(f"cannot serve metrics on {listen}: {exc.strerror or exc}; "
                       "choose another --metrics address") from None


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.claim = Histogram("pgq_worker_claim_seconds",
                               "GETJOB of the worker: its round trip, or up to poll_timeout "
                               "while blocked on empty queues",
                               buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ack = Histogram("pgq_worker_ack_seconds", "batched ACKJOB round trip",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.jobs = Counter("pgq_worker_jobs", "jobs handled", ["queue", "outcome"],
                            registry=self.registry)

    def observe(self, what: str, seconds: float) -> None:
        (self.claim if what == "claim" else self.ack).observe(seconds)

    def job_done(self, queue: str, outcome: str) -> None:
        self.jobs.labels(queue, outcome).inc()

    def serve(self, listen: str) -> None:
        serve(self.registry, listen)


class _NodeCollector(Collector):
    """Reads queue statistics and node state when Prometheus scrapes."""

    def __init__(self, dsn: str, snapshot: Callable[[], dict[str, Any]] | None) -> None:
        self.dsn = dsn
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        import psycopg

        from .dsn import connection_settings
        from .statements import QUEUE_METRICS

        length = GaugeMetricFamily("pgq_queue_length", "jobs queued", labels=["queue"])
        active = GaugeMetricFamily("pgq_queue_active", "jobs active (delivered, delayed, copies)",
                                   labels=["queue"])
        jobs_in = CounterMetricFamily("pgq_jobs_in", "jobs that entered the queue", labels=["queue"])
        jobs_out = CounterMetricFamily("pgq_jobs_out", "jobs delivered from the queue", labels=["queue"])
        # Without the database the queue series vanish from the scrape; this
        # says why, so an alert can fire on it (as postgres_exporter's pg_up).
        up = GaugeMetricFamily("pgq_database_up", "1 if the queue statistics were read from "
                               "the database at this scrape, else 0")
        try:
            # Bounded: a scrape waiting on a lock (a migration, VACUUM FULL)
            # held its thread and its connection, and the next scrapes piled
            # up behind it.
            with psycopg.connect(self.dsn, connect_timeout=3, **connection_settings(
                    self.dsn, f"-c statement_timeout={SCRAPE_TIMEOUT_MS}", "pgq-metrics",
                    default_name="pgq-metrics")) as conn:
                rows = conn.execute(QUEUE_METRICS).fetchall()
            up.add_metric([], 1)
        except psycopg.Error:
            rows = []
            up.add_metric([], 0)
        yield up
        for queue, n, a, i, o in rows:
            length.add_metric([queue], n)
            active.add_metric([queue], a)
            jobs_in.add_metric([queue], i)
            jobs_out.add_metric([queue], o)
        yield from (length, active, jobs_in, jobs_out)
        if self.snapshot is None:  # a client-side front (HTTP): queue metrics only
            return
        state = self.snapshot()
        nodes = GaugeMetricFamily("pgq_cluster_nodes", "known nodes by state", labels=["status"])
        # Every status, 0 included: a series that vanishes when its count
        # falls to 0 never fires an alert such as {status="alive"} < 3.
        counts = state["nodes"]
        for status in (*NODE_STATUSES, *sorted(set(counts) - set(NODE_STATUSES))):
            nodes.add_metric([status], counts.get(status, 0))
        yield nodes
        messages = CounterMetricFamily("pgq_bus_messages", "bus messages", labels=["direction", "kind"])
        for direction in ("in", "out"):
            for kind, count in state["bus"][f"messages_{direction}"].items():
                messages.add_metric([direction, kind], count)
        yield messages
        yield CounterMetricFamily("pgq_bus_rejected", "bus frames or handshakes rejected",
                                  value=state["bus"]["rejected_total"])


class NodeMetrics:
    def __init__(self, dsn: str, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        self.replication = Histogram("pgq_replication_seconds",
                                     "from a new replicated job to its W copies",
                                     buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_NodeCollector(dsn, snapshot))

    def serve(self, listen: str) -> None:
        serve(self.registry, listen)
