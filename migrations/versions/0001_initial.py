"""pgq schema, version 1: job tables, counters, sweep functions, stats views.

Revision ID: 0001
Revises:
Create Date: 2026-11-21

Everything in schema ``pgq`` is created here (and by later revisions), never
by the library at run time. The tables must equal ``pgq.schema.metadata``
(tests/test_schema.py checks it); functions, triggers and views are SQL.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

C = "C"
TS = sa.DateTime(timezone=True)
CTIME_DEFAULT = (
    "(((floor((date_part('epoch'::text, clock_timestamp()) * (1000)::double precision)))"
    "::bigint * 1000000) + (nextval('pgq.ctime_seq'::regclass) % (1000000)::bigint))"
)


def _tables() -> None:
    op.create_table(
        "meta",
        sa.Column("key", sa.Text(collation=C), primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
        schema="pgq",
    )
    # No per-backend CACHE: pooled connections take turns, and cached blocks
    # would let two adds in the same millisecond come out of order.
    op.execute("CREATE SEQUENCE pgq.ctime_seq")
    op.create_table(
        "jobs",
        sa.Column("id", sa.Text(collation=C), nullable=False),
        sa.Column("queue", sa.Text(collation=C), nullable=False),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("ctime", sa.BigInteger, nullable=False, server_default=sa.text(CTIME_DEFAULT)),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.Column("repl", sa.Integer, nullable=False, server_default=sa.text("1")),
        sa.Column("retry", sa.Double, nullable=False),
        sa.Column("delay", sa.Double, nullable=False, server_default=sa.text("0")),
        sa.Column("expires_at", TS, nullable=False),
        sa.Column("requeue_at", TS),
        sa.Column("queued_at", TS),
        sa.Column("delivered_at", TS),
        sa.Column("nacks", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("additional_deliveries", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("deliveries", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("enqueues", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.PrimaryKeyConstraint("id", name="jobs_pkey"),
        sa.CheckConstraint(
            "state = ANY (ARRAY['wait-repl'::text, 'active'::text, 'queued'::text])",
            name="jobs_state_check",
        ),
        schema="pgq",
        postgresql_with={
            "fillfactor": "70",
            "autovacuum_vacuum_scale_factor": "0.01",
            "autovacuum_vacuum_threshold": "1000",
            "autovacuum_vacuum_insert_scale_factor": "0.05",
            "autovacuum_analyze_scale_factor": "0.02",
            "autovacuum_vacuum_cost_delay": "0",
        },
    )
    op.create_index("jobs_queued_idx", "jobs", ["queue", "ctime"], schema="pgq",
                    postgresql_where=sa.text("state = 'queued'::text"))
    op.create_index("jobs_timer_idx", "jobs", ["queue", "requeue_at"], schema="pgq",
                    postgresql_where=sa.text("state = 'active'::text AND requeue_at IS NOT NULL"))
    op.create_index("jobs_expiry_idx", "jobs", ["expires_at"], schema="pgq")

    op.create_table(
        "history",
        sa.Column("seq", sa.BigInteger, sa.Identity(always=True), nullable=False),
        sa.Column("id", sa.Text(collation=C), nullable=False),
        sa.Column("queue", sa.Text(collation=C), nullable=False),
        sa.Column("outcome", sa.Text, nullable=False),
        sa.Column("ctime", sa.BigInteger, nullable=False),
        sa.Column("finished_at", TS, nullable=False, server_default=sa.text("statement_timestamp()")),
        sa.Column("delivered_at", TS),
        sa.Column("deliveries", sa.Integer, nullable=False),
        sa.Column("nacks", sa.Integer, nullable=False),
        sa.Column("additional_deliveries", sa.Integer, nullable=False),
        sa.Column("retry", sa.Double, nullable=False),
        sa.Column("repl", sa.Integer, nullable=False),
        sa.Column("body_size", sa.Integer, nullable=False),
        sa.PrimaryKeyConstraint("seq", name="history_pkey"),
        sa.CheckConstraint(
            "outcome = ANY (ARRAY['acked'::text, 'fastacked'::text, 'deleted'::text, 'expired'::text])",
            name="history_outcome_check",
        ),
        schema="pgq",
    )
    op.create_index("history_finished_at_idx", "history", ["finished_at"], schema="pgq",
                    postgresql_using="brin")

    op.create_table(
        "acks",
        sa.Column("id", sa.Text(collation=C), nullable=False),
        sa.Column("queue", sa.Text(collation=C)),
        sa.Column("acked_at", TS, nullable=False, server_default=sa.text("statement_timestamp()")),
        sa.Column("expires_at", TS, nullable=False),
        sa.Column("dummy", sa.Boolean, nullable=False, server_default=sa.text("false")),
        sa.PrimaryKeyConstraint("id", name="acks_pkey"),
        schema="pgq",
    )
    op.create_index("acks_expiry_idx", "acks", ["expires_at"], schema="pgq")

    op.create_table(
        "queues",
        sa.Column("name", sa.Text(collation=C), nullable=False),
        sa.Column("paused", sa.Text, nullable=False, server_default=sa.text("'none'::text")),
        sa.Column("created_at", TS, nullable=False, server_default=sa.text("statement_timestamp()")),
        sa.Column("updated_at", TS, nullable=False, server_default=sa.text("statement_timestamp()")),
        sa.PrimaryKeyConstraint("name", name="queues_pkey"),
        sa.CheckConstraint(
            "paused = ANY (ARRAY['none'::text, 'in'::text, 'out'::text, 'all'::text])",
            name="queues_paused_check",
        ),
        schema="pgq",
    )

    op.create_table(
        "queue_counters",
        sa.Column("queue", sa.Text(collation=C), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("queued", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("active", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("waiting", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("jobs_in", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("jobs_out", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("created_at", TS, nullable=False, server_default=sa.text("statement_timestamp()")),
        sa.Column("touched_at", TS, nullable=False, server_default=sa.text("statement_timestamp()")),
        sa.PrimaryKeyConstraint("queue", "pid", name="queue_counters_pkey"),
        schema="pgq",
        postgresql_with={"fillfactor": "50"},
    )

    op.create_table(
        "waiters",
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("queue", sa.Text(collation=C), nullable=False),
        sa.Column("since", TS, nullable=False, server_default=sa.text("statement_timestamp()")),
        sa.PrimaryKeyConstraint("pid", "queue", name="waiters_pkey"),
        schema="pgq",
        prefixes=["UNLOGGED"],
    )
    op.create_index("waiters_queue_idx", "waiters", ["queue"], schema="pgq")


# Counters: one row per (queue, backend pid), so two sessions never update the
# same row and never wait on each other. Statement-level triggers with
# transition tables run once per statement, not once per row.
COUNTER_TRIGGERS = r"""
CREATE FUNCTION pgq.count_inserted_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
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
    RETURN NULL;
