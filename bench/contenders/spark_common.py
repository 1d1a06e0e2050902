"""What the Spark contenders share: one local session and the same rows."""

from __future__ import annotations

from typing import Any


def session() -> Any:
    from pgq.spark import spark_session

    return spark_session("local[2]", app_name="pgq-bench")


def rows(spark: Any, n: int) -> Any:
    """n rows (bigint id, 16-byte binary body) in 2 partitions, as the COPY contender writes."""
    from pyspark.sql import functions as F

    return spark.range(n, numPartitions=2).select(
        F.col("id"), F.encode(F.lpad(F.col("id").cast("string"), 16, "0"), "UTF-8").alias("body"))
