"""Federation: consumers blocked on one node get jobs queued on others."""

from __future__ import annotations

import random
import time

import pytest

from .conftest import wait_until


@pytest.mark.parametrize("retry", [30, 0], ids=["at-least-once", "at-most-once"])
def test_jobs_from_random_nodes_are_consumed_on_one_node(make_cluster, retry):
    cluster = make_cluster(3)
    rng = random.Random(retry)
    added = []
    for i in range(100):
        node = rng.choice(cluster.nodes[1:])  # nothing is added on the consuming node
        with node.client() as client:
            added.append(client.add_job("fed", b"%d" % i, replicate=1, retry=retry))
    consumed = []
    start = time.monotonic()
    with cluster[0].client() as client:
        while len(consumed) < 100 and time.monotonic() - start < 60:
            jobs = client.get_job("fed", count=10, timeout=5)
            consumed += [j.id for j in jobs]
            if jobs:
                client.ack_job(*(j.id for j in jobs))
    assert sorted(consumed) == sorted(added)  # all of them, each once
    if retry == 0:
        # moved, never copied: nothing left on the exporting nodes
        assert all(cluster.holders(j) == {} for j in added)
    else:
        # acked on the importer, which told the origin (Disque's defect 1)
        wait_until(lambda: all(cluster.copies(j) == 0 for j in added), 15,
                   message="exporters to learn the acks")


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


def test_a_paused_out_queue_is_not_exported(make_cluster):
    cluster = make_cluster(2)
    with cluster[1].client() as client:
        client.add_job("po", b"x", replicate=1)
        client.pause("po", "out")
    with cluster[0].client() as client:
        assert client.get_job("po", timeout=3) == []
    with cluster[1].client() as client:
        client.pause("po", "none")
    with cluster[0].client() as client:
        assert len(client.get_job("po", timeout=10)) == 1