END $$;

CREATE FUNCTION pgq.count_updated_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
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
    RETURN NULL;
END $$;

CREATE FUNCTION pgq.count_deleted_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO pgq.queue_counters AS c (queue, pid, queued, active, waiting)
    SELECT queue, pg_backend_pid(),
           -count(*) FILTER (WHERE state = 'queued'),
           -count(*) FILTER (WHERE state = 'active'),
           -count(*) FILTER (WHERE state = 'wait-repl')
    FROM deleted GROUP BY queue ORDER BY queue
    ON CONFLICT (queue, pid) DO UPDATE SET
        queued = c.queued + excluded.queued, active = c.active + excluded.active,
        waiting = c.waiting + excluded.waiting, touched_at = statement_timestamp();
    RETURN NULL;
END $$;

-- TRUNCATE fires no delete trigger: zero the per-state counts instead.
CREATE FUNCTION pgq.count_truncated_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE pgq.queue_counters SET queued = 0, active = 0, waiting = 0;
    RETURN NULL;
END $$;

CREATE TRIGGER count_inserted_jobs AFTER INSERT ON pgq.jobs
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION pgq.count_inserted_jobs();
CREATE TRIGGER count_updated_jobs AFTER UPDATE ON pgq.jobs
    REFERENCING OLD TABLE AS updated_old NEW TABLE AS updated_new
    FOR EACH STATEMENT EXECUTE FUNCTION pgq.count_updated_jobs();
