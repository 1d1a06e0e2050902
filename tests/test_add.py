"""ADDJOB: IDs, defaults, delay, TTL, MAXLEN, PAUSED, NOREPL, bulk adds, ordering."""

from __future__ import annotations

import threading
import time

import pytest

from pgq.errors import MaxLenError, NoReplError, PausedError
from pgq.ids import is_at_least_once_id, validate_job_id

from .conftest import counters_match_jobs


def test_add_returns_a_disque_id_of_this_node(client):
    job_id = client.add_job("q", b"body")
    assert validate_job_id(job_id) == job_id
    assert job_id[2:10] == client.node_id[:8]
    assert is_at_least_once_id(job_id)
    assert not is_at_least_once_id(client.add_job("q", b"once", retry=0))


def test_defaults_are_disques(client):
    info = client.show(client.add_job("q", "text body"))
    assert info["body"] == b"text body"
    assert info["state"] == "queued"
    assert info["repl"] == 1 and info["delay"] == 0 and info["retry"] == 300
    assert 86399 <= info["ttl"] <= 86400
    assert info["next_requeue_within"] is None  # queued: no lease yet


def test_explicit_parameters_are_stored(client):
    info = client.show(client.add_job("q", b"x", ttl=600, retry=7, replicate=1))
    assert info["retry"] == 7 and 599 <= info["ttl"] <= 600


def test_delayed_job_is_active_until_its_time(client):
    added = time.monotonic()  # (before the add: the checks below take time on a loaded machine)
    job_id = client.add_job("delayed", b"later", delay=1)
    assert client.show(job_id)["state"] == "active"
    assert client.qlen("delayed") == 0
    assert client.get_job("delayed", nohang=True) == []
    jobs = client.get_job("delayed", timeout=5)
    waited = time.monotonic() - added
    assert [j.id for j in jobs] == [job_id]
    assert 0.95 <= waited <= 3.5  # at its due time (1 s after the add), not by a long poll


def test_jobs_come_out_in_creation_order(client):
    ids = [client.add_job("fifo", b"%d" % i) for i in range(20)]
    ids += client.add_jobs("fifo", [b"bulk%d" % i for i in range(30)])
    got = [j.id for j in client.get_job("fifo", count=100)]
    assert got == ids


def test_bulk_add_small_and_copy_paths(client, db):
    small = client.add_jobs("bulk", [b"a", b"b", b"c"], ttl=100, retry=5)
    large = client.add_jobs("bulk", (b"%d" % i for i in range(5000)), delay=0)
    assert len(small) == 3 and len(large) == 5000 and len(set(small + large)) == 5003
    assert client.qlen("bulk") == 5003
    retry, ttl = db.execute(
        "SELECT retry, extract(epoch FROM expires_at - now()) FROM pgq.jobs WHERE id = %s",
        (small[0],)).fetchone()
    assert retry == 5 and 95 < ttl <= 100
    assert client.add_jobs("bulk", []) == []
    assert counters_match_jobs(db)


def test_copy_path_stores_what_the_insert_path_stores(client, db):
    # The COPY rows are hand-encoded (pgq.copydata): every column must match
    # what the one-statement path stores for the same arguments.
    bodies = [b"", b"\x00\xff" * 3000, "h\u00e9llo \U0001f600".encode()] + [b"%d" % i for i in range(2100)]
    columns = ("queue, state, body, repl, retry, delay, requeue_at IS NULL, queued_at IS NULL, "
               "enqueues, round(extract(epoch FROM expires_at - coalesce(queued_at, requeue_at - "
               "delay * interval '1 second'))::numeric, 1)")
    for delay in (0, 30):
        small = client.add_jobs("same", bodies[:3], retry=7.5, ttl=900, delay=delay)
        large = client.add_jobs("same", bodies, retry=7.5, ttl=900, delay=delay)
        for one, other in zip(small, large[:3], strict=True):
            mine, theirs = (db.execute(f"SELECT {columns} FROM pgq.jobs WHERE id = %s", (i,)).fetchone()
                            for i in (one, other))
            assert mine == theirs
        assert db.execute("SELECT count(*) FROM pgq.jobs WHERE id = ANY(%s)", (large,)).fetchone()[0] == len(bodies)
    assert counters_match_jobs(db)


def test_bulk_add_with_delay_through_copy(client):
    ids = client.add_jobs("bulk-delay", [b"x"] * 2500, delay=30)
    assert client.qlen("bulk-delay") == 0
    assert client.show(ids[-1])["state"] == "active"


def test_maxlen_refuses_when_the_queue_is_full(client):
    for _ in range(3):
        client.add_job("capped", b"x", maxlen=3)
    with pytest.raises(MaxLenError):
        client.add_job("capped", b"x", maxlen=3)
    assert client.qlen("capped") == 3
    client.add_job("capped", b"no limit given")  # maxlen is per add
    with pytest.raises(MaxLenError):
        client.add_jobs("capped", [b"1", b"2"], maxlen=5)
    assert client.qlen("capped") == 4
    with pytest.raises(MaxLenError):  # the COPY path checks too
        client.add_jobs("capped", [b"x"] * 3000, maxlen=3000)
    assert client.qlen("capped") == 4


