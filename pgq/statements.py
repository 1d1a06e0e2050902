"""Every SQL statement pgq runs at run time, by name.

Kept in one module so the hot path can be read, reviewed and EXPLAINed in one
place (the schema itself is in ``migrations/``). Parameters are always bound
(``%(name)s``), never spliced: queue names and bodies may contain anything.

Conventions:

* ``pgq.now()`` is "now" (schema 0008): ``statement_timestamp()``, stable
  within a statement and fresh for each statement even inside a long caller
  transaction (``now()`` would be the transaction's start and would shorten
  leases); the simulation sets it to its virtual time instead.
* A job whose ``expires_at`` has passed is treated as gone by every statement,
  whether or not the sweep has deleted it yet.
* An ``active`` job whose ``requeue_at`` has passed is treated as queued: a
  claim takes it directly, so no background process is needed for re-queues.
* Claims and timer scans lock with ``FOR UPDATE SKIP LOCKED`` through ``ctid``
  so concurrent consumers never wait on each other and the update does not
  re-walk the primary key.
"""

from __future__ import annotations

from .contracts import (
                        DOORBELL_CHANNEL,
                        JOBS_CHANNEL,
                        NODE_LOCK_HELD,
                        OUTBOX_ABORT,
                        OUTBOX_ACK,
                        OUTBOX_FASTACK,
                        OUTBOX_PAUSE,
                        OUTBOX_QUEUED,
                        OUTBOX_REPLICATE,
                        OUTBOX_WORKING,
                        batch_rows,
                        meta,
)

# ------------------------------------------------------------- connections

# Settings of every connection pgq opens for itself (client pools and the
# node process), passed as libpq options so they cost no round trip.
# * plan_cache_mode: pgq's statements are prepared; with array parameters
#   PostgreSQL would keep re-planning them ("custom plans"), which costs
#   more than running them.
# * enable_bitmapscan / enable_seqscan off: the generic plans are made once
#   per connection, often while pgq.jobs is empty or never analysed; the
#   planner then picks a bitmap scan (or a seq scan) that reads every queued
#   job to return a few - 20x slower on a fresh node with a backlog. With
#   these off the plan is the ordered index walk whatever the table's
#   history (pgq's statements all have an index to walk; a table without
#   one is still scanned: "off" only makes a plan costlier).
# * enable_sort off, for the same reason: on a fresh node with a backlog in
#   several priorities, the claim's priority arm read jobs_queued_idx and
#   sorted every queued job of the queue (33 ms a claim with 60k jobs)
#   instead of walking jobs_priority_idx in its order (0.7 ms). A sort with
#   no ordered path to replace it (a LIMITed arm's few rows) stays.
# * jit off: such a plan's inflated cost would otherwise trigger JIT
#   compilation (60 ms for a one-row read); pgq's statements are short OLTP.
SESSION_OPTIONS = ("-c plan_cache_mode=force_generic_plan -c enable_bitmapscan=off "
                   "-c enable_seqscan=off -c enable_sort=off -c jit=off")
TURBO_OPTIONS = " -c synchronous_commit=off"

# --------------------------------------------------------------------- node

# A client's first statements: is pgq there (a reference to a missing table
# fails at parse time, so this is asked first), then its revision and node.
HAS_SCHEMA = """
SELECT to_regclass('pgq.alembic_version') IS NOT NULL AND to_regclass('pgq.meta') IS NOT NULL
"""
SCHEMA_AND_NODE = """
SELECT (SELECT version_num FROM pgq.alembic_version),
       (SELECT value FROM pgq.meta WHERE key = 'node_id')
"""

# The periodic sweep, and which hot tables now need a vacuum (see pgq.vacuum):
# over 20% dead rows, at least dead_min, not vacuumed in the last 10 s.
SWEEP = """
SELECT s.expired, s.requeued, s.acks_expired,
       ARRAY(SELECT t.relname::text FROM pg_stat_user_tables t
             WHERE t.schemaname = 'pgq' AND t.relname IN ('jobs', 'acks', 'outbox')
               AND t.n_dead_tup > greatest(%(dead_min)s, t.n_live_tup / 5)
               AND coalesce(greatest(t.last_vacuum, t.last_autovacuum), '-infinity')
                   < pgq.now() - interval '10 seconds') AS vacuum
FROM pgq.sweep() s
"""
SWEEP_TABLES_TO_VACUUM = 3  # the column of SWEEP's row naming them

# Up to this many of the oldest rows of pgq.history past retention (schema
# 0017), in a maintenance thread (pgq.vacuum); it calls again while batches
# come back full.
PRUNE_HISTORY = "SELECT pgq.prune_history(%(rows)s)"

# Expire, and queue the due jobs of one queue, so that introspection of that
# queue (QLEN, QPEEK, QSTAT) reports Disque's state exactly.
SWEEP_QUEUE = "SELECT pgq.expire_jobs(), pgq.requeue_due(10000, %(queue)s)"
SWEEP_ALL_QUEUES = "SELECT pgq.expire_jobs(), pgq.requeue_due(10000)"

# ---------------------------------------------------------------------- add

# The parts ADD_JOBS and ADD_JOBS_CLUSTER share: PAUSED and MAXLEN checked
# by the inserting statement, and its reply (paused, full, added, and the
# NOTIFY of blocked consumers when a job became ready, or will be: an add
# with a DELAY is 'active' until its requeue_at, and a GET blocked before
# it knew of no such job. Woken, the GET claims, learns from the claim when
# the job is due and waits until then; without the wake it found the job
# only at its next poll, up to poll_interval (0.5 s by default) late, or
# later with a longer poll_interval).
_ADD_PAUSED_ROOM = """paused AS (
    SELECT 1 FROM pgq.queues WHERE name = %(queue)s AND paused IN ('in', 'all')
), room AS (
    SELECT %(maxlen)s::bigint IS NULL
           OR coalesce((SELECT sum(queued) FROM pgq.queue_counters WHERE queue = %(queue)s), 0)
              + %(n)s::bigint <= %(maxlen)s::bigint AS ok
), existing AS (  -- a live job with the add's idempotency key (jobs_key_idx)
    SELECT id FROM pgq.jobs
    WHERE %(key)s::text IS NOT NULL AND queue = %(queue)s AND key = %(key)s::text
      AND expires_at > pgq.now()
    LIMIT 1
)"""

_ADD_REPLY = f"""SELECT EXISTS (SELECT 1 FROM paused) AS paused,
       NOT (SELECT ok FROM room) AS full,
       (SELECT count(*) FROM inserted) AS added,
       (SELECT pg_notify('{JOBS_CHANNEL}', %(queue)s)::text
        WHERE EXISTS (SELECT 1 FROM inserted WHERE state IN ('queued', 'active'))
          AND (%(always_notify)s OR EXISTS (SELECT 1 FROM pgq.waiters w WHERE w.queue = %(queue)s)))
        AS notified,
       (SELECT id FROM existing) AS existing,"""

# One statement adds one or many jobs. Why it is safe:
# * ON CONFLICT (id) DO NOTHING makes a retry after a lost connection
#   idempotent: IDs are made by the client, so a second attempt finds the row.
# * PAUSED and MAXLEN are checked by the same statement that inserts; for
#   MAXLEN the caller first takes the queue's advisory lock in the same
#   transaction, so two producers cannot both see room for one more job.
# * NOTIFY is sent at most once per statement, and only when a consumer is
#   registered as blocked on the queue (or, inside a caller's transaction,
#   always: see protocol.Session). No trigger is involved.
ADD_JOBS = f"""
WITH leaving AS (  -- a leaving node keeps no new copy (the client re-routes the add)
    SELECT 1 FROM pgq.meta WHERE key = 'leaving' AND value = 'true'
), {_ADD_PAUSED_ROOM}, inserted AS (
    INSERT INTO pgq.jobs (id, queue, state, body, repl, retry, delay,
                          expires_at, requeue_at, queued_at, enqueues, priority, key)
    SELECT u.id, %(queue)s,
           CASE WHEN %(delay)s::float8 > 0 THEN 'active' ELSE 'queued' END,
           u.body, %(repl)s, %(retry)s, %(delay)s,
           pgq.now() + %(ttl)s::float8 * interval '1 second',
           CASE WHEN %(delay)s::float8 > 0
                THEN pgq.now() + %(delay)s::float8 * interval '1 second' END,
           CASE WHEN %(delay)s::float8 > 0 THEN NULL ELSE pgq.now() END,
           CASE WHEN %(delay)s::float8 > 0 THEN 0 ELSE 1 END,
           %(priority)s, %(key)s
    FROM unnest(%(ids)s::text[], %(bodies)s::bytea[]) WITH ORDINALITY AS u(id, body, n)
    WHERE NOT EXISTS (SELECT 1 FROM paused) AND (SELECT ok FROM room)
      AND NOT EXISTS (SELECT 1 FROM leaving) AND NOT EXISTS (SELECT 1 FROM existing)
    ORDER BY u.n  -- ctime follows the order of the bodies
    ON CONFLICT (id) DO NOTHING
    RETURNING state
)
{_ADD_REPLY}
       EXISTS (SELECT 1 FROM leaving) AS leaving
"""

