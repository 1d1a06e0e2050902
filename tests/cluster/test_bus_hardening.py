"""The bus against hostile or broken input, on real node processes: nothing
a peer sends (authenticated or not) stops a node, is stored when invalid, or
lets an unauthenticated connection linger."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import msgpack
import pytest
from pgq.cluster.secret import stretch
from pgq.cluster.wire import ACCEPT_SIZE, CHALLENGE_SIZE, FrameWriter, Initiator

from .conftest import wait_until

EVIL = "e" * 40  # the id our fake peer claims


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def authenticated(node, claim: str = EVIL) -> tuple[socket.socket, FrameWriter]:
    """A connection to ``node``'s bus that completed the handshake with the
    cluster secret (what a member, or a thief of the secret, can do)."""
    host, port = node.bus.split(":")
    key = stretch(node.secret_file.read_bytes().strip())
    sock = socket.create_connection((host, int(port)), timeout=5)
    initiator = Initiator(key, claim)
    sock.sendall(initiator.hello())
    sock.sendall(initiator.answer(recv_exactly(sock, CHALLENGE_SIZE)))
    initiator.accepted(recv_exactly(sock, ACCEPT_SIZE))
    return sock, FrameWriter(initiator.frame_key)


def closed_by_peer(sock: socket.socket, timeout: float = 10) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except (ConnectionError, OSError):
        pass
    return True


def rejected(node) -> int:
    with node.client() as client:
        return int(client.info()["cluster"]["bus"]["rejected_total"])


def test_records_a_node_cannot_use_are_dropped_and_never_stop_it(make_cluster):
    cluster = make_cluster(2)
    target = cluster[1]
    members = target.sql("SELECT id, host, incarnation FROM pgq.nodes ORDER BY id")
    bad_records = [
        [EVIL, "\u200d", 7000, 0, "alive", False, "x"],     # IDNA rejects it
        [EVIL, "\u00e9" * 64, 7000, 0, "alive", False, "x"],
        [cluster.ids()["n1"], "127.0.0.2", 7000, 2**63 - 1, "alive", False, "x"],  # overflow
    ]
    before = rejected(target)
    for record in bad_records:
        sock, writer = authenticated(target)
        with sock:
            payload = msgpack.packb({"k": "pushpull", "m": [record], "r": True}, use_bin_type=True)
            sock.sendall(writer.frame(payload))
            assert closed_by_peer(sock)
    wait_until(lambda: rejected(target) >= before + len(bad_records), 10,
               message="the bad records to be counted")
    assert target.alive
    assert target.sql("SELECT id, host, incarnation FROM pgq.nodes ORDER BY id") == members
    # the same through the command line and the outbox
    meet = subprocess.run([sys.executable, "-m", "pgq.cli", "cluster", "meet", "\u200d:7000",
                           "--dsn", target.dsn], capture_output=True, text=True)
    assert meet.returncode == 2 and "not a host" in meet.stderr  # bad usage
    target.sql("INSERT INTO pgq.outbox (kind, arg) VALUES ('meet', %s)", ("\u200d:7000",))
    target.sql("SELECT pg_notify('pgq_node', '')")
    with cluster[0].client() as client:  # the cluster still replicates through it
        job = client.add_job("still", b"x", replicate=2)
    assert cluster.copies(job) == 2 and target.alive


def test_a_peer_may_not_claim_the_acceptors_id_or_a_connected_one(make_cluster):
    cluster = make_cluster(2)
    target = cluster[1]
    with pytest.raises(Exception):  # noqa: B017 - the handshake fails one way or another
        authenticated(target, claim=cluster.ids()["n2"])
    # n1 talks to n2 all the time: a second connection claiming n1 is refused
    with pytest.raises(ConnectionError):
        authenticated(target, claim=cluster.ids()["n1"])
    assert target.alive


def test_huge_frames_and_idle_handshakes_are_cut_off(make_cluster):
    cluster = make_cluster(2)
    target = cluster[1]
    host, port = target.bus.split(":")
    sock, _writer = authenticated(target)
    with sock:  # announces a 1 GiB frame: refused before anything is buffered
        sock.sendall((2**30).to_bytes(4, "big") + b"x" * 100)
        assert closed_by_peer(sock)
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(80)]
    try:
        # Beyond 64 unauthenticated connections the node closes new ones at
        # once; the others are closed when the 5 s handshake timeout passes.
        started = time.monotonic()
        for sock in idle:
            assert closed_by_peer(sock, timeout=15)
        assert time.monotonic() - started < 12
    finally:
        for sock in idle:
            sock.close()
    assert target.alive
    with cluster[0].client() as client:
        job = client.add_job("after", b"x", replicate=2)
    assert cluster.copies(job) == 2
