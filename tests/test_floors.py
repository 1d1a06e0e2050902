"""Claim floors (pgq.floors) and pgq's own vacuum (pgq.vacuum): where claims
start, when they walk from the front and how a floor moves, on their own;
then with a database, the queue epoch and the claim's cost behind a held
xmin horizon."""

from __future__ import annotations

import time

import psycopg

import pgq.vacuum
from pgq import statements as sql
from pgq.core import _floors_of as floors_of
from pgq.floors import FROM_THE_FRONT, FULL_WALK_EVERY, MARGIN, Floors
from pgq.statements import SESSION_OPTIONS
from pgq.vacuum import BACKOFF_MAX, BACKOFF_MIN, DEAD_MIN, Vacuumer

from .conftest import wait_until


def test_the_first_claim_walks_from_the_front_then_from_what_it_took():
    floors = Floors()
    used = floors.for_claim(["q"], now=0.0)
    assert used == [FROM_THE_FRONT]
    floors.claimed(["q"], used, [("q", 1000 * MARGIN), ("q", 1001 * MARGIN)], 0.0, 0.01)
    assert floors.for_claim(["q"], now=0.1) == [1000 * MARGIN]  # highest taken, minus the margin


def test_a_floor_never_moves_back_and_a_full_walk_keeps_it():
    floors = Floors()
    used = floors.for_claim(["q"], 0.0)
    floors.claimed(["q"], used, [("q", 50 * MARGIN)], 0.0, 0.0)
    used = floors.for_claim(["q"], 0.5)
    floors.claimed(["q"], used, [("q", 10 * MARGIN)], 0.5, 0.5)  # an older job, found late
    assert floors.for_claim(["q"], 0.6) == [49 * MARGIN]
    # the periodic full walk starts from the front but does not forget the floor
    assert floors.for_claim(["q"], FULL_WALK_EVERY + 1) == [FROM_THE_FRONT]
    assert floors.for_claim(["q"], FULL_WALK_EVERY + 1.1) == [49 * MARGIN]


def test_a_costly_full_walk_is_made_rarely():
    floors = Floors()
    used = floors.for_claim(["q"], 0.0)
    # a walk of 0.5 s (a held horizon) that drained the queue up to ctime 9
    floors.claimed(["q"], used, [("q", 9 * MARGIN)], started=0.0, now=0.5)
    # at most a tenth of the time is spent walking from the front: 5 s until the next one
    assert floors.for_claim(["q"], 4.0) != [FROM_THE_FRONT]
    assert floors.for_claim(["q"], 5.1) == [FROM_THE_FRONT]


def test_a_moving_epoch_brings_full_walks_at_once_for_a_moment():
    floors = Floors()
    used = floors.for_claim(["q"], 0.0)
    floors.claimed(["q"], used, [("q", 9 * MARGIN)], 0.0, 0.001, epoch=1)
    assert floors.for_claim(["q"], 0.1) == [8 * MARGIN]
    floors.claimed(["q"], [8 * MARGIN], [], 0.1, 0.1, epoch=2)  # a job was queued late
    assert floors.for_claim(["q"], 0.2) == [FROM_THE_FRONT]
    floors.claimed(["q"], [FROM_THE_FRONT], [], 0.2, 0.201, epoch=2)
    assert floors.for_claim(["q"], 0.3) == [FROM_THE_FRONT]  # the writer may not have committed yet
    assert floors.for_claim(["q"], 0.2 + 0.26) == [8 * MARGIN]  # then back to the floor