# The parts of a many-caller add (ADD_MANY, ADD_MANY_REPLICATED) that
# refuse jobs (a leaving node stores none; a paused queue none of its
# own) and wake blocked consumers of queues that got ready jobs.
def _many_refusals(names: str) -> str:
    return f"""leaving AS (
    SELECT 1 FROM pgq.meta WHERE key = 'leaving' AND value = 'true'
), paused AS (
    SELECT p.name FROM pgq.queues p
    WHERE p.name = ANY ({names}) AND p.paused IN ('in', 'all')
)"""
_MANY_WOKEN = f"""woken AS (
    SELECT pg_notify('{JOBS_CHANNEL}', q.queue)
    FROM (SELECT DISTINCT queue FROM inserted WHERE state IN ('queued', 'active')) AS q
    WHERE EXISTS (SELECT 1 FROM pgq.waiters w WHERE w.queue = q.queue)
)"""

# ADDJOB of many callers at once (group commit): jobs held here only, each
# row with its own queue and parameters, one statement and one commit for
# all. Safe for the same reasons as ADD_JOBS (idempotent by client-made IDs;
# PAUSED checked in the statement; a leaving node stores nothing: every
# call is then re-routed). MAXLEN adds never come here (they lock).
def _add_here(rows: str, names: str) -> str:
    return f"""
WITH {_many_refusals(names)}, input AS (
{rows}), inserted AS (
    INSERT INTO pgq.jobs (id, queue, state, body, repl, retry, delay,
                          expires_at, requeue_at, queued_at, enqueues, priority)
    SELECT i.id, i.queue, CASE WHEN i.delay > 0 THEN 'active' ELSE 'queued' END,
           i.body, 1, i.retry, i.delay,
           pgq.now() + i.ttl * interval '1 second',
           CASE WHEN i.delay > 0 THEN pgq.now() + i.delay * interval '1 second' END,
           CASE WHEN i.delay > 0 THEN NULL ELSE pgq.now() END,
           CASE WHEN i.delay > 0 THEN 0 ELSE 1 END, i.priority
    FROM input i
    WHERE NOT EXISTS (SELECT 1 FROM leaving)
      AND NOT EXISTS (SELECT 1 FROM paused p WHERE p.name = i.queue)
    ORDER BY i.n  -- ctime follows arrival order
    ON CONFLICT (id) DO NOTHING
    RETURNING queue, state
), {_MANY_WOKEN}
SELECT ARRAY(SELECT name FROM paused) AS paused,
       EXISTS (SELECT 1 FROM leaving) AS leaving,
       (SELECT count(*) FROM woken) AS woken  -- a plain CTE runs only if referenced
"""


# The rows of an add batch: one per job from arrays, or the one job of a
# batch of one from plain values (contracts.batch_rows; measured here, a
# lone add's statement went from 0.46 to 0.39 ms at p50 and from 0.15 to
# 0.09 ms of client CPU). pgq.commands picks the statement, and names the
# one job's parameters with ADD_ONE_NAMES.
_MANY_ROWS, _ONE_ROW, ADD_ONE_NAMES = batch_rows([
    ("ids", "id", "text"), ("queues", "queue", "text"), ("bodies", "body", "bytea"),
    ("retries", "retry", "float8"), ("delays", "delay", "float8"), ("ttls", "ttl", "float8"),
    ("priorities", "priority", "int")], ordinal=True)
ADD_MANY = _add_here(_MANY_ROWS, "%(names)s::text[]")
ADD_ONE = _add_here(_ONE_ROW, "ARRAY[%(queue)s::text]")

# ADD_MANY for replicated adds of many callers (group commit on a node
# served by a node process): one statement and one commit store every
# caller's jobs, as ADD_JOBS_CLUSTER does for one caller. Three uses:
# * synchronous (wait), announced: 'wait-repl' with an outbox event each,
#   until the node process, which copies them in one drain, confirms each
#   and wakes this connection (pgq_r<pid>);
# * asynchronous, announced: queued at once (or active until their delay),
#   with an outbox event each, copied in the background;
# * direct copies (not announced): queued at once with their holders, in a
#   transaction the client commits only once every peer committed its copy
#   (pgq.commands._add_direct); `stored` gives the copies what only this
#   insert knows (id, ctime, expiry as epoch seconds).
# `holders`: per job, the comma-joined nodes holding it (this one first).
# A leaving node stores nothing: every call goes the long way (it
# replicates externally), as with ADD_MANY.
def _add_replicated(rows: str, names: str) -> str:
    return f"""
WITH {_many_refusals(names)}, input AS (
{rows}), inserted AS (
    INSERT INTO pgq.jobs (id, queue, state, body, repl, repl_min, retry, delay, expires_at,
                          requeue_at, queued_at, enqueues, nodes_delivered, nodes_confirmed,
                          repl_waiter, priority, cluster_requeue_at, requeue_counts)
    SELECT i.id, i.queue,
           CASE WHEN %(wait)s THEN 'wait-repl' WHEN i.delay > 0 THEN 'active' ELSE 'queued' END,
           i.body, i.repl, i.repl_min, i.retry, i.delay,
           pgq.now() + i.ttl * interval '1 second',
           CASE WHEN i.delay > 0 THEN pgq.now() + i.delay * interval '1 second' END,
           CASE WHEN %(wait)s OR i.delay > 0 THEN NULL ELSE pgq.now() END,
           CASE WHEN %(wait)s OR i.delay > 0 THEN 0 ELSE 1 END,
           string_to_array(i.holders, ','), string_to_array(i.holders, ','),
           CASE WHEN %(wait)s THEN pg_backend_pid() END, i.priority,
           -- A queued copy with holders elsewhere (direct copies) keeps watch
           -- from the start (schema 0009), as TIMERS would arm it: a batch
           -- armed later is locked while the node does it, and claims skip it.
           -- A delayed one: its delay's end, counting nothing (see
           -- pgq.cluster.sql _delay_timer).
           CASE WHEN %(wait)s OR i.retry <= 0 OR cardinality(string_to_array(i.holders, ',')) < 2
                THEN NULL
                WHEN i.delay <= 0 THEN pgq.now() + (i.retry + random() * 0.5) * interval '1 second'
                ELSE pgq.now() + i.delay * interval '1 second' END,
           %(wait)s OR i.delay <= 0 OR i.retry <= 0 OR cardinality(string_to_array(i.holders, ',')) < 2
    FROM input i
    WHERE NOT EXISTS (SELECT 1 FROM leaving)
      AND NOT EXISTS (SELECT 1 FROM paused p WHERE p.name = i.queue)
    ORDER BY i.n  -- ctime follows arrival order
    ON CONFLICT (id) DO NOTHING
    RETURNING id, queue, state, ctime, expires_at
), events AS (
    INSERT INTO pgq.outbox (kind, job_id)
    SELECT '{OUTBOX_REPLICATE}', id FROM inserted WHERE %(announce)s RETURNING 1
), {_MANY_WOKEN}
SELECT ARRAY(SELECT name FROM paused) AS paused,
       EXISTS (SELECT 1 FROM leaving) AS leaving,
       (SELECT count(*) FROM events) AS events,
       (SELECT count(*) FROM woken) AS woken,  -- a plain CTE runs only if referenced
       CASE WHEN NOT %(announce)s THEN
           (SELECT array_agg(ARRAY[id, ctime::text, extract(epoch FROM expires_at)::text])
            FROM inserted) END AS stored
"""


# As for ADD_MANY / ADD_ONE: arrays, or the one job of a batch of one.
_MANY_REPLICATED_ROWS, _ONE_REPLICATED_ROW, ADD_ONE_REPLICATED_NAMES = batch_rows([
    ("ids", "id", "text"), ("queues", "queue", "text"), ("bodies", "body", "bytea"),
    ("repls", "repl", "int"), ("repl_mins", "repl_min", "int"), ("retries", "retry", "float8"),
    ("delays", "delay", "float8"), ("ttls", "ttl", "float8"), ("priorities", "priority", "int"),
    ("holders", "holders", "text")], ordinal=True)
ADD_MANY_REPLICATED = _add_replicated(_MANY_REPLICATED_ROWS, "%(names)s::text[]")
ADD_ONE_REPLICATED = _add_replicated(_ONE_REPLICATED_ROW, "ARRAY[%(queue)s::text]")

