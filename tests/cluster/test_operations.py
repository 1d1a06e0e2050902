"""Operating a cluster: leaving (through the CLI), bad frames, CPU
starvation, and a client failing over when a node's PostgreSQL dies. Kills
of node processes and of their PostgreSQL under load are the chaos test's
(tests/chaos); the leaving protocol's story and the pause broadcast are
proven in the simulation (tests/cluster/test_scenarios.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from pgq.cluster.wire import HELLO_SIZE, Initiator

import pgq
from pgq import embedded

from .conftest import wait_until


def test_leaving_and_leave_through_the_cli(make_cluster):
    cluster = make_cluster(3)
    leaver = cluster[2]
    with leaver.client() as client:
        job = client.add_job("drain", b"x", replicate=1)
    run = [sys.executable, "-m", "pgq.cli", "cluster"]
    subprocess.run([*run, "leaving", "yes", "--dsn", leaver.dsn], check=True, capture_output=True)

    def others_see_it_leaving() -> bool:
        with cluster[0].client() as client:
            return {n["id"]: n["priority"] for n in client.hello()["nodes"]}[leaver.id()] == 100

    wait_until(others_see_it_leaving, 10, message="the leaving flag to spread")
    with cluster[0].client() as client:  # a consumer elsewhere drains it through federation
        got = client.get_job("drain", timeout=10)
        assert [j.id for j in got] == [job]
        client.ack_job(job)
    done = subprocess.run([*run, "leave", "--dsn", leaver.dsn, "--timeout", "30"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "safe to stop" in done.stdout


def _rejected(node) -> int:
    with node.client() as client:
        return int(client.info()["cluster"]["bus"]["rejected_total"])


def test_bad_or_unauthenticated_frames_change_nothing(make_cluster):
    cluster = make_cluster(2)
    target = cluster[1]
    before = target.sql("SELECT count(*) FROM pgq.jobs")[0][0], target.view()
    rejected_before = _rejected(target)
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
    # the bus counts a rejection once the connection closed on its side
    wait_until(lambda: _rejected(target) >= rejected_before + 3, 10,
               message="the bad connections to be rejected")
    assert target.alive
    assert (target.sql("SELECT count(*) FROM pgq.jobs")[0][0], target.view()) == before
    with cluster[0].client() as client:  # the bus still works for real members
        job = client.add_job("still", b"x", replicate=2)
    assert cluster.copies(job) == 2


@pytest.mark.slow
@pytest.mark.serial  # it saturates both cores: the tests beside it would pay
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
