"""The SQL of bulk ingestion and of Spark reads, by name.

``{staging}`` stands for the ingestion's table in schema ``pgq_staging``;
it is filled in with :func:`psycopg.sql.Identifier`, never spliced as text.
"""

from __future__ import annotations

from psycopg import sql as pgsql

from ..contracts import JOBS_CHANNEL

__all__ = ["staging", "NODE", "INGEST_STATE", "RECORD_INGEST", "LOCK_INGEST", "QUEUE_PAUSED_IN",
           "CREATE_STAGING", "DROP_STAGING", "TOMBSTONED", "PRESENT", "merge_staged", "MARK_MERGED",
           "NOTIFY_QUEUE", "CLUSTER_MEMBERS", "HOLD_INGEST", "RELEASE_INGEST", "NODE_LEAVING",
           "SEQ_BOUNDS", "JOB_COUNT"]


def staging(statement: str, table: str) -> pgsql.Composed:
    return pgsql.SQL(statement).format(staging=pgsql.Identifier("pgq_staging", table))


NODE = """
SELECT (SELECT value FROM pgq.meta WHERE key = 'node_id'),
       coalesce((SELECT value FROM pgq.meta WHERE key = 'node_name'), ''),
       (SELECT active FROM pgq.cluster_state),
       (SELECT reachable_nodes FROM pgq.cluster_state)
"""

# Nodes this node knows alive: a W > 1 ingestion needs its targets to be
# members of one running cluster (their node processes run the re-queue
# timers and the ACK protocol of the copies).
CLUSTER_MEMBERS = "SELECT id FROM pgq.cluster_nodes WHERE status = 'alive'"

# Held by a run of an ingestion for its whole length, on every target
# (pgq.spark.ingest.Ingestion._hold); the class id spells "pgqI".
_INGEST_LOCK = "1885827401, hashtext(%(ingest_id)s)"
HOLD_INGEST = f"SELECT pg_try_advisory_lock({_INGEST_LOCK})"
RELEASE_INGEST = f"SELECT pg_advisory_unlock({_INGEST_LOCK})"

INGEST_STATE = """
SELECT queue, state, started_ms, params, jobs FROM pgq.ingests WHERE ingest_id = %(ingest_id)s
"""

RECORD_INGEST = """
INSERT INTO pgq.ingests (ingest_id, queue, started_ms, params)
VALUES (%(ingest_id)s, %(queue)s, %(started_ms)s, %(params)s)
ON CONFLICT (ingest_id) DO NOTHING
"""

# The merge holds this row lock to its commit: two runs of one ingestion
# never merge twice (the second sees 'merged').
LOCK_INGEST = """
SELECT state FROM pgq.ingests WHERE ingest_id = %(ingest_id)s FOR UPDATE
"""

# A node leaving its cluster takes no new job nor copy (ADD_JOBS and
# STORE_COPIES refuse there): nor does an ingestion. (The flag as the
# cluster_state view reads it, for the node's clients too.)
NODE_LEAVING = "SELECT leaving FROM pgq.cluster_state"

QUEUE_PAUSED_IN = """
SELECT EXISTS (SELECT 1 FROM pgq.queues WHERE name = %(queue)s AND paused IN ('in', 'all'))
"""

# UNLOGGED, no index, no constraint but NOT NULL: Spark's inserts cost the
# least possible; a crash empties it, and the ingestion is simply re-run.
CREATE_STAGING = """
CREATE UNLOGGED TABLE {staging} (
    seq bigint NOT NULL,
    grp integer NOT NULL,
    id text COLLATE "C" NOT NULL,
    body bytea NOT NULL
)
"""

DROP_STAGING = "DROP TABLE IF EXISTS {staging}"

# Rows whose job was acknowledged already (a tombstone is here): a re-run
# after a partial failure must not bring them back.
TOMBSTONED = """
SELECT count(DISTINCT s.seq) FROM {staging} s JOIN pgq.acks a ON a.id = s.id
"""

# Staged rows whose job is here already, not by this merge: federation
# (YOURJOBS) brings a job to another node under its ID, so a node merging
# after the origin may hold some of its rows' jobs before it merges them.
# Counted only when the merge met an existing ID (the fast form failed).
PRESENT = """
SELECT count(DISTINCT s.seq) FROM {staging} s JOIN pgq.jobs j ON j.id = s.id
WHERE NOT EXISTS (SELECT 1 FROM pgq.acks a WHERE a.id = s.id)
"""

