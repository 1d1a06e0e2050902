"""The blocking clients of one database in a process share one pool (pgq.sharedpool)."""

from __future__ import annotations

import threading

import psycopg
import pytest

import pgq
from pgq import sharedpool

from .conftest import wait_until


def _backends(dsn: str, application_name: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = %s", [application_name]).fetchone()[0]  # type: ignore[index]


def test_clients_of_one_database_share_a_pool_sized_by_all_of_them(dsn):
    with pgq.Client(dsn, pool_size=3) as one, pgq.Client(dsn, pool_size=4) as two:
        assert one._pool is two._pool
        assert one._pool is not None and one._pool.max_size == 7
        one.add_job("shared", b"a")
        assert two.get_job("shared", nohang=True)[0].body == b"a"
        pool = one._pool
    assert pool.closed  # the last member closed it
    assert not any(e.pool is pool for e in sharedpool._pools.values())


def test_a_closed_client_leaves_the_pool_to_the_others(dsn):
    app = "pgq-sharedpool-test"
    first = pgq.Client(dsn, application_name=app)
    second = pgq.Client(dsn, application_name=app)
    try:
        pool = first._pool
        first.close()
        assert pool is not None and not pool.closed and pool.max_size == 10
        with pytest.raises(pgq.errors.DatabaseUnavailableError, match="closed"):
            first.add_job("left", b"x")
        second.add_job("left", b"x")  # the other member goes on, on the same pool
        assert second.qlen("left") == 1
        assert _backends(dsn, app) >= 1
    finally:
        second.close()
    assert pool.closed


def test_clients_with_other_settings_keep_their_own_pools(dsn):
    with pgq.Client(dsn) as plain, pgq.Client(dsn, turbo=True) as turbo, \
            pgq.Client(dsn, application_name="other") as named, \
            pgq.Client(dsn, prepare=False) as unprepared:
        pools = {id(c._pool) for c in (plain, turbo, named, unprepared)}
        assert len(pools) == 4


def test_a_client_with_several_dsns_keeps_its_own_pool(dsn):
    # It fails over when its pool stays busy: another client's load must not
    # move it to another node.
    with pgq.Client([dsn, dsn]) as one, pgq.Client([dsn, dsn]) as two, pgq.Client(dsn) as plain:
        assert len({id(c._pool) for c in (one, two, plain)}) == 3


def test_a_forked_child_starts_with_no_shared_pool(dsn):
    import os

    with pgq.Client(dsn) as parent:
        assert sharedpool._pools
        before = parent._pool
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: pools of its own, on a fresh registry
            try:
                fresh = all(e.pool is not before for e in sharedpool._pools.values())  # the child's only
                with pgq.Client(dsn) as child:
                    ok = fresh and child._pool is not before and child.qlen("forked") == 0 \
                        and parent.qlen("forked") == 0 and parent._pool is not before  # renewed
                os.write(write, b"1" if ok else b"0")
            finally:
                os._exit(0)
        os.close(write)
        assert os.read(read, 1) == b"1"
        os.waitpid(pid, 0)
        assert parent.qlen("forked") == 0  # the parent's pool still works


def test_threads_with_a_client_each_use_few_connections(dsn):
    # Ten threads, each with its own Client, adding at once: the pool they
    # share opens connections as its flushes need them, not one per client
    # (a pool per client kept ten open).
    app = "pgq-sharedpool-threads"
    clients = [pgq.Client(dsn, application_name=app) for _ in range(10)]
    try:
        barrier = threading.Barrier(10)

        def add(client: pgq.Client) -> None:
            barrier.wait()
            for _ in range(50):
                client.add_job("threads", b"x")

        threads = [threading.Thread(target=add, args=(c,)) for c in clients]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert clients[0].qlen("threads") == 500
        assert len({id(c._pool) for c in clients}) == 1
        assert _backends(dsn, app) < 10
    finally:
        for client in clients:
            client.close()
    # The last client closed the pool; the server sees the backends go.
    wait_until(lambda: _backends(dsn, app) == 0, 10, message="the pool's connections closed")


def test_an_exhausted_shared_pool_says_whose_connections_are_busy(dsn):
    with pgq.Client(dsn, pool_size=1, reconnect_timeout=0.5) as one, \
            pgq.Client(dsn, pool_size=1, reconnect_timeout=0.5) as two:
        assert one._pool is two._pool
        with one._pool.connection(), two._pool.connection():
            with pytest.raises(pgq.errors.DatabaseUnavailableError,
                               match="all 2 connections this process's clients"):
                one.qlen("held")


def test_a_call_waiting_for_a_connection_goes_on_when_another_fails_over(dsn):
    # Its pool closed by the failover under it: the call was lost with a
    # DatabaseUnavailableError (PoolClosed), though nothing had been sent.
    with pgq.Client([dsn, dsn], pool_size=1) as client:
        old = client._pool
        assert old is not None
        outcome: list[object] = []
        with old.connection():  # the one connection taken: the next call waits
            waiter = threading.Thread(target=lambda: outcome.append(_qlen_or_error(client)))
            waiter.start()
            wait_until(lambda: old.get_stats().get("requests_waiting", 0) >= 1, 10,
                       message="a call waiting for a connection")
            assert client._fail_over(old)  # as a call that timed out would
        waiter.join(30)
        assert outcome == [0]
        assert client._pool is not old


def _qlen_or_error(client: pgq.Client) -> object:
    try:
        return client.qlen("failover")
    except pgq.errors.PgqError as exc:
        return exc


def _hold(client: pgq.Client, seconds: float) -> object:
    """A call that keeps its pooled connection ``seconds`` (a slow statement)."""
    from pgq.protocol import Query, Result

    def slow(_session: object):
        yield Query("SELECT pg_sleep(%(s)s)", {"s": seconds}, Result.ROW)
        return "held"

    try:
        return client._run(slow)
    except pgq.errors.PgqError as exc:
        return exc


def test_a_busy_pool_is_no_reason_to_fail_over(dsn):
    # A call that waited its pool timeout (3 s with several DSNs) behind
    # others on a node that kept answering failed the client over to the
    # next DSN: a burst of calls moved it off a healthy node.
    with pgq.Client([dsn, dsn], pool_size=1, reconnect_timeout=10) as client:
        pool = client._pool
        assert pool is not None and client.pool_timeout == 3.0

        def waiting(n: int) -> bool:
            return pool.get_stats().get("requests_waiting", 0) >= n

        outcomes: dict[str, object] = {}
        # The timings: A gives its connection back at 1.5 s, B (first in
        # line) keeps it until about 4 s, so C times out at 3 s after a
        # connection came back, and gets one at about 4 s.
        calls = {"A": 1.5, "B": 2.5, "C": 0.0}
        threads = {name: threading.Thread(target=lambda n=name: outcomes.update(
            {n: _hold(client, calls[n])})) for name in calls}
        threads["A"].start()
        wait_until(lambda: pool.get_stats().get("pool_available", 1) == 0, 10,
                   message="A holding the one connection")
        threads["B"].start()
        wait_until(lambda: waiting(1), 10, message="B in line")
        threads["C"].start()
        wait_until(lambda: waiting(2), 10, message="C in line behind B")
        for thread in threads.values():
            thread.join(30)
        assert outcomes == {"A": "held", "B": "held", "C": "held"}
        assert client._pool is pool  # still on the first DSN


def test_two_callers_failing_on_a_dead_node_both_fail_over_to_the_next(dsn, monkeypatch):
    # Each caller failed over "the pool in use" after its attempt: the
    # second, whose attempt had run on the first node too, switched the
    # client that the first had just moved on back to the dead node, and
    # its add failed (found by a read-only review). The barrier makes both
    # first attempts run on the first node; the second caller's fails once
    # the first caller has failed the client over.
    other = dsn + ("&" if "?" in dsn else "?") + "application_name=second"
    with pgq.Client([dsn, other], pool_size=2) as client:
        first, pool = client.dsn, client._pool
        both_on_it = threading.Barrier(2, timeout=10)
        tried: set[int] = set()
        real = client._add_once

        def attempt(call, make, conn):
            if client.dsn != first:
                return real(call, make, conn)
            if threading.get_ident() not in tried:
                tried.add(threading.get_ident())
                if both_on_it.wait() == 0:
                    wait_until(lambda: client._pool is not pool, 10, message="the other caller's failover")
            raise pgq.errors.NoReplError("node process down", node_down=True)

        monkeypatch.setattr(client, "_add_once", attempt)
        switches: list[str] = []
        real_next = client.next_dsn

        def next_dsn() -> bool:
            switches.append(client.dsn)
            return real_next()

        monkeypatch.setattr(client, "next_dsn", next_dsn)
        outcomes: list[object] = []

        def add() -> None:
            try:
                outcomes.append(client.add_job("over", b"x"))
            except pgq.errors.PgqError as exc:
                outcomes.append(exc)

        threads = [threading.Thread(target=add) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert all(isinstance(o, str) for o in outcomes) and len(outcomes) == 2, outcomes
        assert client.dsn != first and switches == [first]  # one failover, never back


def test_a_client_made_before_a_fork_talks_on_backends_of_its_own_in_the_child(dsn):
    # The child used the parent's pooled connections (their sockets), and
    # two processes interleaved their messages on one backend (found by a
    # read-only review): a module-level client under gunicorn --preload.
    # A pool of one connection of its own (its application name), so that
    # the parent's backend is one known pid.
    import os

    with pgq.Client(dsn, pool_size=1, application_name="forked") as client:
        def backend() -> int:
            return client._run_on_pool(lambda conn, _lease: conn.info.backend_pid)

        parent = backend()
        client.add_job("forked", b"x")
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # the child: report, then leave without running pytest's teardown
            try:
                # Nothing opened before its first call: a child that never
                # uses the client (a subprocess with preexec_fn runs the
                # fork hooks too) made a connection and two threads.
                idle = not [t for t in threading.enumerate() if t.name.startswith("pgq-")]
                ok = idle and backend() != parent and client.qlen("forked") == 1
                os.write(write, b"1" if ok else b"0")
            finally:
                os._exit(0)
        os.close(write)
        _pid, status = os.waitpid(child, 0)
        assert os.read(read, 1) == b"1" and status == 0
        assert backend() == parent and client.qlen("forked") == 1  # the parent's, untouched


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_the_dsns_own_options_and_name_reach_every_pooled_connection(dsn, kind):
    # pgq's keyword settings replaced the DSN's: a user's ?options=-c ...
    # (or a provider's routing option) and application_name reached the
    # first connection only (found by a read-only review).
    import anyio

    own = dsn + ("&" if "?" in dsn else "?") + "options=-c%20lock_timeout%3D1234&application_name=mine"
    query = "SELECT current_setting('lock_timeout'), current_setting('application_name')"
    if kind == "sync":
        with pgq.Client(own) as client:
            seen = client._run_on_pool(lambda conn, _lease: conn.execute(query).fetchone())
    else:
        async def main() -> tuple[str, str]:
            async with pgq.AsyncClient(own) as client:
                async def read(conn, _lease):
                    return await (await conn.execute(query)).fetchone()
                return await client._run_on_pool(read)  # type: ignore[no-any-return]
        seen = anyio.run(main)
    assert seen == ("1234ms", "mine")


def test_connection_settings_put_the_dsns_options_after_pgqs():
    # Every connection pgq makes (pools, LISTEN, the dashboard's reader,
    # metrics scrapes, vacuum) keeps the DSN's own options and name.
    from pgq.dsn import connection_settings

    dsn = "postgresql://h/db?options=-c%20a%3D1&application_name=mine"
    assert connection_settings(dsn, "-c b=2", "pgq") == {"options": "-c b=2 -c a=1",
                                                         "application_name": "mine"}
    assert connection_settings(dsn, "-c b=2", "asked")["application_name"] == "asked"
    assert connection_settings("host=h dbname=d", "-c b=2", "pgq") == {"options": "-c b=2",
                                                                       "application_name": "pgq"}
