"""pgq schema, version 5: one view of the cluster, soft default replication.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24

* ``cluster_state.reachable_nodes`` is now counted from ``cluster_nodes``
  (the rows with priority 1: alive and not leaving, this node included
  unless it is leaving), so what HELLO / ``cluster_nodes`` report and what
  an add checks come from one source and agree. ``cluster_state.member``
  tells a cluster node's database (its node process ran at least once)
  from a standalone one: a member whose process is not running refuses
  adds that need copies instead of quietly keeping a single copy.
* ``jobs.repl_min``: for a job whose ``replicate`` was left to its default,
  the copies that suffice when the last target does not confirm in time
  (a node down but not yet declared dead); NULL means ``repl``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

CLUSTER_STATE = r"""
CREATE OR REPLACE VIEW pgq.cluster_state AS
SELECT pgq.meta_value('node_id') AS node_id,
       coalesce(pgq.meta_value('heartbeat_at')::timestamptz > statement_timestamp() - interval '10 seconds',
                false) AS active,
       coalesce(pgq.meta_value('leaving')::boolean, false) AS leaving,
       CASE WHEN pgq.meta_value('bus_host') IS NULL THEN 1
            ELSE (SELECT count(*) FROM pgq.cluster_nodes WHERE priority = 1)::integer END
           AS reachable_nodes,
       pgq.meta_value('bus_host') AS bus_host,
       pgq.meta_value('bus_port')::integer AS bus_port,
       pgq.meta_value('heartbeat_at')::timestamptz AS heartbeat_at,
       pgq.meta_value('bus_host') IS NOT NULL AS member;
"""

PREVIOUS = r"""
DROP VIEW pgq.cluster_state;
CREATE VIEW pgq.cluster_state AS
SELECT pgq.meta_value('node_id') AS node_id,
       coalesce(pgq.meta_value('heartbeat_at')::timestamptz > statement_timestamp() - interval '10 seconds',
                false) AS active,
       coalesce(pgq.meta_value('leaving')::boolean, false) AS leaving,
       1 + (SELECT count(*) FROM pgq.nodes WHERE status = 'alive' AND NOT leaving)::integer
           AS reachable_nodes,
       pgq.meta_value('bus_host') AS bus_host,
       pgq.meta_value('bus_port')::integer AS bus_port,
       pgq.meta_value('heartbeat_at')::timestamptz AS heartbeat_at;
"""


def upgrade() -> None:
    op.add_column("jobs", sa.Column("repl_min", sa.Integer), schema="pgq")
    op.execute(CLUSTER_STATE)


def downgrade() -> None:
    op.execute(PREVIOUS)
    op.drop_column("jobs", "repl_min", schema="pgq")
