"""pgq schema, version 17: a bounded history, and no VACUUM truncation of the hot tables.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-26

**History retention.** ``pgq.history`` gets one row per acknowledged,
deleted, expired or dead job, and nothing removed them: at 2k jobs/s that
is 170 million rows a day, until the disk is full and PostgreSQL stops.
It now keeps what is younger than ``history_keep`` (an interval, default
one day, as River keeps finished jobs) and at most ``history_keep_rows``
rows (default 10 million, about 1-2 GB), both ``pgq.meta`` keys an
operator may set. ``pgq.prune_history(n)`` deletes up to ``n`` of the
oldest rows past either bound. Clients prune in their background
maintenance thread (pgq.vacuum) at most once a minute, never on a
caller's call.

**A cap on claim floors.** A claim walks a queue from its client's floor
(pgq.floors): the highest ctime it took, less 50 ms. A job whose ctime lies
ahead of this database's clock (a copy or an import from a node whose clock
is ahead, a Spark ingestion timed by the driver's clock, the clock stepped
back) moved the floor past every job added after it, and those were found
only by the full walks, one batch every 2 s, for as long as the clocks
differed. ``pgq.floor_cap()``: 50 ms before now in ctime units; a claim
starts at its floor or there, whichever is lower.

**No truncation.** A VACUUM that finds empty pages at the end of a table
truncates it under an ACCESS EXCLUSIVE lock, which every claim, add and
ack then waits for, and which a hot standby replays as a conflict; the
next burst extends the file again. A queue's tables empty and fill all
the time, so ``vacuum_truncate`` is off for ``jobs``, ``acks`` and
``outbox`` (autovacuum's runs too).
"""

from __future__ import annotations

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

HOT_TABLES = ("jobs", "acks", "outbox")

FUNCTIONS = r"""
CREATE FUNCTION pgq.floor_cap() RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT (floor(extract(epoch FROM pgq.now()) * 1000)::bigint - 50) * 1000000
$$;

CREATE FUNCTION pgq.history_keep() RETURNS interval
LANGUAGE sql STABLE AS $$
    SELECT coalesce(pgq.meta_value('history_keep')::interval, interval '1 day')
$$;

CREATE FUNCTION pgq.history_keep_rows() RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT coalesce(pgq.meta_value('history_keep_rows')::bigint, 10000000)
$$;

-- Delete up to max_rows of the oldest rows past either bound. Only the
-- oldest max_rows are looked at (seq follows finished_at), each by a probe
-- of history_pkey (seq = ANY of an array: the plan cannot become a scan
-- of the table, whatever max_rows is), so a call costs its batch whatever
-- the table's size. Pruners do not overlap: the client's maintenance
-- thread holds pgq.vacuum's advisory lock.
CREATE FUNCTION pgq.prune_history(max_rows integer DEFAULT 10000) RETURNS integer
LANGUAGE sql AS $$
    WITH gone AS (
        DELETE FROM pgq.history h
        WHERE h.seq = ANY (ARRAY(SELECT seq FROM pgq.history ORDER BY seq LIMIT max_rows))
          AND (h.finished_at < pgq.now() - pgq.history_keep()
               OR h.seq < (SELECT max(seq) FROM pgq.history) - pgq.history_keep_rows())
        RETURNING 1)
    SELECT count(*)::integer FROM gone
$$;
"""


def upgrade() -> None:
    op.execute(FUNCTIONS)
    for table in HOT_TABLES:
        op.execute(f"ALTER TABLE pgq.{table} SET (vacuum_truncate = false)")


def downgrade() -> None:
    for table in HOT_TABLES:
        op.execute(f"ALTER TABLE pgq.{table} RESET (vacuum_truncate)")
    op.execute("DROP FUNCTION pgq.prune_history(integer), pgq.history_keep_rows(), "
               "pgq.history_keep(), pgq.floor_cap()")
