"""ACK across real node processes: an ACK reaches every holder and the job
and its tombstones are collected. The garbage collection's stories (a
holder or the origin down, every holder down, the take-over, FASTACK, a
dummy ACK) are proven in the simulation: tests/cluster/test_scenarios.py."""

from __future__ import annotations

from .conftest import wait_until


def test_ack_on_a_holder_reaches_every_holder_and_is_collected(make_cluster):
    cluster = make_cluster(3)
    with cluster[0].client() as client:
        job = client.add_job("a", b"x", replicate=3)
        assert client.get_job("a")[0].id == job
        assert client.ack_job(job) == 1
    # The origin made the ID: it keeps a tombstone with no holders left to
    # collect from for a minute, for a client that runs the add again after
    # a lost connection (cluster.sql APPLY_DELJOB, RETRY_WINDOW).
    wait_until(lambda: cluster.holders(job) == {"n1": "acked"} and cluster[0].sql(
        "SELECT nodes IS NULL FROM pgq.acks WHERE id = %s", (job,)) == [(True,)], 10,
               message="the job and its acks to be collected")
