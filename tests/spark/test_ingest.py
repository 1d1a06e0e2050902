"""Bulk ingestion from Spark into one node: real Spark, real PostgreSQL, JDBC."""

from __future__ import annotations

import psycopg
import pytest

import pgq
from pgq.errors import IngestError, InvalidArgumentError, NoReplError, PausedError
from pgq.ids import ingest_job_id, is_at_least_once_id, validate_job_id
from pgq.spark import write_jobs
from pgq.spark.ingest import Ingestion

from ..conftest import counters_match_jobs


def frame(spark, bodies, partitions=3, column="body"):
    """A DataFrame whose order is the order of ``bodies`` (no shuffle)."""
    return spark.sparkContext.parallelize([(b,) for b in bodies], partitions).toDF([column])


def ingestion(spark, df, dsn, **options):
    defaults = dict(nodes=dsn, replicate=None, delay=0, retry=None, ttl=None, body_col="body",
                    ingest_id=None, partitions=None, progress=None)
    return Ingestion(spark, df, "lake", **{**defaults, **options})


def test_a_dataframe_becomes_jobs_in_its_order(spark, client, db, dsn):
    bodies = [f"event {i}" for i in range(600)]
    db.execute("LISTEN pgq")
    result = write_jobs(frame(spark, bodies), "lake", nodes=dsn, retry=30, ttl=3600)
    # The merge NOTIFYs whether or not a consumer was registered when it
    # looked (one registering before its commit slept until its next poll).
    assert [n.payload for n in db.notifies(timeout=5, stop_after=1)] == ["lake"]
    assert (result.jobs, result.replicate, result.already_done) == (600, 1, False)
    assert client.qlen("lake") == 600
    jobs = client.get_job("lake", count=1000, nohang=True)
    assert [j.body for j in jobs] == [b.encode() for b in bodies]
    assert len({validate_job_id(j.id) for j in jobs}) == 600
    assert all(is_at_least_once_id(j.id) for j in jobs)
    shown = client.show(jobs[0].id)
    assert shown["retry"] == 30 and 3500 < shown["ttl"] <= 3600
    assert counters_match_jobs(db)
    assert db.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'pgq_staging'").fetchone()[0] == 0


def test_spark_builds_the_reference_job_ids(spark, dsn):
    run = ingestion(spark, frame(spark, [f"b{i}" for i in range(50)], partitions=4), dsn,
                    retry=0, ttl=7200)
    run.begin()
    prepared = run.prepare()
    rows = prepared.select("seq", "id").collect()
    run.finish()
    assert sorted(r["seq"] for r in rows) == list(range(50))
    node_id = run.plan.node_ids[0]
    for row in rows:
        assert row["id"] == ingest_job_id(node_id, run.started_ms, run.plan.key, row["seq"],
                                          run.plan.ttl_field)
    assert not is_at_least_once_id(rows[0]["id"])  # retry=0: even TTL field
    by_seq = sorted(rows, key=lambda r: r["seq"])
    assert [r["id"] for r in by_seq] == sorted(r["id"] for r in rows)  # IDs grow with the row


def test_binary_bodies_delay_and_at_most_once(spark, client, dsn):
    bodies = [bytes([i % 256, 0, 255]) for i in range(300)]
    result = write_jobs(frame(spark, bodies), "lake", nodes=dsn, delay=60, retry=0)
    assert result.jobs == 300
    assert client.qlen("lake") == 0  # delayed: active, not queued
    ids = [row[0] for row in psycopg.connect(dsn).execute(
        "SELECT id FROM pgq.jobs ORDER BY ctime").fetchall()]
    assert len(ids) == 300 and not any(is_at_least_once_id(i) for i in ids)
    assert client.show(ids[0])["state"] == "active"
    assert bytes(client.show(ids[7])["body"]) == bodies[7]


def test_a_rerun_adds_nothing_even_after_jobs_were_acked(spark, client, dsn):
    df = frame(spark, [f"order {i}" for i in range(400)])
    first = write_jobs(df, "lake", nodes=dsn, ingest_id="orders-2026-11-21")
    assert first.jobs == 400
    done = client.get_job("lake", count=150, nohang=True)
    client.ack_job(*(j.id for j in done))
    again = write_jobs(df, "lake", nodes=dsn, ingest_id="orders-2026-11-21")
    assert again.already_done and again.jobs == 0
    assert client.qlen("lake") == 250


