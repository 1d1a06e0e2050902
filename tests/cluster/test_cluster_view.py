"""One view of the cluster (issue 10, part 2), on real node processes:
what HELLO shows is what an add checks; a leaving node keeps no new copy
from the moment the flag is set; QSCAN IMPORTRATE; adds with the default
replicate stay available while one node is down but not yet declared dead,
or while the client's own node process is down."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

import pgq

from .conftest import wait_until


def test_an_add_decides_on_what_hello_shows(make_cluster):
    cluster = make_cluster(3)
    with cluster[0].client() as client:
        assert [n["priority"] for n in client.hello()["nodes"]] == [1, 1, 1]
        # The view cached a moment ago said 2 nodes could take a copy (a
        # node that just came back, say): the add re-reads before refusing.
        client._cluster.reachable = 2
        client._cluster.fetched_at = time.monotonic()
        job = client.add_job("agree", b"x", replicate=3)
    assert cluster.copies(job) == 3


def test_a_leaving_node_keeps_no_new_copy_whatever_a_client_cached(make_cluster):
    cluster = make_cluster(3)
    leaver = cluster[2]
    with leaver.client() as client:
        assert client.add_job("warm", b"x") is not None  # the client's view: not leaving
        subprocess.run([sys.executable, "-m", "pgq.cli", "cluster", "leaving", "yes",
                        "--dsn", leaver.dsn], check=True, capture_output=True)
        # at once, with a cached view that still says "not leaving"
        sync = client.add_job("after", b"sync")
        single = client.add_job("after", b"one", replicate=1)
        background = client.add_job("after", b"async", asynchronous=True)
        with pgq.Client(leaver.dsn) as other, __import__("psycopg").connect(leaver.dsn) as conn:
            in_tx = other.add_job("after", b"tx", conn=conn)
            conn.commit()
    jobs = [sync, single, background, in_tx]
    for job in jobs:
        # never deliverable on the leaver: at most a hand-over receipt there
        assert leaver.sql("SELECT state FROM pgq.jobs WHERE id = %s AND state IN "
                          "('queued', 'active') AND %s = ANY (nodes_delivered)",
                          (job, leaver.id())) == []
    for job in jobs:
        wait_until(lambda job=job: cluster.copies(job) >= 1 and "n3" not in cluster.holders(job),
                   20, message=f"{job} to live elsewhere only")
    with cluster[0].client() as client:
        got = []
        while len(got) < 4:
            batch = client.get_job("after", count=4, timeout=5)
            assert batch, "a job added on the leaving node was lost"
            got += batch
            client.ack_job(*(j.id for j in batch))
    assert sorted(j.body for j in got) == [b"async", b"one", b"sync", b"tx"]


def test_qscan_importrate_lists_the_queues_being_imported(make_cluster):
    cluster = make_cluster(2)
    with cluster[0].client() as origin:
        origin.add_jobs("imported", [b"%d" % i for i in range(2000)], replicate=1)
    with cluster[1].client() as importer:
        got = 0
        seen_listed = False
        deadline = time.monotonic() + 30
        while got < 2000 and time.monotonic() < deadline:
            jobs = importer.get_job("imported", count=20, timeout=2)
            importer.ack_job(*(j.id for j in jobs))
            got += len(jobs)
            if not seen_listed and "imported" in importer.qscan(importrate=1)[1]:
                seen_listed = True
                assert "imported" not in importer.qscan(importrate=10**9)[1]
        assert seen_listed, "QSCAN IMPORTRATE never listed the queue being imported"


def test_default_adds_go_on_while_a_node_is_down_but_not_declared_dead(make_cluster):
    """Through the node processes (the soft W's grace); a client writing its
    copies itself reaches the stopped node's database, which answers:
    test_direct_copies.py."""
    cluster = make_cluster(3)
    cluster[2].process.send_signal(signal.SIGSTOP)  # silent, yet alive in everyone's view for seconds
    try:
        with cluster[0].client(direct_copies=False) as client:
            jobs, took = [], []
            for i in range(5):
                started = time.monotonic()
                jobs.append(client.add_job("avail", b"%d" % i))
                took.append(time.monotonic() - started)
            # each waits out the 0.5 s grace for the silent node, not the 5 s
            # timeout (3 s: room for a loaded machine, short of the timeout;
            # the five together under 4.5 s left 0.4 s a round trip)
            assert max(took) < 3, took
            info = client.show(jobs[0])
            assert info["repl"] == 3 and len(info["nodes_confirmed"]) == 2
            # (later adds may see the node suspected already: W = 2 for them)
            wanted = {job: client.show(job)["repl"] for job in jobs}
            with pytest.raises(pgq.errors.NoReplError):  # an explicit W is strict
                client.add_job("avail", b"strict", replicate=3, timeout=1)
    finally:
        cluster[2].process.send_signal(signal.SIGCONT)
    # the missing copies follow once the node answers again
    wait_until(lambda: all(cluster.copies(j) == wanted[j] for j in jobs), 30,
               message="the third copies")


def test_a_client_adds_through_another_node_when_its_node_process_is_down(make_cluster):
    cluster = make_cluster(3)
    # (A client writing its copies itself needs no node process to add:
    # test_direct_copies.py.)
    with pgq.Client([cluster[0].dsn, cluster[1].dsn], direct_copies=False) as client:
        assert client.add_job("fo", b"warm") is not None
        cluster[0].process.send_signal(signal.SIGSTOP)  # its database still answers
        try:
            started = time.monotonic()
            job = client.add_job("fo", b"moved")
            # noticed by the outbox the process no longer drains (3 s), then added on n2
            assert time.monotonic() - started < 10
            assert client.node_id == cluster[1].id()
            assert cluster.copies(job) >= 2
        finally:
            cluster[0].process.send_signal(signal.SIGCONT)


def test_a_synchronous_add_stops_waiting_at_once_when_its_node_process_was_killed(make_cluster):
    cluster = make_cluster(3)
    node = cluster[0]
    with node.client(direct_copies=False) as client:
        assert client.add_job("gone", b"warm", replicate=2) is not None
        node.kill(signal.SIGKILL)  # its heartbeat still says "active" for 10 s
        started = time.monotonic()
        with pytest.raises(pgq.errors.NoReplError, match="is not running .or stopped draining") as info:
            client.add_job("gone", b"x", replicate=2, timeout=60)
        # The node lock is free at the first poll (50 ms); without it only
        # the outbox's age would tell, after NODE_STUCK_AFTER (3 s).
        assert time.monotonic() - started < pgq.commands.NODE_STUCK_AFTER
    assert info.value.node_down and len(info.value.removed) == 1 and not info.value.added
    assert node.sql("SELECT count(*) FROM pgq.jobs WHERE id = %s", info.value.removed) == [(0,)]


def test_a_cluster_node_without_its_process_refuses_adds_that_need_copies(make_cluster):
    cluster = make_cluster(2)
    node = cluster[0]
    node.stop()
    with node.client() as client:
        with pytest.raises(pgq.errors.NoReplError, match="not running") as info:
            client.add_job("alone", b"x")  # not quietly a single copy
        assert info.value.node_down
        assert client.add_job("alone", b"x", replicate=1) is not None  # asked for: fine
