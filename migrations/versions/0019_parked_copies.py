"""pgq schema, version 19: copies parked on the holder that has their job queued.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-27

A job replicated to several nodes is queued at one holder; the others keep
active copies with a re-queue timer. Each QUEUED the queueing holder sends
(at every retry, from its watch: schema 0009) postponed every other copy's
timer by one retry: a row written on every holder for every queued job at
every retry (a 1,000-job backlog queued on one of three nodes, retry 2 s:
16,669 row updates on each other node in ten retries). A copy that hears
QUEUED is now *parked* on the sender (``parked_on``): its timer goes ten
retries out (at most half the TTL left) and later QUEUEDs from that holder
leave the row alone until half of that is left; it comes back to one retry
as soon as its membership sees the holder suspect, dead or gone
(pgq.cluster.requeue, "Parked copies").
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("parked_on", sa.Text), schema="pgq")
    op.create_index("jobs_parked_idx", "jobs", ["parked_on"], schema="pgq",
                    postgresql_where=sa.text("parked_on IS NOT NULL"))


def downgrade() -> None:
    op.drop_index("jobs_parked_idx", table_name="jobs", schema="pgq")
    op.drop_column("jobs", "parked_on", schema="pgq")