# Direct copies that did not all commit: the client withdraws those it
# wrote into a peer's database (run there, `myself` that peer's id, as in
# STORE_COPIES) before going through the node process. Only this client
# knew of them: nothing else can hold them yet.
WITHDRAW_COPIES = f"""
DELETE FROM pgq.jobs WHERE id = ANY (%(ids)s::text[]) AND state = 'active'
  AND {meta('node_id')} = %(myself)s
"""

# The withdrawn IDs, on this node: tombstones until the jobs' expiry, that
# no GC drives (nodes NULL, not dummy). A copy the withdrawal missed (its
# peer committed it late) lists this node among its holders, and its
# WILLQUEUE is answered SETACK (cluster WILLQUEUE_STATE reads pgq.acks),
# where it would have queued a second delivery of a job the node's way
# stores under new IDs (pgq.commands._renew_ids).
WITHDRAWN_HERE = """
INSERT INTO pgq.acks (id, queue, expires_at, dummy)
SELECT w.id, w.queue, to_timestamp(w.expires), false
FROM unnest(%(ids)s::text[], %(queues)s::text[], %(expires)s::float8[]) AS w(id, queue, expires)
ON CONFLICT (id) DO NOTHING
"""

# ADDJOB of a replicated job on a node served by a node process. The job is
# stored here first (durably, before anything is announced) and an outbox
# event asks the node process for copies:
# * synchronous add: state 'wait-repl' (not deliverable) until the node
#   confirms W copies and wakes this connection (channel pgq_r<pid>);
# * asynchronous or transactional add: queued at once, copied in the background.
ADD_JOBS_CLUSTER = f"""
WITH leaving AS (  -- read at statement time, whatever the client cached
    SELECT coalesce({meta('leaving')}::boolean, false) AS yes
), {_ADD_PAUSED_ROOM}, inserted AS (
    INSERT INTO pgq.jobs (id, queue, state, body, repl, repl_min, retry, delay, expires_at,
                          requeue_at, queued_at, enqueues, nodes_delivered, nodes_confirmed,
                          repl_waiter, priority, key)
    SELECT u.id, %(queue)s,
           CASE WHEN %(wait)s OR l.yes THEN 'wait-repl'
                WHEN %(delay)s::float8 > 0 THEN 'active' ELSE 'queued' END,
           u.body, %(repl)s, %(repl_min)s, %(retry)s, %(delay)s,
           pgq.now() + %(ttl)s::float8 * interval '1 second',
           CASE WHEN %(delay)s::float8 > 0
                THEN pgq.now() + %(delay)s::float8 * interval '1 second' END,
           CASE WHEN %(wait)s OR l.yes OR %(delay)s::float8 > 0 THEN NULL
                ELSE pgq.now() END,
           CASE WHEN %(wait)s OR l.yes OR %(delay)s::float8 > 0 THEN 0 ELSE 1 END,
           -- leaving: this node holds no copy; the node process hands the
           -- job to W other nodes (external replication) and drops the row
           CASE WHEN l.yes THEN '{{}}'::text[] ELSE ARRAY[%(myself)s]::text[] END,
           CASE WHEN l.yes THEN '{{}}'::text[] ELSE ARRAY[%(myself)s]::text[] END,
           CASE WHEN %(wait)s THEN pg_backend_pid() END,
           %(priority)s, %(key)s
    FROM unnest(%(ids)s::text[], %(bodies)s::bytea[]) WITH ORDINALITY AS u(id, body, n)
    CROSS JOIN leaving l
    WHERE NOT EXISTS (SELECT 1 FROM paused) AND (SELECT ok FROM room)
      AND NOT EXISTS (SELECT 1 FROM existing)
    ORDER BY u.n
    ON CONFLICT (id) DO NOTHING
    RETURNING id, state
), events AS (
    INSERT INTO pgq.outbox (kind, job_id) SELECT '{OUTBOX_REPLICATE}', id FROM inserted RETURNING 1
)
{_ADD_REPLY}
       (SELECT pg_notify('{DOORBELL_CHANNEL}', '')::text WHERE %(ring)s AND EXISTS (SELECT 1 FROM events))
        AS rang
"""

# The doorbell of the node process, rung after outbox events committed. It
# commits without waiting for the WAL flush: it carries nothing durable
# (the events are), and NOTIFY's commit is serialised cluster-wide.
RING_NODE = f"""
SELECT set_config('synchronous_commit', 'off', true), pg_notify('{DOORBELL_CHANNEL}', '')
"""

# The node's cluster as its process last wrote it, and the peers a client
# may write copies into directly: alive, not leaving (HELLO's priority 1),
# with an advertised DSN (schema 0014), ordered by id in both arrays.
CLUSTER_STATE = """
SELECT s.active, s.leaving, s.reachable_nodes, s.member,
       ARRAY(SELECT n.id FROM pgq.nodes n
             WHERE n.status = 'alive' AND NOT n.leaving AND n.dsn IS NOT NULL
             ORDER BY n.id) AS peer_ids,
       ARRAY(SELECT n.dsn FROM pgq.nodes n
             WHERE n.status = 'alive' AND NOT n.leaving AND n.dsn IS NOT NULL
             ORDER BY n.id) AS peer_dsns
FROM pgq.cluster_state s
"""

# Synchronous replication: which of these jobs got their copies (or vanished).
# outbox_lag: age of the oldest outbox event (the node process drains them
# continuously; a lag of seconds means it is stuck, e.g. stopped).
# node_running: some session holds the node lock (pgq.contracts): a killed
# node process's backend is gone within milliseconds, and its lock with it.
REPLICATION_DONE = f"""
SELECT u.id, j.state IS NOT NULL AND j.state <> 'wait-repl' AS replicated, j.state IS NULL AS gone,
       (SELECT extract(epoch FROM pgq.now() - o.created_at)::float8
        FROM pgq.outbox o ORDER BY o.seq LIMIT 1) AS outbox_lag,
       {NODE_LOCK_HELD} AS node_running
FROM unnest(%(ids)s::text[]) AS u(id) LEFT JOIN pgq.jobs j ON j.id = u.id
"""

# The client gave up waiting: remove the jobs still waiting, and ask the node
# to delete partial copies. A job confirmed meanwhile stays (and counts).
ABORT_REPLICATION = f"""
WITH gone AS (
    DELETE FROM pgq.jobs WHERE id = ANY (%(ids)s::text[]) AND state = 'wait-repl' RETURNING id
), events AS (
    INSERT INTO pgq.outbox (kind, job_id) SELECT '{OUTBOX_ABORT}', id FROM gone RETURNING 1
)
SELECT id FROM gone
"""

# wait_replicated(): which jobs still lack copies (acked or gone ones don't).
MISSING_COPIES = """
SELECT id FROM pgq.jobs
WHERE id = ANY (%(ids)s::text[])
  AND coalesce(cardinality(nodes_confirmed), 1) < repl
"""

# Serialises producers that pass MAXLEN for one queue until their commit.
LOCK_QUEUE_FOR_MAXLEN = "SELECT pg_advisory_xact_lock(hashtextextended(%(queue)s, 7))"

# Serialises adds of one idempotency key in one queue until their commit,
# so the add's next statement (a fresh snapshot) sees a job a concurrent add
# of the same key committed. Two int4 keys: a key space apart from MAXLEN's.
LOCK_IDEMPOTENCY_KEY = "SELECT pg_advisory_xact_lock(hashtext(%(queue)s), hashtext(%(key)s))"

# Bulk path: checks first (same transaction), then COPY, then one NOTIFY.
ADD_CHECK = """
SELECT EXISTS (SELECT 1 FROM pgq.queues WHERE name = %(queue)s AND paused IN ('in', 'all')),
       coalesce((SELECT sum(queued) FROM pgq.queue_counters WHERE queue = %(queue)s), 0),
       EXISTS (SELECT 1 FROM pgq.meta WHERE key = 'leaving' AND value = 'true')
"""

# An add run again after a lost connection (pgq.commands._kept_before):
# which of its IDs the attempt before stored, in one snapshot: still here
# (stored), or done with since (acknowledged, deleted, expired, dead:
# pgq.history, or an ACK tombstone). A delete commits with its history row,
# so an ID in neither was never stored. The INSERTs' ON CONFLICT alone let
# a retry store again a job consumed in between: delivered after its ACK
# returned (an at-most-once job delivered twice).
# pgq.history has no index on id (every ack would pay for one): it is read
# from the first attempt on, by its BRIN index on finished_at: the rows of
# the time between the attempts, whatever the table's size. The first
# attempt is the IDs' time on the client's clock, moved onto this
# database's by their difference now, less ``slack`` seconds (the round
# trip, a clock slewed meanwhile): a job is finished after its row
# committed, so never before that. RETRY_PLAN makes that plan certain under
# pgq's session options (no bitmap scans, generic plans), for this
# transaction only. (In a cluster, see pgq.commands._kept_before for what
# this cannot see.)
RETRY_PLAN = """
SELECT set_config('enable_bitmapscan', 'on', true), set_config('enable_seqscan', 'off', true),
       set_config('plan_cache_mode', 'force_custom_plan', true)
"""
RETRIED_ADD = """
SELECT ARRAY(SELECT id FROM pgq.jobs WHERE id = ANY (%(ids)s::text[])) AS stored,
       ARRAY(SELECT id FROM pgq.acks WHERE id = ANY (%(ids)s::text[])
             UNION
             SELECT id FROM pgq.history
             WHERE finished_at >= to_timestamp(%(first)s) + (pgq.now() - to_timestamp(%(client_now)s))
                                  - %(slack)s * interval '1 second'
               AND id = ANY (%(ids)s::text[])) AS done
"""

