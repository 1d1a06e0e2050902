"""pgq's own Jepsen-style test: a real cluster, real clients, real faults.

A run starts a local cluster (each node its own process and PostgreSQL, on
its own 127.0.0.x address), lets producers add unique values and consumers
take and acknowledge them while a seeded nemesis kills node processes,
postmasters or both (one node, a minority, all at once), pauses nodes with
SIGSTOP, partitions them with nftables and skews their clocks with
libfaketime; then it heals everything, drains the queue and checks the
total-queue property on the recorded history.

* ``history``   the operations, as clients and the nemesis saw them
* ``checker``   the total-queue check and availability (pure)
* ``nemesis``   the seeded fault schedule (pure) and the code that applies it
* ``netfilter`` partitions by address pair (nftables, root only)
* ``clock``     per-node clock skew (libfaketime); ``skewed`` launches under it
* ``workload``  producers and consumers
* ``run``       one run, end to end; ``python -m tests.chaos`` (``make chaos``)

``tests/chaos/test_chaos.py`` runs a short seeded run in ``make test``;
``docs/chaos.md`` says what the runs found.
"""
