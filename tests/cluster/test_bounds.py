"""Bounds of what a node holds for its peers (issue 10, part 3), on their
own: replicated batches are cut by count and bytes, and a peer's outbound
queue drops its oldest messages rather than grow without end."""

from __future__ import annotations

from pgq.cluster import messages as m
from pgq.cluster.bus import BusLimits, _Link
from pgq.cluster.core import BATCH_BYTES, REPLJOB_BATCH, by_size


def copy(n: int, size: int) -> m.JobCopy:
    return m.JobCopy(id=f"D-{n:08d}", queue="q", body=b"x" * size, ctime=n, repl=2, retry=5.0,
                     delay=0.0, expires_at=2e9, nodes=("a", "b"))


def test_replicated_jobs_are_cut_by_count_and_by_bytes():
    many = [copy(i, 10) for i in range(REPLJOB_BATCH * 2 + 1)]
    assert [len(b) for b in by_size(many)] == [REPLJOB_BATCH, REPLJOB_BATCH, 1]
    big = [copy(i, BATCH_BYTES // 3 + 1) for i in range(5)]
    batches = by_size(big)
    assert [len(b) for b in batches] == [2, 2, 1]
    assert all(sum(len(c.body) for c in b) <= BATCH_BYTES for b in batches)
    huge = [copy(0, 1), copy(1, BATCH_BYTES * 2), copy(2, 1)]
    assert [len(b) for b in by_size(huge)] == [1, 1, 1]  # a bigger job travels alone
    assert [c.id for b in by_size(many) for c in b] == [c.id for c in many]  # order kept


def test_a_peers_queue_drops_its_oldest_messages_beyond_its_bounds():
    limits = BusLimits(queue_messages=3, queue_bytes=100)
    link = _Link()
    dropped = sum(link.push(b"%d" % i, "PING", limits) for i in range(5))
    assert dropped == 2 and [p for p, _ in link.queue] == [b"2", b"3", b"4"]
    assert link.push(b"y" * 90, "REPLJOB", limits) == 1  # 4 messages: the oldest goes
    # [4, y*90, w*20] would be 111 bytes and [y*90, w*20] 110: both over 100
    assert link.push(b"w" * 20, "REPLJOB", limits) == 3
    assert [p for p, _ in link.queue] == [b"w" * 20] and link.bytes == 20
    assert link.push(b"z" * 500, "REPLJOB", limits) == 1  # the newest always stays
    assert [p for p, _ in link.take()] == [b"z" * 500] and link.bytes == 0