# The per-call constant columns come first, then id and body (pgq.copydata).
COPY_JOBS = """
COPY pgq.jobs (queue, state, repl, retry, delay, expires_at, requeue_at, queued_at, enqueues,
               priority, id, body)
FROM STDIN (FORMAT BINARY)
"""
COPY_JOBS_CONSTANT_TYPES = ("text", "text", "int4", "float8", "float8",
                            "timestamptz", "timestamptz", "timestamptz", "int4", "int4")

DB_NOW = "SELECT pgq.now()"

# What a Prometheus scrape reads (pgq.metrics): per queue, from the public view.
QUEUE_METRICS = "SELECT queue, length, active, jobs_in, jobs_out FROM pgq.queue_stats"

# The nodes a database knows in its cluster, left ones aside (1: alone).
CLUSTER_SIZE = "SELECT greatest(count(*), 1) FROM pgq.cluster_nodes WHERE status <> 'left'"

NOTIFY_QUEUE = f"""
SELECT pg_notify('{JOBS_CHANNEL}', %(queue)s)::text
WHERE %(always_notify)s OR EXISTS (SELECT 1 FROM pgq.waiters w WHERE w.queue = %(queue)s)
"""

# -------------------------------------------------------------------- claim

# GETJOB in one statement. Queues are served left to right (pos), each by
# job priority (higher first), then ctime; COUNT is filled in that order.
# Three arms per queue, each a LIMITed index scan: queued jobs in ctime order
# from the queue's floor on (jobs_queued_idx), queued jobs above priority 0
# in priority order (jobs_priority_idx: empty, and one probe, for a queue
# that never uses priorities), and active jobs whose re-queue time has come
# (jobs_timer_idx) - so an expired lease is found by the claim itself.
# Why the order is right: every job above priority 0 is in the second arm's
# order, and the first arm's first COUNT jobs by ctime hold at least as many
# jobs of priority 0 as the claim can still take once those are taken
# (priorities are never negative; schema 0013). Only jobs the first arm took
# move the floor, so a job found by priority never hides older ones.
# Why it is safe:
# * FOR UPDATE SKIP LOCKED: a row locked by another claim is skipped, never
#   delivered twice; after the lock, PostgreSQL re-checks the WHERE clause on
#   the newest row version, so a row claimed and committed meanwhile is not
#   taken again.
# * A retry-0 job gets requeue_at NULL: no arm can ever select it again.
# * The lease is (retry + 0..250 ms of jitter): never shorter than asked.
# * picked is MATERIALIZED and the UPDATE joins it by ctid: evaluated once,
#   it updates at most COUNT rows, each through a TID probe whatever plan
#   the (generic) statement was given.
# * The floor (pgq.floors) only skips dead index entries of jobs claimed
#   before; the client walks from the front now and then for the rest. It
#   is capped at 50 ms before now (schema 0017): a job with a ctime ahead
#   of this clock must not hide the jobs added after it.
# In `picked`, a job of priority > 0 may come from both ready arms: it is
# picked once, from_ready if so. The lease (`claimed`): for a job held here
# only, a timer any claim honours (requeue_at); for a job with copies
# elsewhere, a timer the node process runs (cluster_requeue_at: it
# announces the re-queue to the other holders first). A job taken straight
# from 'active' had an (implicit) re-queue first: enqueues counts it.
# (These notes live here, not in the SQL: psycopg caches the parsing of a
# statement only up to 4096 bytes, and parses a longer one again at every
# execution, in the client's CPU; test_stats_and_plans pins the sizes.)
# A queue of the alias q that is not paused for output: what a claim may
# serve, and whose due jobs a blocked GET waits for.
_NOT_PAUSED_OUT = ("NOT EXISTS (SELECT 1 FROM pgq.queues p "
                   "WHERE p.name = q.name AND p.paused IN ('out', 'all'))")
_CLAIM_BODY = f"""
WITH wanted AS (
    SELECT q.name, q.pos, least(q.floor, pgq.floor_cap()) AS floor
    FROM {{wanted}}
    WHERE {_NOT_PAUSED_OUT}
), ready AS (
    SELECT c.ctid, w.pos, c.ctime, c.priority
    FROM wanted w CROSS JOIN LATERAL (
        SELECT j.ctid, j.ctime, j.priority FROM pgq.jobs j
        WHERE j.queue = w.name AND j.state = 'queued' AND j.ctime >= w.floor
          AND j.expires_at > pgq.now()
        ORDER BY j.ctime
        LIMIT %(count)s FOR UPDATE SKIP LOCKED) AS c
), ranked AS (
    SELECT c.ctid, w.pos, c.ctime, c.priority
    FROM wanted w CROSS JOIN LATERAL (
        SELECT j.ctid, j.ctime, j.priority FROM pgq.jobs j
        WHERE j.queue = w.name AND j.state = 'queued' AND j.priority > 0
          AND j.expires_at > pgq.now()
        ORDER BY j.priority DESC, j.ctime
        LIMIT %(count)s FOR UPDATE SKIP LOCKED) AS c
), candidates AS (
    SELECT ctid, pos, ctime, priority, true AS from_ready FROM ready
    UNION ALL
    SELECT ctid, pos, ctime, priority, false FROM ranked
    UNION ALL
    SELECT c.ctid, w.pos, c.ctime, c.priority, false
    FROM wanted w CROSS JOIN LATERAL (
        SELECT j.ctid, j.ctime, j.priority FROM pgq.jobs j
        WHERE j.queue = w.name AND j.state = 'active'
          AND j.requeue_at <= pgq.now()
          AND j.expires_at > pgq.now()
        ORDER BY j.requeue_at
        LIMIT %(count)s FOR UPDATE SKIP LOCKED) AS c
), picked AS MATERIALIZED (
    SELECT ctid, bool_or(from_ready) AS from_ready FROM candidates
    GROUP BY ctid, pos, priority, ctime
    ORDER BY pos, priority DESC, ctime LIMIT %(count)s
), claimed AS (
    UPDATE pgq.jobs j SET
        state = 'active',
        requeue_at = CASE WHEN j.retry > 0 AND coalesce(cardinality(j.nodes_delivered), 0) <= 1
                          THEN pgq.now()
                               + (j.retry + random() * 0.25) * interval '1 second' END,
        cluster_requeue_at = CASE WHEN j.retry > 0 AND cardinality(j.nodes_delivered) > 1
                                  THEN pgq.now()
                                       + (j.retry + random() * 0.25) * interval '1 second' END,
        enqueues = j.enqueues + (j.state = 'active')::integer,
        additional_deliveries = j.additional_deliveries
                                + (j.state = 'active' AND j.enqueues > 0 AND j.requeue_counts)::integer,
        requeue_counts = true,
        deliveries = j.deliveries + 1,
        delivered_at = pgq.now()
    FROM picked p
    WHERE j.ctid = p.ctid
    RETURNING j.queue, j.id, j.body, j.nacks, j.additional_deliveries, j.ctime, j.retry,
              greatest(0, extract(epoch FROM j.expires_at - pgq.now()))::float8 AS ttl,
              p.from_ready, j.priority
)"""