def test_rows_staged_twice_become_one_job_each(spark, client, db, dsn):
    # A Spark task that committed and then was retried (or ran speculatively)
    # stages its partition twice: the merge keeps one job per row.
    run = ingestion(spark, frame(spark, [f"x{i}" for i in range(500)]), dsn)
    run.begin()
    prepared = run.prepare()
    run.stage(prepared, 0)
    run.stage(prepared, 0)
    staged = db.execute(f"SELECT count(*) FROM pgq_staging.{run.plan.staging_table}").fetchone()[0]
    assert staged == 1000
    assert run.merge(0) == 500
    run.finish()
    assert client.qlen("lake") == 500
    assert db.execute("SELECT count(DISTINCT body) FROM pgq.jobs").fetchone()[0] == 500
    assert counters_match_jobs(db)


def test_a_job_here_already_under_a_rows_id_counts_as_merged(spark, client, db, dsn):
    # Federation (YOURJOBS) brings a job to another node under its ID: a node
    # merging after the origin may hold some of its rows' jobs already. The
    # count check refused the merge, and every re-run, while that job lived
    # (found by a read-only review). Stand-in for the import: a live job of
    # the queue given one staged row's ID.
    run = ingestion(spark, frame(spark, [f"f{i}" for i in range(200)]), dsn)
    run.begin()
    run.stage(run.prepare(), 0)
    [staged_id] = db.execute(f"SELECT id FROM pgq_staging.{run.plan.staging_table} "
                             "ORDER BY seq LIMIT 1").fetchone()
    imported = client.add_job("lake", b"f0", retry=30)
    db.execute("UPDATE pgq.jobs SET id = %s WHERE id = %s", (staged_id, imported))
    assert run.merge(0) == 199
    run.finish()
    assert client.qlen("lake") == 200 and client.show(staged_id)["body"] == b"f0"
    assert counters_match_jobs(db)


def test_an_interrupted_ingestion_shows_nothing_and_a_rerun_finishes_it(spark, client, dsn):
    df = frame(spark, [f"y{i}" for i in range(300)])
    run = ingestion(spark, df, dsn, ingest_id="interrupted")
    run.begin()
    run.stage(run.prepare(), 0)
    run.finish()  # the driver died before merging
    assert client.qlen("lake") == 0 and client.get_job("lake", nohang=True) == []
    result = write_jobs(df, "lake", nodes=dsn, ingest_id="interrupted")
    assert result.jobs == 300 and not result.already_done
    assert sorted(j.body for j in client.get_job("lake", count=500, nohang=True)) == \
        sorted(f"y{i}".encode() for i in range(300))


def test_input_that_changes_between_passes_is_refused_not_half_merged(spark, client, db, dsn):
    run = ingestion(spark, frame(spark, [f"z{i}" for i in range(200)]), dsn)
    run.begin()
    prepared = run.prepare()
    # Stage only part of the rows, as a DataFrame that lost rows between passes would.
    run.stage(prepared.filter("seq < 150"), 0)
    with pytest.raises(IngestError, match="150 distinct rows .* 200 expected"):
        run.merge(0)
    run.finish()
    assert client.qlen("lake") == 0
    assert db.execute("SELECT state FROM pgq.ingests").fetchone()[0] == "staging"


def test_bad_input_is_refused_before_anything_is_written(spark, client, db, dsn):
    good = frame(spark, ["a", "b"])
    with pytest.raises(InvalidArgumentError, match="no column 'payload'"):
        write_jobs(good, "lake", nodes=dsn, body_col="payload")
    numbers = spark.createDataFrame([(1,), (2,)], ["body"])
    with pytest.raises(InvalidArgumentError, match="string or binary"):
        write_jobs(numbers, "lake", nodes=dsn)
    with_nulls = spark.createDataFrame([("a",), (None,)], "body string")
    with pytest.raises(InvalidArgumentError, match="1 null value"):
        write_jobs(with_nulls, "lake", nodes=dsn)
    with pytest.raises(InvalidArgumentError, match="TCP host"):
        write_jobs(good, "lake", nodes="dbname=pgq host=/var/run/postgresql")
    with pytest.raises(NoReplError, match="at least 2 target nodes"):
        write_jobs(good, "lake", nodes=dsn, replicate=2)
    with pytest.raises(InvalidArgumentError, match="delay"):
        write_jobs(good, "lake", nodes=dsn, delay=100, ttl=10)
    with pytest.raises(InvalidArgumentError, match="queue"):
        write_jobs(good, "", nodes=dsn)
    # psycopg's DataError and a UnicodeEncodeError from deep inside before (a review)
    for bad in ("a\x00b", "\udcff"):
        with pytest.raises(InvalidArgumentError, match="ingest_id"):
            write_jobs(good, "lake", nodes=dsn, ingest_id=bad)
    # one database, two DSNs (localhost and 127.0.0.1, say): half the rows were lost
    twice = dsn + ("&" if "?" in dsn else "?") + "application_name=another-spelling"
    with pytest.raises(InvalidArgumentError, match="same database twice"):
        write_jobs(good, "lake", nodes=[dsn, twice])
    write_jobs(good, "lake", nodes=dsn, ingest_id="fixed", retry=10)
    with pytest.raises(InvalidArgumentError, match="other options"):
        write_jobs(good, "lake", nodes=dsn, ingest_id="fixed", retry=20)
    # An empty input adds nothing and records nothing: it marked the ID done,
    # and the data that came later under that ID was dropped (a review).
    empty = spark.createDataFrame([], "body string")
    assert write_jobs(empty, "later", nodes=dsn, ingest_id="daily").jobs == 0
    assert write_jobs(frame(spark, ["x"]), "later", nodes=dsn, ingest_id="daily").jobs == 1
    assert client.qlen("later") == 1
    client.pause("paused", "in")
    with pytest.raises(PausedError):
        write_jobs(good, "paused", nodes=dsn)
    assert client.qlen("lake") == 2 and client.qlen("paused") == 0
    assert db.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'pgq_staging'").fetchone()[0] == 0


