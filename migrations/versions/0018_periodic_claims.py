"""pgq schema, version 18: one job per tick in a cluster.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-27

Each node's database keeps its own schedules (``pgq.periodic``), so workers
that declared one schedule on three nodes added three jobs a tick. A
schedule's name now names one schedule in the cluster: every scheduler
claims a tick in the same place, the *tick home*, the database of the
live node with the lowest ID (pgq.periodic, "One job per tick in a
cluster"). ``pgq.periodic_claims`` is that place: the last tick claimed
for each schedule name, by which node. A scheduler whose home is its own
database claims there in the transaction that adds the job; another
node's scheduler claims over the home's advertised DSN (schema 0014).
"""

from __future__ import annotations

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE TABLE pgq.periodic_claims (
            name text COLLATE "C" NOT NULL,
            last_tick timestamptz NOT NULL,
            claimed_by text NOT NULL,
            updated_at timestamptz NOT NULL DEFAULT pgq.now(),
            CONSTRAINT periodic_claims_pkey PRIMARY KEY (name)
        )
    """)


def downgrade() -> None:
    op.execute("DROP TABLE pgq.periodic_claims")
