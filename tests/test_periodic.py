"""Periodic jobs (pgq.periodic): ticks of cron expressions in a time zone,
one job per tick however many schedulers run, missed ticks coalesced, the
worker's decorator and the CLI. Time is a parameter: nothing waits for a
real minute to pass."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from zoneinfo import ZoneInfo

import psycopg
import pytest

import pgq
from pgq import periodic
from pgq.errors import InvalidArgumentError, InvalidTypeError
from pgq.testing import run_jobs

from .conftest import TEMPLATE, _numbers

UTC = dt.UTC


def at(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text).replace(tzinfo=UTC)


def fire_together(schedulers: list[periodic.Scheduler], now: dt.datetime,
                  timeout: float = 60) -> list[tuple[str, dt.datetime, str]]:
    """Every scheduler's fire_due(now) at once, each in a thread; the jobs
    they added, all together."""
    added: list[tuple[str, dt.datetime, str]] = []
    threads = [threading.Thread(target=lambda s=s: added.extend(s.fire_due(now))) for s in schedulers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    return added


def test_ticks_follow_the_time_zone_across_a_dst_change():
    # 03:00 in Paris is 01:00 UTC in winter and 01:00 UTC again after the
    # October change (CEST -> CET moves it from 01:00 UTC to 02:00 UTC)
    assert periodic.latest_tick("0 3 * * *", "Europe/Paris", at("2026-10-24T12:00")) \
        == at("2026-10-24T01:00")
    assert periodic.latest_tick("0 3 * * *", "Europe/Paris", at("2026-10-26T12:00")) \
        == at("2026-10-26T02:00")
    assert periodic.next_tick("*/5 * * * *", "UTC", at("2026-11-25T08:50")) == at("2026-11-25T08:55")


def test_due_ticks_fire_once_and_coalesce_what_was_missed():
    cron = "0 * * * *"  # hourly
    assert periodic.due_tick(cron, "UTC", at("2026-11-25T08:00"), at("2026-11-25T08:59")) is None
    assert periodic.due_tick(cron, "UTC", at("2026-11-25T08:00"), at("2026-11-25T09:00")) \
        == at("2026-11-25T09:00")
    # down from 08:00 to 12:30: one job, for 12:00 (09:00-11:00 are skipped)
    assert periodic.due_tick(cron, "UTC", at("2026-11-25T08:00"), at("2026-11-25T12:30")) \
        == at("2026-11-25T12:00")
    # ... unless even the latest is older than the catch-up window
    assert periodic.due_tick(cron, "UTC", at("2026-11-25T08:00"), at("2026-11-25T12:30"),
                             catch_up=600) is None


def test_the_hour_after_an_autumn_dst_change_keeps_its_ticks():
    """The second 02:00 of 2024-10-27 in Paris (01:00 UTC) follows the first
    (00:00 UTC). last_tick comes back from the database in the session's
    zone, the same tzinfo as the tick: compared by wall clock they looked
    equal, and the repeated hour's ticks were dropped."""
    paris = dt.datetime(2024, 10, 27, 0, 0, tzinfo=UTC).astimezone(ZoneInfo("Europe/Paris"))
    assert paris.hour == 2 and paris.fold == 0
    tick = periodic.due_tick("0 * * * *", "Europe/Paris", paris, at("2024-10-27T01:00:30"))
    assert tick is not None and tick.astimezone(UTC) == at("2024-10-27T01:00")
    every15 = [periodic.due_tick("*/15 * * * *", "Europe/Paris", paris + dt.timedelta(minutes=i),
                                 at("2024-10-27T01:00") + dt.timedelta(minutes=i + 15, seconds=5))
               for i in (0, 15, 30)]
    assert all(t is not None for t in every15)


