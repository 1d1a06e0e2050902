"""pgq schema, version 12: periodic jobs.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25

A schedule (``pgq periodic add``, ``@worker.periodic``) adds a job to its
queue at every tick of a cron expression. ``last_tick`` is the tick a job
was last added for: a worker adds the job of a tick in the same
transaction as it moves ``last_tick`` forward, under the row's lock, so
however many workers run the schedule on this database, a tick adds one
job.
"""

from __future__ import annotations

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE TABLE pgq.periodic (
            name text COLLATE "C" NOT NULL,
            cron text NOT NULL,
            tz text NOT NULL DEFAULT 'UTC',
            queue text COLLATE "C" NOT NULL,
            body bytea NOT NULL DEFAULT ''::bytea,
            options jsonb NOT NULL DEFAULT '{}'::jsonb,
            last_tick timestamptz,
            updated_at timestamptz NOT NULL DEFAULT pgq.now(),
            CONSTRAINT periodic_pkey PRIMARY KEY (name)
        )
    """)


def downgrade() -> None:
    op.execute("DROP TABLE pgq.periodic")
