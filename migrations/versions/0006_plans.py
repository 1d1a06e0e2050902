"""pgq schema, version 6: plans that do not depend on the table's history.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24

pgq's own connections now run with ``enable_seqscan`` and
``enable_bitmapscan`` off and without JIT (see
``pgq.statements.SESSION_OPTIONS``): their generic plans, often made while
``pgq.jobs`` was empty and never analysed, then walk the indexes whatever
the table holds later. ``compact_counters`` joins ``pg_stat_activity``,
for which a sequential scan is the right plan: it keeps the defaults.
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER FUNCTION pgq.compact_counters() SET enable_seqscan = on "
               "SET enable_bitmapscan = on")


def downgrade() -> None:
    op.execute("ALTER FUNCTION pgq.compact_counters() RESET ALL")
