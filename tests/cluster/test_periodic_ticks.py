"""Periodic jobs on real node processes: a schedule that workers declare on
every node adds one job a tick in the cluster, claimed at the tick home
(the live node with the lowest ID) over the DSN it advertised. The clock is
a parameter of the scheduler: nothing waits for a real tick."""

from __future__ import annotations

import datetime as dt
import logging

import pgq
from pgq import periodic
from pgq.testing import run_jobs

from ..test_periodic import fire_together
from .conftest import wait_until

# A tick a year: the workers' own schedulers (run_jobs) must find no real
# tick due while the test runs (with "*/5", one that crossed a 5-minute
# boundary added a second job), and both nodes' saves read the same last
# tick.
YEARLY = "0 3 1 1 *"


def test_workers_declaring_a_schedule_on_every_node_add_one_job_a_tick(make_cluster, caplog):
    cluster = make_cluster(2)
    ids = cluster.ids()
    wait_until(lambda: all(dsn for node in cluster for (dsn,) in node.sql("SELECT dsn FROM pgq.nodes")),
               15, message="the nodes to learn each other's DSN")
    clients = [node.client() for node in cluster]
    try:
        with caplog.at_level(logging.WARNING, logger="pgq"):
            for client in clients:  # what each node's workers do when they start
                worker = pgq.Worker(client, concurrency=1)
                worker.periodic(YEARLY, queue="reports", name="reports", replicate=2)(
                    lambda job: None)
                run_jobs(worker)
        assert "tick home" not in caplog.text  # the ticks can be shared: nothing to warn about
        (last,), = cluster[0].sql("SELECT last_tick FROM pgq.periodic")
        tick = periodic.next_tick(YEARLY, "UTC", last)
        schedulers = [periodic.Scheduler(client) for client in clients for _ in range(2)]
        added = fire_together(schedulers, tick + dt.timedelta(seconds=1))
        assert [(name, when) for name, when, _ in added] == [("reports", tick)]
        job_id = added[0][2]
        # One job, its two copies. The scheduler adds inside its own
        # transaction, so the copy goes out after the commit (the node's
        # outbox), not before add_job returns: looked at once, the second
        # copy was sometimes not there yet.
        wait_until(lambda: {node.name for node in cluster
                            if node.sql("SELECT 1 FROM pgq.jobs WHERE queue = 'reports'")}
                   == {"n1", "n2"}, 15, message="the job's two copies")
        assert all(node.sql("SELECT id FROM pgq.jobs WHERE queue = 'reports'") == [(job_id,)]
                   for node in cluster)
        home = min(ids, key=lambda name: ids[name])
        claims = cluster[0 if home == "n1" else 1].sql("SELECT last_tick FROM pgq.periodic_claims")
        assert claims == [(tick,)]
    finally:
        for client in clients:
            client.close()
