"""Priority within a queue and idempotency keys (schema 0013), on one node.

Priority: higher first, FIFO within a priority, whatever the claim floors
did before; the claim stays LIMITed index scans (its plan is pinned in
test_stats_and_plans). Keys: an add with the key of a live job in the
queue adds nothing and answers that job's ID, also under concurrent adds;
the key is free again once the job is acknowledged. The cluster side (keys
through another node holding a copy) is in tests/cluster/test_replication.
"""

from __future__ import annotations

import threading

import anyio
import pytest

import pgq
from pgq.errors import InvalidArgumentError, InvalidTypeError


def test_higher_priority_first_fifo_within_a_priority(client):
    plain = client.add_jobs("p", [b"a", b"b"])
    urgent = client.add_jobs("p", [b"u1", b"u2"], priority=10)
    middle = client.add_job("p", b"m", priority=5)
    got = client.get_job("p", count=10)
    assert [j.id for j in got] == urgent + [middle] + plain


def test_count_one_at_a_time_follows_priority(client):
    ids = {name: client.add_job("p1", name.encode(), priority=prio)
           for name, prio in (("low", 0), ("high", 3), ("top", 9), ("low2", 0), ("high2", 3))}
    order = [client.get_job("p1", nohang=True)[0].id for _ in range(5)]
    assert order == [ids[n] for n in ("top", "high", "high2", "low", "low2")]


def test_a_job_added_after_the_floor_moved_still_jumps_the_queue(client):
    # Claims of priority-0 jobs move the queue's floor past them; a job of a
    # higher priority added later (a higher ctime, but first in line) must
    # still come before the older priority-0 jobs left.
    plain = client.add_jobs("pf", [b"%d" % i for i in range(20)])
    assert [j.id for j in client.get_job("pf", count=5)] == plain[:5]
    urgent = client.add_job("pf", b"urgent", priority=1)
    assert client.get_job("pf", nohang=True)[0].id == urgent
    assert [j.id for j in client.get_job("pf", count=100)] == plain[5:]


def test_queues_still_go_left_to_right_before_priority(client):
    low_queue = client.add_job("lq", b"x", priority=100)
    high_queue = client.add_job("hq", b"y")
    assert [j.id for j in client.get_job("hq", "lq", count=2)] == [high_queue, low_queue]


def test_a_nacked_job_keeps_its_priority(client):
    plain = client.add_job("pn", b"plain")
    urgent = client.add_job("pn", b"urgent", priority=2)
    assert client.get_job("pn", nohang=True)[0].id == urgent
    client.nack_job(urgent)
    assert client.get_job("pn", nohang=True)[0].id == urgent
    assert client.get_job("pn", nohang=True)[0].id == plain


def test_bulk_add_through_copy_carries_the_priority(client):
    plain = client.add_job("pc", b"first")
    many = client.add_jobs("pc", [b"%d" % i for i in range(2_000)], priority=4)  # COPY path
    got = client.get_job("pc", count=2_001)
    assert [j.id for j in got] == many + [plain]


