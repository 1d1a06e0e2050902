"""Contender: a COPY of the same jobs into a table with the job table's
columns, defaults, constraints and indexes (``LIKE pgq.jobs INCLUDING ALL``),
and nothing else: the floor for bulk adds and Spark ingestion that issue
"Speed that scales" asks for beside the bare-table COPY.

The rows are what pgq's bulk add writes (the same columns and constant
values, time-ordered 40-character IDs, the 16-byte body), encoded with the
same binary COPY writer, so the gap to pgq is pgq's own work (checks, IDs,
notification), not the encoding. The table has no trigger and is not
``pgq.jobs`` itself: none of pgq's logic runs.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import psycopg

from pgq.copydata import binary_copy

from .common import BODY, main

COLUMNS = "queue, state, repl, retry, delay, expires_at, requeue_at, queued_at, enqueues, priority, id, body"
TYPES = ("text", "text", "int4", "float8", "float8", "timestamptz", "timestamptz", "timestamptz",
         "int4", "int4")
CHUNK = 100_000  # rows per COPY statement, as pgq's bulk add is called in the bench


def enqueue_bulk(dsn: str, n: int) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE floor_jobs (LIKE pgq.jobs INCLUDING ALL)")
        now = dt.datetime.now(dt.UTC)
        constants = ("bench", "queued", 1, 300.0, 0.0, now + dt.timedelta(days=1), None, now, 1, 0)
        ids = [f"D-0a1b2c3d-{i:024x}-0001" for i in range(n)]  # 40 chars, increasing
        started = time.perf_counter()
        for start in range(0, n, CHUNK):
            with conn.transaction(), conn.cursor().copy(
                    f"COPY floor_jobs ({COLUMNS}) FROM STDIN (FORMAT BINARY)") as copy:
                chunk = ids[start:start + CHUNK]
                for data in binary_copy(TYPES, constants, chunk, [BODY] * len(chunk)):
                    copy.write(data)
        seconds = time.perf_counter() - started
    return {"jobs": n, "seconds": seconds}


if __name__ == "__main__":
    main({"enqueue_bulk": enqueue_bulk, "spark_ingest": enqueue_bulk})
