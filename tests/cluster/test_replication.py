"""Synchronous and asynchronous replication to W node databases, through
real node processes. The stories with failures (W copies while nodes died
undetected, a timeout withdrawing the job, a target coming back, NOREPL
following what the node sees) are proven in the simulation:
tests/cluster/test_scenarios.py."""

from __future__ import annotations

import signal
import threading
import time

import psycopg
import pytest

import pgq
from pgq import commands


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


def test_concurrent_replicated_adds_share_batches_and_each_gets_its_copies(make_cluster,
                                                                          monkeypatch):
    cluster = make_cluster(3)
    sizes: list[int] = []
    batch = commands.add_replicated_batch

    def recorded(session, calls):
        sizes.append(len(calls))
        return (yield from batch(session, calls))

    monkeypatch.setattr(commands, "add_replicated_batch", recorded)
    results: dict[int, list[str]] = {}
    # Through the node process, which the test stops (a client writing its
    # copies itself does not wait for it).
    with cluster[0].client(pool_size=20, direct_copies=False) as client:
        replicated = client._combiners().replicated
        origin = cluster[0].process
        # While n1's node process is stopped, the batches in flight wait
        # for copies and the next callers gather: a shared batch for sure.
        origin.send_signal(signal.SIGSTOP)
        try:
            threads = [threading.Thread(target=lambda i=i: results.__setitem__(
                i, client.add_jobs("rb", [b"%d" % i, b"%d'" % i], replicate=3)))
                for i in range(16)]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 2.5  # under NODE_STUCK_AFTER (3 s): no withdrawal
            while len(replicated._queue.waiting) < 8 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert len(replicated._queue.waiting) >= 8, "callers did not gather behind the batches"
        finally:
            origin.send_signal(signal.SIGCONT)
        for thread in threads:
            thread.join(30)
    assert sorted(results) == list(range(16)) and max(sizes) >= 8 and sum(sizes) == 16
    jobs = [job for ids in results.values() for job in ids]
    assert len(set(jobs)) == 32
    assert all(cluster.copies(job) == 3 for job in jobs)


def test_replicate_async_copies_arrive_in_the_background(make_cluster):
    cluster = make_cluster(3)
    with cluster[1].client() as client:
        job = client.add_job("ra", b"x", replicate=3, asynchronous=True)
        # Queued at once. (Read, not claimed: a NOHANG claim skips a row the
        # node process holds locked for the moment it records a copy.)
        assert cluster[1].sql("SELECT state FROM pgq.jobs WHERE id = %s", (job,)) == [("queued",)]
        assert client.get_job("ra", timeout=5)[0].id == job
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
        # The node drains its outbox in commit order: once a job committed
        # after the rollback has its copies, the rolled-back one had its chance.
        later = client.add_job("rt", b"z", replicate=2)
    assert cluster.copies(later) == 2 and cluster.copies(rolled) == 0


def test_norepl_when_w_exceeds_reachable_nodes(make_cluster):
    cluster = make_cluster(2)
    with cluster[0].client() as client:
        with pytest.raises(pgq.errors.NoReplError, match="2 can take a copy"):
            client.add_job("n", b"x", replicate=3)
        assert client.qlen("n") == 0


def test_priority_and_key_travel_with_the_copies(make_cluster):
    # A replicated job's copies carry its priority and idempotency key: an
    # add with the same key through another node holding a copy answers the
    # first job's ID, and a copy queued there keeps its place in line.
    cluster = make_cluster(3)
    with cluster[0].client() as client:
        job = client.add_job("rk", b"charge", replicate=3, key="charge-7", priority=4)
    assert cluster.copies(job) == 3
    with cluster[1].client() as other:
        assert other.add_job("rk", b"charge (retried)", key="charge-7") == job
        info = other.show(job)
        assert info["priority"] == 4 and info["key"] == "charge-7"
    with cluster[0].client() as client:
        assert client.qlen("rk") == 1
