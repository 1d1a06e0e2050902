"""Re-queue through real node processes: a holder re-queues a job whose
queueing node was killed. The protocol's stories (one queued copy, the
timers' race, WORKING, counters, at-most-once, TTL) are proven in the
simulation: tests/cluster/test_scenarios.py."""

from __future__ import annotations

from pgq.cluster.core import batched_notices

from .conftest import wait_until


def test_requeue_after_retry_when_the_queueing_node_is_killed(make_cluster):
    cluster = make_cluster(3)
    with cluster[0].client() as client:
        job = client.add_job("rq", b"x", replicate=3, retry=1)
    cluster[0].kill()
    survivors = cluster.nodes[1:]
    queued = wait_until(lambda: [n for n in survivors if cluster.holders(job).get(n.name) == "queued"],
                        10, message="another holder to queue the job")
    with queued[0].client() as client:
        got = client.get_job("rq", timeout=2, withcounters=True)
    assert got[0].id == job and got[0].additional_deliveries == 1


def test_two_nacks_drained_together_count_twice_on_every_peer():
    # Two NACKs of one job often leave the outbox in the same drain. Batched
    # into one QUEUED message naming the job twice, the peer's single UPDATE
    # counted one nack (a flaky counter test found it): a repeated job now
    # starts a new message, after everything pending for that peer.
    events = [("p1", "queued", "nacks", "A"), ("p2", "queued", "nacks", "A"),
              ("p1", "working", "", "B"), ("p1", "queued", "nacks", "C"),
              ("p1", "queued", "nacks", "A"), ("p2", "queued", "nacks", "A")]
    assert batched_notices(events) == [
        ("p1", "queued", "nacks", ("A", "C")), ("p1", "working", "", ("B",)),
        ("p2", "queued", "nacks", ("A",)),
        ("p1", "queued", "nacks", ("A",)), ("p2", "queued", "nacks", ("A",)),
    ]
    many = [("p", "working", "", f"j{i}") for i in range(4500)]
    assert [len(ids) for *_, ids in batched_notices(many)] == [2000, 2000, 500]