# The rows: one per claimed job (``epoch`` NULL), then one row with a NULL
# id whose ``epoch`` is the queue epoch (schema 0007): it moves whenever a
# job may sit queued behind a claim floor (see pgq.floors). This claim moves
# it too when its ready arm locked jobs it did not take (COUNT was filled by
# a higher queue or by due leases): a concurrent claim skipped them and may
# have moved its floor past them.
#
# A claim that came up short (took fewer than its COUNT: the queues ran
# dry) also says, in that row, how long until a job of these queues becomes
# due (``due_in``, as NEXT_DUE below): a blocked GET bounds its wait with it
# without asking again (0.3 statements per job in the steady-state bench),
# and so do the callers of a combined claim left without a job (0.4 NEXT_DUE
# per job there, when only claims that took nothing probed). A claim that
# filled its COUNT skips the probe, and the probe skips the leases the
# claim took (the statement's snapshot still shows them due: "now").
# A queue paused for output gives nothing, so its due jobs are no reason to
# wake: the claim's probe reads the queues it wanted (paused-out ones are not),
# where a due job of a paused one made a blocked GET claim every millisecond.
_CLAIM_RESULT = """
SELECT queue, id, body, nacks, additional_deliveries, ctime, retry, ttl, from_ready, priority,
       NULL::bigint AS epoch, NULL::float8 AS due_in
FROM claimed
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       CASE WHEN EXISTS (SELECT 1 FROM ready r WHERE r.ctid NOT IN (SELECT ctid FROM picked))
            THEN nextval('pgq.queue_epoch')
            ELSE (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM pgq.queue_epoch)
       END,
       CASE WHEN (SELECT count(*) FROM claimed) < %(count)s THEN (
           SELECT extract(epoch FROM min(d.requeue_at) - pgq.now())::float8
           FROM wanted q
           CROSS JOIN LATERAL (
               SELECT j.requeue_at FROM pgq.jobs j
               WHERE j.queue = q.name AND j.state = 'active' AND j.requeue_at IS NOT NULL
                 AND j.expires_at > pgq.now() AND j.ctid NOT IN (SELECT ctid FROM picked)
               ORDER BY j.requeue_at LIMIT 1) AS d)
       END{source}"""

# The queues of a claim: several as arrays (with their floors, served left
# to right), or one as plain values (a GET of one queue, the common case:
# as ADD_ONE, cheaper to send and to run).
_MANY_QUEUES = {"wanted": "unnest(%(queues)s::text[], %(floors)s::bigint[]) "
                          "WITH ORDINALITY AS q(name, floor, pos)"}
_ONE_QUEUE = {"wanted": "(SELECT %(queue)s::text AS name, %(floor)s::bigint AS floor, "
                        "1::bigint AS pos) AS q"}


def _claim(queues: dict[str, str], relaxed: bool) -> str:
    """On a caller's connection: plain, the caller's transaction decides
    durability. Relaxed, on pgq's own autocommit connections: losing the
    claim of an at-least-once job in a crash only means it is delivered
    again, which at-least-once allows, so such a claim commits without
    waiting for the WAL flush. A batch holding any retry-0 job commits
    durably: an at-most-once job must never be delivered twice, even after
    a crash. set_config(..., true) lasts until the end of this statement's
    own transaction; the epoch row evaluates it, after the claim (it reads
    claimed)."""
    body = _CLAIM_BODY.format(wanted=queues["wanted"])
    if not relaxed:
        return body + _CLAIM_RESULT.format(source="") + "\n"
    return body + """, commit_mode AS (
    SELECT set_config('synchronous_commit',
        CASE WHEN EXISTS (SELECT 1 FROM claimed WHERE retry = 0)
             THEN current_setting('synchronous_commit') ELSE 'off' END, true) AS mode
)""" + _CLAIM_RESULT.format(source="\nFROM commit_mode") + "\n"


CLAIM = _claim(_MANY_QUEUES, relaxed=False)
CLAIM_RELAXED = _claim(_MANY_QUEUES, relaxed=True)
CLAIM_ONE = _claim(_ONE_QUEUE, relaxed=False)
CLAIM_ONE_RELAXED = _claim(_ONE_QUEUE, relaxed=True)

# How long until a job of these queues becomes due (delayed or leased), so a
# blocked consumer wakes up in time without polling faster. A claim that took
# nothing says the same (its due_in); this is for a GET whose last claim
# did not (a combined claim that took jobs, for other callers).
# Seconds until the next lease of these queues runs out (negative: already),
# NULL when none will (an expired job, not swept yet, never will: it read as
# due now, and a blocked GET claimed every millisecond until the sweep).
# Not greatest(0, ...): GREATEST ignores NULL, so "none" read as "due now"
# and a blocked GET on an idle queue polled every millisecond (790
# statements/s; the simulation found it). The caller clamps.
NEXT_DUE = f"""
SELECT extract(epoch FROM min(d.requeue_at) - pgq.now())::float8
FROM unnest(%(queues)s::text[]) AS q(name)
CROSS JOIN LATERAL (
    SELECT j.requeue_at FROM pgq.jobs j
    WHERE j.queue = q.name AND j.state = 'active' AND j.requeue_at IS NOT NULL
      AND j.expires_at > pgq.now()
    ORDER BY j.requeue_at LIMIT 1) AS d
WHERE {_NOT_PAUSED_OUT}
"""

REGISTER_WAITER = """
INSERT INTO pgq.waiters (pid, queue)
SELECT pg_backend_pid(), q FROM unnest(%(queues)s::text[]) AS q
ON CONFLICT DO NOTHING
"""
UNREGISTER_WAITER = "DELETE FROM pgq.waiters WHERE pid = pg_backend_pid()"

# A shared listener's count of the GETs it holds blocked per queue (QSTAT's
# blocked sums it; schema 0016).
SET_WAITER_GETS = """
UPDATE pgq.waiters w SET gets = c.gets
FROM unnest(%(queues)s::text[], %(gets)s::integer[]) AS c(queue, gets)
WHERE w.pid = pg_backend_pid() AND w.queue = c.queue AND w.gets <> c.gets
"""

# ---------------------------------------------------------------- ack / del

_LOG_GONE = """
logged AS (
    INSERT INTO pgq.history (id, queue, outcome, ctime, delivered_at, deliveries, nacks,
                             additional_deliveries, retry, repl, body_size)
    SELECT id, queue,
           CASE WHEN expires_at <= pgq.now() THEN 'expired' ELSE %(outcome)s END,
           ctime, delivered_at, deliveries, nacks, additional_deliveries, retry, repl, size
    FROM gone
)"""

def _delete_gone(match: str) -> str:
    return f"""
gone AS (
    DELETE FROM pgq.jobs WHERE {match}
    RETURNING id, queue, ctime, delivered_at, deliveries, nacks, additional_deliveries,
              retry, repl, length(body) AS size, expires_at, nodes_delivered
)"""


_DELETE_GONE = _delete_gone("id = ANY (%(ids)s::text[])")

# ACKJOB: the job is done. On one node nobody else holds a copy, so the job is
# deleted at once (Disque garbage-collects it immediately too) and logged to
# pgq.history. An ACK for an unknown at-least-once ID leaves a "dummy ack"
# tombstone for the TTL encoded in the ID: a copy arriving later (cluster
# replication, federation) then cannot resurrect the job.
#
# Cluster: a job with copies on other nodes leaves a tombstone (its holders
# to reach) and an outbox event; the node process sends SETACK to every
# holder and drops the tombstone when all confirmed. A dummy ack on a node
# in a cluster is announced to every node (whoever holds the job takes over).
#
# The IDs go as binary arrays (%b): a worker acks 100 at a time, and
# psycopg's text dump of an array costs its thread about twice the binary
# one (profiled in a worker's burn-down).
def _ack(match: str, dummies: str) -> str:
    return f"""
WITH {_delete_gone(match)}, {_LOG_GONE}, tombstones AS (
    INSERT INTO pgq.acks AS a (id, queue, expires_at, nodes)
    SELECT id, queue, expires_at, nodes_delivered FROM gone
    WHERE cardinality(nodes_delivered) > 1
    ON CONFLICT (id) DO UPDATE SET nodes = excluded.nodes
), dummies AS (
    INSERT INTO pgq.acks (id, expires_at, dummy)
    SELECT u.id, pgq.now() + u.ttl * interval '1 second', true
    FROM {dummies}
    WHERE u.id IS NOT NULL AND NOT EXISTS (SELECT 1 FROM gone g WHERE g.id = u.id)
    ON CONFLICT (id) DO NOTHING
    RETURNING id
), events AS (
    INSERT INTO pgq.outbox (kind, job_id, arg)
    SELECT '{OUTBOX_ACK}', id, array_to_string(nodes_delivered, ',') FROM gone
    WHERE cardinality(nodes_delivered) > 1
    UNION ALL
    SELECT '{OUTBOX_ACK}', id, NULL FROM dummies WHERE %(cluster)s
    RETURNING 1
)
SELECT ARRAY(SELECT id FROM gone WHERE expires_at > pgq.now()) AS acked,
       (SELECT count(*) FROM events),
       (SELECT pg_notify('{DOORBELL_CHANNEL}', '')::text WHERE %(ring)s AND EXISTS (SELECT 1 FROM events))
"""


# ACK's forms: IDs as an array, or one ID as a plain value (a group-commit
# batch of one, as ADD_ONE): a lone ack went from 0.44-0.49 to 0.37-0.43 ms
# at p50 and from 0.12-0.14 to 0.09 ms of client CPU here.
ACK = _ack("id = ANY (%(ids)b::text[])",
           "unnest(%(dummy_ids)b::text[], %(dummy_ttls)b::float8[]) AS u(id, ttl)")
