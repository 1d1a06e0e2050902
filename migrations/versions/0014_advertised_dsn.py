"""pgq schema, version 14: the database address each node advertises.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-25

``pgq.nodes.dsn``: the libpq DSN a peer node advertised for its database
(``pgq node start --advertise-dsn``, by default the DSN the node itself
uses), learnt over the bus (ADVERT). A client of this node writes the
copies of a synchronous replicated add straight into those databases
(see docs/cluster-protocol.md, "Replication of a new job"), instead of
asking the node process to carry them: fewer hops, no node process on the
hot path. NULL: the peer advertised nothing (an older node, or
``--advertise-dsn none``); its copies go through the node process.

The DSN may hold the peer's password: it is kept out of the stable views
(``pgq.cluster_nodes`` does not show it), and readable by whoever may read
``pgq.nodes``, i.e. the clients of this node, which are trusted with the
cluster's jobs anyway.
"""

from __future__ import annotations

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE pgq.nodes ADD COLUMN dsn text")


def downgrade() -> None:
    op.execute("ALTER TABLE pgq.nodes DROP COLUMN dsn")
