"""The worst crash (issue 10, part 1): kill -9 of every node process and every
node's PostgreSQL at once, then every node restarted at once. Each node must
come up (its launcher must not trust the port it recorded: another node's
new server may hold it now, and the old postmaster may be a zombie) and the
cluster must then deliver every job it held."""

from __future__ import annotations

import os
import signal
import time

import pgq
from pgq.embedded import read_postmaster
from pgq.localcluster import LocalCluster, wait_for


def kill_everything(cluster: LocalCluster) -> None:
    postmasters = [read_postmaster(node.data / "postgres" / "data") for node in cluster.nodes]
    for node in cluster.nodes:
        node.process.send_signal(signal.SIGKILL)
    for postmaster in postmasters:
        assert postmaster is not None
        os.kill(postmaster.pid, signal.SIGKILL)
    for node in cluster.nodes:
        node.process.wait(10)


def test_every_node_and_database_killed_then_restarted_at_once():
    with LocalCluster(3, prefix="pgq-crash-") as cluster:
        with pgq.Client(cluster.nodes[0].dsn) as client:
            ids = client.add_jobs("crash", [b"%d" % i for i in range(50)], replicate=3)
            extra = client.add_job("crash", b"sync", replicate=3)
        kill_everything(cluster)
        for node in cluster.nodes:  # all at once
            node.start()
        for node in cluster.nodes:
            wait_for(node.serving, 90, f"{node.name} to serve again")
        # each node uses its own server again, whatever port it got
        ports = {read_postmaster(n.data / "postgres" / "data").port for n in cluster.nodes}
        assert len(ports) == 3
        wanted = set(ids) | {extra}
        got: set[str] = set()
        deadline = time.monotonic() + 60
        with pgq.Client([n.dsn for n in cluster.nodes]) as client:
            while not wanted <= got and time.monotonic() < deadline:
                jobs = client.get_job("crash", count=100, timeout=2)
                got |= {j.id for j in jobs}
                if jobs:
                    client.ack_job(*(j.id for j in jobs))
        assert wanted <= got, f"{len(wanted - got)} jobs held before the crash were not delivered"


def _lock_holder(dsn: str) -> int | None:
    """The backend holding the node lock, None if nobody (or no server)."""
    import psycopg

    from pgq.contracts import NODE_LOCK_KEY

    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=2) as conn:
            row = conn.execute(f"""SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted
                                   AND classid = {NODE_LOCK_KEY >> 32}
                                   AND objid = {NODE_LOCK_KEY & 0xFFFFFFFF} AND objsubid = 1""").fetchone()
    except psycopg.OperationalError:
        return None
    return None if row is None else int(row[0])


def test_a_crash_of_postgresql_alone_leaves_the_node_process_its_lock():
    """An OOM kill of one backend makes PostgreSQL restart them all. The node
    process lived on without its node lock: clients read "no node process"
    and withdrew replicated adds after 50 ms, until the node was restarted."""
    with LocalCluster(1, prefix="pgq-pgcrash-") as cluster:
        node = cluster.nodes[0]
        holder = _lock_holder(node.dsn)
        assert holder is not None
        os.kill(holder, signal.SIGKILL)  # crash recovery: every backend ends
        wait_for(lambda: _lock_holder(node.dsn) not in (None, holder), 60,
                 "the node process to take its lock again")
        assert node.alive()
        with pgq.Client(node.dsn) as client:  # and it serves
            assert client.get_job("pgcrash", nohang=True) == []
