"""The contracts between pgq's clients and a node process, written once.

A client never talks to its node process directly: both meet in the node's
database. This module holds every name and encoding they share, so that
the client statements (:mod:`pgq.statements`), the CLI, the Spark writer
and the node (:mod:`pgq.cluster.sql`, :mod:`pgq.cluster.core`) cannot drift
apart:

* **NOTIFY channels.** :data:`JOBS_CHANNEL` (payload: a queue name) wakes
  consumers blocked on that queue; :data:`DOORBELL_CHANNEL` (empty payload)
  tells the node process that outbox events committed;
  :data:`REPLICATION_CHANNEL_PREFIX` + a client backend's pid (payload: a
  job ID) tells a synchronous adder that its job got its W copies. A lost
  notification costs latency only: every waiter also polls.
* **The node lock.** A node process holds the session advisory lock
  :data:`NODE_LOCK_KEY` on its database while it runs (one process per
  database); its backend ends with the process, so a free lock means no
  node process runs: a synchronous adder stops waiting for copies at once.
  A crash of PostgreSQL alone ends the lock too: the node process checks it
  every second and takes it again.
* **Outbox events** (``pgq.outbox``: kind, job_id, queue, arg), written by
  client statements in the transaction of the change they announce, and
  read by the node process in ``seq`` order (:data:`OUTBOX_KINDS`; the
  schema's CHECK constraint lists the same kinds). Arguments:

  ========== ======== ===== =====================================================
  kind       job_id   queue arg
  ========== ======== ===== =====================================================
  replicate  new job        (none): copy it to W-1 peers
  abort      job            (none): the adder gave up; remove partial copies
  ack        job            holders, comma-separated; empty: unknown (dummy ack)
  fastack    job            holders, comma-separated; empty: ask everyone
  queued     job            ``counter:holders`` (counter ``nacks``,
                            ``additional_deliveries`` or empty)
  working    job            ``:holders``
  pause      (none)   queue the new pause state (``none|in|out|all``)
  meet       (none)         ``HOST:PORT`` to join
  forget     (none)         a node ID
  leaving    (none)         ``yes`` or ``no``
  ========== ======== ===== =====================================================

The statements a tool uses to speak to a node (:data:`TELL_NODE`,
:data:`SET_LEAVING`, :data:`HELD_BY_NODE`, ...) are here too: the CLI and
the simulation send exactly what a client statement would.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "JOBS_CHANNEL", "DOORBELL_CHANNEL", "REPLICATION_CHANNEL_PREFIX", "OUTBOX_KINDS",
    "OUTBOX_REPLICATE", "OUTBOX_ABORT", "OUTBOX_ACK", "OUTBOX_FASTACK", "OUTBOX_QUEUED",
    "OUTBOX_WORKING", "OUTBOX_PAUSE", "OUTBOX_MEET", "OUTBOX_FORGET", "OUTBOX_LEAVING",
    "TELL_NODE", "SET_LEAVING", "NODE_ID", "HELD_BY_NODE", "CLUSTER_STATE", "NODES",
    "holders_arg", "split_holders", "notice_arg", "split_notice", "NODE_LOCK_KEY", "NODE_LOCK_HELD",
    "STORE_COPIES", "DIRECT_COPIES", "DIRECT_COPY", "ONE_COPY_NAMES", "COPY_ROWS", "batch_rows",
    "meta",
]

JOBS_CHANNEL = "pgq"
NODE_LOCK_KEY = 0x7067716E  # "pgqn": pg_advisory_lock(bigint) of the node process
# Some session holds the node lock. A bigint advisory key shows in pg_locks
# as classid = its high half, objid = its low half, objsubid = 1.
NODE_LOCK_HELD = f"""EXISTS (SELECT FROM pg_locks l
               WHERE l.locktype = 'advisory' AND l.granted
                 AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                 AND l.classid = {NODE_LOCK_KEY >> 32} AND l.objid = {NODE_LOCK_KEY & 0xFFFFFFFF}
                 AND l.objsubid = 1)"""
DOORBELL_CHANNEL = "pgq_node"
REPLICATION_CHANNEL_PREFIX = "pgq_r"

OUTBOX_REPLICATE = "replicate"
OUTBOX_ABORT = "abort"
OUTBOX_ACK = "ack"
OUTBOX_FASTACK = "fastack"
OUTBOX_QUEUED = "queued"
OUTBOX_WORKING = "working"
OUTBOX_PAUSE = "pause"
OUTBOX_MEET = "meet"
OUTBOX_FORGET = "forget"
OUTBOX_LEAVING = "leaving"
OUTBOX_KINDS = (OUTBOX_REPLICATE, OUTBOX_ABORT, OUTBOX_ACK, OUTBOX_FASTACK, OUTBOX_QUEUED,
                OUTBOX_WORKING, OUTBOX_PAUSE, OUTBOX_MEET, OUTBOX_FORGET, OUTBOX_LEAVING)


def holders_arg(nodes: list[str] | tuple[str, ...]) -> str:
    """An ``ack``/``fastack`` argument: the holders, comma-separated."""
    return ",".join(nodes)


def split_holders(arg: str | None) -> list[str]:
    """The holders an ``ack``/``fastack`` argument names (empty: unknown)."""
    return [node for node in (arg or "").split(",") if node]


def notice_arg(counter: str, holders: list[str] | tuple[str, ...]) -> str:
    """A ``queued``/``working`` argument: ``counter:holders``."""
    return f"{counter}:{holders_arg(holders)}"


def split_notice(arg: str | None) -> tuple[str, list[str]]:
    """(counter, holders) of a ``queued``/``working`` argument."""
    counter, _, holders = (arg or "").partition(":")
    return counter, split_holders(holders)


# An event for the node process, and its doorbell (the node also polls).
TELL_NODE = f"""
WITH event AS (
    INSERT INTO pgq.outbox (kind, queue, arg) VALUES (%(kind)s, %(queue)s, %(arg)s) RETURNING 1
)
SELECT pg_notify('{DOORBELL_CHANNEL}', '') FROM event
"""

# The leaving flag a node reads at start (its process learns it from the
# 'leaving' event, which follows).
SET_LEAVING = """
INSERT INTO pgq.meta (key, value) VALUES ('leaving', CASE WHEN %(leaving)s THEN 'true' ELSE 'false' END)
ON CONFLICT (key) DO UPDATE SET value = excluded.value
"""


def meta(key: str) -> str:
    """A value of ``pgq.meta``, as a scalar subquery for a statement.

    Not ``pgq.meta_value(key)``: an SQL function that reads a table is never
    inlined, and PostgreSQL (up to 17) parses and plans such a function's
    body again at every execution of the statement that calls it, even
    from a cached plan; the subquery is planned once with the statement.
    Measured in a server-side loop on this machine: a peer's copy of a lone
    add (DIRECT_COPY, three reads) 0.25-0.41 -> 0.18-0.31 ms."""
    return f"(SELECT value FROM pgq.meta WHERE key = '{key}')"


NODE_ID = f"SELECT {meta('node_id')}"

# What a leaving node still holds: jobs it has a copy of, ACKs it still
# has to collect (the tombstones it drives, as PENDING_ACK_GC reads them).
# Zero: it may stop. A passive tombstone (this node answered the SETACK and
# waits for the DELJOB) does not count: it keeps late copies out while the
# node runs, and a DELJOB lost once made `pgq cluster leave` wait for the
# job's TTL (a day by default).
# (A job waiting for its copies counts whatever its holders say: a leaving
# node stores an add's row with no holder, '{}', until its copies are made
# elsewhere and it is handed over; uncounted, `pgq cluster leave` said the
# node was safe to stop while an add it had answered lived only there.)
HELD_BY_NODE = """
SELECT (SELECT count(*) FROM pgq.jobs
        WHERE nodes_delivered IS NULL OR %(myself)s = ANY (nodes_delivered)
           OR (state = 'wait-repl' AND expires_at > pgq.now()))
     + (SELECT count(*) FROM pgq.acks
        WHERE (nodes IS NOT NULL OR dummy) AND expires_at > pgq.now())
