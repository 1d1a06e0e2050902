"""The tables of schema ``pgq`` as SQLAlchemy metadata.

This metadata is the reference the alembic migrations must produce: a test
compares a freshly migrated database with it (no drift). Functions, triggers
and views are created by the migrations as SQL (SQLAlchemy does not model
them) and are covered by their own tests.

Design of the hot path (see docs/storage.md):

* ``jobs`` holds only jobs that are not acknowledged: an ACK deletes the row
  and appends to ``history``, so the hot table stays small. ``fillfactor`` 70
  and aggressive per-table autovacuum keep it compact under churn.
* ``history`` keeps a day and at most 10 million rows by default (the
  ``pgq.meta`` keys ``history_keep`` and ``history_keep_rows``, schema 0017);
  clients prune it in the background.
* A job is ``queued`` (claimable now, in the partial index ``jobs_queued_idx``
  ordered by ``ctime``) or ``active`` (delivered, delayed, or held without
  being queued here; a due ``requeue_at`` in ``jobs_timer_idx`` makes it
  claimable again) or ``wait-repl`` (created, waiting for its copies).
  A claim moves rows out of the ready index, so it never walks over leased
  jobs, however many are in flight.
* Priority (higher first) is a second, partial index of the queued jobs
  above priority 0 (``jobs_priority_idx``); the claim walks both.
* ``queue_counters`` holds per-queue counts in one row per (queue, backend
  pid), maintained by statement-level triggers: sessions never contend on a
  counter row, and the stats views never count the hot table.
"""

from __future__ import annotations

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Double,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

from .contracts import OUTBOX_KINDS

__all__ = ["SCHEMA", "metadata", "jobs", "history", "acks", "queues", "queue_counters",
           "waiters", "meta", "outbox", "nodes", "queue_imports", "dead_letters", "ingests",
           "results", "periodic", "periodic_claims", "CTIME_DEFAULT"]

SCHEMA = "pgq"
metadata = MetaData(schema=SCHEMA)

# Disque's ctime: milliseconds * 10^6 + a per-millisecond sequence, so jobs
# created in the same millisecond keep their creation order (pgq's clock
# since schema 0010).
CTIME_DEFAULT = (
    "(((floor((date_part('epoch'::text, pgq.now()) * (1000)::double precision)))"
    "::bigint * 1000000) + (nextval('pgq.ctime_seq'::regclass) % (1000000)::bigint))"
)

C = "C"  # byte-order collation: cheapest comparisons, deterministic cursors

meta = Table(
    "meta",
    metadata,
    Column("key", Text(collation=C), primary_key=True),
    Column("value", Text, nullable=False),
)