def test_the_repeated_hour_keeps_its_ticks_when_now_is_in_the_schedules_zone():
    """``now`` comes from the database in its session's time zone. When
    that is the schedule's zone (zoneinfo hands out one object per zone),
    Python added and subtracted by wall clock and dropped DST's fold:
    during the repeated hour, `now + 1 s` landed an hour back and those
    ticks were lost (or fired 45 minutes early), and the wait for the next
    tick was 0 (found by a read-only review). Looked at every 20 s from
    23:00 UTC, `*/15` must fire 16 times across 2024-10-27 01:00-05:00 in
    Paris (the hour 02:xx twice), as with ``now`` in UTC."""
    paris = ZoneInfo("Europe/Paris")
    fired: dict[str, list[dt.datetime]] = {"UTC": [], "Paris": []}
    for zone_name, zone in (("UTC", UTC), ("Paris", paris)):
        last = None
        now = at("2024-10-26T23:00")
        while now < at("2024-10-27T03:00"):
            tick = periodic.due_tick("*/15 * * * *", "Europe/Paris", last, now.astimezone(zone))
            if tick is not None:
                fired[zone_name].append(tick.astimezone(UTC))
                last = tick
            now += dt.timedelta(seconds=20)
    assert fired["Paris"] == fired["UTC"] and len(fired["UTC"]) == 16
    assert len(set(fired["UTC"])) == 16  # each once
    # The wait for the next tick, inside the repeated hour: 60 s (at most), not 0.
    schedule = periodic.Schedule("s", "*/15 * * * *", "q", tz="Europe/Paris")
    inside = at("2024-10-27T00:45:30").astimezone(paris)
    assert periodic._until_next([(schedule, None)], inside) == 60.0


@pytest.mark.parametrize("cron, tz, now, following", [
    ("30 2 * * *", "Europe/Paris", "2026-10-25T01:10", "2026-10-26T01:30"),  # in the second 02:xx
    ("30 1 * * *", "America/New_York", "2026-11-01T06:10", "2026-11-02T06:30"),
    ("59 1 * * *", "America/New_York", "2026-11-01T06:00:30", "2026-11-02T06:59"),
    ("* * * * *", "Europe/Paris", "2026-10-25T01:00:30", "2026-10-25T01:01"),
])
def test_the_next_tick_is_never_in_the_past_during_the_repeated_hour(cron, tz, now, following):
    """From the hour's second pass, cronsim's forward search gave that hour's
    first-pass tick, up to an hour back: the wait for it was 0, and every
    scheduler of the database looked 20 times a second, a new connection
    each, for up to an hour (found by a read-only review)."""
    tick = periodic.next_tick(cron, tz, at(now).astimezone(ZoneInfo(tz)))
    assert tick.astimezone(UTC) == at(following)
    schedule = periodic.Schedule("s", cron, "q", tz=tz)
    assert periodic._until_next([(schedule, None)], at(now)) > 0


def test_a_tick_seen_on_time_fires_whatever_catch_up_says():
    # the scheduler wakes 0.05 s after a tick: catch_up=0 used to mean never
    tick = at("2026-11-25T09:00")
    assert periodic.due_tick("0 * * * *", "UTC", None, tick + dt.timedelta(seconds=0.05),
                             catch_up=0) == tick
    assert periodic.due_tick("0 * * * *", "UTC", None, tick + dt.timedelta(minutes=5),
                             catch_up=0) is None  # missed, and no catching up


@pytest.mark.parametrize("cron,tz,message", [
    ("61 * * * *", "UTC", "invalid cron expression"),
    ("* * *", "UTC", "invalid cron expression"),
    # six fields (seconds first): cronsim reads them without its DST
    # correction, so "0 30 2 * * *" in Paris fired twice one autumn night
    ("0 30 2 * * *", "Europe/Paris", "give five fields"),
    # never fires: cronsim gave up after 50 years with StopIteration, which
    # killed every worker whose scheduler loaded the row
    ("0 0 */31 * 1#5", "UTC", "never fires"),
    ("* * * * *", "Mars/Olympus", "unknown time zone"),
    ("* * * * *", "America", "unknown time zone"),  # a directory: IsADirectoryError
    ("* * * * *", "x" * 300, "unknown time zone"),  # a name too long: OSError
])
def test_bad_schedules_are_refused_with_what_to_fix(cron, tz, message):
    with pytest.raises(InvalidArgumentError, match=message):
        periodic.Schedule("s", cron, "q", tz=tz)
    with pytest.raises(InvalidArgumentError, match="unknown schedule option"):
        periodic.Schedule("s", "* * * * *", "q", options={"priority": 1})
    # A name from a shell that is no UTF-8 ($'\xff'): psycopg's encoding
    # error was a traceback; NUL cannot be stored.
    for name in ("\udcff", "a\x00b"):
        with pytest.raises(InvalidArgumentError, match="name"):
            periodic.Schedule(name, "* * * * *", "q")