def test_a_walk_from_the_front_that_finds_jobs_below_the_floor_goes_on_until_it_finds_none():
    # One epoch move (a NACK of many jobs) left more jobs below the floor
    # than the claims of DIRTY_FOR took: the rest were served COUNT at a
    # time every FULL_WALK_EVERY seconds (found by a read-only review).
    floors = Floors()
    used = floors.for_claim(["q"], 0.0)
    floors.claimed(["q"], used, [("q", 100 * MARGIN)], 0.0, 0.001, epoch=1)
    assert floors.for_claim(["q"], 1.0) == [99 * MARGIN]
    floors.claimed(["q"], [99 * MARGIN], [], 1.0, 1.0, epoch=2)  # many jobs queued again, old
    assert floors.for_claim(["q"], 1.1) == [FROM_THE_FRONT]
    floors.claimed(["q"], [FROM_THE_FRONT], [("q", c * MARGIN) for c in range(10)], 1.1, 1.1, epoch=2)
    assert floors.for_claim(["q"], 1.5) == [FROM_THE_FRONT]  # past DIRTY_FOR: more may wait there
    floors.claimed(["q"], [FROM_THE_FRONT], [("q", c * MARGIN) for c in range(10, 20)], 1.5, 1.5)
    assert floors.for_claim(["q"], 1.6) == [FROM_THE_FRONT]
    floors.claimed(["q"], [FROM_THE_FRONT], [("q", 101 * MARGIN)], 1.6, 1.6)  # none below: done
    assert floors.for_claim(["q"], 1.7) == [100 * MARGIN]