ACK_ONE = _ack("id = %(id)s::text",
               "(SELECT %(dummy_id)s::text, %(dummy_ttl)s::float8) AS u(id, ttl)")

# A worker gives up on jobs: like ACK (every holder learns it is done), and
# the job goes to pgq.dead_letters with its body and the reason.
DEAD_LETTER = f"""
WITH gone AS (
    DELETE FROM pgq.jobs WHERE id = ANY (%(ids)s::text[])
    RETURNING id, queue, body, ctime, delivered_at, deliveries, nacks, additional_deliveries,
              retry, repl, length(body) AS size, expires_at, nodes_delivered, priority, key
), logged AS (
    INSERT INTO pgq.history (id, queue, outcome, ctime, delivered_at, deliveries, nacks,
                             additional_deliveries, retry, repl, body_size)
    SELECT id, queue, 'dead', ctime, delivered_at, deliveries, nacks, additional_deliveries,
           retry, repl, size
    FROM gone
), dead AS (  -- with its priority and key (schema 0020), for a requeue
    INSERT INTO pgq.dead_letters (id, queue, body, reason, nacks, additional_deliveries,
                                  deliveries, ctime, retry, repl, priority, key)
    SELECT id, queue, body, %(reason)s, nacks, additional_deliveries, deliveries, ctime, retry, repl,
           priority, key
    FROM gone
), tombstones AS (
    INSERT INTO pgq.acks AS a (id, queue, expires_at, nodes)
    SELECT id, queue, expires_at, nodes_delivered FROM gone
    WHERE cardinality(nodes_delivered) > 1
    ON CONFLICT (id) DO UPDATE SET nodes = excluded.nodes
), events AS (
    INSERT INTO pgq.outbox (kind, job_id, arg)
    SELECT '{OUTBOX_ACK}', id, array_to_string(nodes_delivered, ',') FROM gone
    WHERE cardinality(nodes_delivered) > 1
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM events),
       (SELECT pg_notify('{DOORBELL_CHANNEL}', '')::text WHERE %(ring)s AND EXISTS (SELECT 1 FROM events))
"""

DEAD_LETTERS = """
SELECT seq, id, queue, reason, nacks, additional_deliveries, deliveries, died_at, body
FROM pgq.dead_letters
WHERE (%(queue)s::text IS NULL OR queue = %(queue)s::text) AND seq > %(after)s
ORDER BY seq LIMIT %(count)s
"""

# Take dead letters out (they are added again as new jobs in the same
# transaction by the caller).
TAKE_DEAD_LETTERS = """
DELETE FROM pgq.dead_letters
WHERE seq IN (SELECT seq FROM pgq.dead_letters
              WHERE (%(queue)s::text IS NULL OR queue = %(queue)s::text)
                AND (%(ids)s::text[] IS NULL OR id = ANY (%(ids)s::text[]))
              ORDER BY seq LIMIT %(count)s FOR UPDATE SKIP LOCKED)
RETURNING seq, queue, body, retry, priority, key
"""

# FASTACK and DELJOB: delete now, no tombstone. FASTACK also asks the node
# process to DELJOB the other holders (every node for an unknown ID, in a
# cluster): best effort, a partitioned holder may deliver the job again.
DELETE_JOBS = f"""
WITH {_DELETE_GONE}, {_LOG_GONE}, tombstones AS (
    DELETE FROM pgq.acks WHERE %(with_acks)s AND id = ANY (%(ids)s::text[]) RETURNING 1
), events AS (
    INSERT INTO pgq.outbox (kind, job_id, arg)
    SELECT '{OUTBOX_FASTACK}', id, array_to_string(nodes_delivered, ',') FROM gone
    WHERE %(broadcast)s AND cardinality(nodes_delivered) > 1
    UNION ALL
    SELECT '{OUTBOX_FASTACK}', u.id, NULL FROM unnest(%(ids)s::text[]) AS u(id)
    WHERE %(broadcast)s AND %(cluster)s AND NOT EXISTS (SELECT 1 FROM gone g WHERE g.id = u.id)
    RETURNING 1
)
SELECT (SELECT count(*) FILTER (WHERE expires_at > pgq.now()) FROM gone)
       + (SELECT count(*) FROM tombstones),
       (SELECT count(*) FROM events),
       (SELECT pg_notify('{DOORBELL_CHANNEL}', '')::text WHERE %(ring)s AND EXISTS (SELECT 1 FROM events))
"""

# ------------------------------------------------------- nack / (en|de)queue

# NACK and ENQUEUE: active -> queued now. Never for a delivered retry-0 job
# (at-most-once). NACK counts a nack; ENQUEUE counts an additional delivery
# when the job was queued before (Disque's rule). A NACK with a back-off
# `delay` (a pgq extension, for workers) keeps the job active until then; its
# timed re-queue is the NACK's and counts nothing more (requeue_counts).
REQUEUE = f"""
WITH requeued AS (
    UPDATE pgq.jobs SET
        state = CASE WHEN %(delay)s > 0 THEN 'active' ELSE 'queued' END,
        queued_at = CASE WHEN %(delay)s > 0 THEN queued_at ELSE pgq.now() END,
        requeue_at = CASE WHEN %(delay)s > 0 AND coalesce(cardinality(nodes_delivered), 0) <= 1
                          THEN pgq.now() + %(delay)s * interval '1 second' END,
        cluster_requeue_at = CASE WHEN %(delay)s > 0 AND cardinality(nodes_delivered) > 1
                                  THEN pgq.now() + %(delay)s * interval '1 second' END,
        requeue_counts = NOT (%(delay)s > 0),
        enqueues = enqueues + (%(delay)s <= 0)::integer,
        nacks = nacks + %(nack)s::boolean::integer,
        additional_deliveries = additional_deliveries
                                + (NOT %(nack)s::boolean AND enqueues > 0)::integer
    WHERE id = ANY (%(ids)s::text[]) AND state = 'active'
      AND expires_at > pgq.now()
      AND NOT (retry = 0 AND deliveries > 0)
    RETURNING id, queue, state, nodes_delivered, enqueues > 1 AS counted
), woken AS (
    SELECT pg_notify('{JOBS_CHANNEL}', r.queue)
    FROM (SELECT DISTINCT queue FROM requeued
          WHERE state = 'queued' OR coalesce(cardinality(nodes_delivered), 0) <= 1) AS r
    WHERE %(always_notify)s OR EXISTS (SELECT 1 FROM pgq.waiters w WHERE w.queue = r.queue)
), events AS (
    -- other holders count it too and postpone their own re-queue (QUEUED)
    INSERT INTO pgq.outbox (kind, job_id, arg)
    SELECT '{OUTBOX_QUEUED}', id,
           CASE WHEN %(nack)s::boolean THEN 'nacks' WHEN counted THEN 'additional_deliveries' ELSE '' END
           || ':' || array_to_string(nodes_delivered, ',')
    FROM requeued WHERE cardinality(nodes_delivered) > 1
    RETURNING 1
)
SELECT (SELECT count(*) FROM requeued) AS requeued,
       (SELECT count(*) FROM woken) AS woken,  -- a plain CTE runs only if referenced
       (SELECT count(*) FROM events) AS events,
       (SELECT pg_notify('{DOORBELL_CHANNEL}', '')::text WHERE %(ring)s AND EXISTS (SELECT 1 FROM events))
"""

# Jobs a claim took for a caller that never got them (asyncio cancelled it
# after the claim committed: pgq.cancelsafe). ENQUEUE puts back those with
# a retry (REQUEUE); this puts back the at-most-once ones, which ENQUEUE
# refuses once delivered: no consumer saw them, so they are queued again.
# Only a copy still active with no timer can be such a job: a retry-0 job
# is never queued again once delivered, so no other claim can have taken it
# since (ACK, DELJOB and expiry remove it; NACK and ENQUEUE refuse it). The
# claim still counts as a delivery (deliveries, and the queue's jobs_out: a
# counter that must never go down, or Prometheus reads a reset).
GIVE_BACK_AT_MOST_ONCE = f"""
WITH given AS (
    UPDATE pgq.jobs SET state = 'queued', queued_at = pgq.now()
    WHERE id = ANY (%(ids)s::text[]) AND state = 'active' AND retry = 0 AND deliveries > 0
      AND requeue_at IS NULL AND cluster_requeue_at IS NULL AND expires_at > pgq.now()
    RETURNING queue
)
SELECT count(*) AS given,
       (SELECT count(pg_notify('{JOBS_CHANNEL}', q.queue)) FROM (SELECT DISTINCT queue FROM given) AS q)
           AS woken
FROM given
"""