@pytest.mark.parametrize("queue,body,options", [
    ("q", b"", {"catch_up": "x"}),  # float("x") crashed every scheduler at each tick
    ("q", b"", {"catch_up": float("nan")}),
    ("q", b"", {"retry": -5}),  # refused by every add: the schedules after it never fired
    ("q", b"", {"replicate": 0}),
    ("", b"", {}),
    ("q", "text", {}),  # a body is bytes here (Worker.periodic encodes str)
])
def test_a_schedule_with_options_an_add_would_refuse_is_refused_when_made(queue, body, options):
    with pytest.raises((InvalidArgumentError, InvalidTypeError)):
        periodic.Schedule("s", "* * * * *", queue, body, options=options)


def test_one_job_per_tick_however_many_schedulers_run(client, dsn):
    start = at("2026-11-25T08:52")
    with psycopg.connect(dsn, autocommit=True) as conn:
        periodic.save(conn, periodic.Schedule("every5", "*/5 * * * *", "ticks", b"go",
                                              options={"retry": 30}), start)
    schedulers = [periodic.Scheduler(client) for _ in range(4)]
    assert schedulers[0].fire_due(start) == []  # a new schedule starts with its next tick
    added = fire_together(schedulers, at("2026-11-25T08:55"))
    assert [(name, tick) for name, tick, _ in added] == [("every5", at("2026-11-25T08:55"))]
    assert client.qlen("ticks") == 1 and client.show(added[0][2])["retry"] == 30
    assert schedulers[1].fire_due(at("2026-11-25T08:59")) == []  # same tick: nothing more
    assert [t for _, t, _ in schedulers[2].fire_due(at("2026-11-25T09:00"))] == [at("2026-11-25T09:00")]
    assert schedulers[2].next_in == 60  # 09:05 is further: capped (schedules may change)
    with psycopg.connect(dsn, autocommit=True) as conn:  # a row broken by hand stops nothing
        conn.execute("INSERT INTO pgq.periodic (name, cron, queue) VALUES ('broken', 'nope', 'q'), "
                     "('never', '0 0 */31 * 1#5', 'q')")
    assert [t for _, t, _ in schedulers[3].fire_due(at("2026-11-25T09:05"))] == [at("2026-11-25T09:05")]
    assert 0 < schedulers[0].seconds_to_next(at("2026-11-25T09:01")) <= 240


