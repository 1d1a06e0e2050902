"""pgq and Spark: bulk ingestion of jobs and analytics of what the queue did.

::

    from pgq.spark import spark_session, write_jobs, read_jobs

    spark = spark_session()                       # or your own, with the JDBC jar
    df = spark.read.parquet("s3://lake/emails/")  # any DataFrame with a body column
    result = write_jobs(df, "emails", nodes=[dsn1, dsn2, dsn3], ingest_id="emails-2026-11-21")
    history = read_jobs(spark, nodes=[dsn1, dsn2, dsn3])   # pgq.job_history of every node

Spark talks to the node databases through its JDBC data source only (the
PostgreSQL driver jar from ``$PGQ_JDBC_JAR`` or Debian's
``libpostgresql-jdbc-java``), so the same code runs in ``local[*]`` and on a
cluster. The command line has ``pgq spark ingest`` and ``pgq spark report``.
See :mod:`pgq.spark.ingest` and :mod:`pgq.spark.read` for the guarantees.
"""

from __future__ import annotations

from .environment import find_jdbc_jar, spark_session
from .ingest import IngestResult, write_jobs
from .read import read_jobs

__all__ = ["spark_session", "write_jobs", "read_jobs", "IngestResult", "find_jdbc_jar"]
