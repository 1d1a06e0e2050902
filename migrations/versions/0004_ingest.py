"""pgq schema, version 4: bulk ingestion (Spark) and the views Spark reads.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-21

* ``ingests``: one row per bulk ingestion into this node (``pgq.spark``).
  ``state`` is ``staging`` while Spark writes the rows into an UNLOGGED
  table of schema ``pgq_staging`` and ``merged`` once one transaction moved
  them into ``jobs``; a re-run of a merged ingestion does nothing, so an
  ingestion is applied at most once per node however often it is retried.
  ``started_ms`` is fixed by the first attempt: job IDs and ``ctime`` derive
  from it, so every attempt (and every node holding a copy) computes the
  same IDs.
* Schema ``pgq_staging``: the per-ingestion staging tables. They are
  UNLOGGED (no WAL for rows that only pass through) and carry no index;
  a crash empties them, which only means the ingestion is re-run.
* ``dead_letter_jobs`` and ``live_jobs``: stable views for readers such as
  Spark, beside ``job_history``; each has a monotonic bigint column (``seq``,
  ``ctime``) to split a read into ranges.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

C = "C"
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    # Only when missing: the embedded server's role owns it already and may
    # not create schemas (CREATE SCHEMA IF NOT EXISTS checks that first).
    op.execute("DO $$ BEGIN IF to_regnamespace('pgq_staging') IS NULL THEN "
               "CREATE SCHEMA pgq_staging; END IF; END $$")
    op.create_table(
        "ingests",
        sa.Column("ingest_id", sa.Text(collation=C), nullable=False),
        sa.Column("queue", sa.Text(collation=C), nullable=False),
        sa.Column("state", sa.Text, nullable=False, server_default=sa.text("'staging'::text")),
        sa.Column("started_ms", sa.BigInteger, nullable=False),
        sa.Column("params", sa.Text, nullable=False),
        sa.Column("jobs", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("created_at", TS, nullable=False, server_default=sa.text("statement_timestamp()")),
        sa.Column("merged_at", TS),
        sa.PrimaryKeyConstraint("ingest_id", name="ingests_pkey"),
        sa.CheckConstraint("state = ANY (ARRAY['staging'::text, 'merged'::text])",
                           name="ingests_state_check"),
        schema="pgq",
    )
    op.execute(VIEWS)


VIEWS = r"""
CREATE VIEW pgq.dead_letter_jobs AS
SELECT d.seq, d.id, d.queue, d.reason,
       to_timestamp(d.ctime / 1e9) AS created_at, d.died_at,
       d.deliveries, d.nacks, d.additional_deliveries, d.retry, d.repl,
       length(d.body) AS body_size, d.body
FROM pgq.dead_letters d;

-- The hot table, readably. Read it in short statements: a long one holds
-- back the vacuum of every table of the database while it runs.
CREATE VIEW pgq.live_jobs AS
SELECT j.ctime, j.id, j.queue, j.state,
       to_timestamp(j.ctime / 1e9) AS created_at, j.queued_at, j.delivered_at,
       j.deliveries, j.nacks, j.additional_deliveries, j.retry, j.repl, j.delay,
       j.expires_at, length(j.body) AS body_size, j.body
FROM pgq.jobs j
WHERE j.expires_at > statement_timestamp();
"""


def downgrade() -> None:
    op.execute("DROP VIEW pgq.live_jobs, pgq.dead_letter_jobs")
    op.drop_table("ingests", schema="pgq")
    # The schema itself stays (it may have been made for the role by an
    # admin, and the role could not make it again); its tables go.
    op.execute("""DO $$ DECLARE t record; BEGIN
        FOR t IN SELECT tablename FROM pg_tables WHERE schemaname = 'pgq_staging' LOOP
            EXECUTE format('DROP TABLE pgq_staging.%I', t.tablename);
        END LOOP; END $$""")