def test_maxlen_is_exact_under_concurrent_producers(client):
    added, refused = [], []

    def produce():
        for _ in range(10):
            try:
                added.append(client.add_job("race", b"x", maxlen=25))
            except MaxLenError:
                refused.append(1)

    threads = [threading.Thread(target=produce) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(added) == 25 and len(refused) == 25
    assert client.qlen("race") == 25


def test_paused_queue_refuses_input(client):
    assert client.pause("p", "in") == "in"
    with pytest.raises(PausedError, match="paused"):
        client.add_job("p", b"x")
    with pytest.raises(PausedError):
        client.add_jobs("p", [b"x"] * 3000)
    assert client.pause("p", "all") == "all"
    with pytest.raises(PausedError):
        client.add_job("p", b"x")
    assert client.pause("p", "out") == "out"  # output paused only: adds are fine
    client.add_job("p", b"x")
    assert client.qlen("p") == 1


def test_replication_beyond_reachable_nodes_is_norepl(client):
    with pytest.raises(NoReplError, match="reachable"):
        client.add_job("q", b"x", replicate=2)
    assert client.qlen("q") == 0
    client.add_job("q", b"x", replicate=1, asynchronous=True, timeout=1)  # accepted on one node


def test_retry_zero_with_replication_is_refused(client):
    with pytest.raises(ValueError, match="at-most-once"):
        client.add_job("q", b"x", retry=0, replicate=2)


def test_big_body_within_the_limit_round_trips(client):
    body = bytes(range(256)) * 4096  # 1 MiB, every byte value
    job_id = client.add_job("big", body)
    assert client.get_job("big")[0].body == body
    assert client.ack_job(job_id) == 1


def test_a_batch_of_one_stores_what_a_batch_of_many_stores(client):
    """The group commit sends a lone add as plain values (ADD_ONE) and a
    batch as arrays (ADD_MANY): the jobs they store and the calls they
    refuse must be the same."""
    from pgq import commands

    client.pause("closed", "in")

    def call(queue, body, delay=0, retry=None, ttl=None, priority=0):
        return client.add_call(queue, [body], replicate=None, delay=delay, retry=retry, ttl=ttl,
                               maxlen=None, asynchronous=False, timeout=None, priority=priority)

    def calls():  # a call is one add: its IDs are made once (a retry stores them once)
        return [call("open", b"a", delay=5, retry=7, ttl=600, priority=3), call("closed", b"b"),
                call("open", b"c", retry=0)]

    alone = [client._run(lambda session, c=c: commands.add_batch(session, [c]))[0] for c in calls()]
    again = calls()
    together = client._run(lambda session: commands.add_batch(session, again))
    same = ("queue", "state", "repl", "delay", "retry", "priority", "body", "deliveries")
    for one, many in zip(alone, together, strict=True):
        if isinstance(one, PausedError):
            assert isinstance(many, PausedError), many
            continue
        first, second = client.show(one[0]), client.show(many[0])
        assert {k: first[k] for k in same} == {k: second[k] for k in same}
        assert abs(first["ttl"] - second["ttl"]) <= 1
    assert [type(o).__name__ for o in alone] == ["list", "PausedError", "list"]
    assert client.qlen("open") == 2 and client.qlen("closed") == 0  # two delayed, two queued


def test_an_add_run_again_after_a_lost_connection_adds_nothing_twice(client):
    """The client runs a command again when its connection broke: its job IDs
    are made once per call, so the second run finds them stored (ON
    CONFLICT, or a probe before a COPY). New IDs at each run added the jobs
    again when the first run had committed."""
    from pgq import arguments, commands

    def call(queue, bodies):
        return commands.AddCall(queue, bodies, arguments.job_params(
            replicate=None, delay=0, retry=30, ttl=None, maxlen=None, asynchronous=False,
            timeout=None))

    one = call("again", [b"x"])
    first = client._run(client.add_command(one))
    assert client._run(client.add_command(one)) == first and client.qlen("again") == 1
    batched = call("again-batch", [b"y", b"z"])
    [first] = client._run(lambda s: commands.add_batch(s, [batched]))
    # run again, a batch leaves the call to its caller's own way
    assert client._run(lambda s: commands.add_batch(s, [batched])) == [commands.REROUTE]
    assert client._run(client.add_command(batched)) == first
    assert client.qlen("again-batch") == 2
    bulk = call("again-bulk", [b"b"] * commands.COPY_THRESHOLD)
    first = client._run(client.add_command(bulk))
    assert client._run(client.add_command(bulk)) == first  # no UniqueViolation from COPY
    assert client.qlen("again-bulk") == commands.COPY_THRESHOLD


@pytest.mark.parametrize("retry, count", [(30, 1), (0, 2), (30, "copy")])
def test_an_add_run_again_after_its_jobs_were_consumed_stores_nothing(client, retry, count):
    """The first attempt committed, its reply was lost with the connection,
    and a consumer took and acknowledged the jobs before the client ran the
    add again: the second run finds them done with (pgq.history) and stores
    nothing. ON CONFLICT alone stored them again, and they were delivered
    after their ACK returned (an at-most-once job twice): the restart test
    caught one under CI."""
    from pgq import arguments, commands

    n = commands.COPY_THRESHOLD if count == "copy" else count
    queue = f"consumed-{retry}-{count}"
    call = commands.AddCall(queue, [b"j%d" % i for i in range(n)], arguments.job_params(
        replicate=None, delay=0, retry=retry, ttl=None, maxlen=None, asynchronous=False,
        timeout=None))
    first = client._run(client.add_command(call))
    taken = client.get_job(queue, count=n, nohang=True)
    assert sorted(j.id for j in taken) == sorted(first)
    client.ack_job(*first[: n // 2 or 1])
    assert client._run(client.add_command(call)) == first
    # the half left unacknowledged is still held by its consumer, not queued again
    assert client.qlen(queue) == 0
    assert client.get_job(queue, nohang=True) == []
    client.ack_job(*first)
    assert client._run(client.add_command(call)) == first
    assert client.qlen(queue) == 0 and client.get_job(queue, nohang=True) == []
