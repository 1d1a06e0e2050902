"""pgq schema, version 7: the queue epoch, for claim floors.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24

Claims start from a per-queue floor past the jobs they took (``pgq.floors``):
below it the ready index holds only dead entries, which cost every claim a
visit while an old snapshot keeps VACUUM from removing them. A job queued
with a ctime older than a few milliseconds may sit below a floor: queued
again (NACK, ENQUEUE, a due lease moved by the sweep), imported, ingested by
Spark, replicated late, the first rows of a long COPY - or merely updated
while it stays queued (the node confirming a copy): its row lock made a
concurrent claim skip it, and that claim's floor may have passed it. Every
statement that leaves such a job queued now advances the sequence
``pgq.queue_epoch``, from the counter triggers that already run once per
statement on ``pgq.jobs``; claims read it, and a client that sees it move
walks from the front once more.

A sequence, because its value is shared and changes in place: no row
version, no bloat, whatever snapshot another session holds. It advances
before the writer commits, so a client keeps walking from the front for a
moment after it saw the epoch move (see ``pgq.floors``).
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# A job is "late" when it becomes queued with a ctime older than this many
# milliseconds (pgq.floors.MARGIN: claims leave that much behind their floor).
LATE_MS = 50

LATE = f"""
    ctime < (floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint - {LATE_MS}) * 1000000
"""

TRIGGERS = rf"""
CREATE SEQUENCE pgq.queue_epoch;

CREATE OR REPLACE FUNCTION pgq.count_inserted_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO pgq.queue_counters AS c (queue, pid, queued, active, waiting, jobs_in, jobs_out)
    SELECT queue, pg_backend_pid(),
           count(*) FILTER (WHERE state = 'queued'),
           count(*) FILTER (WHERE state = 'active'),
           count(*) FILTER (WHERE state = 'wait-repl'),
           sum(enqueues), sum(deliveries)
    FROM inserted GROUP BY queue ORDER BY queue
    ON CONFLICT (queue, pid) DO UPDATE SET
        queued = c.queued + excluded.queued, active = c.active + excluded.active,
        waiting = c.waiting + excluded.waiting, jobs_in = c.jobs_in + excluded.jobs_in,
        jobs_out = c.jobs_out + excluded.jobs_out, touched_at = statement_timestamp();
    IF EXISTS (SELECT 1 FROM inserted WHERE state = 'queued' AND {LATE}) THEN
        PERFORM nextval('pgq.queue_epoch');  -- queued behind a claim floor, maybe
    END IF;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION pgq.count_updated_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO pgq.queue_counters AS c (queue, pid, queued, active, waiting, jobs_in, jobs_out)
    SELECT queue, pg_backend_pid(),
           coalesce(sum(sign) FILTER (WHERE state = 'queued'), 0),
           coalesce(sum(sign) FILTER (WHERE state = 'active'), 0),
           coalesce(sum(sign) FILTER (WHERE state = 'wait-repl'), 0),
           sum(sign * enqueues), sum(sign * deliveries)
    FROM (SELECT queue, state, enqueues, deliveries, 1 AS sign FROM updated_new
          UNION ALL
          SELECT queue, state, enqueues, deliveries, -1 FROM updated_old) AS delta
    GROUP BY queue
    -- Statements that change no count (WORKING, say) write nothing.
    HAVING coalesce(sum(sign) FILTER (WHERE state = 'queued'), 0) <> 0
        OR coalesce(sum(sign) FILTER (WHERE state = 'active'), 0) <> 0
        OR coalesce(sum(sign) FILTER (WHERE state = 'wait-repl'), 0) <> 0
        OR sum(sign * enqueues) <> 0 OR sum(sign * deliveries) <> 0
    ORDER BY queue
    ON CONFLICT (queue, pid) DO UPDATE SET
        queued = c.queued + excluded.queued, active = c.active + excluded.active,
        waiting = c.waiting + excluded.waiting, jobs_in = c.jobs_in + excluded.jobs_in,
        jobs_out = c.jobs_out + excluded.jobs_out, touched_at = statement_timestamp();
    IF EXISTS (SELECT 1 FROM updated_new WHERE state = 'queued' AND {LATE}) THEN
        PERFORM nextval('pgq.queue_epoch');  -- queued (again) behind a claim floor, maybe
    END IF;
    RETURN NULL;
END $$;
"""


def upgrade() -> None:
    op.execute(TRIGGERS)


def downgrade() -> None:
    from importlib import import_module

    initial = import_module("pgq.migrations.versions.0001_initial")
    body = initial.COUNTER_TRIGGERS.split("CREATE FUNCTION pgq.count_deleted_jobs()")[0]
    op.execute(body.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION"))
    op.execute("DROP SEQUENCE pgq.queue_epoch")
