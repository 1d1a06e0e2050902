"""Vacuuming pgq's hot tables when they need it, instead of waiting for
autovacuum; pruning the history past its retention.

Every claimed and acknowledged job leaves a dead row and dead index entries
in ``pgq.jobs``. Autovacuum looks at a table once a minute at best: a queue
burning down 30k jobs a second piles up a million dead rows in between, and
every claim walks past them (a run of burn-downs slowed from 29k to 14k
jobs/s over ten rounds here). So pgq vacuums its own tables:

* the periodic sweep that every client runs tells which of ``pgq.jobs``,
  ``pgq.acks`` and ``pgq.outbox`` carry more than 20% dead rows (and at
  least ``DEAD_MIN``) and were not vacuumed in the last 10 s;
* :class:`Vacuumer` then runs ``VACUUM`` on them in a background thread, on
  a connection of its own, so no caller waits for it;
* one vacuum at a time per process (a flag) and per database (a session
  advisory lock, released when done; none behind a transaction pooler,
  where a session's lock outlives it): many clients never vacuum the same
  table together; a process that finds the lock taken leaves those tables
  for ``BACKOFF_MIN``;
* a VACUUM that could not remove at least half of the dead rows (another
  session holds an old snapshot: the xmin horizon) makes the next one of
  that table wait, twice as long each time up to ``BACKOFF_MAX``, so a
  held horizon does not turn into a full scan of the table every 10 s;
* at most every ``PRUNE_EVERY`` seconds per database (sooner while a run
  found more than it could take), the same thread deletes the rows of
  ``pgq.history`` past its retention (schema 0017: a day and 10 million
  rows by default), ``PRUNE_BATCH`` rows a statement, at most
  ``PRUNE_ROUNDS`` statements a run: a caller never waits for it, and a
  steady queue, whose oldest row ages past the bound every second, costs
  a connection a minute, not one a second.

Invariant: a failure here is logged and never reaches a caller; a role that
does not own the tables makes VACUUM skip them (a warning), nothing more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import psycopg
from psycopg import sql

from .dsn import connection_settings
from .statements import PRUNE_HISTORY

__all__ = ["Vacuumer", "DEAD_MIN", "VACUUM_LOCK", "BACKOFF_MIN", "BACKOFF_MAX", "PRUNE_BATCH"]

log = logging.getLogger("pgq")
DEAD_MIN = 20_000
VACUUM_LOCK = 0x70677176  # "pgqv"
TABLES = ("jobs", "acks", "outbox")
BACKOFF_MIN = 10.0  # seconds
BACKOFF_MAX = 300.0
PRUNE_BATCH = 10_000  # rows of pgq.history per statement (tens of ms)
PRUNE_ROUNDS = 100
PRUNE_EVERY = 60.0  # seconds

DEAD_ROWS = "SELECT n_dead_tup FROM pg_stat_user_tables WHERE schemaname = 'pgq' AND relname = %s"


class Vacuumer:
    def __init__(self, options: str) -> None:
        self.options = options
        self._busy = threading.Lock()
        self._backoff: dict[tuple[str, str], tuple[float, float]] = {}  # -> (until, wait)
        self._prune_at: dict[str, float] = {}  # dsn -> when its history is pruned next

    def request(self, dsn: str, tables: Sequence[str] | None, pooled: bool = False) -> None:
        """Vacuum ``tables`` (of schema pgq), and prune the history when that
        is due, soon, unless this process runs maintenance already.
        ``pooled``: ``dsn`` is a transaction pooler's (PgBouncer): no
        database-wide lock then (see _run)."""
        now = time.monotonic()
        wanted = self.due(dsn, tables or (), now)
        prune_history = now >= self._prune_at.get(dsn, 0.0)
        if not (wanted or prune_history) or not self._busy.acquire(blocking=False):
            return
        if prune_history:
            self._prune_at[dsn] = now + PRUNE_EVERY
        thread = threading.Thread(target=self._run, args=(dsn, wanted, prune_history, pooled),
                                  daemon=True, name="pgq-vacuum")
        thread.start()

    def due(self, dsn: str, tables: Sequence[str], now: float) -> list[str]:
        """Which of ``tables`` may be vacuumed now (not backing off)."""
        return [t for t in tables
                if t in TABLES and self._backoff.get((dsn, t), (0.0, 0.0))[0] <= now]

    def _run(self, dsn: str, tables: list[str], prune_history: bool = False,
             pooled: bool = False) -> None:
        try:
            with psycopg.connect(dsn, autocommit=True, connect_timeout=10, **connection_settings(
                    dsn, self.options, "pgq-vacuum", default_name="pgq-vacuum")) as conn:
                # The lock is a session's, and VACUUM cannot run in a
                # transaction: behind a transaction pooler the lock stayed on
                # whichever server connection took it, and every process
                # found it taken until the pooler dropped that connection (no
                # vacuum, no pruning; found by a read-only review). There,
                # none is taken: VACUUM (SKIP_LOCKED) passes a table another
                # one vacuums, and two prunes delete different rows.
                if not pooled:
                    locked = conn.execute("SELECT pg_try_advisory_lock(%s)",
                                          (VACUUM_LOCK,)).fetchone()
                    if not locked or not locked[0]:
                        # Another client vacuums this database right now: look
                        # again in BACKOFF_MIN, not at the next sweep (each
                        # process opened a connection a second while it ran).
                        self._wait_for_other(dsn, tables)
                        return
                try:
                    self._maintain(conn, dsn, tables, prune_history)
                finally:
                    if not pooled:  # not left to the connection's end
                        conn.execute("SELECT pg_advisory_unlock(%s)", (VACUUM_LOCK,))
        except Exception as exc:  # never the caller's problem
            log.warning("pgq: maintenance of %s failed: %s",
                        ", ".join([*tables, *(["history"] if prune_history else [])]), exc)
        finally:
            self._busy.release()

    def _maintain(self, conn: psycopg.Connection, dsn: str, tables: list[str],
                  prune_history: bool) -> None:
        for table in tables:
            before = self._dead_rows(conn, table)
            conn.execute(sql.SQL("VACUUM (SKIP_LOCKED) pgq.{}").format(sql.Identifier(table)))
            self._judge(dsn, table, before, self._dead_rows(conn, table))
        if prune_history and self._prune(conn) >= PRUNE_BATCH * PRUNE_ROUNDS:
            self._prune_at[dsn] = 0.0  # more to take: at the next sweep

    @staticmethod
    def _prune(conn: psycopg.Connection) -> int:
        """Delete the history past retention; the rows deleted."""
        pruned = 0
        for _round in range(PRUNE_ROUNDS):
            row = conn.execute(PRUNE_HISTORY, {"rows": PRUNE_BATCH}).fetchone()
            deleted = int(row[0]) if row else 0
            pruned += deleted
            if deleted < PRUNE_BATCH:
                break
        return pruned

    @staticmethod
    def _dead_rows(conn: psycopg.Connection, table: str) -> int:
        row = conn.execute(DEAD_ROWS, (table,)).fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def _wait_for_other(self, dsn: str, tables: Sequence[str]) -> None:
        until = time.monotonic() + BACKOFF_MIN
        for table in tables:
            after, wait = self._backoff.get((dsn, table), (0.0, 0.0))
            self._backoff[(dsn, table)] = (max(until, after), wait)

    def _judge(self, dsn: str, table: str, before: int, after: int,
               now: float | None = None) -> None:
        """Back off from a table whose vacuum left most dead rows in place."""
        key = (dsn, table)
        if before and after * 2 > before:
            wait = min(BACKOFF_MAX, max(BACKOFF_MIN, self._backoff.get(key, (0.0, 0.0))[1] * 2))
            self._backoff[key] = ((time.monotonic() if now is None else now) + wait, wait)
            log.info("pgq: VACUUM of pgq.%s left %d of %d dead rows (an old snapshot holds "
                     "them); next try in %.0f s", table, after, before, wait)
        else:
            self._backoff.pop(key, None)