def test_two_standalone_nodes_share_the_rows(spark, server, dsn):
    server.create_database("pgq_spark_second", template="pgq_template")
    second = server.dsn("pgq_spark_second")
    try:
        with psycopg.connect(second, autocommit=True) as conn:  # its own node id
            conn.execute("UPDATE pgq.meta SET value = repeat('e', 40) WHERE key = 'node_id'")
        result = write_jobs(frame(spark, [f"s{i}" for i in range(101)]), "lake", nodes=[dsn, second])
        assert result.jobs == 101 and sorted(result.copies_by_node.values()) == [50, 51]
        with pytest.raises(InvalidArgumentError, match="one running cluster"):
            write_jobs(frame(spark, ["a"]), "lake", nodes=[dsn, second], replicate=2)
        taken = []
        for target in (dsn, second):
            with pgq.Client(target) as client:
                jobs = client.get_job("lake", count=200, nohang=True)
                assert {j.id[2:10] for j in jobs} == {client.node_id[:8]}  # each node's own prefix
                taken += [j.body for j in jobs]
        assert sorted(taken) == sorted(f"s{i}".encode() for i in range(101))
    finally:
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            conn.execute("DROP DATABASE IF EXISTS pgq_spark_second WITH (FORCE)")


def test_a_failure_of_spark_or_a_node_names_the_ingestion_to_run_again():
    """What Spark raises (a Py4JJavaError: one line, then a page of Java
    stack) or a node's database raises while staging or merging comes out as
    an IngestError naming the ingest id, which the default id never showed.
    The wrapper on its own (the failures themselves need a broken cluster)."""
    from types import SimpleNamespace

    stand_in = SimpleNamespace(plan=SimpleNamespace(ingest_id="lake-42"))
    with pytest.raises(IngestError, match=r"ingestion 'lake-42' failed while writing the rows "
                                          r"to the nodes: An error occurred while calling o93\.save\. "
                                          r"Fix the cause and run it again with ingest_id='lake-42'"):
        with Ingestion._failing(stand_in, "writing the rows to the nodes"):  # type: ignore[arg-type]
            raise RuntimeError("An error occurred while calling o93.save.\n"
                               ": org.postgresql.util.PSQLException: ...\n\tat org.postgresql...")
    with pytest.raises(PausedError):  # pgq's own errors pass as they are
        with Ingestion._failing(stand_in, "merging"):  # type: ignore[arg-type]
            raise PausedError("paused")


def test_the_default_copies_are_the_clusters_not_the_listed_nodes():
    """Counted from the listed targets, one DSN of a 3-node cluster (as
    `pgq spark ingest` with $PGQ_DSN gives) ingested with one copy, and so
    did listed nodes whose processes were down: fewer copies than ADDJOB
    makes, without a word (found by a read-only review). The rule on its own
    (real clusters are tests/cluster/test_spark_ingest.py's)."""
    from pgq import arguments as args
    from pgq.spark.ingest import _Node, _replication

    def nodes(count: int, reachable: int, active: bool = True) -> list[_Node]:
        return [_Node(f"dbname=n{i}", f"{i:040d}", f"n{i}", active, None, reachable=reachable)  # type: ignore[arg-type]
                for i in range(count)]

    def params(**given: object) -> args.JobParams:
        return args.job_params(**{"replicate": None, "delay": 0, "retry": None, "ttl": None,
                                  "maxlen": None, "asynchronous": False, "timeout": None, **given})

    with pytest.raises(NoReplError, match="a cluster of 3: its jobs get 3 copies by default"):
        _replication(params(), nodes(1, reachable=3))
    with pytest.raises(NoReplError, match="list 2 nodes"):
        _replication(params(), nodes(1, reachable=2))
    with pytest.raises(InvalidArgumentError, match="one running cluster"):  # processes down
        _replication(params(), nodes(3, reachable=3, active=False))
    assert _replication(params(replicate=1), nodes(1, reachable=3)) == 1  # asked for
    assert _replication(params(retry=0), nodes(1, reachable=3)) == 1  # at most once: one copy
    assert _replication(params(), nodes(2, reachable=1)) == 1  # standalone nodes share the rows


