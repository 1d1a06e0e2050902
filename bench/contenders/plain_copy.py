"""Contender: a plain COPY of the same rows (bigint id, 16-byte body) into a
bare table with no index: the ceiling for bulk adds."""

from __future__ import annotations

import time
from typing import Any

import psycopg

from .common import BODY, main


def enqueue_bulk(dsn: str, n: int) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE bare (id bigint, body bytea)")
        started = time.perf_counter()
        with conn.cursor().copy("COPY bare (id, body) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(["int8", "bytea"])
            for i in range(n):
                copy.write_row((i, BODY))
        seconds = time.perf_counter() - started
    return {"jobs": n, "seconds": seconds}


if __name__ == "__main__":
    # The Spark ingestion workload compares against the same COPY of the same rows.
    main({"enqueue_bulk": enqueue_bulk, "spark_ingest": enqueue_bulk})