@pytest.fixture
def two_nodes(server) -> Iterator[list[str]]:
    """Two databases that see each other as nodes of one cluster, as their
    node processes write it (pgq.meta: their IDs and bus addresses;
    pgq.nodes: the peer, alive, with the DSN it advertised). Node A has
    the lower ID: it is the tick home."""
    names = [f"pgq_test_{os.getpid()}_{next(_numbers)}" for _ in "ab"]
    with psycopg.connect(server.admin_dsn, autocommit=True) as admin:
        for name in names:
            admin.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
    dsns = [server.dsn(name) for name in names]
    ids = ["a" * 40, "b" * 40]
    try:
        for me, dsn in enumerate(dsns):
            with psycopg.connect(dsn, autocommit=True) as conn:
                # A heartbeat far ahead: "its node process runs" for the whole test.
                conn.execute("INSERT INTO pgq.meta (key, value) VALUES ('bus_host', '127.0.0.1'), "
                             "('bus_port', %s), ('heartbeat_at', '2100-01-01T00:00:00Z') "
                             "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                             (str(7800 + me),))
                conn.execute("UPDATE pgq.meta SET value = %s WHERE key = 'node_id'", (ids[me],))
                conn.execute("INSERT INTO pgq.nodes (id, host, port, status, dsn) "
                             "VALUES (%s, '127.0.0.1', %s, 'alive', %s)",
                             (ids[1 - me], 7800 + 1 - me, dsns[1 - me]))
        yield dsns
    finally:
        with psycopg.connect(server.admin_dsn, autocommit=True) as admin:
            for name in names:
                admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _every5(name: str, queue: str) -> periodic.Schedule:
    # replicate=1: no node process runs here to make copies
    return periodic.Schedule(name, "*/5 * * * *", queue, options={"replicate": 1})


def _save(dsns: list[str], *schedules: periodic.Schedule) -> None:
    for dsn in dsns:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for schedule in schedules:
                periodic.save(conn, schedule, at("2026-11-25T08:52"))


def test_one_job_per_tick_in_a_cluster_whichever_nodes_hold_the_schedule(two_nodes):
    # Each node's database kept its own schedules: workers declaring one
    # schedule on every node added a job per node at every tick.
    _save(two_nodes, _every5("every5", "ticks"))
    clients = [pgq.Client(dsn) for dsn in two_nodes]
    try:
        for dsn in two_nodes:
            with psycopg.connect(dsn) as conn:
                home = periodic.tick_home(conn)
                assert home is not None and home.node == "a" * 40
        schedulers = [periodic.Scheduler(c) for c in clients for _ in range(2)]
        added = fire_together(schedulers, at("2026-11-25T08:55"))
        assert [(name, tick) for name, tick, _ in added] == [("every5", at("2026-11-25T08:55"))]
        assert sum(c.qlen("ticks") for c in clients) == 1
        # Node B alone at the next tick: it claims at A's database, adds on its own.
        assert [t for _, t, _ in schedulers[2].fire_due(at("2026-11-25T09:00:01"))] == [at("2026-11-25T09:00")]
        assert schedulers[0].fire_due(at("2026-11-25T09:00:02")) == []
        assert [c.qlen("ticks") for c in clients][1] >= 1 and sum(c.qlen("ticks") for c in clients) == 2
        with psycopg.connect(two_nodes[0]) as conn:
            assert conn.execute("SELECT last_tick, claimed_by FROM pgq.periodic_claims").fetchall() == [
                (at("2026-11-25T09:00"), "b" * 40)]
        with psycopg.connect(two_nodes[1]) as conn:  # claimed at the home only
            assert conn.execute("SELECT count(*) FROM pgq.periodic_claims").fetchone() == (0,)
    finally:
        for c in clients:
            c.close()


def test_a_look_does_not_wait_for_ever_on_a_locked_table(client, dsn, monkeypatch):
    """A look's connection had no lock (nor statement, nor connect) timeout:
    behind a migration or VACUUM FULL holding pgq.periodic it waited for as
    long, in a thread the worker's stop then waited for (found by a
    read-only review). The lock timeout is made short here; the lock is held
    up to 20 s (TableLock), far longer."""
    import time

    from .conftest import TableLock

    monkeypatch.setattr(periodic, "LOOK_LOCK_TIMEOUT_MS", 200)
    lock = TableLock(dsn, "pgq.periodic")
    lock.take()
    try:
        started = time.monotonic()
        with pytest.raises(psycopg.errors.LockNotAvailable):
            periodic.Scheduler(client).fire_due()
        assert time.monotonic() - started < 10  # (the lock would have held it 20 s)
    finally:
        lock.release()
    # One schedule's row held by another session (a scheduler adding its
    # job): that schedule waits for the next look, the others fire (its
    # lock timeout, an OperationalError, ended the whole look).
    start = at("2026-11-25T08:52")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in ("held", "free"):
            periodic.save(conn, periodic.Schedule(name, "*/5 * * * *", f"{name}-ticks"), start)
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT 1 FROM pgq.periodic WHERE name = 'held' FOR UPDATE")
        fired = periodic.Scheduler(client).fire_due(at("2026-11-25T08:55"))
    assert [name for name, _, _ in fired] == ["free"]
    assert [name for name, _, _ in periodic.Scheduler(client).fire_due(at("2026-11-25T08:55"))] == ["held"]


def test_a_tick_home_that_does_not_answer_delays_the_tick(two_nodes, caplog):
    _save(two_nodes[1:], _every5("late", "late-ticks"), _every5("later", "late-ticks"))
    with psycopg.connect(two_nodes[1], autocommit=True) as conn:
        conn.execute("UPDATE pgq.nodes SET dsn = 'host=127.0.0.1 port=1 dbname=gone connect_timeout=2'")
    with pgq.Client(two_nodes[1]) as client:
        scheduler = periodic.Scheduler(client)
        with caplog.at_level("WARNING", logger="pgq"):
            assert scheduler.fire_due(at("2026-11-25T08:55")) == []
        assert "tick home, node aaaaaaaa, did not answer (" in caplog.text
        # once a look: the second schedule did not wait for it again
        assert "tick home, node aaaaaaaa, did not answer earlier in this look" in caplog.text
        assert client.qlen("late-ticks") == 0
        with psycopg.connect(two_nodes[1], autocommit=True) as conn:  # answers again
            conn.execute("UPDATE pgq.nodes SET dsn = %s", (two_nodes[0],))
        assert [t for _, t, _ in scheduler.fire_due(at("2026-11-25T08:56"))] == [at("2026-11-25T08:55")] * 2
        assert client.qlen("late-ticks") == 2


def test_a_tick_home_without_a_dsn_leaves_each_node_its_own_tick(two_nodes, caplog):
    _save(two_nodes, _every5("own", "own-ticks"))
    for dsn in two_nodes:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("UPDATE pgq.nodes SET dsn = NULL")
    clients = [pgq.Client(dsn) for dsn in two_nodes]
    try:
        with caplog.at_level("WARNING", logger="pgq"):
            for c in clients:
                assert len(periodic.Scheduler(c).fire_due(at("2026-11-25T08:55"))) == 1
        assert "cannot share ticks: it advertised no DSN" in caplog.text
        assert [c.qlen("own-ticks") for c in clients] == [1, 1]
    finally:
        for c in clients:
            c.close()


def test_an_add_a_node_refuses_leaves_the_tick_to_another_node(two_nodes, caplog):
    # The claim was made before the add: node B won the tick at the home,
    # its add was refused (a paused queue), and no node added the job.
    _save(two_nodes, _every5("refused", "refused-q"))
    with pgq.Client(two_nodes[0]) as a, pgq.Client(two_nodes[1]) as b:
        b.pause("refused-q", "in")
        with caplog.at_level("WARNING", logger="pgq"):
            assert periodic.Scheduler(b).fire_due(at("2026-11-25T08:55")) == []
        assert "could not add its job" in caplog.text
        assert [t for _, t, _ in periodic.Scheduler(a).fire_due(at("2026-11-25T08:55:30"))] == \
            [at("2026-11-25T08:55")]
        assert (a.qlen("refused-q"), b.qlen("refused-q")) == (1, 0)


def test_a_claim_is_its_claimers_to_win_again(two_nodes):
    # Node B claimed 08:55 at the home, and its own commit was lost (a
    # crash, a dropped reply): B's next look adds the job; A's adds none.
    _save(two_nodes, _every5("again", "again-q"))
    with psycopg.connect(two_nodes[0], autocommit=True) as home:
        home.execute("INSERT INTO pgq.periodic_claims (name, last_tick, claimed_by) "
                     "VALUES ('again', %s, %s)", (at("2026-11-25T08:55"), "b" * 40))
    with pgq.Client(two_nodes[0]) as a, pgq.Client(two_nodes[1]) as b:
        assert periodic.Scheduler(a).fire_due(at("2026-11-25T08:55:10")) == []
        assert len(periodic.Scheduler(b).fire_due(at("2026-11-25T08:55:20"))) == 1
        assert (a.qlen("again-q"), b.qlen("again-q")) == (0, 1)


def test_a_dsn_that_reaches_another_database_shares_no_tick(two_nodes, caplog):
    # Nodes that advertise "localhost" reach their own databases: each won
    # its own claim there, silently.
    _save(two_nodes, _every5("local", "local-q"))
    with psycopg.connect(two_nodes[1], autocommit=True) as conn:
        conn.execute("UPDATE pgq.nodes SET dsn = %s", (two_nodes[1],))  # B's own, as A's
    with pgq.Client(two_nodes[1]) as b:
        with caplog.at_level("WARNING", logger="pgq"):
            assert len(periodic.Scheduler(b).fire_due(at("2026-11-25T08:55"))) == 1
        assert "reaches another database (node bbbbbbbb)" in caplog.text
    with psycopg.connect(two_nodes[1]) as conn:
        assert conn.execute("SELECT count(*) FROM pgq.periodic_claims").fetchone() == (0,)


def test_a_node_whose_process_is_down_leaves_its_ticks_to_the_others(two_nodes, caplog):
    # A's own row says "alive" whatever: with its process down it took
    # itself for the home while the others had moved on, and both added.
    _save(two_nodes, _every5("down", "down-q"), _every5("down-too", "down-q"))
    with psycopg.connect(two_nodes[0], autocommit=True) as conn:
        conn.execute("UPDATE pgq.meta SET value = '2000-01-01T00:00:00Z' WHERE key = 'heartbeat_at'")
    with pgq.Client(two_nodes[0]) as a, pgq.Client(two_nodes[1]) as b:
        with caplog.at_level("WARNING", logger="pgq"):
            assert periodic.Scheduler(a).fire_due(at("2026-11-25T08:55")) == []
        # said once a look, not once per schedule
        assert caplog.text.count("this node's process is not running") == 1
        assert len(periodic.Scheduler(b).fire_due(at("2026-11-25T08:55"))) == 2
        assert (a.qlen("down-q"), b.qlen("down-q")) == (0, 2)


def test_ticks_follow_the_databases_clock_not_this_machines(client, dsn):
    # Each machine's clock decided: a schedule saved at 02:55 from a host
    # whose clock said 03:01 skipped that night's tick, and a scheduler on a
    # fast host claimed every tick early. The database's clock (pgq.now(),
    # set here per session) is the one all schedulers share.
    from psycopg.conninfo import make_conninfo

    def clocked(when: str) -> str:
        return make_conninfo(dsn, options=f"-c pgq.now={when}")

    with psycopg.connect(clocked("2030-01-01T02:55:00Z"), autocommit=True) as conn:
        periodic.save(conn, periodic.Schedule("nightly-db", "0 3 * * *", "db-ticks", b"go"))

    class OnTheDatabasesClock:  # the scheduler's view of its client: a DSN, and the add
        dsn = clocked("2030-01-01T03:00:30Z")
        add_job = staticmethod(client.add_job)

    added = periodic.Scheduler(OnTheDatabasesClock()).fire_due()
    assert [(name, tick) for name, tick, _ in added] == [("nightly-db", at("2030-01-01T03:00"))]
    assert client.qlen("db-ticks") == 1


def test_one_schedule_that_cannot_add_stops_no_other(client, dsn):
    start = at("2026-11-25T08:52")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name, queue in (("a-paused", "paused-q"), ("b-fine", "fine-q")):
            periodic.save(conn, periodic.Schedule(name, "*/5 * * * *", queue), start)
        # hand-edited rows whose options are no object are skipped, not fatal
        conn.execute("INSERT INTO pgq.periodic (name, cron, queue, options) "
                     "VALUES ('c-list', '* * * * *', 'q', '[1]'), ('d-text', '* * * * *', 'q', '\"x\"')")
    client.pause("paused-q", "in")
    scheduler = periodic.Scheduler(client)
    added = scheduler.fire_due(at("2026-11-25T08:55"))
    assert [(name, tick) for name, tick, _ in added] == [("b-fine", at("2026-11-25T08:55"))]
    assert client.qlen("fine-q") == 1 and client.qlen("paused-q") == 0
    client.pause("paused-q", "none")  # its tick was not claimed: the next look adds it
    assert [name for name, _, _ in scheduler.fire_due(at("2026-11-25T08:56"))] == ["a-paused"]
    assert client.qlen("paused-q") == 1


def test_a_changed_schedule_starts_at_its_next_tick(client, dsn):
    with psycopg.connect(dsn, autocommit=True) as conn:
        periodic.save(conn, periodic.Schedule("nightly", "0 3 * * *", "backups"),
                      at("2026-11-25T03:00:10"))
    scheduler = periodic.Scheduler(client)
    with psycopg.connect(dsn, autocommit=True) as conn:  # at 10:20, made hourly
        periodic.save(conn, periodic.Schedule("nightly", "0 * * * *", "backups"),
                      at("2026-11-25T10:20"))
    assert scheduler.fire_due(at("2026-11-25T10:20:30")) == []  # not the 10:00 tick
    assert [t for _, t, _ in scheduler.fire_due(at("2026-11-25T11:00:01"))] == [at("2026-11-25T11:00")]
    with psycopg.connect(dsn, autocommit=True) as conn:  # saved unchanged: a missed tick stays due
        periodic.save(conn, periodic.Schedule("nightly", "0 * * * *", "backups"),
                      at("2026-11-25T12:10"))
    assert [t for _, t, _ in scheduler.fire_due(at("2026-11-25T12:10:30"))] == [at("2026-11-25T12:00")]


def test_a_tick_claimed_after_its_schedule_changed_adds_nothing_stale(client, dsn):
    """A scheduler that read a schedule, then claimed its tick after the
    schedule changed (here its queue), added the job with what it had read:
    into the old queue. The claim now holds only for the schedule it read."""
    start = at("2026-11-25T08:52")
    old = periodic.Schedule("changing", "*/5 * * * *", "old-queue")
    scheduler = periodic.Scheduler(client)
    with psycopg.connect(dsn, autocommit=True) as conn:
        periodic.save(conn, old, start)
        periodic.save(conn, periodic.Schedule("changing", "*/5 * * * *", "new-queue"), start)
        assert scheduler._fire(conn, old, at("2026-11-25T08:55")) is None
    assert client.qlen("old-queue") == 0
    assert [t for _, t, _ in scheduler.fire_due(at("2026-11-25T08:55"))] == [at("2026-11-25T08:55")]
    assert client.qlen("new-queue") == 1


def test_two_periodic_functions_may_not_share_a_queue(client):
    worker = pgq.Worker(client, concurrency=1)

    @worker.periodic("0 * * * *", queue="maint")
    def hourly(job):
        pass

    with pytest.raises(InvalidArgumentError, match="already has a handler"):
        @worker.periodic("0 3 * * *", queue="maint")
        def nightly(job):
            pass

    worker.periodic("30 * * * *", queue="maint", name="hourly-too")(hourly)  # one function, two schedules
    assert [s.name for s in worker.schedules] == [f"{__name__}.{hourly.__qualname__}", "hourly-too"]
    # Saved by name: a second schedule of one function without its own name
    # replaced the first one in the database.
    with pytest.raises(InvalidArgumentError, match="registered already"):
        worker.periodic("45 * * * *", queue="maint")(hourly)
    assert len(worker.schedules) == 2


def test_crons_shortcuts_work_as_documented():
    """@daily and friends were documented and refused (cronsim reads none)."""
    now = at("2026-11-25T08:52")
    assert periodic.next_tick("@daily", "UTC", now) == at("2026-11-26T00:00")
    assert periodic.next_tick("@hourly", "UTC", now) == at("2026-11-25T09:00")
    assert periodic.next_tick("@weekly", "UTC", now) == at("2026-11-29T00:00")  # a Sunday
    assert periodic.next_tick("@monthly", "UTC", now) == at("2026-12-01T00:00")
    assert periodic.next_tick("@yearly", "UTC", now) == at("2027-01-01T00:00")
    assert periodic.Schedule("s", "@midnight", "q").cron == "@midnight"  # kept as written


def test_a_workers_periodic_task_is_scheduled_and_served(client, dsn):
    seen = []
    worker = pgq.Worker(client, concurrency=1)

    @worker.periodic("0 3 * * *", queue="nightly", tz="Europe/Paris", retry=60)
    def backup(job):
        seen.append(job.body)

    run_jobs(worker)  # saves the schedule; nothing is due yet
    with psycopg.connect(dsn) as conn:
        (schedule, last), = periodic.load(conn)
    assert (schedule.name, schedule.cron, schedule.tz) == (f"{__name__}.{backup.__qualname__}",
                                                           "0 3 * * *", "Europe/Paris")
    assert last is not None and seen == []
    added = periodic.Scheduler(client).fire_due(last + dt.timedelta(days=1, minutes=1))
    assert len(added) == 1
    run_jobs(worker)
    assert seen == [b""]


def test_a_worker_declaring_schedules_on_a_node_of_a_cluster_warns(client, dsn, caplog):
    # A cluster whose tick home advertised no DSN cannot share ticks:
    # workers declaring one schedule on every node add a job per node at
    # each tick, and the worker says so.
    worker = pgq.Worker(client, concurrency=1)
    worker.periodic("0 3 * * *", queue="nightly-c", name="nightly-c")(lambda job: None)
    with caplog.at_level("WARNING", logger="pgq"):
        run_jobs(worker)  # saves the schedule; alone: nothing to say
        assert "tick home" not in caplog.text
        with psycopg.connect(dsn, autocommit=True) as db:  # two peers, as a node process writes them
            db.execute("INSERT INTO pgq.nodes (id, host, port, status) VALUES "
                       "(repeat('b', 40), '127.0.0.1', 7999, 'alive'), "
                       "(repeat('c', 40), '127.0.0.1', 7998, 'alive')")
        run_jobs(worker)
    assert "one of 2 in a cluster, and the cluster's tick home" in caplog.text
    assert "nightly-c" in caplog.text


def test_the_periodic_commands(dsn):
    def pgq_cli(*args):
        return subprocess.run([sys.executable, "-m", "pgq", "periodic", *args, "--dsn", dsn],
                              capture_output=True, text=True, timeout=60)

    done = pgq_cli("add", "reports", "*/10 * * * *", "--queue", "reports", "--body", "weekly",
                   "--replicate", "1")
    assert done.returncode == 0 and done.stdout.startswith("reports: next job "), done.stderr
    listed = json.loads(pgq_cli("list", "--json").stdout)
    assert [(s["name"], s["cron"], s["queue"], s["options"]) for s in listed] == [  # options: an object
        ("reports", "*/10 * * * *", "reports", {"replicate": 1, "catch_up": 3600.0})]
    bad = pgq_cli("add", "x", "every day", "--queue", "q")
    assert bad.returncode == 1 and "invalid cron expression" in bad.stderr
    # A row made invalid by hand is listed, with why: it was hidden, and its
    # name could not be found to remove it.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO pgq.periodic (name, cron, queue, tz) VALUES ('mars', '0 3 * * *', 'q', "
                     "'Mars/Olympus')")
    listed = {s["name"]: s for s in json.loads(pgq_cli("list", "--json").stdout)}
    assert listed["mars"]["next_tick"].startswith("never (invalid: ") and "Mars/Olympus" in \
        listed["mars"]["next_tick"]
    assert pgq_cli("remove", "mars").returncode == 0
    assert pgq_cli("remove", "reports").returncode == 0
    missing = pgq_cli("remove", "reports")
    assert missing.returncode == 3 and "no schedule named reports" in missing.stderr
