"""Synchronous and asynchronous replication to W node databases."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

import pgq

from .conftest import wait_until


def test_replicate_1_and_3_sync_copy_counts(make_cluster):
    cluster = make_cluster(3)
    with cluster[0].client() as client:
        one = client.add_job("r", b"x", replicate=1)
        three = client.add_job("r", b"y", replicate=3)
        default = client.add_job("r", b"z")  # min(3, reachable) = 3
    assert cluster.copies(one) == 1
    assert cluster.copies(three) == 3  # durably stored on 3 nodes when add_job returned
    assert cluster.copies(default) == 3
    states = cluster.holders(three)
    assert states["n1"] == "queued" and sorted(states.values()) == ["active", "active", "queued"]
    with cluster[0].client() as client:
        info = client.show(three)
    assert info["repl"] == 3 and len(info["nodes_delivered"]) == 3 and len(info["nodes_confirmed"]) == 3


def test_replicate_async_copies_arrive_in_the_background(make_cluster):
    cluster = make_cluster(3)
    with cluster[1].client() as client:
        job = client.add_job("ra", b"x", replicate=3, asynchronous=True)
        assert client.get_job("ra", nohang=True)[0].id == job  # queued at once
        client.nack_job(job)
        client.wait_replicated([job], timeout=10)
    assert cluster.copies(job) == 3


def test_transactional_add_is_replicated_after_commit(make_cluster):
    cluster = make_cluster(3)
    with cluster[0].client() as client, psycopg.connect(cluster[0].dsn) as conn:
        job = client.add_job("rt", b"x", replicate=2, conn=conn)
        rolled = client.add_job("rt", b"y", replicate=2, conn=conn)
        assert cluster.copies(job) == 0
        conn.commit()
        client.wait_replicated([job], timeout=10)
        assert cluster.copies(job) == 2
        with psycopg.connect(cluster[0].dsn) as other:
            rolled = client.add_job("rt", b"y", replicate=2, conn=other)
            other.rollback()
    time.sleep(0.5)
    assert cluster.copies(rolled) == 0


def test_norepl_when_w_exceeds_reachable_nodes(make_cluster):
    cluster = make_cluster(2)
    with cluster[0].client() as client:
        with pytest.raises(pgq.errors.NoReplError, match="2 can take a copy"):
            client.add_job("n", b"x", replicate=3)
        assert client.qlen("n") == 0
        cluster[1].kill()
        wait_until(lambda: list(cluster[0].view().values()) == ["dead"], 20)
        time.sleep(1.1)  # the client's view of the cluster refreshes every second
        with pytest.raises(pgq.errors.NoReplError):
            client.add_job("n", b"x", replicate=2)
        assert client.add_job("n", b"x") is not None  # default W follows reachable nodes (1)


def test_w_succeeds_when_nodes_died_but_are_not_yet_detected(make_cluster):
    cluster = make_cluster(5)
    cluster[3].kill()
    cluster[4].kill()  # still "alive" in everyone's view for several seconds
    start = time.monotonic()
    with cluster[0].client() as client:
        jobs = [client.add_job("w", b"%d" % i, replicate=3, timeout=5) for i in range(5)]
    assert time.monotonic() - start < 5
    for job in jobs:
        holders = cluster.holders(job)
        assert len(holders) == 3 and "n4" not in holders and "n5" not in holders


def test_timeout_withdraws_the_job_and_partial_copies(make_cluster):
    cluster = make_cluster(3)
    cluster[1].kill()
    cluster[2].kill()
    with cluster[0].client() as client:
        with pytest.raises(pgq.errors.NoReplError) as info:
            client.add_job("t", b"x", replicate=3, timeout=0.5)
        job = info.value.removed[0]
        assert client.show(job) is None and client.qlen("t") == 0


def test_replication_completes_when_a_dead_target_comes_back(make_cluster):
    cluster = make_cluster(2)
    cluster[1].kill()
    result = {}

    def add():
        with cluster[0].client() as client:
            start = time.monotonic()
            result["id"] = client.add_job("back", b"x", replicate=2, timeout=20)
            result["took"] = time.monotonic() - start

    thread = threading.Thread(target=add)
    thread.start()
    time.sleep(2)
    cluster[1].start()
    thread.join(30)
    assert "id" in result, "add_job did not return"
    assert 1.5 < result["took"] < 20
    assert cluster.copies(result["id"]) == 2


def test_bulk_replicated_add(make_cluster):
    cluster = make_cluster(3)
    with cluster[0].client() as client:
        ids = client.add_jobs("bulk", [b"%d" % i for i in range(300)], replicate=2)
        assert client.qlen("bulk") == 300
    assert all(cluster.copies(i) == 2 for i in ids[::37])