jobs = Table(
    "jobs",
    metadata,
    Column("id", Text(collation=C), nullable=False),
    Column("queue", Text(collation=C), nullable=False),
    Column("state", Text, nullable=False),
    Column("ctime", BigInteger, nullable=False, server_default=text(CTIME_DEFAULT)),
    Column("body", LargeBinary, nullable=False),
    Column("repl", Integer, nullable=False, server_default=text("1")),
    Column("retry", Double, nullable=False),
    Column("delay", Double, nullable=False, server_default=text("0")),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Column("requeue_at", DateTime(timezone=True)),
    Column("queued_at", DateTime(timezone=True)),
    Column("delivered_at", DateTime(timezone=True)),
    Column("nacks", Integer, nullable=False, server_default=text("0")),
    Column("additional_deliveries", Integer, nullable=False, server_default=text("0")),
    Column("deliveries", Integer, nullable=False, server_default=text("0")),
    Column("enqueues", Integer, nullable=False, server_default=text("0")),
    # Cluster (NULL for jobs that live on this node only):
    Column("nodes_delivered", ARRAY(Text)),  # nodes that may hold a copy (Disque's)
    Column("nodes_confirmed", ARRAY(Text)),  # nodes known to have stored it durably
    Column("cluster_requeue_at", DateTime(timezone=True)),  # re-queue run by the node process
    Column("repl_waiter", Integer),  # backend pid of a client waiting for its copies
    # Whether the next timed re-queue counts an additional delivery (false at
    # the end of a NACK's back-off: that re-queue is the NACK's).
    Column("requeue_counts", Boolean, nullable=False, server_default=text("true")),
    # Copies that suffice for a job whose replicate was defaulted, when the
    # last target does not confirm in time (NULL: repl).
    Column("repl_min", Integer),
    # Higher first, FIFO within a priority (schema 0013); see jobs_priority_idx.
    Column("priority", Integer, nullable=False, server_default=text("0")),
    # Idempotency key: no second live job with this key in the queue (schema 0013).
    Column("key", Text(collation=C)),
    # The holder this copy is parked on: it has the job queued, so this
    # copy's timer waits ten retries, or until that holder is suspect
    # (schema 0019, pgq.cluster.requeue).
    Column("parked_on", Text),
    PrimaryKeyConstraint("id", name="jobs_pkey"),
    CheckConstraint("state = ANY (ARRAY['wait-repl'::text, 'active'::text, 'queued'::text])",
                    name="jobs_state_check"),
    CheckConstraint("priority >= 0", name="jobs_priority_check"),
    Index("jobs_queued_idx", "queue", "ctime", postgresql_where=text("state = 'queued'::text")),
    # Queued jobs above priority 0, in claim order; jobs of priority 0 (the
    # default) are not in it, so queues without priorities never touch it.
    Index("jobs_priority_idx", "queue", text("priority DESC"), "ctime",
          postgresql_where=text("state = 'queued'::text AND priority > 0")),
    Index("jobs_key_idx", "queue", "key", postgresql_where=text("key IS NOT NULL")),
    Index("jobs_timer_idx", "queue", "requeue_at",
          postgresql_where=text("state = 'active'::text AND requeue_at IS NOT NULL")),
    Index("jobs_expiry_idx", "expires_at"),
    Index("jobs_cluster_timer_idx", "cluster_requeue_at",
          postgresql_where=text("cluster_requeue_at IS NOT NULL")),
    Index("jobs_wait_repl_idx", "ctime", postgresql_where=text("state = 'wait-repl'::text")),
    Index("jobs_parked_idx", "parked_on", postgresql_where=text("parked_on IS NOT NULL")),
    # Queued copies of replicated jobs whose watch the node has yet to arm (schema 0009).
    Index("jobs_unwatched_idx", "id",
          postgresql_where=text("state = 'queued'::text AND cluster_requeue_at IS NULL "
                                "AND cardinality(nodes_delivered) > 1")),
    postgresql_with={
        "fillfactor": "70",
        "autovacuum_vacuum_scale_factor": "0.01",
        "autovacuum_vacuum_threshold": "1000",
        "autovacuum_vacuum_insert_scale_factor": "0.05",
        "autovacuum_analyze_scale_factor": "0.02",
        "autovacuum_vacuum_cost_delay": "0",
        # No truncation by VACUUM: its ACCESS EXCLUSIVE lock stalls every
        # claim, and the next burst extends the file again (schema 0017).
        "vacuum_truncate": "false",
    },
)

history = Table(
    "history",
    metadata,
    Column("seq", BigInteger, Identity(always=True), nullable=False),
    Column("id", Text(collation=C), nullable=False),
    Column("queue", Text(collation=C), nullable=False),
    Column("outcome", Text, nullable=False),
    Column("ctime", BigInteger, nullable=False),
    Column("finished_at", DateTime(timezone=True), nullable=False,
           server_default=text("pgq.now()")),
    Column("delivered_at", DateTime(timezone=True)),
    Column("deliveries", Integer, nullable=False),
    Column("nacks", Integer, nullable=False),
    Column("additional_deliveries", Integer, nullable=False),
    Column("retry", Double, nullable=False),
    Column("repl", Integer, nullable=False),
    Column("body_size", Integer, nullable=False),
    PrimaryKeyConstraint("seq", name="history_pkey"),
    CheckConstraint(
        "outcome = ANY (ARRAY['acked'::text, 'fastacked'::text, 'deleted'::text, 'expired'::text, "
        "'dead'::text])",
        name="history_outcome_check",
    ),
    # Append-only and monotonic in time: a BRIN index costs almost nothing to
    # maintain and serves retention and time-range analytics.
    Index("history_finished_at_idx", "finished_at", postgresql_using="brin"),
)

acks = Table(
    "acks",
    metadata,
    Column("id", Text(collation=C), nullable=False),
    Column("queue", Text(collation=C)),
    Column("acked_at", DateTime(timezone=True), nullable=False,
           server_default=text("pgq.now()")),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Column("dummy", Boolean, nullable=False, server_default=text("false")),
    Column("nodes", ARRAY(Text)),  # holders to reach (cluster GC); NULL: none known
    Column("confirmed", ARRAY(Text)),  # holders that answered GOTACK
    PrimaryKeyConstraint("id", name="acks_pkey"),
    Index("acks_expiry_idx", "expires_at"),
    postgresql_with={"vacuum_truncate": "false"},  # as jobs (schema 0017)
)

