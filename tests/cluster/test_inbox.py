"""The node's inbox (cluster/inbox.py): back-pressure that wakes every link
it held."""

from __future__ import annotations

import anyio
from pgq.cluster.inbox import Inbox


def test_every_link_waiting_for_room_is_read_again():
    """Two links wait for room in a full inbox. Each waiter once made an
    event of its own and the taker set only the last: the first link was
    never read again."""
    async def main() -> None:
        inbox: Inbox[str] = Inbox(1, 1 << 20, lambda _item: 1)
        await inbox.put("first")
        done: list[str] = []

        async def link(item: str) -> None:
            await inbox.put(item)
            done.append(item)

        taken: list[str] = []
        # 10 s: far more than this needs; a waiter never woken hangs for ever
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(link, "a")
                await anyio.wait_all_tasks_blocked()
                tasks.start_soon(link, "b")
                await anyio.wait_all_tasks_blocked()
                assert done == [] and inbox.full
                while len(taken) < 3:
                    taken += await inbox.take()
        assert sorted(taken) == ["a", "b", "first"] and sorted(done) == ["a", "b"]

    anyio.run(main)


def test_the_inbox_is_full_by_count_or_by_weight():
    async def main() -> None:
        inbox: Inbox[bytes] = Inbox(10, 100, len)
        await inbox.put(b"x" * 60)
        assert not inbox.full
        await inbox.put(b"y" * 60)  # room when it came: the bound is soft by one item
        assert inbox.full and len(inbox) == 2
        assert await inbox.take() == [b"x" * 60, b"y" * 60]
        assert not inbox.full and len(inbox) == 0

    anyio.run(main)


def test_messages_weigh_the_jobs_they_name():
    """A DELJOB of 100k IDs weighed what an empty message does (256 bytes):
    a full inbox could hold tens of GB of them."""
    from pgq.cluster import messages as m
    from pgq.cluster.node import _weight

    ids = tuple(f"D-{i:08x}-job" for i in range(100_000))
    assert _weight(("peer", m.DelJob(ids))) >= 100_000 * 100
    assert _weight(("peer", m.DelJob(ids[:1]))) < 1000
    # Their holder lists too (a read-only review): a SETACK of 990 jobs with
    # 990 holders each holds about 96 MB, and weighed 127 KB.
    nodes = tuple(f"{n:040x}" for n in range(990))
    assert _weight(("peer", m.SetAck(tuple((i, nodes) for i in ids[:990])))) >= 990 * 990 * 100
    assert _weight(("peer", m.Queued(ids[:990], "", (nodes,) * 990))) >= 990 * 990 * 100
    assert _weight(("peer", m.WillQueue(ids[:990], (nodes,) * 990))) >= 990 * 990 * 100
