"""Reading pgq's views into Spark over JDBC, without holding back VACUUM."""

from __future__ import annotations

import re
import threading
import time

import psycopg
import pytest

from pgq.errors import InvalidArgumentError
from pgq.spark import read_jobs


def _finish(client, queue, n, outcome="ack"):
    ids = client.add_jobs(queue, [b"%d" % i for i in range(n)])
    jobs = client.get_job(queue, count=n, nohang=True)
    assert len(jobs) == n
    if outcome == "ack":
        client.ack_job(*(j.id for j in jobs))
    else:
        for job in jobs:
            client.dead_letter(job.id, reason="broken")
    return ids


def test_history_read_in_four_ranges_equals_what_was_acked(spark, client):
    acked = set(_finish(client, "reports", 2000))
    history = read_jobs(spark, client.dsn, "history", partitions=4)
    assert history.rdd.getNumPartitions() == 4
    rows = history.select("id", "queue", "outcome", "node").collect()
    assert {r["id"] for r in rows} == acked and len(rows) == 2000
    assert {(r["queue"], r["outcome"]) for r in rows} == {("reports", "acked")}
    assert len({r["node"] for r in rows}) == 1
    sizes = history.rdd.glom().map(len).collect()
    assert len(sizes) == 4 and min(sizes) > 0  # the ranges split the rows


def test_dead_letters_and_live_jobs_views(spark, client):
    dead = set(_finish(client, "fragile", 30, outcome="dead"))
    waiting = set(client.add_jobs("backlog", [b"x"] * 40))
    letters = read_jobs(spark, client.dsn, "dead_letters").collect()
    assert {r["id"] for r in letters} == dead and {r["reason"] for r in letters} == {"broken"}
    live = read_jobs(spark, client.dsn, "jobs", partitions=3).collect()
    assert {r["id"] for r in live} == waiting and {r["state"] for r in live} == {"queued"}
    with pytest.raises(InvalidArgumentError, match="choose one of"):
        read_jobs(spark, client.dsn, "pgq.secrets")


def _not_yet_removable(conn: psycopg.Connection) -> int:
    """VACUUM the hot table; how many dead rows it had to keep."""
    messages: list[str] = []

    def collect(diag: psycopg.errors.Diagnostic) -> None:
        messages.append(diag.message_primary or "")

    conn.add_notice_handler(collect)
    try:
        conn.execute("VACUUM (VERBOSE) pgq.jobs")
    finally:
        conn.remove_notice_handler(collect)
    found = [int(m) for text in messages for m in re.findall(r"(\d+) are dead but not yet removable", text)]
    assert found, messages
    return sum(found)


def _make_dead_rows(client, n=300):
    client.add_jobs("churn", [b"c"] * n)
    jobs = client.get_job("churn", count=n, nohang=True)
    client.ack_job(*(j.id for j in jobs))  # n deleted rows in pgq.jobs


def test_a_long_spark_read_does_not_hold_back_vacuum_of_the_hot_table(spark, client, dsn):
    _finish(client, "reports", 4000)
    history = read_jobs(spark, dsn, "history", partitions=8)
    done = threading.Event()

    def slow_analysis():
        # Spark spends seconds on the rows (2 ms each): the read must not
        # keep a snapshot open all that time.
        history.rdd.map(lambda row: (time.sleep(0.002), row)[1]).count()
        done.set()

    reader = threading.Thread(target=slow_analysis)
    reader.start()
    try:
        time.sleep(1.5)
        assert not done.is_set(), "the analysis must still be running for this test to mean anything"
        with psycopg.connect(dsn, autocommit=True) as conn:
            kept = None
            for _ in range(3):  # a range query running at this very moment is short: try again
                _make_dead_rows(client)
                kept = _not_yet_removable(conn)
                if kept == 0:
                    break
                time.sleep(0.2)
            assert kept == 0
            assert not done.is_set()
    finally:
        reader.join()

    # The control: a reader that holds its snapshot (a cursor read in one
    # transaction, as a naive JDBC read with fetchsize does) keeps them.
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn, autocommit=True) as conn:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pgq.job_history").fetchone()
        _make_dead_rows(client)
        assert _not_yet_removable(conn) >= 300
        holder.rollback()