"""

def batch_rows(columns: Sequence[tuple[str, str, str]], *,
               ordinal: bool = False) -> tuple[str, str, dict[str, str]]:
    """The input rows of a batch statement, from its columns (array
    parameter, column, SQL type), in two forms and a map:

    * many rows: an unnest of one binary array parameter per column;
    * one row: plain values, each parameter named as its column, for a
      batch of one job (the common case at low concurrency: psycopg dumps
      no one-element arrays, several microseconds of client CPU each, and
      the server unnests nothing);
    * each array parameter's name in the one-row form.

    ``ordinal`` adds the row number ``n`` (arrival order)."""
    arrays = ", ".join(f"%({array})b::{kind}[]" for array, _column, kind in columns)
    names = ", ".join(column for _array, column, _kind in columns) + (", n" if ordinal else "")
    many = (f"    SELECT * FROM unnest({arrays})\n"
            f"        {'WITH ORDINALITY ' if ordinal else ''}AS u({names})\n")
    one = ("    SELECT " + ", ".join(f"%({column}){'b' if kind == 'bytea' else 's'}::{kind} AS {column}"
                                   for _array, column, kind in columns)
           + (", 1::bigint AS n" if ordinal else "") + "\n")
    return many, one, {array: column for array, column, _kind in columns}


# A copy of a new job, stored by a peer: by its node process for a REPLJOB
# (it answers GOTJOB for `stored`, SETACK for `acked`), or by a client of
# the origin writing the copies of its own add straight into this database
# (pgq.commands, direct copies: it counts `stored`). `myself` is the id of
# the node whose database this is: nothing is stored, or answered, in any
# other. A copy is refused (not stored: the origin widens, the client goes
# through the node) when its queue is paused for input or this node is
# leaving (read from pgq.meta at statement time: the flag counts from the
# moment it is set). A re-sent copy (STORE_COPIES) merges its holder list into ours. The
# copy is 'active' with a re-queue timer run by the node process: retry
# (+ delay) from now, jittered 0..500 ms so copies do not fire together.
def _store_copies(incoming: str, match: str, conflict: str) -> str:
    return f"""
