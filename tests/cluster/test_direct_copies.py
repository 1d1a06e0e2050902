"""Direct copies through real node processes: nodes advertise their
databases over the bus (ADVERT, ``--advertise-dsn``), and a client's
synchronous replicated add writes its copies there itself. The protocol's
stories (a peer unreachable or refusing, a client dying between its copies
and its own commit) are proven in the simulation: test_scenarios.py."""

from __future__ import annotations

import signal
import time

from .conftest import wait_until


def advertised(node) -> dict[str, str | None]:
    """peer id -> the DSN this node's database knows for it."""
    return dict(node.sql("SELECT id, dsn FROM pgq.nodes"))


def test_a_client_writes_its_copies_into_the_databases_its_peers_advertised(make_cluster):
    cluster = make_cluster(3, node_args={2: ["--advertise-dsn", "none"]})
    ids = cluster.ids()
    wait_until(lambda: advertised(cluster[0]) == {ids["n2"]: cluster[1].dsn, ids["n3"]: None},
               15, message="n1 to learn n2's DSN, and that n3 advertises none")
    with cluster[0].client() as client:
        pairs = [client.add_job("dc", b"%d" % i, replicate=2) for i in range(10)]
        # n3 advertised nothing: W=3 needs it, so the node processes copy.
        triple = client.add_job("dc", b"three", replicate=3)
    # Only n2's database was written directly: every W=2 job is there (the
    # node process would have drawn n2 or n3 at random for each).
    assert [cluster.holders(job) for job in pairs] == [{"n1": "queued", "n2": "active"}] * 10
    assert cluster.holders(triple) == {"n1": "queued", "n2": "active", "n3": "active"}
    assert cluster[0].sql("SELECT count(*) FROM pgq.outbox") == [(0,)]


def test_an_add_that_writes_its_copies_needs_no_node_process(make_cluster):
    cluster = make_cluster(3)
    ids = cluster.ids()
    wait_until(lambda: set(advertised(cluster[0])) == {ids["n2"], ids["n3"]}
               and None not in advertised(cluster[0]).values(), 15,
               message="n1 to learn its peers' DSNs")
    with cluster[0].client() as client:
        client.add_job("np", b"warm", replicate=3)
        cluster[0].process.send_signal(signal.SIGSTOP)  # its database still answers
        try:
            started = time.monotonic()
            job = client.add_job("np", b"x", replicate=3, timeout=10)
            # Within a few direct writes, not the replication timeout (10 s):
            # the stopped process was never asked for anything. (Bound 5 s:
            # room for a loaded machine.)
            assert time.monotonic() - started < 5
            assert cluster.holders(job) == {"n1": "queued", "n2": "active", "n3": "active"}
            got = client.get_job("np", count=10, nohang=True)
            assert job in [j.id for j in got] and client.ack_job(*[j.id for j in got]) == len(got)
        finally:
            cluster[0].process.send_signal(signal.SIGCONT)
    # The ACK, written to n1's outbox, reaches the copies once its process runs.
    wait_until(lambda: cluster.copies(job) == 0, 30, message="the ACK to reach every copy")


def test_jobs_added_with_direct_copies_are_claimable_at_once(make_cluster):
    """A batch of queued copies is armed (its re-queue watch, schema 0009) by
    the insert itself: armed later by the node's TIMERS statement, the rows
    were locked meanwhile and a claim skipped them all (SKIP LOCKED), so a
    consumer found the queue empty with 2,000 jobs in it, 4 times in 6."""
    cluster = make_cluster(3)
    ids = cluster.ids()
    wait_until(lambda: None not in advertised(cluster[0]).values()
               and set(advertised(cluster[0])) == {ids["n2"], ids["n3"]}, 15,
               message="n1 to learn its peers' DSNs")
    with cluster[0].client() as client:
        for round_no in range(3):
            queue = f"now{round_no}"
            for _ in range(2):
                client.add_jobs(queue, [b"x"] * 1000, replicate=3)
            for got in range(2000):
                jobs = client.get_job(queue, nohang=True)
                assert jobs, f"the queue looked empty after {got} of 2000 jobs"
                client.ack_job(jobs[0].id)
