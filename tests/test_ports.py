"""pgq.ports: ports for the servers pgq starts are never ones an outgoing
connection may take between the probe and the server's bind."""

from __future__ import annotations

import socket

import pytest

from pgq import ports


def test_a_free_port_is_outside_the_ephemeral_range_and_bindable():
    low, high = ports._ephemeral()
    for _ in range(50):
        port = ports.free_port("127.0.0.1")
        # bind(0) gave a port of the ephemeral range: a bench's client
        # connection took one as its source port before a node's bus bound
        # it ("Address already in use", a red CI)
        assert not low <= port <= high, (port, low, high)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports.free_port()))
        taken.listen()
        used = taken.getsockname()[1]
        # every candidate is that port: the probe must move on (to bind(0))
        monkeypatch.setattr(ports, "_candidates", lambda servers=False: range(used, used + 1))
        assert ports.free_port() != used


def test_embedded_servers_draw_from_a_pool_of_their_own():
    # A local cluster picks its bus ports, then starts its nodes' embedded
    # servers: one that drew a bus port not yet bound made that node fail.
    low, high = ports._ephemeral()
    if 65535 - high < 1000 or low - 10000 < 1000:
        pytest.skip("this machine's ephemeral range leaves room for one pool only")
    servers = {ports.free_port("127.0.0.1", servers=True) for _ in range(50)}
    others = {ports.free_port("127.0.0.1") for _ in range(50)}
    assert min(servers) > high and max(others) < low


def test_without_proc_servers_stay_below_the_assumed_range(monkeypatch):
    # macOS and the BSDs hand out 49152-65535 as ephemeral ports: a pool
    # "above 60999", assumed from Linux's defaults, lies inside theirs.
    monkeypatch.setattr(ports, "_read_ephemeral", lambda: None)
    for _ in range(20):
        assert ports.free_port("127.0.0.1", servers=True) < 32768
