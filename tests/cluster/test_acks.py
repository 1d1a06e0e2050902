"""ACK, FASTACK and DELJOB across nodes: every holder learns, garbage is collected."""

from __future__ import annotations

import pytest

from pgq.ids import new_job_id

from .conftest import wait_until


def no_trace(cluster, job_id):
    return lambda: cluster.holders(job_id) == {}


def test_ack_on_a_holder_reaches_every_holder_and_is_collected(make_cluster):
    cluster = make_cluster(3)
    with cluster[0].client() as client:
        job = client.add_job("a", b"x", replicate=3)
        assert client.get_job("a")[0].id == job
        assert client.ack_job(job) == 1
    wait_until(no_trace(cluster, job), 10, message="the job and its acks to be collected")


def test_ack_on_a_node_that_never_held_the_job(make_cluster):
    cluster = make_cluster(3)
    with cluster[0].client() as client:
        job = client.add_job("a", b"x", replicate=2)
    outsider = next(n for n in cluster if n.name not in cluster.holders(job))
    with outsider.client() as client:
        assert client.ack_job(job) == 0  # unknown here: a dummy ack, sent to everyone
    wait_until(no_trace(cluster, job), 10, message="the job to be acked everywhere")


def test_ack_with_the_origin_killed(make_cluster):
    cluster = make_cluster(3)
    with cluster[0].client() as client:
        job = client.add_job("a", b"x", replicate=3)
    cluster[0].kill()
    with cluster[1].client() as client:
        assert client.ack_job(job) == 1
    wait_until(lambda: cluster.copies(job) == 1, 10, message="the live copies to go")
    assert cluster.holders(job)["n1"] == "queued"  # the dead origin still has it...
    cluster[0].start()  # ...until it comes back: the ack was kept for it
    wait_until(no_trace(cluster, job), 30, message="the origin to learn the ack")


@pytest.mark.slow
def test_ack_with_all_holders_killed_then_restarted(make_cluster):
    cluster = make_cluster(4)
    with cluster[0].client() as client:
        job = client.add_job("a", b"x", replicate=2)
    holders = [n for n in cluster if n.name in cluster.holders(job)]
    acker = next(n for n in cluster if n.name not in cluster.holders(job))
    for node in holders:
        node.kill()
    with acker.client() as client:
        assert client.ack_job(job) == 0  # nobody alive knows it: a dummy ack
    for node in holders:
        node.start()
    wait_until(no_trace(cluster, job), 40, message="eventually no copy anywhere")


def test_fast_ack_from_a_holder_and_a_non_holder(make_cluster):
    cluster = make_cluster(3)
    with cluster[0].client() as client:
        one = client.add_job("f", b"x", replicate=3)
        two = client.add_job("f", b"y", replicate=2)
        assert client.fast_ack(one) == 1
    wait_until(no_trace(cluster, one), 10, message="fast-acked copies to go")
    outsider = next(n for n in cluster if n.name not in cluster.holders(two))
    with outsider.client() as client:
        assert client.fast_ack(two) == 0
    wait_until(no_trace(cluster, two), 10, message="copies of an unknown id to go")


def test_dummy_ack_of_a_never_seen_id_is_collected(make_cluster):
    cluster = make_cluster(3)
    ghost = new_job_id(cluster[0].id(), 600, 5)
    with cluster[0].client() as client:
        assert client.ack_job(ghost) == 0
    wait_until(no_trace(cluster, ghost), 10, message="the dummy ack to be dropped")