queues = Table(
    "queues",
    metadata,
    Column("name", Text(collation=C), nullable=False),
    Column("paused", Text, nullable=False, server_default=text("'none'::text")),
    Column("created_at", DateTime(timezone=True), nullable=False,
           server_default=text("pgq.now()")),
    Column("updated_at", DateTime(timezone=True), nullable=False,
           server_default=text("pgq.now()")),
    PrimaryKeyConstraint("name", name="queues_pkey"),
    CheckConstraint("paused = ANY (ARRAY['none'::text, 'in'::text, 'out'::text, 'all'::text])",
                    name="queues_paused_check"),
)

queue_counters = Table(
    "queue_counters",
    metadata,
    Column("queue", Text(collation=C), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("queued", BigInteger, nullable=False, server_default=text("0")),
    Column("active", BigInteger, nullable=False, server_default=text("0")),
    Column("waiting", BigInteger, nullable=False, server_default=text("0")),
    Column("jobs_in", BigInteger, nullable=False, server_default=text("0")),
    Column("jobs_out", BigInteger, nullable=False, server_default=text("0")),
    Column("created_at", DateTime(timezone=True), nullable=False,
           server_default=text("pgq.now()")),
    Column("touched_at", DateTime(timezone=True), nullable=False,
           server_default=text("pgq.now()")),
    PrimaryKeyConstraint("queue", "pid", name="queue_counters_pkey"),
    postgresql_with={"fillfactor": "50"},
)

# Blocked consumers, one row per (backend, queue). UNLOGGED: after a crash
# nobody is blocked any more, so losing it is exactly right.
waiters = Table(
    "waiters",
    metadata,
    Column("pid", Integer, nullable=False),
    Column("queue", Text(collation=C), nullable=False),
    Column("since", DateTime(timezone=True), nullable=False,
           server_default=text("pgq.now()")),
    # GETs the connection holds blocked on the queue (schema 0016: QSTAT's
    # blocked sums it); a shared listener keeps it, a lone GET leaves 1.
    Column("gets", Integer, nullable=False, server_default=text("1")),
    PrimaryKeyConstraint("pid", "queue", name="waiters_pkey"),
    Index("waiters_queue_idx", "queue"),
    prefixes=["UNLOGGED"],
)


# Events the node process must carry to other nodes, written by client
# statements in the same transaction as the change they describe (the
# transactional outbox): nothing is announced that did not commit, and
# nothing that committed is forgotten if the node process is down.
outbox = Table(
    "outbox",
    metadata,
    Column("seq", BigInteger, Identity(always=True), nullable=False),
    Column("kind", Text, nullable=False),
    Column("job_id", Text(collation=C)),
    Column("queue", Text(collation=C)),
    Column("arg", Text),
    Column("created_at", DateTime(timezone=True), nullable=False,
           server_default=text("pgq.now()")),
    PrimaryKeyConstraint("seq", name="outbox_pkey"),
    CheckConstraint(
        "kind = ANY (ARRAY[" + ", ".join(f"'{kind}'::text" for kind in OUTBOX_KINDS) + "])",
        name="outbox_kind_check",
    ),
    postgresql_with={"vacuum_truncate": "false"},  # as jobs (schema 0017)
)

# The node process's view of the cluster (written by it; read by clients and SQL).
nodes = Table(
    "nodes",
    metadata,
    Column("id", Text(collation=C), nullable=False),
    Column("name", Text, nullable=False, server_default=text("''::text")),
    Column("host", Text, nullable=False),
    Column("port", Integer, nullable=False),
    Column("status", Text, nullable=False),
    Column("incarnation", BigInteger, nullable=False, server_default=text("0")),
    Column("leaving", Boolean, nullable=False, server_default=text("false")),
    Column("updated_at", DateTime(timezone=True), nullable=False,
           server_default=text("pgq.now()")),
    # The DSN the node advertised for its database (schema 0014): clients
    # of this node write copies there directly. NULL: none advertised.
    Column("dsn", Text),
    # HOST:PORT of the node's RESP front (schema 0015), for HELLO. NULL: none.
    Column("resp", Text),
    PrimaryKeyConstraint("id", name="nodes_pkey"),
    CheckConstraint("status = ANY (ARRAY['alive'::text, 'suspect'::text, 'dead'::text, 'left'::text])",
                    name="nodes_status_check"),
)

# Federation statistics per queue, written by the node process (QSTAT).
queue_imports = Table(
    "queue_imports",
    metadata,
    Column("queue", Text(collation=C), nullable=False),
    Column("import_from", ARRAY(Text), nullable=False),
    Column("import_rate", Integer, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False,
           server_default=text("pgq.now()")),
    PrimaryKeyConstraint("queue", name="queue_imports_pkey"),
)


# Jobs a worker gave up on, kept with their body until requeued or deleted.
dead_letters = Table(
    "dead_letters",
    metadata,
    Column("seq", BigInteger, Identity(always=True), nullable=False),
    Column("id", Text(collation=C), nullable=False),
    Column("queue", Text(collation=C), nullable=False),
    Column("body", LargeBinary, nullable=False),
    Column("reason", Text, nullable=False, server_default=text("''::text")),
    Column("nacks", Integer, nullable=False),
    Column("additional_deliveries", Integer, nullable=False),
    Column("deliveries", Integer, nullable=False),
    Column("ctime", BigInteger, nullable=False),
    Column("retry", Double, nullable=False),
    Column("repl", Integer, nullable=False),
    Column("died_at", DateTime(timezone=True), nullable=False,
           server_default=text("pgq.now()")),
    Column("priority", Integer, nullable=False, server_default=text("0")),  # schema 0020
    Column("key", Text),
    PrimaryKeyConstraint("seq", name="dead_letters_pkey"),
    Index("dead_letters_queue_idx", "queue", "seq"),
    Index("dead_letters_id_idx", "id"),  # schema 0020
)


# Bulk ingestions (pgq.spark): at most one merge per ingestion and node.
ingests = Table(
    "ingests",
    metadata,
    Column("ingest_id", Text(collation=C), nullable=False),
    Column("queue", Text(collation=C), nullable=False),
    Column("state", Text, nullable=False, server_default=text("'staging'::text")),
    Column("started_ms", BigInteger, nullable=False),
    Column("params", Text, nullable=False),
    Column("jobs", BigInteger, nullable=False, server_default=text("0")),
    Column("created_at", DateTime(timezone=True), nullable=False,
           server_default=text("pgq.now()")),
    Column("merged_at", DateTime(timezone=True)),
    PrimaryKeyConstraint("ingest_id", name="ingests_pkey"),
    CheckConstraint("state = ANY (ARRAY['staging'::text, 'merged'::text])", name="ingests_state_check"),
)


# Results of jobs, for workers told to keep them (schema 0011): the value a
# handler returned, or the error that sent the job to the dead letters.
results = Table(
    "results",
    metadata,
    Column("id", Text(collation=C), nullable=False),
    Column("value", LargeBinary),
    Column("error", Text),
    Column("stored_at", DateTime(timezone=True), nullable=False,
           server_default=text("pgq.now()")),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    PrimaryKeyConstraint("id", name="results_pkey"),
    Index("results_expires_at_idx", "expires_at"),
)


# Schedules of periodic jobs (schema 0012): a job to ``queue`` at every tick
# of ``cron`` (in time zone ``tz``); ``last_tick`` is the last tick a job was
# added for (moved under the row's lock, with the add: one job per tick).
periodic = Table(
    "periodic",
    metadata,
    Column("name", Text(collation=C), nullable=False),
    Column("cron", Text, nullable=False),
    Column("tz", Text, nullable=False, server_default=text("'UTC'::text")),
    Column("queue", Text(collation=C), nullable=False),
    Column("body", LargeBinary, nullable=False, server_default=text("'\\x'::bytea")),
    Column("options", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("last_tick", DateTime(timezone=True)),
    Column("updated_at", DateTime(timezone=True), nullable=False,
           server_default=text("pgq.now()")),
    PrimaryKeyConstraint("name", name="periodic_pkey"),
)

# The cluster's claims of periodic ticks (schema 0018), in the database of
# the tick home (pgq.periodic): the last tick claimed for each schedule
# name, and by which node; one claim per tick however many nodes hold the
# schedule.
periodic_claims = Table(
    "periodic_claims",
    metadata,
    Column("name", Text(collation=C), nullable=False),
    Column("last_tick", DateTime(timezone=True), nullable=False),
    Column("claimed_by", Text, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False,
           server_default=text("pgq.now()")),
    PrimaryKeyConstraint("name", name="periodic_claims_pkey"),
)
