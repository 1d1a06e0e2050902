"""Membership with real node processes: discovery, failure detection, recovery."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from .conftest import wait_until


def test_distinct_ids_and_full_mesh_from_one_meet(make_cluster):
    cluster = make_cluster(4, mesh=False)  # n2..n4 were only told about n1
    cluster.wait_mesh(timeout=20)
    ids = cluster.ids()
    assert len(set(ids.values())) == 4
    assert all(len(i) == 40 and int(i, 16) >= 0 for i in ids.values())
    for node in cluster:
        assert set(node.view()) == set(ids.values()) - {ids[node.name]}
    with cluster[2].client() as client:
        hello = client.hello()
    assert hello["id"] == ids["n3"]
    assert {n["id"] for n in hello["nodes"]} == set(ids.values())
    assert {n["priority"] for n in hello["nodes"]} == {1}


@pytest.mark.slow
def test_two_killed_nodes_of_five_are_detected_and_rejoin(make_cluster):
    cluster = make_cluster(5)
    ids = cluster.ids()
    killed = [cluster[3], cluster[4]]
    start = time.monotonic()
    for node in killed:
        node.kill()
    survivors = cluster.nodes[:3]

    def detected() -> bool:
        return all(s.view()[ids[k.name]] == "dead" for s in survivors for k in killed)

    from pgq.cluster.membership import Config

    config = Config()  # the node processes' own
    # The protocol's own worst case: a probe round stretched by the local
    # health multiplier, then a suspicion stretched to suspicion_max while
    # confirmations are slow to arrive (a loaded 2-core machine running the
    # whole suite: 12.4 s seen once; typically 6-8 s).
    bound = config.probe_interval * (config.max_health + 1) + config.suspicion_max + 3
    wait_until(detected, bound + 5, 0.2, "the killed nodes to be declared dead")
    detection = time.monotonic() - start
    assert detection <= bound, detection
    assert all(s.view()[ids[o.name]] == "alive" for s in survivors for o in survivors if o is not s)
    with survivors[0].client() as client:
        priorities = {n["id"]: n["priority"] for n in client.hello()["nodes"]}
    assert priorities[ids["n4"]] == 100 and priorities[ids["n1"]] == 1
    for node in killed:
        node.start()
    cluster.wait_mesh(timeout=30)
    assert cluster.ids() == ids  # same data, same identity


def test_cli_reports_node_status_and_cluster_nodes(make_cluster):
    cluster = make_cluster(2)
    node = cluster[1]
    run = [sys.executable, "-m", "pgq.cli"]
    status = json.loads(subprocess.run([*run, "node", "status", "--dsn", node.dsn, "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    assert status["id"] == node.id() and status["bus"] == node.bus and status["active"] is True
    nodes = json.loads(subprocess.run([*run, "cluster", "nodes", "--dsn", node.dsn, "--json"],
                                      capture_output=True, text=True, check=True).stdout)
    assert [n["myself"] for n in nodes] == [True, False]
    assert {n["id"] for n in nodes} == set(cluster.ids().values())


def test_forget_removes_a_node(make_cluster):
    cluster = make_cluster(3)
    gone = cluster[2]
    gone_id = gone.id()
    gone.kill()
    itself = subprocess.run([sys.executable, "-m", "pgq.cli", "cluster", "forget", cluster[0].id(),
                             "--dsn", cluster[0].dsn], capture_output=True, text=True)
    assert itself.returncode == 1 and "is this node" in itself.stderr, itself.stderr
    subprocess.run([sys.executable, "-m", "pgq.cli", "cluster", "forget", gone_id,
                    "--dsn", cluster[0].dsn], check=True, capture_output=True)
    wait_until(lambda: all(gone_id not in n.view() for n in cluster.nodes[:2]), 10,
               message="the node to be forgotten everywhere")
