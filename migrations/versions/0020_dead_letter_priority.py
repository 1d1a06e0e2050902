"""pgq schema, version 20: a dead letter keeps its job's priority and key.

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-28

A job a worker gave up on went to ``pgq.dead_letters`` without its
priority or its idempotency key (schema 0013), and putting it back
(``requeue_dead_letters``, ``pgq dead-letters --requeue``) added it at
priority 0 with no key: an urgent job came back behind the whole backlog,
and a keyed one could be queued twice. Both columns are kept now (rows
from before read priority 0 and no key), and ``pgq.dead_letter_jobs``
shows them at its end.

``dead_letters_id_idx``: the dashboard's view of a job looks its dead
letter up by ID, every 2 s while the view is open; with no index that was
a scan of every dead letter (they are kept until requeued or deleted).
Dead letters are rare writes: the index costs the hot path nothing.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

VIEW = r"""
CREATE OR REPLACE VIEW pgq.dead_letter_jobs AS
SELECT d.seq, d.id, d.queue, d.reason,
       to_timestamp(d.ctime / 1e9) AS created_at, d.died_at,
       d.deliveries, d.nacks, d.additional_deliveries, d.retry, d.repl,
       length(d.body) AS body_size, d.body{more}
FROM pgq.dead_letters d;
"""


def upgrade() -> None:
    op.add_column("dead_letters", sa.Column("priority", sa.Integer, nullable=False,
                                            server_default=sa.text("0")), schema="pgq")
    op.add_column("dead_letters", sa.Column("key", sa.Text), schema="pgq")
    op.execute(VIEW.format(more=", d.priority, d.key"))
    op.create_index("dead_letters_id_idx", "dead_letters", ["id"], schema="pgq")


def downgrade() -> None:
    op.drop_index("dead_letters_id_idx", table_name="dead_letters", schema="pgq")
    op.execute("DROP VIEW pgq.dead_letter_jobs")
    op.execute(VIEW.format(more=""))
    op.drop_column("dead_letters", "key", schema="pgq")
    op.drop_column("dead_letters", "priority", schema="pgq")
