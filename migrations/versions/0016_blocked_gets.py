"""pgq schema, version 16: QSTAT's ``blocked`` counts blocked GETs, not clients.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-26

A client's blocked GETs share one LISTEN connection (pgq.listener), so
``pgq.waiters`` holds one row per client and queue, and ``queue_stats.blocked``
(QSTAT) counted clients: fifty RESP connections blocked in GETJOB through
one front showed ``blocked 1``. Disque counts the clients blocked on the
queue, one per GETJOB. ``pgq.waiters.gets``: how many GETs the row's
connection holds blocked on the queue, kept by the listener (at most a
fraction of a second behind); 1 for a GET that registered on its own.
The view ``queue_stats`` sums it; its columns are unchanged (its text is
0001's as schema 0008 rewrote it: the clock read through ``pgq.now()``).
"""

from __future__ import annotations

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

# The view as schemas 0001 and 0008 left it; 0016 changes its blocked column only.
QUEUE_STATS_0015 = r"""
CREATE OR REPLACE VIEW pgq.queue_stats AS
WITH counts AS (
    SELECT queue, sum(queued) AS queued, sum(active) AS active, sum(waiting) AS waiting,
           sum(jobs_in) AS jobs_in, sum(jobs_out) AS jobs_out,
           min(created_at) AS created_at, max(touched_at) AS last_activity
    FROM pgq.queue_counters GROUP BY queue),
names AS (  -- like Disque, a queue exists once used, paused, or waited on
    SELECT queue FROM counts UNION SELECT name FROM pgq.queues
    UNION SELECT queue FROM pgq.waiters)
SELECT n.queue,
       coalesce(c.queued, 0)::bigint AS length,
       coalesce(c.active, 0)::bigint AS active,
       coalesce(c.waiting, 0)::bigint AS waiting_repl,
       o.oldest_queued_at,
       extract(epoch FROM pgq.now() - o.oldest_queued_at)::double precision
           AS oldest_age_seconds,
       coalesce(c.jobs_in, 0)::bigint AS jobs_in,
       coalesce(c.jobs_out, 0)::bigint AS jobs_out,
       coalesce(p.paused, 'none') AS paused,
       (SELECT count(*) FROM pgq.waiters w
        WHERE w.queue = n.queue  -- a crashed consumer's row is ignored until swept
          AND EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = w.pid)) AS blocked,
       coalesce(c.created_at, p.created_at) AS created_at,
       coalesce(c.last_activity, p.updated_at) AS last_activity
FROM names n
LEFT JOIN counts c ON c.queue = n.queue
LEFT JOIN pgq.queues p ON p.name = n.queue
LEFT JOIN LATERAL (
    SELECT to_timestamp(j.ctime / 1e9) AS oldest_queued_at
    FROM pgq.jobs j WHERE j.queue = n.queue AND j.state = 'queued'
    ORDER BY j.ctime LIMIT 1) AS o ON true;
"""
BLOCKED_0015 = "(SELECT count(*) FROM pgq.waiters w"
BLOCKED = "(SELECT coalesce(sum(w.gets), 0)::bigint FROM pgq.waiters w"
assert QUEUE_STATS_0015.count(BLOCKED_0015) == 1
QUEUE_STATS = QUEUE_STATS_0015.replace(BLOCKED_0015, BLOCKED)


def upgrade() -> None:
    op.execute("ALTER TABLE pgq.waiters ADD COLUMN gets integer NOT NULL DEFAULT 1")
    op.execute(QUEUE_STATS)


def downgrade() -> None:
    op.execute(QUEUE_STATS_0015)
    op.execute("ALTER TABLE pgq.waiters DROP COLUMN gets")