# DEQUEUE: queued -> active; the retry timer queues it again (never for retry 0).
DEQUEUE = """
UPDATE pgq.jobs SET
    state = 'active',
    requeue_at = CASE WHEN retry > 0 AND coalesce(cardinality(nodes_delivered), 0) <= 1
                      THEN pgq.now() + retry * interval '1 second' END,
    cluster_requeue_at = CASE WHEN retry > 0 AND cardinality(nodes_delivered) > 1
                              THEN pgq.now() + retry * interval '1 second' END
WHERE id = ANY (%(ids)s::text[]) AND (state = 'queued') IS TRUE AND expires_at > pgq.now()
"""
# (`IS TRUE`: the same test, which no partial index's predicate matches. As
# `state = 'queued'`, the generic plan made on a fresh node's empty table
# walked the whole of jobs_queued_idx, every queued job, with the IDs as a
# filter, instead of probing jobs_pkey: found by the plan check's walk test.)

# WORKING: postpone the next re-queue by RETRY (dequeueing the job if it is
# queued). TOOLATE once half the TTL has elapsed, so a worker cannot keep a
# job forever. Nothing to postpone for a retry-0 job.
WORKING = f"""
WITH target AS (
    SELECT id, state, retry, nodes_delivered,
           pgq.now() - to_timestamp(ctime / 1e9)
               > (expires_at - to_timestamp(ctime / 1e9)) / 2 AS too_late
    FROM pgq.jobs
    WHERE id = %(id)s AND expires_at > pgq.now()
    FOR UPDATE
), postponed AS (
    UPDATE pgq.jobs j SET
        state = 'active',
        requeue_at = CASE WHEN coalesce(cardinality(j.nodes_delivered), 0) <= 1
                          THEN pgq.now()
                               + (j.retry + random() * 0.25) * interval '1 second' END,
        cluster_requeue_at = CASE WHEN cardinality(j.nodes_delivered) > 1
                                  THEN pgq.now()
                                       + (j.retry + random() * 0.25) * interval '1 second' END
    FROM target t
    WHERE j.id = t.id AND NOT t.too_late AND t.retry > 0 AND t.state <> 'wait-repl'
    RETURNING j.id, j.nodes_delivered
), events AS (
    -- every other holder takes it out of its queue and postpones its re-queue
    INSERT INTO pgq.outbox (kind, job_id, arg)
    SELECT '{OUTBOX_WORKING}', id, ':' || array_to_string(nodes_delivered, ',') FROM postponed
    WHERE cardinality(nodes_delivered) > 1
    RETURNING 1
)
SELECT t.state, t.retry, t.too_late,
       EXISTS (SELECT 1 FROM pgq.acks a
               WHERE a.id = %(id)s AND a.expires_at > pgq.now()) AS acked,
       (SELECT count(*) FROM events) AS events,
       (SELECT pg_notify('{DOORBELL_CHANNEL}', '')::text WHERE %(ring)s AND EXISTS (SELECT 1 FROM events))
FROM (SELECT 1) AS one LEFT JOIN target t ON true
"""

# -------------------------------------------------------------- introspection

_SHOW_COLUMNS = """
    id, queue,
    CASE WHEN state = 'active' AND requeue_at <= pgq.now()
         THEN 'queued' ELSE state END AS state,
    repl,
    greatest(0, extract(epoch FROM expires_at - pgq.now()))::float8 AS ttl,
    ctime, delay, retry, nacks, additional_deliveries, deliveries,
    CASE WHEN requeue_at IS NULL THEN NULL
         ELSE greatest(0, extract(epoch FROM requeue_at - pgq.now()))::float8
    END AS next_requeue_within,
    greatest(0, extract(epoch FROM least(coalesce(requeue_at, expires_at), expires_at)
                                   - pgq.now()))::float8 AS next_awake_within,
    body, nodes_delivered, nodes_confirmed, priority, key
"""

SHOW = f"""
SELECT {_SHOW_COLUMNS}
FROM pgq.jobs WHERE id = %(id)s AND expires_at > pgq.now()
"""

# An acknowledged job's tombstone: ``nodes`` are the holders its ACK must
# still reach (cluster GC; NULL when none).
_ACK_COLUMNS = """id, queue, acked_at, dummy,
       greatest(0, extract(epoch FROM expires_at - pgq.now()))::float8 AS ttl,
       coalesce(nodes, '{}'::text[])"""

SHOW_ACKED = f"""
SELECT {_ACK_COLUMNS}
FROM pgq.acks WHERE id = %(id)s AND expires_at > pgq.now()
"""

# WAITJOB of a job this node does not show: done with if it was, and this
# node still knows (an ACK's tombstone, a row expired and not swept yet, or
# its history row, looked up from the job's creation time that its ID
# encodes (now if that is ahead), less an hour of clock skew, and no further back than history is
# kept: history has no index on id, and every ack would pay for one). Run
# under RETRY_PLAN, as RETRIED_ADD, which reads history the same way.
WAITED_GONE = """
SELECT EXISTS (SELECT 1 FROM pgq.acks WHERE id = %(id)s AND expires_at > pgq.now())
    OR EXISTS (SELECT 1 FROM pgq.jobs WHERE id = %(id)s AND expires_at <= pgq.now())
    OR EXISTS (SELECT 1 FROM pgq.history
               WHERE finished_at >= greatest(least(to_timestamp(%(made)s), pgq.now())
                                             - interval '1 hour',
                                             pgq.now() - pgq.history_keep())
                 AND id = %(id)s)
"""

QLEN = """
SELECT coalesce(sum(queued), 0)::bigint FROM pgq.queue_counters WHERE queue = %(queue)s
"""

# QPEEK in delivery order (priority, then ctime), or its reverse: the jobs
# above priority 0 from jobs_priority_idx, those of priority 0 from
# jobs_queued_idx (filtered: QPEEK is no hot path), each arm LIMITed.
_QPEEK = """
SELECT queue, id, body, nacks, additional_deliveries FROM (
    (SELECT queue, id, body, nacks, additional_deliveries, priority, ctime FROM pgq.jobs
     WHERE queue = %(queue)s AND state = 'queued' AND priority > 0 AND expires_at > pgq.now()
     ORDER BY priority {order_priority}, ctime {order} LIMIT %(count)s)
    UNION ALL
    (SELECT queue, id, body, nacks, additional_deliveries, priority, ctime FROM pgq.jobs
     WHERE queue = %(queue)s AND state = 'queued' AND priority = 0 AND expires_at > pgq.now()
     ORDER BY ctime {order} LIMIT %(count)s)
) AS peek
ORDER BY priority {order_priority}, ctime {order} LIMIT %(count)s
"""
QPEEK_OLDEST = _QPEEK.format(order="ASC", order_priority="DESC")
QPEEK_NEWEST = _QPEEK.format(order="DESC", order_priority="ASC")

QSTAT = """
SELECT s.queue, s.length, s.created_at, s.last_activity, s.blocked, s.jobs_in, s.jobs_out,
       s.paused,
       greatest(0, extract(epoch FROM pgq.now() - s.created_at))::float8 AS age,
       greatest(0, extract(epoch FROM pgq.now() - s.last_activity))::float8 AS idle,
       coalesce(i.import_from, '{}'::text[]), coalesce(i.import_rate, 0)
FROM pgq.queue_stats s
LEFT JOIN pgq.queue_imports i
       ON i.queue = s.queue AND i.updated_at > pgq.now() - interval '10 seconds'
WHERE s.queue = %(queue)s
"""

# import_rate: jobs/s imported into the queue by federation (as QSTAT shows it).
QSCAN = """
SELECT s.queue, s.length, coalesce(i.import_rate, 0)
FROM (SELECT queue, length FROM pgq.queue_stats
      WHERE queue > %(after)s ORDER BY queue LIMIT %(count)s) AS s
LEFT JOIN pgq.queue_imports i
       ON i.queue = s.queue AND i.updated_at > pgq.now() - interval '10 seconds'
ORDER BY s.queue
"""

_JSCAN_FILTERS = """
      AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
"""

# A page of jobs by ID; JSCAN's STATE filter is applied to it by the caller,
# which must know how far the page went (filtered here, a page came back
# short while more jobs followed, and the scan ended early).
JSCAN_JOBS = f"""
SELECT {_SHOW_COLUMNS}
FROM pgq.jobs
WHERE id > %(after)s AND expires_at > pgq.now()
{_JSCAN_FILTERS}
ORDER BY id LIMIT %(count)s
"""

# Dummy ACKs (an ACK of an ID this node never held) are no jobs: Disque's
# JSCAN skips them.
JSCAN_ACKS = f"""
SELECT {_ACK_COLUMNS}
FROM pgq.acks
WHERE id > %(after)s AND expires_at > pgq.now() AND NOT dummy
{_JSCAN_FILTERS}
ORDER BY id LIMIT %(count)s
"""

# --------------------------------------------------------------------- pause

