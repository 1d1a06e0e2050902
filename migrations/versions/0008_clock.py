"""pgq schema, version 8: one clock, ``pgq.now()``, that a simulation can drive.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25

Every statement and function of pgq read "now" as ``statement_timestamp()``.
They now read ``pgq.now()``: the setting ``pgq.now`` of the session when
it is set (the seeded simulation sets it to its virtual time before each
step of a node, so leases, delays, TTLs and re-queue timers run on virtual
time), ``statement_timestamp()`` otherwise. Nothing else sets it. The
function is a STABLE SQL expression, inlined by the planner: an index
condition such as ``expires_at > pgq.now()`` is still computed once per
scan.

The functions, views and column defaults of earlier revisions are rewritten
from the catalog (their definitions as PostgreSQL holds them), so this
revision does not repeat their bodies. Column defaults matter too: a client
judges a node process stuck by the age of its oldest outbox event
(``created_at``) measured against ``pgq.now()``.
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

NOW = """
CREATE FUNCTION pgq.now() RETURNS timestamptz LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT coalesce(nullif(current_setting('pgq.now', true), '')::timestamptz,
                    statement_timestamp())
$$;
COMMENT ON FUNCTION pgq.now() IS
    'pgq''s "now": the session setting pgq.now if set (the simulation''s virtual time), else statement_timestamp()';
"""


def _rewrite(old: str, new: str) -> str:
    """Replace ``old`` by ``new`` in every function, column default and view of schema pgq."""
    return f"""
DO $rewrite$
DECLARE
    f record;
    d record;
    v record;
BEGIN
    FOR f IN SELECT p.oid FROM pg_proc p
             WHERE p.pronamespace = 'pgq'::regnamespace AND p.proname <> 'now'
               AND p.prokind = 'f' AND p.prosrc LIKE '%{old}%'
    LOOP
        EXECUTE replace(pg_get_functiondef(f.oid), '{old}', '{new}');
    END LOOP;
    FOR d IN SELECT c.relname, a.attname, pg_get_expr(ad.adbin, ad.adrelid) AS expr
             FROM pg_attrdef ad
             JOIN pg_class c ON c.oid = ad.adrelid
             JOIN pg_attribute a ON a.attrelid = ad.adrelid AND a.attnum = ad.adnum
             WHERE c.relnamespace = 'pgq'::regnamespace
               AND pg_get_expr(ad.adbin, ad.adrelid) LIKE '%{old}%'
    LOOP
        EXECUTE format('ALTER TABLE pgq.%I ALTER COLUMN %I SET DEFAULT %s', d.relname,
                       d.attname, replace(d.expr, '{old}', '{new}'));
    END LOOP;
    FOR v IN SELECT c.oid, c.relname FROM pg_class c
             WHERE c.relnamespace = 'pgq'::regnamespace AND c.relkind = 'v'
               AND pg_get_viewdef(c.oid) LIKE '%{old}%'
    LOOP
        EXECUTE format('CREATE OR REPLACE VIEW pgq.%I AS %s', v.relname,
                       replace(pg_get_viewdef(v.oid), '{old}', '{new}'));
    END LOOP;
END
$rewrite$;
"""


def upgrade() -> None:
    op.execute(NOW)
    op.execute(_rewrite("statement_timestamp()", "pgq.now()"))


def downgrade() -> None:
    op.execute(_rewrite("pgq.now()", "statement_timestamp()"))
    op.execute("DROP FUNCTION pgq.now()")
