"""GETJOB: priority across queues, COUNT, blocking, NOTIFY wake-up, polling
fallback, NOHANG, WITHCOUNTERS, paused output."""

from __future__ import annotations

import threading
import time

import pytest

import pgq

from .conftest import wait_until


def add_later(dsn, queue, delay, body=b"late", **options):
    """Add a job from another client after ``delay`` seconds; returns the thread."""
    result = {}

    def run():
        time.sleep(delay)
        with pgq.Client(dsn, **options) as producer:
            result["id"] = producer.add_job(queue, body)
            result["at"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_queues_are_served_left_to_right(client):
    low = client.add_jobs("low", [b"l1", b"l2"])
    high = client.add_jobs("high", [b"h1", b"h2"])
    assert [j.id for j in client.get_job("high", "low", count=1)] == high[:1]
    assert [j.id for j in client.get_job("low", "high", count=1)] == low[:1]
    # COUNT is filled by priority: all of 'high' first, then 'low'
    got = client.get_job("high", "low", count=10)
    assert [j.id for j in got] == high[1:] + low[1:]
    assert [j.queue for j in got] == ["high", "low"]


def test_count_returns_what_is_ready_up_to_count(client):
    ids = client.add_jobs("c", [b"%d" % i for i in range(5)])
    assert [j.id for j in client.get_job("c", count=3)] == ids[:3]
    assert [j.id for j in client.get_job("c", count=100)] == ids[3:]
    assert client.get_job("c", nohang=True) == []


def test_a_job_is_delivered_to_one_consumer_only(dsn, client):
    ids = set(client.add_jobs("shared", [b"%d" % i for i in range(400)]))
    seen: list[str] = []
    lock = threading.Lock()

    def consume():
        with pgq.Client(dsn) as c:
            while True:
                jobs = c.get_job("shared", count=7, nohang=True)
                if not jobs:
                    return
                with lock:
                    seen.extend(j.id for j in jobs)

    threads = [threading.Thread(target=consume) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == sorted(ids)


def test_nohang_and_timeout_return_empty(client):
    assert client.get_job("empty", nohang=True) == []
    start = time.monotonic()
    assert client.get_job("empty", timeout=0.4) == []
    assert 0.35 <= time.monotonic() - start < 2


def test_blocked_consumer_is_woken_by_notify(dsn):
    # poll_interval 30: the polls (50 ms doubling) fall near 3.2 s and 6.4 s,
    # so a job added 4 s in is found by a poll only ~2.2 s later; woken by
    # NOTIFY it comes at once (a 0.3 s bound failed on a loaded machine).
    with pgq.Client(dsn, poll_interval=30) as client:
        thread, produced = add_later(dsn, "wake", 4)
        start = time.monotonic()
        jobs = client.get_job("wake", timeout=20)
        woke = time.monotonic()
        thread.join()
    assert [j.id for j in jobs] == [produced["id"]]
    assert woke - produced["at"] < 1.5  # NOTIFY, not the next poll
    assert woke - start < 10


def test_blocking_forever_returns_when_a_job_arrives(dsn, client):
    thread, produced = add_later(dsn, "forever", 0.3)
    jobs = client.get_job("forever")  # timeout=None: block forever
    thread.join()
    assert jobs[0].id == produced["id"]
    thread, produced = add_later(dsn, "forever", 0.3)
    jobs = client.get_job("forever", timeout=0)  # 0 = forever too
    # The job can be claimed before the producer's add_job returned (the
    # NOTIFY comes with its commit): its ID is known once the thread ended.
    thread.join()
    assert jobs[0].id == produced["id"]
    thread.join()


def test_polling_fallback_without_listen(dsn):
    # As behind PgBouncer in transaction mode: no LISTEN, no prepared statements.
    with pgq.Client(dsn, pgbouncer=True, poll_interval=0.2) as consumer:
        thread, produced = add_later(dsn, "poll", 0.5)
        jobs = consumer.get_job("poll", timeout=10)
        woke = time.monotonic()
        thread.join()
    assert jobs[0].id == produced["id"]
    assert woke - produced["at"] < 3  # found by a poll, long before the 10 s timeout


def test_blocked_consumers_are_visible_and_cleaned_up(dsn, client, db):
    thread = threading.Thread(target=lambda: client.get_job("watched", "other", timeout=1.5))
    thread.start()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and not db.execute(
            "SELECT count(*) FROM pgq.waiters").fetchone()[0]:
        time.sleep(0.05)
    assert client.qstat("watched")["blocked"] == 1
    assert sorted(r[0] for r in db.execute("SELECT queue FROM pgq.waiters")) == ["other", "watched"]
    thread.join()
    # The client's shared listener drops the registration once nobody has
    # waited for its linger (pgq.listener.LINGER, 1 s).
    wait_until(lambda: db.execute("SELECT count(*) FROM pgq.waiters").fetchone()[0] == 0, 10,
               message="the registration to go")
    # Nothing keeps the queue alive any more (no jobs, waiter or pause).
    assert client.qstat("watched") is None


def test_producer_does_not_notify_when_nobody_waits(client, db):
    db.execute("LISTEN pgq")
    client.add_job("quiet", b"x")
    assert list(db.notifies(timeout=0.3)) == []


def test_withcounters(client):
    job_id = client.add_job("wc", b"x")
    plain = client.get_job("wc")[0]
    assert plain.nacks is None and plain.additional_deliveries is None
    client.nack_job(job_id)
    counted = client.get_job("wc", withcounters=True)[0]
    assert (counted.nacks, counted.additional_deliveries) == (1, 0)


def test_paused_output_is_skipped_and_resumed(dsn, client):
    job_id = client.add_job("po", b"x")
    client.pause("po", "out")
    assert client.get_job("po", nohang=True) == []
    other = client.add_job("po2", b"y")
    assert [j.id for j in client.get_job("po", "po2", count=5)] == [other]

    def resume():
        time.sleep(0.5)
        with pgq.Client(dsn) as c:
            c.pause("po", "none")

    thread = threading.Thread(target=resume)
    thread.start()
    start = time.monotonic()
    jobs = client.get_job("po", timeout=10)
    thread.join()
    assert [j.id for j in jobs] == [job_id]
    assert time.monotonic() - start < 1.5


def test_duplicate_queue_names_count_once(client):
    ids = client.add_jobs("dup", [b"1", b"2"])
    assert [j.id for j in client.get_job("dup", "dup", count=5)] == ids


def test_a_job_queued_again_behind_the_claim_floor_is_still_delivered(client):
    """Claims start from a floor past the jobs they took (pgq.floors); a job
    queued again with its old ctime (NACK) sits below it and must still come
    back: the queue epoch moves, or the periodic walk from the front finds it."""
    import time

    client.add_jobs("floor", [b"%d" % i for i in range(300)])
    first = client.get_job("floor")[0]
    client.get_job("floor", count=100)  # the floor moves past `first`
    assert client.nack_job(first.id) == 1
    seen = False
    deadline = time.monotonic() + 15  # the walk from the front comes every 2 s
    while not seen and time.monotonic() < deadline:
        jobs = client.get_job("floor", count=10, timeout=1)
        seen = any(j.id == first.id for j in jobs)
    assert seen, "a NACKed job below the floor was never delivered again"


def count_statements(monkeypatch) -> list[str]:
    """The SQL of every statement the blocking clients' drivers run from now
    on (for this test), in a list that fills as they run."""
    from pgq.driver import SyncDriver
    from pgq.protocol import Query

    queries: list[str] = []
    handle = SyncDriver._handle

    def counting(self, request):
        if isinstance(request, Query):
            queries.append(request.sql)
        return handle(self, request)

    monkeypatch.setattr(SyncDriver, "_handle", counting)
    return queries


def test_a_consumer_blocked_on_an_idle_queue_does_not_spin(dsn, monkeypatch):
    """NEXT_DUE once said "due now" when nothing was due (GREATEST ignores
    NULL): a blocked GET polled every millisecond, ~800 statements a second.
    It backs off now: 50 ms doubling to the poll interval."""
    queries = count_statements(monkeypatch)
    for options in ({}, {"pgbouncer": True, "poll_interval": 0.2}):
        with pgq.Client(dsn, **options) as consumer:
            consumer.get_job("idle", nohang=True)
            queries.clear()
            assert consumer.get_job("idle", timeout=1) == []
        # claim + next-due per wake-up: 50, 100, 200, 400 ms, then the interval
        assert len(queries) < 40, (options, len(queries))


def test_a_due_job_in_a_queue_paused_for_output_does_not_make_a_get_spin(dsn, client, monkeypatch):
    """A blocked GET over a queue paused for output and another: a due job
    in the paused one made the claim's "next due" say "now", and the GET
    claimed every millisecond until a sweep re-queued the job."""
    import psycopg

    job_id = client.add_job("held", b"x", retry=30)
    client.get_job("held")  # leased: due again once its lease runs out
    client.pause("held", "out")
    queries = count_statements(monkeypatch)
    # sweep_interval: the sweep would re-queue the due job, which hid the spin
    with pgq.Client(dsn, sweep_interval=3600) as consumer:
        consumer.get_job("held", "other", nohang=True)  # its first sweep is done
        with psycopg.connect(dsn, autocommit=True) as conn:  # the lease runs out
            conn.execute("UPDATE pgq.jobs SET requeue_at = now() - interval '1 second' "
                         "WHERE id = %s", (job_id,))
        queries.clear()
        assert consumer.get_job("held", "other", timeout=1) == []
    assert len(queries) < 40, len(queries)  # as an idle queue's (above); ~1000 before


@pytest.mark.parametrize("why", ["locked by an open transaction", "expired"])
def test_a_due_job_the_claim_cannot_take_does_not_make_a_get_spin(dsn, client, monkeypatch, why):
    """A job whose lease ran out, acknowledged in a caller's transaction
    still open (its row locked: the claim's SKIP LOCKED passes it), or
    expired and not swept yet: the claim's "next due" said "now", and a
    blocked GET claimed every millisecond, some 600 claims a second, for as
    long as that lasted (found by a read-only review)."""
    import psycopg

    job_id = client.add_job("stuck", b"x", retry=30, ttl=60)
    client.get_job("stuck")  # leased
    queries = count_statements(monkeypatch)
    # sweep_interval: a sweep would re-queue (or drop) the due job, which hid the spin
    with pgq.Client(dsn, sweep_interval=3600) as consumer, psycopg.connect(dsn) as holder:
        consumer.get_job("stuck", "other", nohang=True)  # its first sweep is done
        with psycopg.connect(dsn, autocommit=True) as conn:  # the lease runs out
            conn.execute("UPDATE pgq.jobs SET requeue_at = now() - interval '1 second'"
                         + (", expires_at = now() - interval '1 second'" if why == "expired" else "")
                         + " WHERE id = %s", (job_id,))
        if why != "expired":
            assert consumer.ack_job(job_id, conn=holder) == 1  # not committed: the row stays locked
        queries.clear()
        assert consumer.get_job("stuck", "other", timeout=1) == []
        holder.rollback()
    assert len(queries) < 40, len(queries)  # as an idle queue's (above); 584 before


def test_a_combined_claim_that_runs_dry_tells_the_callers_it_left_when_a_job_is_due(client, db):
    """Callers of one combined claim left without a job wait at once: the
    claim that came up short says when the next job is due (a lease here),
    so their first wait needs no NEXT_DUE of its own (0.4 statements per
    job in the steady-state bench, when only a claim that took nothing
    said it). A claim that filled its COUNT does not probe."""
    from pgq import commands

    leased = client.add_job("dry", b"leased", retry=30)
    assert [j.id for j in client.get_job("dry")] == [leased]  # due again in 30 s
    ready = client.add_job("dry", b"ready")
    calls = [commands.ClaimCall(("dry",), 1, False)] * 3
    first, second, third = client._run(lambda session: commands.claim_batch(session, calls))
    assert [j.id for j in first] == [ready]
    assert isinstance(second, commands.Due) and second == third
    assert second.seconds is not None and 25 < second.seconds <= 30.3  # the lease's retry (+ jitter)
    client.add_job("dry", b"a")
    client.add_job("dry", b"b")
    full = client._run(lambda session: commands.claim_batch(session, calls[:2]))
    assert [len(jobs) for jobs in full] == [1, 1]
    # A lease that ran out is taken by the claim: not what the others wait
    # for (the statement's snapshot still shows it due, which said "now").
    client.ack_job(*(j.id for jobs in full for j in jobs))
    expired = client.add_job("dry", b"expired", retry=30)
    assert [j.id for j in client.get_job("dry")] == [expired]
    db.execute("UPDATE pgq.jobs SET requeue_at = now() - interval '1 second' WHERE id = %s",
               (expired,))
    taken, waiting, _third = client._run(lambda session: commands.claim_batch(session, calls))
    assert [j.id for j in taken] == [expired]
    assert isinstance(waiting, commands.Due) and 25 < waiting.seconds <= 30.3  # the first lease


def test_a_job_stands_for_its_id(client):
    client.add_jobs("asid", [b"1", b"2"], retry=30)
    first, second = client.get_job("asid", count=2)
    assert client.working(first) == 30 and client.show(first)["id"] == first.id
    assert client.nack_job(second) == 1
    assert client.ack_job(first) == 1 and client.show(first) is None  # one node: no tombstone
    again = client.get_job("asid")
    assert [j.id for j in again] == [second.id] and client.fast_ack(*again) == 1


def test_wait_job_returns_once_the_job_is_done_with(client):
    import threading

    import pytest

    job = client.add_job("waited", b"x", retry=30)
    assert client.wait_job(job, timeout=0.2) is False  # queued: not done
    done = {}
    waiter = threading.Thread(target=lambda: done.update(ok=client.wait_job(job, timeout=30)))
    waiter.start()
    got = client.get_job("waited")
    assert client.ack_job(*got) == 1
    waiter.join(30)
    assert done == {"ok": True}
    # Done with before the wait began (a fast worker, goware/disque's
    # add-then-wait): acked and gone on one node, history knows. It raised
    # NoJobError, as did an expired job not swept yet (found by a review).
    assert client.wait_job(job, timeout=0.2) is True
    short = client.add_job("waited", b"y", ttl=1)
    from .conftest import wait_until
    wait_until(lambda: client.show(short) is None, 10, message="the job to expire")
    assert client.wait_job(short, timeout=0.2) is True
    client.sweep()
    assert client.wait_job(short, timeout=0.2) is True  # swept: history says 'expired'
    never = pgq.ids.new_job_id("0" * 40, 60, 30)
    with pytest.raises(pgq.errors.NoJobError, match="not held on this node"):
        client.wait_job(never)  # no copy, no record: ask a node that holds one
    # An ID made by a client whose clock is two hours ahead: its history row
    # (finished now) was looked for from an hour past the ID's time, after
    # it (found by a review).
    ahead = pgq.ids.ingest_job_id("0" * 40, int((time.time() + 7200) * 1000), 1, 1,
                                  pgq.ids.ttl_minutes_field(3600, 30))
    with client._pool.connection() as conn:
        conn.execute("INSERT INTO pgq.history (id, queue, outcome, ctime, deliveries, nacks, "
                     "additional_deliveries, retry, repl, body_size) "
                     "VALUES (%s, 'waited', 'acked', 0, 1, 0, 0, 30, 1, 1)", (ahead,))
    assert client.wait_job(ahead, timeout=0.2) is True
