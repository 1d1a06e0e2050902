"""Transactional use: pgq calls inside the caller's own transaction (psycopg
connection, SQLAlchemy Connection or Session) commit or roll back with it."""

from __future__ import annotations

import time

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

import pgq
from pgq.errors import InvalidTypeError, TransactionAbortedError


@pytest.fixture
def orders(db):
    db.execute("CREATE TABLE orders (id serial PRIMARY KEY, status text NOT NULL)")
    return db


@pytest.fixture
def engine(dsn):
    eng = create_engine(dsn.replace("postgresql://", "postgresql+psycopg://"))
    yield eng
    eng.dispose()


def test_add_then_rollback_is_never_visible(dsn, client):
    with psycopg.connect(dsn) as conn:
        job_id = client.add_job("tx", b"x", conn=conn)
        other = client.add_jobs("tx", [b"y"] * 3, conn=conn)
        assert client.show(job_id) is None  # not visible outside before commit
        conn.rollback()
    assert client.show(job_id) is None and client.show(other[0]) is None
    assert client.qlen("tx") == 0 and client.get_job("tx", nohang=True) == []


def test_add_then_commit_is_visible_and_wakes_consumers(dsn, client):
    with psycopg.connect(dsn) as conn:
        job_id = client.add_job("tx", b"x", conn=conn)
        conn.commit()
    assert client.get_job("tx", nohang=True)[0].id == job_id


def test_get_then_rollback_makes_the_job_available_at_once(dsn, client):
    job_id = client.add_job("tx", b"x", retry=300)
    with psycopg.connect(dsn) as conn:
        got = client.get_job("tx", conn=conn)
        assert [j.id for j in got] == [job_id]
        assert client.get_job("tx", nohang=True) == []  # locked by the open transaction
        conn.rollback()
    start = time.monotonic()
    assert [j.id for j in client.get_job("tx", nohang=True)] == [job_id]
    assert time.monotonic() - start < 1  # no waiting for the retry lease


def test_business_write_and_ack_commit_together(dsn, client, orders):
    job_id = client.add_job("orders", b"ship order 1")
    client.get_job("orders")
    with psycopg.connect(dsn) as conn:
        conn.execute("INSERT INTO orders (status) VALUES ('shipped')")
        assert client.ack_job(job_id, conn=conn) == 1
        conn.rollback()  # both undone
    assert orders.execute("SELECT count(*) FROM orders").fetchone()[0] == 0
    assert client.show(job_id)["state"] == "active"
    with psycopg.connect(dsn) as conn:
        conn.execute("INSERT INTO orders (status) VALUES ('shipped')")
        assert client.ack_job(job_id, conn=conn) == 1
        conn.commit()  # both done
    assert orders.execute("SELECT count(*) FROM orders").fetchone()[0] == 1
    assert client.show(job_id) is None


def test_a_failed_business_write_undoes_the_ack(dsn, client, orders):
    job_id = client.add_job("orders", b"x")
    client.get_job("orders")
    with psycopg.connect(dsn) as conn:
        client.ack_job(job_id, conn=conn)
        with pytest.raises(psycopg.errors.NotNullViolation):
            conn.execute("INSERT INTO orders (status) VALUES (NULL)")
        with pytest.raises(TransactionAbortedError, match="roll it back"):
            client.nack_job(job_id, conn=conn)
        conn.rollback()
    assert client.show(job_id)["state"] == "active"


def test_caller_transaction_settings_are_untouched(dsn, client):
    client.add_job("tx", b"x")
    with psycopg.connect(dsn) as conn:
        client.get_job("tx", conn=conn)
        setting = conn.execute("SHOW synchronous_commit").fetchone()[0]
        assert setting == "on"  # the relaxed-commit claim is only for pgq's own connections
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        conn.commit()


def test_autocommit_caller_connection_and_maxlen_group(dsn, client):
    with psycopg.connect(dsn, autocommit=True) as conn:
        job_id = client.add_job("auto", b"x", maxlen=5, conn=conn)
        ids = client.add_jobs("auto", [b"y"] * 2500, conn=conn)  # COPY path, own transaction
    assert client.qlen("auto") == 2501 and client.show(job_id) and client.show(ids[-1])