def test_claims_that_raise_the_floor_during_a_walk_from_the_front_do_not_make_the_next_walk():
    # The walk took the oldest jobs while a concurrent claim from the floor
    # took the next ones and raised the floor past them: no hole, so the
    # next claim starts at the floor.
    floors = Floors()
    used = floors.for_claim(["q"], 0.0)
    floors.claimed(["q"], used, [("q", c * MARGIN // 10) for c in range(10)], 0.0, 0.001)
    walk = floors.for_claim(["q"], 3.0)
    assert walk == [FROM_THE_FRONT]
    step = floors.for_claim(["q"], 3.0)
    assert step != [FROM_THE_FRONT]
    floors.claimed(["q"], step, [("q", 4 * MARGIN + c) for c in range(10)], 3.0, 3.001)
    floors.claimed(["q"], walk, [("q", 2 * MARGIN + c) for c in range(10)], 3.0, 3.002)
    assert floors.for_claim(["q"], 3.01) == [3 * MARGIN + 9]  # the floor: no walk from the front


def test_queues_have_their_own_floors():
    floors = Floors()
    used = floors.for_claim(["a", "b"], 0.0)
    floors.claimed(["a", "b"], used, [("b", 7 * MARGIN)], 0.0, 0.0)
    assert floors.for_claim(["a", "b"], 0.1) == [FROM_THE_FRONT, 6 * MARGIN]
    floors.forget(["b"])
    assert floors.for_claim(["b"], 0.2) == [FROM_THE_FRONT]


def test_a_vacuum_that_removes_little_backs_off_and_one_that_cleans_resets():
    vacuumer = Vacuumer(SESSION_OPTIONS)
    assert vacuumer.due("db", ["jobs", "acks", "pg_class"], now=0.0) == ["jobs", "acks"]
    vacuumer._judge("db", "jobs", before=100_000, after=90_000, now=0.0)  # a held horizon
    assert vacuumer.due("db", ["jobs", "acks"], now=BACKOFF_MIN - 1) == ["acks"]
    assert vacuumer.due("db", ["jobs"], now=BACKOFF_MIN + 1) == ["jobs"]
    vacuumer._judge("db", "jobs", before=100_000, after=95_000, now=20.0)  # still held: twice as long
    assert vacuumer.due("db", ["jobs"], now=20.0 + 2 * BACKOFF_MIN - 1) == []
    assert vacuumer.due("other-db", ["jobs"], now=20.0) == ["jobs"]  # per database
    vacuumer._judge("db", "jobs", before=100_000, after=1_000, now=50.0)  # the horizon moved on
    assert vacuumer.due("db", ["jobs"], now=50.0) == ["jobs"]
    for _attempt in range(20):
        vacuumer._judge("db", "acks", before=10, after=10, now=0.0)
    assert vacuumer.due("db", ["acks"], now=BACKOFF_MAX + 0.1) == ["acks"]  # bounded


# ------------------------------------------------------------- with a database


def test_jobs_queued_again_below_a_floor_are_served_at_claim_speed(client):
    # The database side of the test above: 200 jobs NACKed at once (one
    # epoch move) behind a consumer's floor. Before, about 70 were served
    # in these 5 s (COUNT every FULL_WALK_EVERY once DIRTY_FOR was over);
    # now all, in a few claims. The consumer claims every 50 ms, as a
    # worker with little to do would (a claim loop that never pauses would
    # finish inside DIRTY_FOR and miss the point); 10 s is 50 times what the
    # 20 claims need here, room for a loaded machine, and still short of
    # serving them all the old way (about 70 in 5 s).
    old = client.add_jobs("below", [b"old"] * 200, retry=60)
    assert len(client.get_job("below", count=200)) == 200
    time.sleep(0.2)  # so that the next job's ctime is past the floor's margin (50 ms) above them
    client.add_job("below", b"fresh")
    assert [j.body for j in client.get_job("below", nohang=True)] == [b"fresh"]  # floor past `old`
    assert client.nack_job(*old) == 200
    served, deadline = 0, time.monotonic() + 10
    while served < 200 and time.monotonic() < deadline:
        client.add_job("below", b"fresh")
        jobs = client.get_job("below", count=10, nohang=True)
        served += sum(j.body == b"old" for j in jobs)
        client.ack_job(*jobs)
        time.sleep(0.05)
    assert served == 200


def test_a_vacuum_that_finds_another_one_running_waits_before_it_looks_again(dsn):
    """The sweep names a bloated table every second while another process
    vacuums it: each process opened a connection a second, only to find the
    advisory lock taken."""
    import time

    import psycopg

    from pgq.vacuum import VACUUM_LOCK

    vacuumer = Vacuumer(SESSION_OPTIONS)
    with psycopg.connect(dsn, autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", (VACUUM_LOCK,))  # "vacuuming"
        vacuumer._busy.acquire()  # as request() does before it starts _run
        vacuumer._run(dsn, ["jobs"])
        now = time.monotonic()
        assert vacuumer.due(dsn, ["jobs", "acks"], now) == ["acks"]
        assert vacuumer.due(dsn, ["jobs"], now + BACKOFF_MIN) == ["jobs"]

def test_maintenance_behind_a_transaction_pooler_takes_no_session_lock(dsn):
    """Behind PgBouncer in transaction mode a session's advisory lock stays
    on whichever server connection took it: every process then found it
    taken, and nothing vacuumed or pruned until the pooler dropped that
    connection. A client with pgbouncer=True takes none, and a direct one
    releases its own when done."""
    import psycopg

    from pgq.vacuum import VACUUM_LOCK

    vacuumer = Vacuumer(SESSION_OPTIONS)
    with psycopg.connect(dsn, autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", (VACUUM_LOCK,))  # left by a pooled connection
        vacuumer._busy.acquire()
        vacuumer._run(dsn, ["jobs"], pooled=True)
        assert vacuumer.due(dsn, ["jobs"], time.monotonic()) == ["jobs"]  # vacuumed, no back-off
        other.execute("SELECT pg_advisory_unlock(%s)", (VACUUM_LOCK,))
    held = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = %s"
    seen: list[int] = []
    maintain = vacuumer._maintain

    def watching(conn, *args):  # the lock is held while it works, and released after
        with psycopg.connect(dsn, autocommit=True) as look:
            seen.append(look.execute(held, (VACUUM_LOCK,)).fetchone()[0])
        return maintain(conn, *args)

    vacuumer._maintain = watching
    vacuumer._busy.acquire()
    vacuumer._run(dsn, ["jobs"])
    with psycopg.connect(dsn, autocommit=True) as look:
        assert seen == [1] and look.execute(held, (VACUUM_LOCK,)).fetchone()[0] == 0


HISTORY = "SELECT count(*) FROM pgq.history"


def _finish(client, queue: str, n: int) -> None:
    client.add_jobs(queue, [b"x"] * n)
    while jobs := client.get_job(queue, count=100, nohang=True):
        client.ack_job(*(j.id for j in jobs))


def test_a_job_from_a_clock_ahead_does_not_hide_the_jobs_added_after_it(client, db):
    client.add_job("f", b"ahead")
    db.execute("UPDATE pgq.jobs SET ctime = ctime + 60000 * 1000000::bigint")  # a minute ahead
    assert [j.body for j in client.get_job("f", nohang=True)] == [b"ahead"]  # a full walk
    client.add_job("f", b"new")
    # Before the next full walk (FULL_WALK_EVERY, 2 s; a slower run passes
    # without proving anything): the floor was a minute ahead, above "new".
    assert [j.body for j in client.get_job("f", nohang=True)] == [b"new"]


def test_the_history_keeps_a_day_by_default(client, db):
    _finish(client, "h", 30)
    assert db.execute(HISTORY).fetchone()[0] == 30
    assert db.execute("SELECT pgq.prune_history(100)").fetchone()[0] == 0
    ahead = db.execute("SELECT statement_timestamp() + interval '1 day 1 minute'").fetchone()[0]
    db.execute("SELECT set_config('pgq.now', %s, false)", (ahead.isoformat(),))
    newest = db.execute("SELECT max(seq) FROM pgq.history").fetchone()[0]
    assert db.execute("SELECT pgq.prune_history(20)").fetchone()[0] == 20  # its batch, oldest first
    assert db.execute("SELECT min(seq) FROM pgq.history").fetchone()[0] == newest - 9
    assert db.execute("SELECT pgq.prune_history(20)").fetchone()[0] == 10
    assert db.execute(HISTORY).fetchone()[0] == 0


def test_clients_prune_the_history_past_its_bounds_in_the_background(dsn, db, monkeypatch):
    # It had no bound: one row per finished job, until the disk was full.
    monkeypatch.setattr(pgq.vacuum, "PRUNE_EVERY", 0.0)  # once a minute otherwise
    db.execute("INSERT INTO pgq.meta (key, value) VALUES ('history_keep_rows', '10')")
    with pgq.Client(dsn, sweep_interval=0.05) as client:
        _finish(client, "h", 50)
        newest = db.execute("SELECT max(seq) FROM pgq.history").fetchone()[0]

        def pruned() -> bool:
            client.qlen("h")  # calls run the periodic sweep, which asks for the pruning
            return db.execute(HISTORY).fetchone()[0] <= 11

        wait_until(pruned, timeout=30, message="a client to prune pgq.history")
    assert db.execute("SELECT min(seq) FROM pgq.history").fetchone()[0] >= newest - 10  # the newest kept
    assert db.execute("SELECT max(seq) FROM pgq.history").fetchone()[0] == newest

EPOCH = "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM pgq.queue_epoch"


def _epoch(db) -> int:
    return db.execute(EPOCH).fetchone()[0]


def _age(db, queue: str, ms_apart: int = 1000) -> None:
    """Make the queued jobs of ``queue`` look created earlier, ``ms_apart``
    ms from each other in their order (test setup instead of waiting)."""
    db.execute("""
        UPDATE pgq.jobs j SET ctime = j.ctime - o.n * %(apart)s::bigint * 1000000
        FROM (SELECT id, row_number() OVER (ORDER BY ctime DESC) AS n
              FROM pgq.jobs WHERE queue = %(queue)s) o
        WHERE j.id = o.id""", {"queue": queue, "apart": ms_apart})


def test_the_epoch_moves_when_an_old_job_is_queued_again(client, db):
    [job_id] = client.add_jobs("e", [b"x"])
    _age(db, "e")
    before = _epoch(db)
    [job] = client.get_job("e")
    assert _epoch(db) == before  # a claim that takes what it locked moves nothing
    assert client.nack_job(job.id) == 1
    assert _epoch(db) > before
    assert [j.id for j in client.get_job("e", nohang=True)] == [job_id]


def test_a_claim_that_locks_ready_jobs_it_does_not_take_moves_the_epoch(client, db):
    client.add_jobs("first", [b"a"])
    client.add_jobs("second", [b"b", b"c"])
    before = _epoch(db)
    # COUNT 1 is filled by 'first': the claim locked a job of 'second' it did
    # not take, which a concurrent claim skipped and may have walked past
    assert [j.queue for j in client.get_job("first", "second", count=1)] == ["first"]
    assert _epoch(db) > before
    moved = _epoch(db)
    assert len(client.get_job("second", count=1)) == 1
    assert _epoch(db) == moved


def test_a_claim_behind_a_held_horizon_starts_past_the_dead_entries(client, db, dsn):
    """While another session holds an old snapshot no dead entry of the ready
    index can be removed or skipped cheaply: a claim from the front visits
    every job claimed before. From the client's floor it does not."""
    client.add_jobs("h", [b"x"] * 20_000)
    _age(db, "h", ms_apart=1)  # as if added over 20 s, not in one COPY
    db.execute("VACUUM pgq.jobs")  # the versions this setup left
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT txid_current()")  # the xmin horizon, held from now on
        while jobs := client.get_job("h", count=500, nohang=True):
            client.ack_job(*(j.id for j in jobs))
        client.add_jobs("h", [b"y"] * 10)
        floor = floors_of(dsn).floor("h")
        assert floor != FROM_THE_FRONT
        from_floor, from_front = _ready_blocks(db, floor), _ready_blocks(db, FROM_THE_FRONT)
        assert from_front > 10 * from_floor, (from_floor, from_front)


def _ready_blocks(db, floor: int) -> int:
    """Buffers a claim of 'h' from ``floor`` touches in the ready index and
    the heap behind it (the claim is rolled back)."""
    with db.transaction(force_rollback=True):
        plan = db.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql.CLAIM_ONE,
                          {"queue": "h", "floor": floor, "count": 10}).fetchone()[0]
    ready = [node for node in _nodes(plan) if node.get("Index Name") == "jobs_queued_idx"]
    assert ready, plan
    return sum(node["Shared Hit Blocks"] + node["Shared Read Blocks"] for node in ready)


def _nodes(plan):
    if isinstance(plan, dict):
        if "Node Type" in plan:
            yield plan
        for value in plan.values():
            yield from _nodes(value)
    elif isinstance(plan, list):
        for value in plan:
            yield from _nodes(value)


def test_clients_vacuum_the_job_table_when_it_is_mostly_dead(client, db):
    # autovacuum off for this table: what cleans it here is the client
    db.execute("ALTER TABLE pgq.jobs SET (autovacuum_enabled = off)")
    client.add_jobs("v", [b"x"] * (DEAD_MIN + 5_000))
    while jobs := client.get_job("v", count=1000, nohang=True):
        client.ack_job(*(j.id for j in jobs))
    stats = "SELECT vacuum_count, autovacuum_count, n_dead_tup, n_live_tup FROM pg_stat_user_tables " \
            "WHERE schemaname = 'pgq' AND relname = 'jobs'"

    def vacuumed() -> bool:
        client.qlen("v")  # calls run the periodic sweep, which asks for the vacuum
        return db.execute(stats).fetchone()[0] > 0

    try:
        wait_until(vacuumed, timeout=30, message="a client to VACUUM pgq.jobs")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; (vacuums, autovacuums, dead, live) = "
                             f"{db.execute(stats).fetchone()}") from None
