"""pgq schema, version 11: results of jobs, kept for a while.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25

A worker told to keep results (``pgq.Worker(keep_results=...)``, and
``pgq.Tasks``, whose tasks return values) stores a job's result, or the
error that sent it to the dead letters, here, for ``keep`` seconds; a
client waits for it with ``wait_result``. Its own small table keyed by the
job's ID: the hot tables and the ACK statement stay as they are for jobs
whose results nobody wants.
"""

from __future__ import annotations

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE TABLE pgq.results (
            id text COLLATE "C" NOT NULL,
            value bytea,
            error text,
            stored_at timestamptz NOT NULL DEFAULT pgq.now(),
            expires_at timestamptz NOT NULL,
            CONSTRAINT results_pkey PRIMARY KEY (id)
        )
    """)
    op.execute("CREATE INDEX results_expires_at_idx ON pgq.results (expires_at)")


def downgrade() -> None:
    op.execute("DROP TABLE pgq.results")
