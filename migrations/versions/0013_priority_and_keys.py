"""pgq schema, version 13: priority within a queue, and idempotency keys.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-25

* ``priority`` (0 and up, higher first; FIFO within a priority). Jobs of
  priority 0, the default, live only in ``jobs_queued_idx`` as before, so
  queues that never use priorities pay nothing more than one probe of an
  empty index per claim. A job of priority above 0 also gets an entry in
  ``jobs_priority_idx`` (queue, priority DESC, ctime): the claim walks it
  beside the ready index, so it stays a LIMITed index scan per arm, whatever
  the backlog (see ``pgq.statements`` CLAIM). Why no negative priorities:
  the ready arm takes jobs in ctime order whatever their priority, so it
  can only stand for "priority 0" if nothing ranks below 0.
* ``key``: an idempotency key. An add with a key adds nothing while a live
  job (not acknowledged, deleted or expired) with the same key is in that
  queue on this node: it answers that job's ID. Copies of replicated jobs
  carry their key, so every node holding a copy knows it. The index is
  partial: jobs without a key pay nothing. Not UNIQUE: a copy replicated
  from another node must be stored even if this node added a job with the
  same key meanwhile (adds are serialised per key by an advisory lock in
  the adding transaction instead; see ``pgq.commands``).

Both columns have constant defaults: adding them rewrites nothing. But the
migration runs in one transaction holding an exclusive lock on pgq.jobs
while the check scans the table and the two indexes are built: on a node
with a large backlog, migrate in a quiet moment.
"""

from __future__ import annotations

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        ALTER TABLE pgq.jobs
            ADD COLUMN priority integer NOT NULL DEFAULT 0,
            ADD COLUMN key text COLLATE "C",
            ADD CONSTRAINT jobs_priority_check CHECK (priority >= 0)
    """)
    op.execute("""
        CREATE INDEX jobs_priority_idx ON pgq.jobs (queue, priority DESC, ctime)
        WHERE state = 'queued' AND priority > 0
    """)
    op.execute("CREATE INDEX jobs_key_idx ON pgq.jobs (queue, key) WHERE key IS NOT NULL")
    op.execute(VIEWS)


# The SQL interface gains the two columns (at the end: CREATE OR REPLACE
# VIEW may only add columns).
LIVE_JOBS = """
CREATE OR REPLACE VIEW pgq.live_jobs AS
SELECT j.ctime, j.id, j.queue, j.state,
       to_timestamp(j.ctime / 1e9) AS created_at, j.queued_at, j.delivered_at,
       j.deliveries, j.nacks, j.additional_deliveries, j.retry, j.repl, j.delay,
       j.expires_at, length(j.body) AS body_size, j.body{more}
FROM pgq.jobs j
WHERE j.expires_at > pgq.now();
"""
VIEWS = LIVE_JOBS.format(more=", j.priority, j.key")


def downgrade() -> None:
    op.execute("DROP VIEW pgq.live_jobs")
    op.execute(LIVE_JOBS.format(more=""))
    op.execute("DROP INDEX pgq.jobs_key_idx")
    op.execute("DROP INDEX pgq.jobs_priority_idx")
    op.execute("ALTER TABLE pgq.jobs DROP COLUMN key, DROP COLUMN priority")