def test_one_run_of_an_ingestion_at_a_time(spark, client, dsn):
    """Two runs of one ingest id at once each recreated the shared staging
    table under the other, and could merge the rows under two sets of IDs
    (found by a read-only review): the second is refused while the first
    runs, and may go once it ended."""
    df = frame(spark, [f"o{i}" for i in range(50)])
    first = ingestion(spark, df, dsn, ingest_id="once")
    first.begin()
    second = ingestion(spark, df, dsn, ingest_id="once")
    with pytest.raises(IngestError, match="ingestion 'once' is running now"):
        second.begin()
    with pytest.raises(IngestError, match="is running now"):
        write_jobs(df, "lake", nodes=dsn, ingest_id="once")
    other = ingestion(spark, df, dsn, ingest_id="other")
    other.begin()  # another id is not held
    other.finish()
    first.finish()
    assert write_jobs(df, "lake", nodes=dsn, ingest_id="once").jobs == 50
    assert client.qlen("lake") == 50


def test_a_leaving_node_takes_no_ingested_jobs(spark, client, db, dsn):
    """As ADDJOB and STORE_COPIES refuse there (found by a read-only review)."""
    from pgq.contracts import SET_LEAVING

    df = frame(spark, [f"l{i}" for i in range(20)])
    db.execute(SET_LEAVING, {"leaving": True})
    with pytest.raises(pgq.errors.LeavingError, match="is leaving its cluster"):
        write_jobs(df, "lake", nodes=dsn)
    run = ingestion(spark, df, dsn)
    db.execute(SET_LEAVING, {"leaving": False})
    run.begin()
    run.stage(run.prepare(), 0)
    db.execute(SET_LEAVING, {"leaving": True})  # a leave begun during the ingestion
    with pytest.raises(pgq.errors.LeavingError, match=f"ingest_id={run.plan.ingest_id!r}"):
        run.merge(0)  # (the message names the ingestion to run again)
    run.finish()
    assert client.qlen("lake") == 0
    # A node that merged takes nothing more: its leave does not stop a
    # re-run that finds the ingestion done there (it was refused).
    db.execute(SET_LEAVING, {"leaving": False})
    write_jobs(df, "lake", nodes=dsn, ingest_id="left-after")
    db.execute(SET_LEAVING, {"leaving": True})
    assert write_jobs(df, "lake", nodes=dsn, ingest_id="left-after").already_done


def test_a_failure_while_counting_names_the_ingestion(spark, client, dsn):
    """The count pass ran outside the failure wrapper: an input Spark could
    not read (a file of another format, a failing expression) came out as a
    Py4JJavaError and a page of Java stack (found by a read-only review)."""
    failing = spark.range(10).selectExpr("CAST(raise_error('unreadable input') AS STRING) AS body")
    with pytest.raises(IngestError, match=r"ingestion 'broken-1' failed while counting the rows: "
                                          r".*unreadable input"):
        write_jobs(failing, "lake", nodes=dsn, ingest_id="broken-1")
    assert client.qlen("lake") == 0


def test_spark_connects_where_libpq_did_with_its_environment(dsn, monkeypatch):
    """Spark's JDBC driver reads none of libpq's environment: a DSN that
    relies on PGPORT and PGPASSWORD (or ~/.pgpass) used to give a JDBC URL of
    port 5432 and no password, failing mid-run."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    from pgq.spark.ingest import _describe

    full = conninfo_to_dict(dsn)
    bare = make_conninfo("", **{k: v for k, v in full.items() if k not in ("port", "password")})
    monkeypatch.setenv("PGPORT", str(full["port"]))
    monkeypatch.setenv("PGPASSWORD", str(full["password"]))
    node = _describe(bare)
    assert f":{full['port']}/" in node.jdbc.url and node.jdbc.password == full["password"]
    assert node.jdbc.user == full["user"]


def test_a_jdbc_batch_of_large_bodies_stays_within_an_executors_memory():
    from pgq.spark.ingest import WRITE_BATCH_BYTES, WRITE_BATCH_SIZE, batch_rows

    assert batch_rows(16) == WRITE_BATCH_SIZE and batch_rows(0) == WRITE_BATCH_SIZE
    assert batch_rows(2**20) == 64 and batch_rows(2**20) * 2**20 <= WRITE_BATCH_BYTES
    assert batch_rows(16 * 2**20) == 4 and batch_rows(2**40) == 1
