"""pgq schema, version 2: the cluster layer.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21

Adds what a node process and cluster-aware clients need: holders of each job
copy, the re-queue timer run by the node process, the synchronous-replication
waiter, the transactional outbox of events for other nodes, the membership
table, federation statistics, and the cluster views. A database that never
runs a node process keeps working exactly as before (every new column is
NULL for its jobs).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

C = "C"
TS = sa.DateTime(timezone=True)
TEXTS = postgresql.ARRAY(sa.Text)


def upgrade() -> None:
    op.add_column("jobs", sa.Column("nodes_delivered", TEXTS), schema="pgq")
    op.add_column("jobs", sa.Column("nodes_confirmed", TEXTS), schema="pgq")
    op.add_column("jobs", sa.Column("cluster_requeue_at", TS), schema="pgq")
    op.add_column("jobs", sa.Column("repl_waiter", sa.Integer), schema="pgq")
    op.create_index("jobs_cluster_timer_idx", "jobs", ["cluster_requeue_at"], schema="pgq",
                    postgresql_where=sa.text("cluster_requeue_at IS NOT NULL"))
    op.create_index("jobs_wait_repl_idx", "jobs", ["ctime"], schema="pgq",
                    postgresql_where=sa.text("state = 'wait-repl'::text"))
    op.add_column("acks", sa.Column("nodes", TEXTS), schema="pgq")
    op.add_column("acks", sa.Column("confirmed", TEXTS), schema="pgq")

    op.create_table(
        "outbox",
        sa.Column("seq", sa.BigInteger, sa.Identity(always=True), nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("job_id", sa.Text(collation=C)),
        sa.Column("queue", sa.Text(collation=C)),
        sa.Column("arg", sa.Text),
        sa.Column("created_at", TS, nullable=False, server_default=sa.text("statement_timestamp()")),
        sa.PrimaryKeyConstraint("seq", name="outbox_pkey"),
        sa.CheckConstraint(
            "kind = ANY (ARRAY['replicate'::text, 'abort'::text, 'ack'::text, 'fastack'::text, "
            "'queued'::text, 'working'::text, 'pause'::text, 'meet'::text, 'forget'::text, "
            "'leaving'::text])",
            name="outbox_kind_check",
        ),
        schema="pgq",
    )
    op.create_table(
        "nodes",
        sa.Column("id", sa.Text(collation=C), nullable=False),
        sa.Column("name", sa.Text, nullable=False, server_default=sa.text("''::text")),
        sa.Column("host", sa.Text, nullable=False),
        sa.Column("port", sa.Integer, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("incarnation", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("leaving", sa.Boolean, nullable=False, server_default=sa.text("false")),
        sa.Column("updated_at", TS, nullable=False, server_default=sa.text("statement_timestamp()")),
        sa.PrimaryKeyConstraint("id", name="nodes_pkey"),
        sa.CheckConstraint(
            "status = ANY (ARRAY['alive'::text, 'suspect'::text, 'dead'::text, 'left'::text])",
            name="nodes_status_check",
        ),
        schema="pgq",
    )
    op.create_table(
        "queue_imports",
        sa.Column("queue", sa.Text(collation=C), nullable=False),
        sa.Column("import_from", TEXTS, nullable=False),
        sa.Column("import_rate", sa.Integer, nullable=False),
        sa.Column("updated_at", TS, nullable=False, server_default=sa.text("statement_timestamp()")),
        sa.PrimaryKeyConstraint("queue", name="queue_imports_pkey"),
        schema="pgq",
    )
    op.execute(CLUSTER_SQL)


# The node writes its own identity into pgq.meta (node_name, bus_host,
# bus_port, leaving, heartbeat_at); the views put it beside its peers.
CLUSTER_SQL = r"""
CREATE FUNCTION pgq.meta_value(name text) RETURNS text
LANGUAGE sql STABLE AS $$ SELECT value FROM pgq.meta WHERE key = name $$;

-- Is a node process serving this database, and what can clients count on?
-- active: the process wrote its heartbeat in the last 10 seconds.
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

-- Disque's HELLO / CLUSTER NODES, in SQL. priority: 1 ok, 10 suspected,
-- 100 failed or leaving.
CREATE VIEW pgq.cluster_nodes AS
SELECT pgq.meta_value('node_id') AS id,
       coalesce(pgq.meta_value('node_name'), '') AS name,
       pgq.meta_value('bus_host') AS host,
       pgq.meta_value('bus_port')::integer AS port,
       true AS myself,
       'alive'::text AS status,
       coalesce(pgq.meta_value('leaving')::boolean, false) AS leaving,
       coalesce(pgq.meta_value('incarnation')::bigint, 0) AS incarnation,
       CASE WHEN coalesce(pgq.meta_value('leaving')::boolean, false) THEN 100 ELSE 1 END AS priority,
       pgq.meta_value('heartbeat_at')::timestamptz AS updated_at
WHERE pgq.meta_value('bus_host') IS NOT NULL
UNION ALL
SELECT id, name, host, port, false, status, leaving, incarnation,
       CASE WHEN status IN ('dead', 'left') OR leaving THEN 100
            WHEN status = 'suspect' THEN 10 ELSE 1 END,
       updated_at
FROM pgq.nodes;
"""


def downgrade() -> None:
    op.execute("DROP VIEW pgq.cluster_nodes, pgq.cluster_state")
    op.execute("DROP FUNCTION pgq.meta_value(text)")
    op.drop_table("queue_imports", schema="pgq")
    op.drop_table("nodes", schema="pgq")
    op.drop_table("outbox", schema="pgq")
    op.drop_column("acks", "confirmed", schema="pgq")
    op.drop_column("acks", "nodes", schema="pgq")
    op.drop_index("jobs_wait_repl_idx", table_name="jobs", schema="pgq")
    op.drop_index("jobs_cluster_timer_idx", table_name="jobs", schema="pgq")
    for column in ("repl_waiter", "cluster_requeue_at", "nodes_confirmed", "nodes_delivered"):
        op.drop_column("jobs", column, schema="pgq")
