"""pgq schema, version 3: what workers need - delayed NACKs and dead letters.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21

* ``jobs.requeue_counts``: whether the job's next timed re-queue counts as an
  additional delivery. A NACK with a back-off delay re-queues the job later;
  that re-queue is the NACK's, already counted in ``nacks``, so it sets this
  to false. Everything that re-queues on a timer honours it and resets it.
* ``dead_letters``: jobs a worker gave up on (too many failures), with their
  body and the reason, until requeued or deleted; ``dead_letter_queues``
  summarises them. History records them with outcome ``dead``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

C = "C"
TS = sa.DateTime(timezone=True)

OUTCOMES_2 = "ARRAY['acked'::text, 'fastacked'::text, 'deleted'::text, 'expired'::text]"
OUTCOMES_3 = "ARRAY['acked'::text, 'fastacked'::text, 'deleted'::text, 'expired'::text, 'dead'::text]"


def upgrade() -> None:
    op.add_column("jobs", sa.Column("requeue_counts", sa.Boolean, nullable=False,
                                    server_default=sa.text("true")), schema="pgq")
    op.drop_constraint("history_outcome_check", "history", schema="pgq")
    op.create_check_constraint("history_outcome_check", "history", f"outcome = ANY ({OUTCOMES_3})",
                               schema="pgq")
    op.create_table(
        "dead_letters",
        sa.Column("seq", sa.BigInteger, sa.Identity(always=True), nullable=False),
        sa.Column("id", sa.Text(collation=C), nullable=False),
        sa.Column("queue", sa.Text(collation=C), nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.Column("reason", sa.Text, nullable=False, server_default=sa.text("''::text")),
        sa.Column("nacks", sa.Integer, nullable=False),
        sa.Column("additional_deliveries", sa.Integer, nullable=False),
        sa.Column("deliveries", sa.Integer, nullable=False),
        sa.Column("ctime", sa.BigInteger, nullable=False),
        sa.Column("retry", sa.Double, nullable=False),
        sa.Column("repl", sa.Integer, nullable=False),
        sa.Column("died_at", TS, nullable=False, server_default=sa.text("statement_timestamp()")),
        sa.PrimaryKeyConstraint("seq", name="dead_letters_pkey"),
        schema="pgq",
    )
    op.create_index("dead_letters_queue_idx", "dead_letters", ["queue", "seq"], schema="pgq")
    op.execute(SQL)


SQL = r"""
CREATE VIEW pgq.dead_letter_queues AS
SELECT queue, count(*) AS dead, min(died_at) AS oldest, max(died_at) AS newest
FROM pgq.dead_letters GROUP BY queue;

-- Timed re-queues honour requeue_counts (see the revision notes).
CREATE OR REPLACE FUNCTION pgq.requeue_due(max_rows integer DEFAULT 10000, only_queue text DEFAULT NULL)
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
            -- an additional delivery. A delayed job's first queueing does
            -- not, nor does the end of a NACK's back-off.
            additional_deliveries = j.additional_deliveries
                                    + (j.enqueues > 0 AND j.requeue_counts)::integer,
            requeue_counts = true
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
"""


def downgrade() -> None:
    previous = SQL.split("-- Timed re-queues honour requeue_counts (see the revision notes).")[1]
    previous = previous.replace(
        "additional_deliveries = j.additional_deliveries\n"
        "                                    + (j.enqueues > 0 AND j.requeue_counts)::integer,\n"
        "            requeue_counts = true",
        "additional_deliveries = j.additional_deliveries + (j.enqueues > 0)::integer")
    op.execute(previous)
    op.execute("DROP VIEW pgq.dead_letter_queues")
    op.drop_table("dead_letters", schema="pgq")
    op.drop_constraint("history_outcome_check", "history", schema="pgq")
    # Revision 0002 has no dead letters: their history rows say 'deleted'
    # (the check refused them, and the downgrade failed whenever a job had
    # ever been dead-lettered; found by a read-only review).
    op.execute("UPDATE pgq.history SET outcome = 'deleted' WHERE outcome = 'dead'")
    op.create_check_constraint("history_outcome_check", "history", f"outcome = ANY ({OUTCOMES_2})",
                               schema="pgq")
    op.drop_column("jobs", "requeue_counts", schema="pgq")