def test_grouped_adds_of_concurrent_callers_keep_each_priority(client):
    # Concurrent add_job calls on one client go out as one statement (group
    # commit); each row keeps its own priority.
    ids: dict[int, str] = {}

    def add(prio):
        ids[prio] = client.add_job("pg", b"%d" % prio, priority=prio)

    threads = [threading.Thread(target=add, args=(p,)) for p in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    got = client.get_job("pg", count=8)
    assert [j.id for j in got] == [ids[p] for p in range(7, -1, -1)]


def test_qpeek_show_and_the_view_tell_the_priority(client, db):
    plain = client.add_job("pv", b"plain")
    urgent = client.add_job("pv", b"urgent", priority=7, key="order-1")
    assert [j.id for j in client.qpeek("pv", 10)] == [urgent, plain]
    assert [j.id for j in client.qpeek("pv", -10)] == [plain, urgent]
    info = client.show(urgent)
    assert info["priority"] == 7 and info["key"] == "order-1"
    assert client.show(plain)["priority"] == 0 and client.show(plain)["key"] is None
    row = db.execute("SELECT priority, key FROM pgq.live_jobs WHERE id = %s", (urgent,)).fetchone()
    assert row == (7, "order-1")


@pytest.mark.parametrize("bad, error", [
    (-1, InvalidArgumentError), (1_000_001, InvalidArgumentError), ("5", InvalidTypeError),
    (True, InvalidTypeError), (2.5, InvalidTypeError),
])
def test_bad_priorities_are_refused(client, bad, error):
    with pytest.raises(error, match="priority"):
        client.add_job("pb", b"x", priority=bad)
    assert client.qlen("pb") == 0


# ------------------------------------------------------------------- keys


def test_a_key_adds_once_while_its_job_lives(client):
    first = client.add_job("k", b"charge #1", key="charge-1")
    again = client.add_job("k", b"charge #1 (retried)", key="charge-1")
    other = client.add_job("k", b"charge #2", key="charge-2")
    assert again == first and other != first
    assert client.qlen("k") == 2
    # the job is delivered: still live, the key still holds
    job = client.get_job("k", nohang=True)[0]
    assert job.id == first and job.body == b"charge #1"
    assert client.add_job("k", b"charge #1", key="charge-1") == first
    client.ack_job(first)
    # acknowledged: the key is free, a new add makes a new job
    fresh = client.add_job("k", b"charge #1 again", key="charge-1")
    assert fresh != first and client.show(fresh)["key"] == "charge-1"


def test_keys_are_per_queue(client):
    a = client.add_job("ka", b"x", key="same")
    b = client.add_job("kb", b"x", key="same")
    assert a != b


def test_deleted_and_expired_jobs_free_their_key(client):
    first = client.add_job("kd", b"x", key="k1")
    client.del_job(first)
    assert client.add_job("kd", b"x", key="k1") != first
    short = client.add_job("ke", b"x", key="k2", ttl=0.2)
    # wait for the TTL by condition: the key frees when the job is no longer live
    from .conftest import wait_until

    wait_until(lambda: client.show(short) is None, timeout=10)
    assert client.add_job("ke", b"x", key="k2") != short


def test_concurrent_adds_of_one_key_make_one_job(dsn):
    # Ten producers, each its own client and connection, race on one key:
    # the per-key lock makes the later adds see the first one's job.
    ids: list[str] = []
    barrier = threading.Barrier(10)

    def add():
        with pgq.Client(dsn) as producer:
            barrier.wait()
            ids.append(producer.add_job("kc", b"x", key="only-once"))

    threads = [threading.Thread(target=add) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(ids) == 10 and len(set(ids)) == 1
    with pgq.Client(dsn) as client:
        assert client.qlen("kc") == 1


def test_a_keyed_add_inside_a_transaction(client, dsn):
    import psycopg

    with psycopg.connect(dsn) as conn:
        first = client.add_job("kt", b"x", key="tx", conn=conn)
        assert client.add_job("kt", b"x", key="tx", conn=conn) == first
        conn.rollback()
    # rolled back: nothing holds the key
    assert client.add_job("kt", b"x", key="tx") != first


def test_async_client_keys_and_priority(dsn):
    async def main():
        async with pgq.AsyncClient(dsn) as client:
            plain = await client.add_job("ak", b"x")
            first = await client.add_job("ak", b"y", key="a", priority=3)
            assert await client.add_job("ak", b"y", key="a") == first
            got = await client.get_job("ak", count=5)
            assert [j.id for j in got] == [first, plain]

    anyio.run(main)


@pytest.mark.parametrize("bad, error", [
    ("", InvalidArgumentError), ("a\x00b", InvalidArgumentError), ("x" * 513, InvalidArgumentError),
    (5, InvalidTypeError), (b"key", InvalidTypeError),
])
def test_bad_keys_are_refused(client, bad, error):
    with pytest.raises(error, match="key"):
        client.add_job("kx", b"x", key=bad)
    assert client.qlen("kx") == 0


def test_a_key_names_one_job(client):
    with pytest.raises(InvalidArgumentError, match="one at a time"):
        client.add_call("kx", [b"a", b"b"], replicate=None, delay=0, retry=None, ttl=None,
                        maxlen=None, asynchronous=False, timeout=None, key="k")


def test_a_dead_letter_comes_back_with_its_priority_and_key(client):
    # A dead letter kept neither (schema 0020): an urgent job came back
    # behind the backlog, and a keyed one without its key (found by a
    # read-only review).
    urgent = client.add_job("dl", b"urgent", priority=9, key="order-7", retry=30)
    client.add_jobs("dl", [b"x", b"y"], retry=30)
    [got] = client.get_job("dl")
    assert got.id == urgent
    assert client.dead_letter(got, reason="gave up") == 1
    [back] = client.requeue_dead_letters("dl")
    shown = client.show(back)
    assert (shown["priority"], shown["key"]) == (9, "order-7")
    assert client.add_job("dl", b"again", key="order-7") == back  # the key holds again
    assert [j.id for j in client.get_job("dl")] == [back]  # ahead of the backlog
