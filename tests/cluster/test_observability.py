"""Prometheus metrics of nodes and workers, and structured (JSON) logs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable

from .conftest import free_port, wait_until


def scrape(host: str, port: int) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()) and head.split("{")[0] == name:
            return float(value)
    return None


def test_node_metrics_and_json_logs(make_cluster):
    port = free_port("127.0.0.2")
    cluster = make_cluster(2, extra_args=["--metrics", "{host}:" + str(port)],
                           env={"PGQ_LOG_FORMAT": "json"})
    with cluster[0].client(direct_copies=False) as client:  # the node replicates (metrics)
        for _ in range(3):
            client.add_job("observed", b"x", replicate=2)
    text = wait_until(lambda: (t := scrape("127.0.0.2", port)) and
                      metric(t, "pgq_queue_length", queue="observed") == 3 and t, 10,
                      message="metrics to show the queue")
    assert metric(text, "pgq_jobs_in_total", queue="observed") == 3
    assert metric(text, "pgq_database_up") == 1
    assert metric(text, "pgq_cluster_nodes", status="alive") == 1
    assert metric(text, "pgq_bus_messages_total", direction="out", kind="repljob") >= 1
    assert metric(text, "pgq_bus_messages_total", direction="out", kind="advert") >= 1
    assert metric(text, "pgq_replication_seconds_count") == 3
    assert metric(text, "pgq_bus_rejected_total") == 0
    lines = [json.loads(line) for line in cluster[0].log.read_text().splitlines()
             if line.startswith("{")]
    assert lines and {e["node"] for e in lines} == {"n1"}
    assert any("up on bus" in e["message"] for e in lines)


def test_worker_metrics(make_cluster, tmp_path):
    cluster = make_cluster(1)
    with cluster[0].client() as client:
        client.add_jobs("metered", [b"1", b"2", b"3"])
    (tmp_path / "quick.py").write_text("def handle(job):\n    pass\n")
    port = free_port("127.0.0.1")
    worker = subprocess.Popen([sys.executable, "-m", "pgq.cli", "worker", "quick:handle",
                               "--queue", "metered", "--dsn", cluster[0].dsn,
                               "--metrics", f"127.0.0.1:{port}"], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # a job counts as succeeded when its handler returns; its batched ack
        # is timed when the ack statement returns, a moment later
        text = wait_until(lambda: _scrape_if(port, lambda t: metric(
            t, "pgq_worker_jobs_total", outcome="succeeded") == 3 and (metric(
                t, "pgq_worker_ack_seconds_count") or 0) >= 1), 20,
                          message="the worker to report 3 jobs and time its ack")
        assert metric(text, "pgq_worker_jobs_total", queue="metered", outcome="succeeded") == 3
        assert metric(text, "pgq_worker_claim_seconds_count") >= 1
        assert metric(text, "pgq_worker_ack_seconds_count") >= 1
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=30)


def _scrape_if(port: int, wanted: Callable[[str], bool]) -> str | None:
    """The metrics text once ``wanted`` holds for it, else None (also while
    the endpoint is not up yet)."""
    try:
        text = scrape("127.0.0.1", port)
    except OSError:  # socket.timeout is an OSError
        return None
    return text if wanted(text) else None


def test_a_scrape_without_the_database_says_so():
    """The queue series vanish when the database cannot be read; a gauge
    says why (an alert on a missing series fires late or never)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from pgq.metrics import _NodeCollector

    registry = CollectorRegistry()
    port = free_port("127.0.0.1")  # nothing listens there
    registry.register(_NodeCollector(f"postgresql://pgq@127.0.0.1:{port}/nothing", None))
    text = generate_latest(registry).decode()
    assert metric(text, "pgq_database_up") == 0 and metric(text, "pgq_queue_length") is None
