"""pgq.peers on a real server: a client's writes to peers' databases (the
direct copies of a replicated add) commit on every peer, return each peer's
error as a value, leave no transaction open, and never hold the caller past
the timeout. Two peer names on one test database stand for two peers."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import anyio
import psycopg
import pytest

from pgq.peers import PEER_POOL_SIZE, AsyncPeerPools, PeerPools, PeerTimeout
from pgq.protocol import PeerUnreached

from .conftest import wait_until

INSERT = "INSERT INTO t (id, v) VALUES (%(id)s, %(v)s) RETURNING id"


@pytest.fixture
def peers(db):
    db.execute("CREATE TABLE t (id integer PRIMARY KEY, v bytea)")
    pools = PeerPools(application_name="pgq-test-peers")
    try:
        yield pools
    finally:
        pools.close()


def sessions_in(db, state: str) -> int:
    return db.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                      "'pgq-test-peers' AND state = %s", (state,)).fetchone()[0]


def test_a_write_commits_on_every_peer(peers, db, dsn):
    body = b"x" * 100
    done = peers.write(INSERT, (("a", dsn, {"id": 1, "v": body}), ("b", dsn, {"id": 2, "v": body})), 5)
    assert done == {"a": [(1,)], "b": [(2,)]}
    assert db.execute("SELECT id, length(v) FROM t ORDER BY id").fetchall() == [(1, 100), (2, 100)]


def test_a_failed_write_is_that_peers_error_and_leaves_no_transaction_open(peers, db, dsn):
    body = b"x" * 100
    peers.write(INSERT, (("a", dsn, {"id": 1, "v": body}),), 5)
    done = peers.write(INSERT, (("a", dsn, {"id": 1, "v": body}), ("b", dsn, {"id": 2, "v": body})), 5)
    assert isinstance(done["a"], psycopg.errors.UniqueViolation) and done["b"] == [(2,)]
    assert sessions_in(db, "idle in transaction (aborted)") == sessions_in(db, "idle in transaction") == 0
    # The connections go on serving: the next writes commit.
    assert peers.write(INSERT, (("a", dsn, {"id": 3, "v": body}),), 5) == {"a": [(3,)]}
    assert db.execute("SELECT count(*) FROM t").fetchone()[0] == 3


def test_a_peer_that_does_not_answer_is_given_up_at_the_timeout(peers, db, dsn):
    peers.write(INSERT, (("a", dsn, {"id": 1, "v": b"old"}),), 5)
    release = threading.Event()

    def hold_the_row() -> None:  # the peer's write waits for this lock (lock_timeout 1 s)
        with psycopg.connect(dsn) as holder:
            holder.execute("SELECT 1 FROM t WHERE id = 1 FOR UPDATE")
            locked.set()
            release.wait(10)

    locked = threading.Event()
    holder = threading.Thread(target=hold_the_row)
    holder.start()
    try:
        assert locked.wait(10)
        started = time.monotonic()
        done = peers.write("UPDATE t SET v = %(v)s WHERE id = 1 RETURNING id",
                           (("a", dsn, {"v": b"y"}), ("b", dsn, {"v": b"z"})), 0.3)
        elapsed = time.monotonic() - started
        # The writes given up on end on the peer, rolled back, while the row
        # is still locked: at the peer sessions' lock timeout (1 s).
        wait_until(lambda: sessions_in(db, "active") == 0, 10,
                   message="the abandoned writes to end on the server")
    finally:
        release.set()
        holder.join()
    assert isinstance(done["a"], PeerTimeout) and isinstance(done["b"], PeerTimeout)
    # 0.3 s asked: well under the peer's own lock timeout (1 s), which would
    # have answered the write with an error had the caller waited for it.
    assert elapsed < 0.9
    assert db.execute("SELECT v FROM t WHERE id = 1").fetchone()[0] == b"old"
    assert peers.write(INSERT, (("a", dsn, {"id": 2, "v": b"new"}),), 5) == {"a": [(2,)]}


def test_a_write_given_up_on_closes_its_connection_and_the_next_reuses_a_good_one(peers, db, dsn):
    # The writes are sent from the calling thread (pgq.multiplex): a
    # connection whose answer never came is closed, never given back with a
    # statement still running on it; one that answered is used again.
    peers.write(INSERT, (("a", dsn, {"id": 1, "v": b"x"}),), 5)
    first = db.execute("SELECT pid FROM pg_stat_activity WHERE application_name = "
                       "'pgq-test-peers'").fetchall()
    assert len(first) == 1
    assert peers.write(INSERT, (("a", dsn, {"id": 2, "v": b"x"}),), 5) == {"a": [(2,)]}
    assert db.execute("SELECT pid FROM pg_stat_activity WHERE application_name = "
                      "'pgq-test-peers'").fetchall() == first
    done = peers.write("SELECT pg_sleep(0.5)", (("a", dsn, {}),), 0.1)
    assert isinstance(done["a"], PeerTimeout)
    wait_until(lambda: sessions_in(db, "active") + sessions_in(db, "idle") == 0, 10,
               message="the connection given up on to be gone")
    assert peers.write(INSERT, (("a", dsn, {"id": 3, "v": b"x"}),), 5) == {"a": [(3,)]}


def test_parameters_of_every_shape_reach_the_peer_as_a_cursor_would_send_them(peers, dsn):
    # Placeholders become $n (a name used twice is one parameter, %% a
    # percent sign); the statement is prepared per parameter types, so an
    # int that needs a wider type, or a NULL, is not sent under the first
    # call's types.
    sql = ("SELECT %(n)s::bigint * 2 AS n, %(n)s::bigint AS again, %(t)s::text AS t, "
           "length(%(b)b::bytea) AS b, %(ids)b::text[] AS ids, 7 %% 4 AS r")
    for n, t in ((1, "one"), (2**40, None), (None, "x"), (3, "three")):
        done = peers.write(sql, (("a", dsn, {"n": n, "t": t, "b": b"\x00\x01", "ids": ["p", "q"]}),),
                           5)
        assert done == {"a": [(None if n is None else n * 2, n, t, 2, ["p", "q"], 3)]}, done


def test_two_async_writes_that_find_the_same_idle_pools_both_go_on(dsn):
    """Two writes in flight at once (a client's replicated batches) pruned
    the same idle pools: the second one's ``del`` raised KeyError in the
    middle of its add (a full bench run's ADDJOB through the RESP port)."""
    from pgq import peers as peer_module

    async def main() -> None:
        pools = AsyncPeerPools()
        try:
            others = [f"{dsn}{'&' if '?' in dsn else '?'}application_name=idle{i}" for i in range(2)]
            for other in others:
                assert await pools.write("SELECT 1", (("p", other, {}),), 5.0) == {"p": [(1,)]}
                pools._used[other] = time.monotonic() - peer_module.IDLE_POOL - 1
            write = (("peer", dsn, {}),)
            done = []

            async def one() -> None:
                done.append(await pools.write("SELECT 1", write, 5.0))

            async with anyio.create_task_group() as tasks:
                for _ in range(2):
                    tasks.start_soon(one)
            assert done == [{"peer": [(1,)]}] * 2
            assert set(pools._idle) == {dsn}
        finally:
            await pools.close()

    anyio.run(main)


def test_the_async_writes_commit_fail_and_give_up_as_the_sync_ones(db, dsn):
    # The async mirror (the RESP and HTTP fronts' replicated adds): every
    # peer's write committed or its error returned; one given up on at the
    # timeout, its connection closed; a caller cancelled while waiting
    # leaves no connection with a statement in flight for the next write.
    db.execute("CREATE TABLE t (id integer PRIMARY KEY, v bytea)")

    async def main() -> None:
        pools = AsyncPeerPools(application_name="pgq-test-peers")
        try:
            done = await pools.write(INSERT, (("a", dsn, {"id": 1, "v": b"x"}),
                                              ("b", dsn, {"id": 2, "v": b"y"})), 5)
            assert done == {"a": [(1,)], "b": [(2,)]}
            done = await pools.write(INSERT, (("a", dsn, {"id": 1, "v": b"x"}),
                                              ("b", dsn, {"id": 3, "v": b"y"})), 5)
            assert isinstance(done["a"], psycopg.errors.UniqueViolation) and done["b"] == [(3,)]
            started = time.monotonic()
            done = await pools.write("SELECT pg_sleep(0.5)", (("a", dsn, {}),), 0.1)
            assert isinstance(done["a"], PeerTimeout) and time.monotonic() - started < 0.4
            # The connection given up on is closed (not idle, nor kept).
            await anyio.to_thread.run_sync(lambda: wait_until(
                lambda: sessions_in(db, "active") == 0 and sessions_in(db, "idle") == 1, 10,
                message="the connection given up on to be gone"))
            with anyio.move_on_after(0.1):
                await pools.write("SELECT pg_sleep(0.5)", (("a", dsn, {}),), 5)
            idle = [p for connections in pools._idle.values() for p in connections]
            assert len(idle) == 0  # the one in use was cancelled with its statement: closed
            assert await pools.write(INSERT, (("a", dsn, {"id": 4, "v": b"z"}),), 5) == {"a": [(4,)]}
            idle = [p for connections in pools._idle.values() for p in connections]
            assert [p.conn.pgconn.transaction_status for p in idle] == [
                psycopg.pq.TransactionStatus.IDLE]
        finally:
            await pools.close()

    anyio.run(main)
    assert sessions_in(db, "idle in transaction") == 0
    assert db.execute("SELECT array_agg(id ORDER BY id) FROM t").fetchone()[0] == [1, 2, 3, 4]
    wait_until(lambda: sessions_in(db, "active") + sessions_in(db, "idle") == 0, 10,
               message="every connection of the pools to be closed")


@contextlib.contextmanager
def silent_host(backlog: int) -> Iterator[str]:
    """The DSN of a server that accepts TCP connections and never answers
    (a host gone silent, as libpq sees it while it connects); closed after."""
    silent = socket.socket()
    try:
        silent.bind(("127.0.0.1", 0))
        silent.listen(backlog)
        yield f"host=127.0.0.1 port={silent.getsockname()[1]} dbname=x user=x"
    finally:
        silent.close()


@contextlib.contextmanager
def peer_writes(flavour: str) -> Iterator[Callable[..., dict[str, object]]]:
    """``write(sql, writes, timeout)`` through PeerPools ("sync"), or
    through AsyncPeerPools on an event loop of its own ("async": the
    calling thread waits for each write); the pools closed after."""
    if flavour == "sync":
        pools = PeerPools(application_name="pgq-test-peers")
        try:
            yield pools.write
        finally:
            pools.close()
        return
    with anyio.from_thread.start_blocking_portal() as portal:
        async_pools = AsyncPeerPools(application_name="pgq-test-peers")
        try:
            yield lambda *args: portal.call(async_pools.write, *args)
        finally:
            portal.call(async_pools.close)


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_hung_peer_fails_alone_and_the_other_peers_write(db, dsn, flavour, monkeypatch):
    # Peer "a" waits on a row lock past the timeout; "b" answers at once.
    # With no connection open yet, both are opened and written at once: "b"
    # is not made to wait behind "a" and given up on with it. The peers'
    # lock timeout is made 5 s here (read as each connection opens), so that
    # the call's 2 s leave a cold "b" time to connect on a loaded machine
    # (0.5 s did not always) while "a" is still given up on, not refused.
    from pgq import peers as peer_module

    monkeypatch.setattr(peer_module, "LOCK_TIMEOUT", 5000)
    monkeypatch.setattr(peer_module, "STATEMENT_TIMEOUT", 6000)
    db.execute("CREATE TABLE t (id integer PRIMARY KEY, v bytea)")
    db.execute("INSERT INTO t VALUES (1, 'old'), (2, 'old')")
    update = "UPDATE t SET v = %(v)s WHERE id = %(id)s RETURNING id"
    writes = (("a", dsn, {"id": 1, "v": b"new"}), ("b", dsn, {"id": 2, "v": b"new"}))
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT 1 FROM t WHERE id = 1 FOR UPDATE")
        with peer_writes(flavour) as write:
            started = time.monotonic()
            done = write(update, writes, 2)
            elapsed = time.monotonic() - started
        # The write given up on ends on the server, rolled back, at the
        # peer's lock timeout (5 s here), while the row is still locked.
        wait_until(lambda: sessions_in(db, "active") == 0, 15,
                   message="the abandoned write to end on the server")
    assert isinstance(done["a"], PeerTimeout) and done["b"] == [(2,)]
    # 2 s asked, under the peer's lock timeout (5 s here) that would have
    # answered "a" with an error.
    assert elapsed < 4.5
    assert db.execute("SELECT id, v FROM t ORDER BY id").fetchall() == [(1, b"old"), (2, b"new")]


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("warm", [True, False], ids=["b-connected", "b-cold"])
def test_a_peer_whose_connect_hangs_fails_alone_and_nothing_is_sent_to_it(db, dsn, flavour, warm):
    # "a" is a server that accepts TCP connections and never answers (a
    # host gone silent, as libpq sees it while it connects): its connect
    # takes the whole timeout. "b", connected already or not, is written
    # meanwhile; "a" is reported unreached (nothing to withdraw there).
    db.execute("CREATE TABLE t (id integer PRIMARY KEY, v bytea)")
    with silent_host(8) as mute, peer_writes(flavour) as write:
        writes = (("a", mute, {"id": 1, "v": b"x"}), ("b", dsn, {"id": 2, "v": b"x"}))
        if warm:
            assert write(INSERT, (("b", dsn, {"id": 0, "v": b"x"}),), 5) == {"b": [(0,)]}
        started = time.monotonic()
        done = write(INSERT, writes, 1.5)  # time for a cold "b" on a loaded machine
        elapsed = time.monotonic() - started
    assert isinstance(done["a"], PeerUnreached) and done["b"] == [(2,)], done
    # 1.5 s asked; libpq's own connect timeout is 3 s.
    assert elapsed < 2.9


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_an_idle_connection_whose_server_ended_it_is_not_used(db, dsn, flavour):
    # A peer restarted, or ended idle sessions: its connections in the idle
    # list are dead. The next write takes a fresh one instead of failing
    # (a failed write backs the peer off for seconds).
    db.execute("CREATE TABLE t (id integer PRIMARY KEY, v bytea)")
    with peer_writes(flavour) as write:
        assert write(INSERT, (("a", dsn, {"id": 1, "v": b"x"}),), 5) == {"a": [(1,)]}
        db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                   "WHERE application_name = 'pgq-test-peers'")
        wait_until(lambda: sessions_in(db, "idle") == 0, 10, message="the sessions to end")
        done = write(INSERT, (("a", dsn, {"id": 2, "v": b"x"}),), 5)
    assert done == {"a": [(2,)]}, done


def test_a_burst_of_writers_to_a_silent_peer_leaves_the_others_connecting(db, dsn):
    # Many writers at once, each without a connection yet, write to a
    # silent host "a" and to a healthy "b". Each connect to "a" holds its
    # thread for libpq's connect timeout (3 s). With one set of connecting
    # threads for every peer, those connects took them all and the
    # connects to "b" waited behind them until the writes gave up: "b"
    # failed with "a". Each peer now has threads of its own.
    db.execute("CREATE TABLE t (id integer PRIMARY KEY, v bytea)")
    # Well past the 2 * PEER_POOL_SIZE threads a set has; 2.5 s per write
    # leaves room for three rounds of connects to "b" on a slow machine,
    # and is under the 3 s a connect to "a" holds its thread.
    writers = 6 * PEER_POOL_SIZE
    outcomes: dict[int, dict[str, object]] = {}
    pools = PeerPools(application_name="pgq-test-peers")
    go = threading.Barrier(writers)

    def write(mute: str, n: int) -> None:
        go.wait()
        outcomes[n] = pools.write(INSERT, (("a", mute, {"id": n, "v": b"x"}),
                                           ("b", dsn, {"id": n, "v": b"x"})), 2.5)

    with silent_host(64) as mute:
        try:
            threads = [threading.Thread(target=write, args=(mute, n)) for n in range(writers)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            pools.close()
    assert all(isinstance(done["a"], PeerUnreached) for done in outcomes.values()), outcomes
    failed = {n: done["b"] for n, done in outcomes.items() if done["b"] != [(n,)]}
    assert not failed, failed
    assert db.execute("SELECT count(*) FROM t").fetchone()[0] == writers