# The merge: one statement, one transaction with the bookkeeping. Why it is
# safe:
# * A Spark task retried after it committed its rows (or a speculative
#   copy) staged the same rows twice, with the same IDs: the merge first
#   runs without ON CONFLICT (30 % faster) and, if that meets a duplicate,
#   again with ON CONFLICT (id) DO NOTHING, so each row becomes one job.
# * The caller compares the rows inserted with the rows expected for this
#   node before committing: a DataFrame that changed between Spark's passes
#   (non-deterministic input) is refused, never half-ingested.
# * The origin queues the job (or keeps it active until its delay); the
#   other holders store a copy as the cluster layer does (STORE_COPIES):
#   active, re-queued by the node process after delay + retry if the job
#   was not acknowledged meanwhile. A job held by one node has no holder
#   list, like a job added by ADDJOB on a single node.
# * {skip_acked} is the tombstone filter, used only when TOMBSTONED found
#   some (a re-run after jobs were acknowledged): it must not resurrect them.
_MERGE = """
WITH holders AS (
    SELECT * FROM unnest(%(groups)s::int[], %(holders)s::text[], %(origin)s::bool[])
        AS h(grp, holders, origin)
)
INSERT INTO pgq.jobs (id, queue, state, ctime, body, repl, retry, delay, expires_at,
                      requeue_at, cluster_requeue_at, queued_at, enqueues,
                      nodes_delivered, nodes_confirmed, requeue_counts)
SELECT s.id, %(queue)s,
       CASE WHEN h.origin AND %(delay)s::float8 = 0 THEN 'queued' ELSE 'active' END,
       %(base_ctime)s::bigint + s.seq, s.body, %(repl)s, %(retry)s, %(delay)s,
       pgq.now() + %(ttl)s::float8 * interval '1 second',
       CASE WHEN h.origin AND %(delay)s::float8 > 0
            THEN pgq.now() + %(delay)s::float8 * interval '1 second' END,
       CASE WHEN NOT h.origin AND %(retry)s::float8 > 0
            THEN pgq.now()
                 + (%(delay)s::float8 + %(retry)s::float8 + random() * 0.5) * interval '1 second'
            -- the origin's delayed copy with holders: its delay's end, counting
            -- nothing, as pgq.cluster.sql's _delay_timer (else only a GET on
            -- the origin served it)
            WHEN %(delay)s::float8 > 0 AND %(retry)s::float8 > 0 AND %(repl)s > 1
            THEN pgq.now() + %(delay)s::float8 * interval '1 second' END,
       CASE WHEN h.origin AND %(delay)s::float8 = 0 THEN pgq.now() END,
       CASE WHEN h.origin AND %(delay)s::float8 = 0 THEN 1 ELSE 0 END,
       CASE WHEN %(repl)s > 1 THEN string_to_array(h.holders, ',') END,
       CASE WHEN %(repl)s > 1 THEN string_to_array(h.holders, ',') END,
       NOT (h.origin AND %(delay)s::float8 > 0 AND %(retry)s::float8 > 0 AND %(repl)s > 1)
FROM {{staging}} s JOIN holders h ON h.grp = s.grp
{skip_acked}
"""
_SKIP_ACKED = "WHERE NOT EXISTS (SELECT 1 FROM pgq.acks a WHERE a.id = s.id)"


def merge_staged(*, deduplicate: bool, skip_acked: bool) -> str:
    """The merge statement (see above) in one of its forms."""
    statement = _MERGE.format(skip_acked=_SKIP_ACKED if skip_acked else "")
    return statement + ("ON CONFLICT (id) DO NOTHING\n" if deduplicate else "")


MARK_MERGED = """
UPDATE pgq.ingests SET state = 'merged', jobs = %(jobs)s, merged_at = pgq.now()
WHERE ingest_id = %(ingest_id)s
"""

# Always, once per merge: the merge is a transaction of several statements
# (and a DROP of the staging table that may wait for a lock), so a consumer
# that registered after a check of pgq.waiters here and before the commit
# slept until its next poll (pgq.protocol.Session: a transaction of several
# statements notifies unconditionally; found by a read-only review).
NOTIFY_QUEUE = f"""
SELECT pg_notify('{JOBS_CHANNEL}', %(queue)s)
"""

# ----------------------------------------------------------------- reading

# Bounds of a range-partitioned read (one cheap index probe each).
SEQ_BOUNDS = "SELECT min({column}), max({column}) FROM {view}"

JOB_COUNT = "SELECT coalesce(sum(jobs), 0)::bigint FROM pgq.job_counts WHERE state <> 'acked'"