CREATE TRIGGER count_deleted_jobs AFTER DELETE ON pgq.jobs
    REFERENCING OLD TABLE AS deleted
    FOR EACH STATEMENT EXECUTE FUNCTION pgq.count_deleted_jobs();
CREATE TRIGGER count_truncated_jobs AFTER TRUNCATE ON pgq.jobs
    FOR EACH STATEMENT EXECUTE FUNCTION pgq.count_truncated_jobs();
"""

# Timers. Nothing needs a background process: a claim takes due jobs itself
# (see the claim statement), and every client runs pgq.sweep() now and then to
# expire jobs, queue due ones (so QLEN counts them) and tidy the counters.
# Everything here uses SKIP LOCKED, so concurrent sweeps never wait on each
# other or on consumers.
SWEEP_FUNCTIONS = r"""
CREATE FUNCTION pgq.expire_jobs(max_rows integer DEFAULT 10000) RETURNS integer
LANGUAGE sql AS $$
    WITH gone AS (
        DELETE FROM pgq.jobs j
        WHERE j.ctid = ANY (ARRAY(
            SELECT ctid FROM pgq.jobs
            WHERE expires_at <= statement_timestamp()
            LIMIT max_rows FOR UPDATE SKIP LOCKED))
        RETURNING j.*),
    logged AS (
        INSERT INTO pgq.history (id, queue, outcome, ctime, delivered_at, deliveries, nacks,
                                 additional_deliveries, retry, repl, body_size)
        SELECT id, queue, 'expired', ctime, delivered_at, deliveries, nacks,
               additional_deliveries, retry, repl, length(body)
        FROM gone
        RETURNING 1)
    SELECT count(*)::integer FROM logged
$$;