PAUSE_STATE = "SELECT coalesce((SELECT paused FROM pgq.queues WHERE name = %(queue)s), 'none')"

# Setting a pause creates the queue's row; clearing it removes the row.
# Consumers blocked on the queue are woken when output resumes.
SET_PAUSE = f"""
WITH cleared AS (
    DELETE FROM pgq.queues WHERE name = %(queue)s AND %(state)s = 'none' RETURNING 1
), stored AS (
    INSERT INTO pgq.queues AS p (name, paused)
    SELECT %(queue)s, %(state)s WHERE %(state)s <> 'none'
    ON CONFLICT (name) DO UPDATE SET paused = excluded.paused, updated_at = pgq.now()
    RETURNING paused
), woken AS (
    SELECT pg_notify('{JOBS_CHANNEL}', %(queue)s) WHERE %(state)s IN ('none', 'in')
), events AS (
    INSERT INTO pgq.outbox (kind, queue, arg)
    SELECT '{OUTBOX_PAUSE}', %(queue)s, %(state)s WHERE %(bcast)s
    RETURNING 1
)
SELECT %(state)s::text AS paused,
       (SELECT count(*) FROM woken) AS woken,  -- a plain CTE runs only if referenced
       (SELECT count(*) FROM events) AS events
"""

# ---------------------------------------------------------------------- info

INFO = f"""
SELECT current_setting('server_version') AS server_version,
       current_database() AS database,
       extract(epoch FROM pgq.now() - pg_postmaster_start_time())::float8 AS uptime,
       (SELECT count(DISTINCT queue) FROM pgq.queue_stats) AS queues,
       (SELECT coalesce(sum(most), 0) FROM (SELECT max(gets) AS most FROM pgq.waiters
                                            GROUP BY pid) AS g) AS blocked_clients,
       current_setting('synchronous_commit') AS synchronous_commit,
       current_setting('fsync') AS fsync,
       {meta('bus_stats')} AS bus_stats
"""

JOB_COUNTS = "SELECT state, jobs FROM pgq.job_counts"

# resp: the node's RESP address (schema 0015), NULL where it serves none.
HELLO_NODES = """
SELECT c.id, c.host, c.port, c.priority, n.resp, c.status, c.leaving
FROM pgq.cluster_nodes c LEFT JOIN pgq.nodes n ON n.id = c.id
ORDER BY NOT c.myself, c.id
"""

# ------------------------------------------------------------------- results

# A job's result (or the error that ended it), kept `keep` seconds; a
# rerun (at-least-once) overwrites it. Up to 100 expired results go in the
# same statement, so the table holds what someone may still ask for.
STORE_RESULT = """
WITH stored AS (
    INSERT INTO pgq.results AS r (id, value, error, expires_at)
    VALUES (%(id)s, %(value)s, %(error)s, pgq.now() + %(keep)s::float8 * interval '1 second')
    ON CONFLICT (id) DO UPDATE SET value = excluded.value, error = excluded.error,
        stored_at = pgq.now(), expires_at = excluded.expires_at
    RETURNING 1
), expired AS (
    -- SKIP LOCKED, as every sweep: concurrent saves picked the same
    -- expired rows and each waited for the other's commit (a worker's
    -- transactional handler held them across its ACK).
    DELETE FROM pgq.results WHERE id IN (
        SELECT id FROM pgq.results WHERE expires_at <= pgq.now() ORDER BY expires_at LIMIT 100
        FOR UPDATE SKIP LOCKED)
    RETURNING 1
)
SELECT (SELECT count(*) FROM stored), (SELECT count(*) FROM expired)
"""

# One row: the kept result if any, whether this node still holds the job
# (a result is stored before the ACK, so in one snapshot a job gone with no
# result kept will never get one here), and the reason of its latest dead
# letter: a worker dead-letters a failed job first and stores its error
# next, so a wait between the two (or after a store that failed) read
# "gone, no result" and said NoJobError for a task that failed (found by a
# read-only review). The latest by max(seq) over dead_letters_id_idx: an
# ORDER BY seq needs a sort, which pgq's sessions turn off, and its generic
# plan walked the whole of dead_letters_pkey backwards at every poll
# (found by a review of the first version).
READ_RESULT = """
SELECT r.value, r.error, r.id IS NOT NULL AS kept,
       EXISTS (SELECT 1 FROM pgq.jobs j WHERE j.id = %(id)s) AS held,
       (SELECT d.reason FROM pgq.dead_letters d
        WHERE d.seq = (SELECT max(l.seq) FROM pgq.dead_letters l WHERE l.id = %(id)s)) AS dead
FROM (SELECT 1) AS one
LEFT JOIN pgq.results r ON r.id = %(id)s AND r.expires_at > pgq.now()
"""

# ------------------------------------------------------------------ periodic

# A schedule, created or changed; a new one starts after the tick in force
# (`start_tick`: the latest tick at or before now), so adding a schedule
# never fires at once for a tick already past.
UPSERT_SCHEDULE = """
INSERT INTO pgq.periodic AS p (name, cron, tz, queue, body, options, last_tick)
VALUES (%(name)s, %(cron)s, %(tz)s, %(queue)s, %(body)s, %(options)s::jsonb, %(start_tick)s)
ON CONFLICT (name) DO UPDATE SET cron = excluded.cron, tz = excluded.tz, queue = excluded.queue,
    body = excluded.body, options = excluded.options, updated_at = pgq.now(),
    -- a changed cron or time zone starts again from the next tick, as a new
    -- schedule does; unchanged (a worker saving its schedules at start), a
    -- tick missed meanwhile is still caught up
    last_tick = CASE WHEN (p.cron, p.tz) IS DISTINCT FROM (excluded.cron, excluded.tz)
                     THEN excluded.last_tick
                     ELSE coalesce(p.last_tick, excluded.last_tick) END
"""

SCHEDULES = """
SELECT name, cron, tz, queue, body, options, last_tick FROM pgq.periodic ORDER BY name
"""

REMOVE_SCHEDULE = "DELETE FROM pgq.periodic WHERE name = %(name)s"

# The tick's job is added in the same transaction, by whoever moves
# last_tick: under the row's lock, one of many schedulers wins a tick.
# Only as the scheduler read it: a schedule changed since (another queue,
# another cron) had its tick claimed and its job added with the settings
# read before; the next look reads it again.
CLAIM_TICK = """
UPDATE pgq.periodic SET last_tick = %(tick)s
WHERE name = %(name)s AND (last_tick IS NULL OR last_tick < %(tick)s)
  AND cron = %(cron)s AND tz = %(tz)s AND queue = %(queue)s AND body = %(body)s
  AND options = %(options)s::jsonb
RETURNING queue, body, options
"""

# In a cluster the tick is also claimed in the tick home's database
# (pgq.periodic, "One job per tick in a cluster"): one row per schedule
# name, moved forward only. A claim row is never deleted with a schedule:
# other nodes may still hold that schedule, and a tick claimed twice is a
# job added twice.
CLAIM_CLUSTER_TICK = """
INSERT INTO pgq.periodic_claims AS c (name, last_tick, claimed_by)
VALUES (%(name)s, %(tick)s, %(node)s)
ON CONFLICT (name) DO UPDATE
SET last_tick = excluded.last_tick, claimed_by = excluded.claimed_by, updated_at = pgq.now()
WHERE c.last_tick < excluded.last_tick
   -- the claimer again: its reply or its job's commit was lost (a node's
   -- schedulers take a tick one at a time, under their schedule's lock)
   OR (c.last_tick = excluded.last_tick AND c.claimed_by = excluded.claimed_by)
RETURNING claimed_by
"""

# Which node's database a connection reached (a claim at the tick home
# checks it: an advertised "localhost" reaches the claimer's own).
NODE_ID = f"SELECT {meta('node_id')}"
HAS_CLAIMS = "SELECT 1 FROM pgq.periodic_claims LIMIT 1"  # schema 0018 or later

# The tick home: the live node (not leaving) with the lowest ID, this one
# included, as this database's membership sees it; with the DSN it
# advertised (NULL: this node, or a peer that advertised none). No row:
# not a node of a cluster. ``stale``: this node has peers and its process
# does not run (no fresh heartbeat), so the statuses are as it left them
# (its own row says 'alive' whatever).
TICK_HOME = """
SELECT c.id, c.myself, n.dsn, s.node_id AS me,
       s.member AND NOT s.active AND EXISTS (SELECT 1 FROM pgq.nodes WHERE status <> 'left') AS stale
FROM pgq.cluster_state s,
     pgq.cluster_nodes c LEFT JOIN pgq.nodes n ON n.id = c.id AND NOT c.myself
WHERE c.status = 'alive' AND NOT c.leaving
ORDER BY c.id COLLATE "C" LIMIT 1
"""