def test_copy_path_rolls_back_with_the_caller(dsn, client):
    with psycopg.connect(dsn) as conn:
        client.add_jobs("bulk-tx", [b"y"] * 2500, conn=conn)
        conn.rollback()
    assert client.qlen("bulk-tx") == 0


def test_blocking_get_inside_a_transaction_polls(dsn, client):
    with psycopg.connect(dsn) as conn:
        start = time.monotonic()
        assert client.get_job("tx-poll", timeout=0.3, conn=conn) == []
        assert time.monotonic() - start >= 0.3
        conn.rollback()


def test_sqlalchemy_session(client, engine, orders):
    job_id = client.add_job("sa", b"x")
    client.get_job("sa")
    with Session(engine) as session:
        session.execute(text("INSERT INTO orders (status) VALUES ('paid')"))
        new_id = client.add_job("sa-next", b"follow-up", conn=session)
        assert client.ack_job(job_id, conn=session) == 1
        session.rollback()
    assert client.show(job_id)["state"] == "active" and client.show(new_id) is None
    with Session(engine) as session:
        session.execute(text("INSERT INTO orders (status) VALUES ('paid')"))
        new_id = client.add_job("sa-next", b"follow-up", conn=session)
        client.ack_job(job_id, conn=session)
        session.commit()
    assert client.show(job_id) is None and client.show(new_id)["state"] == "queued"
    assert orders.execute("SELECT count(*) FROM orders").fetchone()[0] == 1


def test_a_scoped_session_is_its_session(client, engine):
    # Flask-SQLAlchemy's db.session is a scoped_session, not a Session: it
    # was refused ("not scoped_session"), though the guide says Session.
    from sqlalchemy.orm import scoped_session, sessionmaker

    scoped = scoped_session(sessionmaker(engine))
    try:
        new_id = client.add_job("sa-scoped", b"x", conn=scoped)
        assert client.show(new_id) is None  # in the session's transaction, not committed yet
        scoped.commit()
        assert client.show(new_id)["state"] == "queued"
    finally:
        scoped.remove()


def test_sqlalchemy_connection(client, engine):
    with engine.connect() as conn:
        job_id = client.add_job("sa", b"x", conn=conn)
        conn.rollback()
    assert client.show(job_id) is None
    with engine.begin() as conn:
        job_id = client.add_job("sa", b"x", conn=conn)
    assert client.show(job_id)["state"] == "queued"


def test_a_sqlalchemy_connection_commits_pgqs_work_when_it_is_alone_in_it(client, engine):
    """SQLAlchemy begins its transaction on its own execute() only: an add
    or an ack that was the only work of a Connection ran in a transaction
    SQLAlchemy did not know of, its commit() did nothing, and the pool
    rolled it back: "added" and "acknowledged", and lost."""
    with engine.connect() as conn:
        job_id = client.add_job("sa-alone", b"x", conn=conn)
        conn.commit()
    assert client.show(job_id)["state"] == "queued"
    assert [j.id for j in client.get_job("sa-alone")] == [job_id]
    with engine.connect() as conn:
        assert client.ack_job(job_id, conn=conn) == 1
        conn.commit()
    assert client.show(job_id) is None