CREATE FUNCTION pgq.requeue_due(max_rows integer DEFAULT 10000, only_queue text DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    requeued integer;
    notified integer;
BEGIN
    -- Only queues with active jobs can have due ones; each is probed through
    -- jobs_timer_idx, so a million delayed jobs that are not due cost nothing.
    WITH due AS (
        SELECT d.ctid
        FROM (SELECT DISTINCT queue FROM pgq.queue_counters
              WHERE active <> 0 AND (only_queue IS NULL OR queue = only_queue)) AS q
        CROSS JOIN LATERAL (
            SELECT j.ctid FROM pgq.jobs j
            WHERE j.queue = q.queue AND j.state = 'active'
              AND j.requeue_at <= statement_timestamp()
              AND j.expires_at > statement_timestamp()
            LIMIT max_rows FOR UPDATE SKIP LOCKED) AS d
        LIMIT max_rows),
    done AS (
        UPDATE pgq.jobs j SET
            state = 'queued', queued_at = statement_timestamp(), requeue_at = NULL,
            enqueues = j.enqueues + 1,
            -- Re-queued after a delivery or an earlier queueing: Disque counts
            -- an additional delivery. A delayed job's first queueing does not.
            additional_deliveries = j.additional_deliveries + (j.enqueues > 0)::integer
        WHERE j.ctid = ANY (ARRAY(SELECT ctid FROM due))
        RETURNING j.queue),
    woken AS (
        SELECT pg_notify('pgq', w.queue)
        FROM (SELECT DISTINCT queue FROM done) AS w
        WHERE EXISTS (SELECT 1 FROM pgq.waiters x WHERE x.queue = w.queue))
    -- woken is referenced so that it runs (a plain CTE runs only if used).
    SELECT (SELECT count(*) FROM done), (SELECT count(*) FROM woken)
    INTO requeued, notified;
    RETURN requeued;
END $$;

CREATE FUNCTION pgq.expire_acks(max_rows integer DEFAULT 10000) RETURNS integer
LANGUAGE sql AS $$
    WITH gone AS (
        DELETE FROM pgq.acks a
        WHERE a.ctid = ANY (ARRAY(
            SELECT ctid FROM pgq.acks WHERE expires_at <= statement_timestamp()
            LIMIT max_rows FOR UPDATE SKIP LOCKED))
        RETURNING 1)
    SELECT count(*)::integer FROM gone
$$;

CREATE FUNCTION pgq.compact_counters() RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    merged integer;
BEGIN
    -- One compactor at a time; the others have nothing to add.
    IF NOT pg_try_advisory_xact_lock(hashtext('pgq.compact_counters')) THEN
        RETURN 0;
    END IF;
    -- Rows of backends that are gone are folded into the queue's pid-0 row.
    -- Sums are preserved even if a new backend reuses a pid meanwhile: its
    -- row is then folded too, with whatever it holds.
    WITH dead AS (
        DELETE FROM pgq.queue_counters c
        WHERE c.pid <> 0
          AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = c.pid)
        RETURNING c.*),
    folded AS (
        INSERT INTO pgq.queue_counters AS c
            (queue, pid, queued, active, waiting, jobs_in, jobs_out, created_at, touched_at)
        SELECT queue, 0, sum(queued), sum(active), sum(waiting), sum(jobs_in), sum(jobs_out),
               min(created_at), max(touched_at)
        FROM dead GROUP BY queue ORDER BY queue
        ON CONFLICT (queue, pid) DO UPDATE SET
            queued = c.queued + excluded.queued, active = c.active + excluded.active,
            waiting = c.waiting + excluded.waiting, jobs_in = c.jobs_in + excluded.jobs_in,
            jobs_out = c.jobs_out + excluded.jobs_out,
            created_at = least(c.created_at, excluded.created_at),
            touched_at = greatest(c.touched_at, excluded.touched_at)
        RETURNING 1)
    SELECT count(*) INTO merged FROM folded;
    -- Like Disque, forget queues that are empty and idle for 5 minutes
    -- (their jobs-in/jobs-out start again from zero), unless paused.
    DELETE FROM pgq.queue_counters c
    WHERE c.pid = 0 AND c.queued = 0 AND c.active = 0 AND c.waiting = 0
      AND c.touched_at < statement_timestamp() - interval '5 minutes'
      AND NOT EXISTS (SELECT 1 FROM pgq.queue_counters o WHERE o.queue = c.queue AND o.pid <> 0)
      AND NOT EXISTS (SELECT 1 FROM pgq.queues p WHERE p.name = c.queue AND p.paused <> 'none');
    DELETE FROM pgq.waiters w
    WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = w.pid);
    RETURN merged;
END $$;

CREATE FUNCTION pgq.sweep(max_rows integer DEFAULT 10000,
                          OUT expired integer, OUT requeued integer, OUT acks_expired integer)
LANGUAGE plpgsql AS $$
BEGIN
    expired := pgq.expire_jobs(max_rows);
    requeued := pgq.requeue_due(max_rows);
    acks_expired := pgq.expire_acks(max_rows);
    PERFORM pgq.compact_counters();
END $$;

