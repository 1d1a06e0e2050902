"""Federation through real node processes: a consumer blocked on one node
gets jobs queued on another, and QSTAT reports where they came from. The
stories (at-least-once and at-most-once jobs, acks reaching the exporter,
a queue paused for output) are proven in the simulation:
tests/cluster/test_scenarios.py."""

from __future__ import annotations

from .conftest import wait_until


def test_qstat_reports_import_source_and_rate(make_cluster):
    cluster = make_cluster(2)
    with cluster[1].client() as client:
        client.add_jobs("imp", [b"x"] * 40, replicate=1)
    with cluster[0].client() as client:
        got = []
        while len(got) < 40:
            got += client.get_job("imp", count=10, timeout=5)
        stat = wait_until(lambda: client.qstat("imp") if client.qstat("imp")["import_rate"] else None,
                          5, message="import statistics")
    assert stat["import_from"] == [cluster[1].id()] and stat["import_rate"] > 0
