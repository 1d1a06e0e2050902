"""pgq schema, version 15: the RESP address each node advertises.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-26

``pgq.nodes.resp``: HOST:PORT where a node speaks Disque's client protocol
(``pgq node start --resp``), learnt over the bus (ADVERT) for the peers and
written by the node itself for its own row. HELLO and CLUSTER NODES list
it, as Disque lists its client port there: a Disque client that follows
HELLO to the other nodes reaches their RESP fronts, not their buses or
databases. NULL: the node serves no RESP front (or is older).
"""

from __future__ import annotations

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE pgq.nodes ADD COLUMN resp text")


def downgrade() -> None:
    op.execute("ALTER TABLE pgq.nodes DROP COLUMN resp")
