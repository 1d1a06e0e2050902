"""Contender: Spark's JDBC writer putting the same rows (bigint id, 16-byte
body) into a bare table: the ceiling of any ingestion through Spark's JDBC
data source on this machine (batched inserts, reWriteBatchedInserts)."""

from __future__ import annotations

import time
from typing import Any

from .common import main
from .spark_common import rows, session


def spark_ingest(dsn: str, n: int) -> dict[str, Any]:
    import psycopg

    from pgq.spark.jdbc import jdbc_target

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE bare (id bigint, body bytea)")
        conn.execute("CREATE TABLE warm (id bigint, body bytea)")
    spark = session()
    target = jdbc_target(dsn)

    def write(table: str, count: int) -> None:
        (rows(spark, count).write.format("jdbc").options(**target.options())
         .option("dbtable", table).option("batchsize", "10000").mode("append").save())

    write("warm", 1000)  # a fresh JVM's first write is slow: not what is measured
    started = time.perf_counter()
    write("bare", n)
    seconds = time.perf_counter() - started
    spark.stop()
    return {"jobs": n, "seconds": seconds}


if __name__ == "__main__":
    main({"spark_ingest": spark_ingest})