def test_a_caller_connection_with_its_own_row_and_cursor_factories(dsn, client):
    """pgq's statements ran with the caller's factories: with dict rows an
    add returned the ID "existing" and a claim committed, then failed,
    leaving its job leased; Django's ClientCursor inlined the smallest
    bigint of a full-walk claim, which overflowed."""
    from psycopg.rows import dict_row

    with psycopg.connect(dsn, row_factory=dict_row, autocommit=True) as conn:
        job_id = client.add_job("factories", b"x", conn=conn)
        assert job_id.startswith("D-") and client.show(job_id)["state"] == "queued"
        assert [j.id for j in client.get_job("factories", conn=conn)] == [job_id]
        assert client.working(job_id, conn=conn) > 0
        assert client.ack_job(job_id, conn=conn) == 1
        for _ in range(8):  # psycopg's default cursor: prepared past its threshold, as before
            client.add_job("factories", b"z", conn=conn)
        assert conn.execute("SELECT count(*) AS n FROM pg_prepared_statements").fetchone()["n"] > 0
    with psycopg.connect(dsn, cursor_factory=psycopg.ClientCursor) as conn:
        job_id = client.add_job("client-cursor", b"y", conn=conn)
        assert [j.id for j in client.get_job("client-cursor", conn=conn)] == [job_id]
        for _ in range(8):  # past psycopg's prepare threshold
            client.add_job("client-cursor", b"z", conn=conn)
        # nothing prepared where the caller's cursors prepare nothing (Django
        # uses ClientCursor so that it works behind PgBouncer)
        assert conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()[0] == 0
        conn.commit()


def test_a_claim_rolled_back_hides_none_of_its_jobs(dsn, client):
    """A claim in the caller's transaction moved the process's claim floor
    past its jobs: rolled back, they were found again only by the next full
    walk, up to 2 s later (the single-job test above did not show it)."""
    ids = [client.add_job("floor-tx", b"%d" % i) for i in range(6)]
    with psycopg.connect(dsn, autocommit=True) as conn:  # 200 ms apart, past the floors' margin
        conn.execute("UPDATE pgq.jobs j SET ctime = j.ctime - (7 - o.n) * 200000000 "
                     "FROM (SELECT id, row_number() OVER (ORDER BY ctime) AS n FROM pgq.jobs "
                     "      WHERE queue = 'floor-tx') o WHERE j.id = o.id")
    with psycopg.connect(dsn) as conn:
        assert len(client.get_job("floor-tx", conn=conn, count=6)) == 6
        conn.rollback()
    assert sorted(j.id for j in client.get_job("floor-tx", nohang=True, count=6)) == sorted(ids)


def test_unsupported_connections_are_type_errors(client):
    with pytest.raises(InvalidTypeError, match="psycopg.Connection"):
        client.add_job("q", b"x", conn="postgresql://localhost/db")
    sqlite = create_engine("sqlite://")
    with sqlite.connect() as conn, pytest.raises(InvalidTypeError, match="postgresql\\+psycopg"):
        client.add_job("q", b"x", conn=conn)
    sqlite.dispose()


def test_async_connection_is_refused_by_the_sync_client(dsn, client):
    import asyncio

    async def check():
        aconn = await psycopg.AsyncConnection.connect(dsn)
        try:
            with pytest.raises(InvalidTypeError, match="AsyncClient"):
                client.add_job("q", b"x", conn=aconn)
        finally:
            await aconn.close()

    asyncio.run(check())


def test_turbo_client_commits_asynchronously(dsn):
    with pgq.Client(dsn, turbo=True) as turbo:
        assert turbo.info()["synchronous_commit"] == "off"
        job_id = turbo.add_job("turbo", b"x")
        assert turbo.get_job("turbo")[0].id == job_id


def test_a_wait_lends_a_connection_that_once_listened_for_copies(dsn):
    # A pooled connection that once waited for a replicated add's copies
    # LISTENs for good; a later wait on it (wait_job here) held it for the
    # whole wait instead of lending it between polls: with a pool of one,
    # every other call of the client failed until the wait ended (found by
    # a read-only review). The loop calls QLEN for 2.5 s of the waiter's 3:
    # long enough that the waiter holds the one connection during it.
    import threading
    import time

    from pgq import driver

    with pgq.Client(dsn, pool_size=1, reconnect_timeout=1) as client:
        job = client.add_job("lent", b"x")
        with client._pool.connection() as conn:  # as a replicated add leaves it
            conn.execute(f"LISTEN {driver.replication_channel(conn)}")
            driver._replication_listeners.add(conn)
        waiter = threading.Thread(target=client.wait_job, args=(job,), kwargs={"timeout": 3})
        waiter.start()
        try:
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:
                assert client.qlen("lent") == 1
        finally:
            waiter.join(10)