-- Rebuild the counters from the jobs themselves (repair after manual edits).
-- Blocks writers of pgq.jobs while it counts.
CREATE FUNCTION pgq.recount() RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    LOCK TABLE pgq.jobs IN SHARE MODE;
    LOCK TABLE pgq.queue_counters IN EXCLUSIVE MODE;
    CREATE TEMPORARY TABLE pgq_recount ON COMMIT DROP AS
        SELECT queue, sum(jobs_in) AS jobs_in, sum(jobs_out) AS jobs_out,
               min(created_at) AS created_at, max(touched_at) AS touched_at
        FROM pgq.queue_counters GROUP BY queue;
    DELETE FROM pgq.queue_counters;
    INSERT INTO pgq.queue_counters (queue, pid, queued, active, waiting, jobs_in, jobs_out,
                                    created_at, touched_at)
    SELECT coalesce(j.queue, r.queue), 0,
           coalesce(j.queued, 0), coalesce(j.active, 0), coalesce(j.waiting, 0),
           coalesce(r.jobs_in, 0), coalesce(r.jobs_out, 0),
           coalesce(r.created_at, statement_timestamp()), coalesce(r.touched_at, statement_timestamp())
    FROM (SELECT queue,
                 count(*) FILTER (WHERE state = 'queued') AS queued,
                 count(*) FILTER (WHERE state = 'active') AS active,
                 count(*) FILTER (WHERE state = 'wait-repl') AS waiting
          FROM pgq.jobs GROUP BY queue) AS j
    FULL JOIN pgq_recount r ON r.queue = j.queue;
END $$;
"""

# The SQL interface: stable views users may SELECT. None of them counts rows
# of pgq.jobs; the oldest job comes from one probe of jobs_queued_idx.
VIEWS = r"""
CREATE VIEW pgq.queue_stats AS
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
       extract(epoch FROM statement_timestamp() - o.oldest_queued_at)::double precision
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

CREATE VIEW pgq.job_counts AS
SELECT 'wait-repl'::text AS state, coalesce(sum(waiting), 0)::bigint AS jobs FROM pgq.queue_counters
UNION ALL
SELECT 'active', coalesce(sum(active), 0)::bigint FROM pgq.queue_counters
UNION ALL
SELECT 'queued', coalesce(sum(queued), 0)::bigint FROM pgq.queue_counters
UNION ALL
SELECT 'acked', count(*) FROM pgq.acks;

CREATE VIEW pgq.job_history AS
SELECT h.seq, h.id, h.queue, h.outcome,
       to_timestamp(h.ctime / 1e9) AS created_at,
       h.delivered_at, h.finished_at,
       extract(epoch FROM h.finished_at - to_timestamp(h.ctime / 1e9))::double precision
           AS lifetime_seconds,
       h.deliveries, h.nacks, h.additional_deliveries, h.retry, h.repl, h.body_size
FROM pgq.history h;
"""

NODE_ID = r"""
INSERT INTO pgq.meta (key, value) VALUES
    ('node_id', substr(encode(sha256((gen_random_uuid()::text || clock_timestamp()::text)::bytea), 'hex'), 1, 40)),
    ('created_at', statement_timestamp()::text);
"""


def upgrade() -> None:
    _tables()
    op.execute(COUNTER_TRIGGERS)
    op.execute(SWEEP_FUNCTIONS)
    op.execute(VIEWS)
    op.execute(NODE_ID)


def downgrade() -> None:
    # The schema itself stays: it holds alembic's version table.
    op.execute("DROP VIEW pgq.queue_stats, pgq.job_counts, pgq.job_history")
    for table in ("jobs", "history", "acks", "queues", "queue_counters", "waiters", "meta"):
        op.execute(f"DROP TABLE pgq.{table} CASCADE")
    op.execute("DROP SEQUENCE pgq.ctime_seq")
    for function in ("count_inserted_jobs()", "count_updated_jobs()", "count_deleted_jobs()",
                     "count_truncated_jobs()", "expire_jobs(integer)", "requeue_due(integer, text)",
                     "expire_acks(integer)", "compact_counters()", "sweep(integer)", "recount()"):
        op.execute(f"DROP FUNCTION pgq.{function}")
