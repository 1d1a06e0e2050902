"""pgq schema, version 9: queued copies of replicated jobs keep watch.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25

Every queued copy of a job held by several nodes keeps a re-queue timer
(``cluster_requeue_at``), and when it comes due the node says QUEUED again
to the other holders (``FIRE_TIMERS``), so that two holders that both queued
the job while their messages were lost end with one queued copy (the
simulation found three ways to get there: seeds 4, 13 and 21). The node
arms the watch of copies that were queued without one (replication
achieved, NACK, ENQUEUE, an import); this partial index finds them without
walking the queue: a copy is in it only between being queued and being
armed.
"""

from __future__ import annotations

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE INDEX jobs_unwatched_idx ON pgq.jobs (id)
        WHERE state = 'queued' AND cluster_requeue_at IS NULL AND cardinality(nodes_delivered) > 1
    """)


def downgrade() -> None:
    op.execute("DROP INDEX pgq.jobs_unwatched_idx")