WITH incoming AS (
{incoming}), acked AS (  -- id = ANY: an index probe per copy, never a scan of pgq.acks
    SELECT i.id, coalesce(array_to_string(a.nodes, ','), i.nodes) AS nodes
    FROM pgq.acks a JOIN incoming i ON i.id = a.id
    WHERE {match} AND {meta('node_id')} = %(myself)s
), accepted AS (
    SELECT i.* FROM incoming i
    WHERE NOT coalesce({meta('leaving')}::boolean, false)
      -- this database is the node meant: a client's DSN of a peer may reach
      -- another database (a DSN advertised as localhost, two DSNs of one
      -- server); a copy stored there would be counted and not be a copy
      AND {meta('node_id')} = %(myself)s
      AND NOT EXISTS (SELECT 1 FROM acked a WHERE a.id = i.id)
      AND NOT EXISTS (SELECT 1 FROM pgq.queues p WHERE p.name = i.queue AND p.paused IN ('in', 'all'))
      AND to_timestamp(i.expires) > pgq.now()
), stored AS (
    INSERT INTO pgq.jobs AS j (id, queue, state, ctime, body, repl, retry, delay, expires_at,
                               cluster_requeue_at, nacks, additional_deliveries,
                               nodes_delivered, nodes_confirmed, priority, key)
    SELECT id, queue, 'active', ctime, body, repl, retry, delay, to_timestamp(expires),
           CASE WHEN retry > 0 THEN pgq.now()
                + (delay + retry + random() * 0.5) * interval '1 second' END,
           nacks, adds, string_to_array(nodes, ','), ARRAY[%(myself)s]::text[], priority, key
    FROM accepted
    {conflict}
    RETURNING j.id
)
SELECT 'stored', id, NULL FROM stored
UNION ALL
SELECT 'acked', id, nodes FROM acked
"""


# The columns of a copy (STORE_COPIES' arrays; STORE_COPY's values, for a
# client's direct copy of a lone add: measured 0.60-0.65 -> 0.50-0.55 ms
# per write, 0.15-0.20 -> 0.09-0.11 ms of client CPU). ONE_COPY_NAMES: the
# one-copy name of each array parameter; both also take `myself`. A
# node's YOURJOBS import (cluster.sql.IMPORT_JOBS) reads COPY_ROWS too.
COPY_ROWS, _ONE_COPY_ROW, ONE_COPY_NAMES = batch_rows([
    ("ids", "id", "text"), ("queues", "queue", "text"), ("bodies", "body", "bytea"),
    ("ctimes", "ctime", "bigint"), ("repls", "repl", "int"), ("retries", "retry", "float8"),
    ("delays", "delay", "float8"), ("expires", "expires", "float8"), ("nacks", "nacks", "int"),
    ("adds", "adds", "int"), ("nodes", "nodes", "text"), ("priorities", "priority", "int"),
    ("keys", "key", "text")])
_MERGE_HOLDERS = """ON CONFLICT (id) DO UPDATE SET nodes_delivered = ARRAY(
        SELECT DISTINCT n FROM unnest(j.nodes_delivered || excluded.nodes_delivered) AS n
        WHERE n IS NOT NULL ORDER BY n)"""
STORE_COPIES = _store_copies(COPY_ROWS, "a.id = ANY (%(ids)b::text[])", _MERGE_HOLDERS)

# A client's direct copies (pgq.commands._add_direct) are of jobs it has
# just made: an ID already here is not merged but left alone, and the
# missing `stored` row fails that peer (the add then goes through the node
# process under new IDs, and withdraws what it wrote). Only an attempt of
# the same add that never committed at the origin can have left one. DO
# NOTHING also spares the statement-level UPDATE trigger that any ON
# CONFLICT DO UPDATE fires, rows or not (about 0.1 ms of the peer's time
# per copy here).
DIRECT_COPIES = _store_copies(COPY_ROWS, "a.id = ANY (%(ids)b::text[])",
                              "ON CONFLICT (id) DO NOTHING")
DIRECT_COPY = _store_copies(_ONE_COPY_ROW, "a.id = %(id)s::text", "ON CONFLICT (id) DO NOTHING")

CLUSTER_STATE = """
SELECT node_id AS id, active, leaving, reachable_nodes, bus_host, bus_port FROM pgq.cluster_state
"""

# Whether a node process ever served this database (the cluster commands
# that write for it to read refuse a plain database).
IS_MEMBER = "SELECT member FROM pgq.cluster_state"

NODES = """
SELECT id, name, host, port, myself, status, leaving, priority FROM pgq.cluster_nodes
ORDER BY NOT myself, id
"""
