"""Operating a cluster: leaving, pause broadcast, bad frames, CPU starvation,
and crashes of node processes and of their PostgreSQL."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest

import pgq
from pgq import embedded
from pgq.cluster.wire import HELLO_SIZE, Initiator

from .conftest import wait_until


def test_leaving_node_drains_and_refuses_to_block(make_cluster):
    cluster = make_cluster(3)
    leaver = cluster[2]
    with leaver.client() as client:
        held = client.add_jobs("drain", [b"%d" % i for i in range(10)], replicate=1)
    run = [sys.executable, "-m", "pgq.cli", "cluster"]
    subprocess.run([*run, "leaving", "yes", "--dsn", leaver.dsn], check=True, capture_output=True)

    def others_see_it_leaving() -> bool:
        with cluster[0].client() as client:
            return {n["id"]: n["priority"] for n in client.hello()["nodes"]}[leaver.id()] == 100

    wait_until(others_see_it_leaving, 10, message="the leaving flag to spread")
    with leaver.client() as client:
        time.sleep(1.1)  # client's cluster view refreshes every second
        with pytest.raises(pgq.errors.LeavingError):
            client.get_job("nothing-here", timeout=1)  # it would block: refused
        assert client.get_job("nothing-here", nohang=True) == []  # nohang never blocks
        new = client.add_job("ext", b"x")  # kept elsewhere, on W other nodes
    # One read: the leaver drops its handed-over copy within a second, so a
    # second read (cluster.copies) could disagree with this one.
    holders = cluster.holders(new)
    elsewhere = [node for node, state in holders.items() if node != "n3" and state != "acked"]
    assert holders.get("n3") in (None, "active") and len(elsewhere) == 2, holders
    with cluster[0].client() as client:  # nobody gets new copies onto the leaving node
        with pytest.raises(pgq.errors.NoReplError):
            client.add_job("x", b"x", replicate=3)
    with cluster[0].client() as client:  # consumers elsewhere drain it through federation
        got = []
        while len(got) < 10:
            jobs = client.get_job("drain", count=10, timeout=5)
            assert jobs, "federation stalled"
            got += jobs
            client.ack_job(*(j.id for j in jobs))
    assert sorted(j.id for j in got) == sorted(held)
    with cluster[1].client() as client:
        client.ack_job(new)
    done = subprocess.run([*run, "leave", "--dsn", leaver.dsn, "--timeout", "30"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "safe to stop" in done.stdout


def test_pause_bcast_reaches_every_node(make_cluster):
    cluster = make_cluster(3)
    with cluster[0].client() as client:
        assert client.pause("pb", "in", "bcast") == "in"
    for node in cluster.nodes[1:]:
        wait_until(lambda n=node: n.client().pause("pb", "state") == "in", 5)
        with node.client() as client, pytest.raises(pgq.errors.PausedError):
            client.add_job("pb", b"x")


def test_bad_or_unauthenticated_frames_change_nothing(make_cluster):
    cluster = make_cluster(2)
    target = cluster[1]
    before = target.sql("SELECT count(*) FROM pgq.jobs")[0][0], target.view()
    host, port = target.bus.split(":")
    payloads = [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\x00" * HELLO_SIZE + b"\xff" * 500,
        Initiator(b"k" * 32, "ab" * 20).hello() + b"\x00" * 32,  # a proof without the secret
        bytes(range(256)) * 40,
    ]
    for payload in payloads:
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(payload)
            sock.settimeout(2)
            try:
                while sock.recv(4096):
                    pass
            except OSError:
                pass
    time.sleep(1.5)
    assert target.alive
    assert (target.sql("SELECT count(*) FROM pgq.jobs")[0][0], target.view()) == before
    with target.client() as client:
        stats = client.info()["cluster"]["bus"]
    assert stats["rejected_total"] >= 3
    with cluster[0].client() as client:  # the bus still works for real members
        job = client.add_job("still", b"x", replicate=2)
    assert cluster.copies(job) == 2


@pytest.mark.slow
def test_no_false_failure_while_both_cores_are_saturated(make_cluster):
    cluster = make_cluster(3)
    ids = cluster.ids()
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(6)]
    try:
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline:
            for node in cluster:
                view = node.view()
                assert "dead" not in view.values(), (node.name, view)
            time.sleep(0.5)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert all(set(n.view().values()) == {"alive"} for n in cluster), [n.view() for n in cluster]
    assert len(ids) == 3


@pytest.mark.slow
def test_kill_9_of_a_node_process_loses_no_replicated_job(make_cluster):
    cluster = make_cluster(3)
    with cluster[0].client() as client:
        jobs = client.add_jobs("crash", [b"%d" % i for i in range(30)], replicate=2, retry=1)
    cluster[0].kill(signal.SIGKILL)
    # n1's database still serves its queued copies; the other holders' timers
    # re-queue theirs. Consume everything on the survivors and on n1's database.
    seen: set[str] = set()
    deadline = time.monotonic() + 40
    while seen != set(jobs) and time.monotonic() < deadline:
        for node in cluster:
            with node.client() as client:
                for job in client.get_job("crash", count=50, nohang=True):
                    seen.add(job.id)
                    client.ack_job(job.id)
        time.sleep(0.3)
    assert seen == set(jobs)
    cluster[0].start()  # rejoins, resumes its timers and acks from its database
    wait_until(lambda: all(cluster.copies(j) == 0 for j in jobs), 40,
               message="every copy to be acked away")


@pytest.mark.slow
def test_kill_of_a_nodes_postgresql_loses_no_replicated_job(make_cluster):
    cluster = make_cluster(3)
    with cluster[1].client() as client:
        jobs = client.add_jobs("pgcrash", [b"%d" % i for i in range(20)], replicate=2, retry=1)
    embedded.stop(cluster[1].server.home, mode="immediate")  # like kill -9 of PostgreSQL
    time.sleep(2)
    embedded.ensure_running(cluster[1].server.home)
    seen: set[str] = set()
    deadline = time.monotonic() + 40
    while seen != set(jobs) and time.monotonic() < deadline:
        for node in cluster:
            with node.client() as client:
                for job in client.get_job("pgcrash", count=50, nohang=True):
                    seen.add(job.id)
                    client.ack_job(job.id)
        time.sleep(0.3)
    assert seen == set(jobs)
    assert cluster[1].alive  # the node process rode out its database's crash
    wait_until(lambda: all(cluster.copies(j) == 0 for j in jobs), 40,
               message="every copy to be acked away")


def test_client_with_several_dsns_fails_over(make_cluster):
    cluster = make_cluster(2)
    client = pgq.Client([cluster[0].dsn, cluster[1].dsn], reconnect_timeout=20)
    try:
        assert client.node_id == cluster[0].id()
        job = client.add_job("fo", b"x", replicate=2, retry=1)
        embedded.stop(cluster[0].server.home, mode="immediate")
        try:
            start = time.monotonic()
            got = client.get_job("fo", timeout=10)  # served by the second node
            assert [j.id for j in got] == [job]
            assert client.node_id == cluster[1].id() and client.dsn == cluster[1].dsn
            assert time.monotonic() - start < 15
        finally:
            embedded.ensure_running(cluster[0].server.home)
    finally:
        client.close()
