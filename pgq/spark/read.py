"""Reading what the queue did into Spark (:func:`read_jobs`).

Reads one of pgq's stable views from every node through Spark's JDBC data
source, split into ranges of a monotonic bigint column
(``partitionColumn``/``lowerBound``/``upperBound``/``numPartitions``), and
adds a ``node`` column.

Why it does not hurt the queue:

* Each range is one short statement fetched in one go (``fetchsize`` 0: no
  server-side cursor, no transaction left open while Spark works through
  the rows). A snapshot lives as long as one range's query, not as long as
  the Spark job, so VACUUM of the hot job table is never held back for the
  length of an analysis. Ranges are sized (``rows_per_partition``) to keep
  each statement well under a second.
* The connection carries ``statement_timeout`` and
  ``idle_in_transaction_session_timeout`` (:mod:`.jdbc`): a stuck reader is
  cut off by the server.
* History and dead letters are append-only tables read through their
  primary key; the live job table (``"jobs"``) is read only on request.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from typing import Any

from ..errors import InvalidArgumentError
from .environment import check_session
from .ingest import _connect, _describe, resolve_nodes
from .jdbc import READ_STATEMENT_TIMEOUT_MS, jdbc_target
from .plan import CTIME_PER_MS

__all__ = ["read_jobs", "VIEWS"]

# name -> (view, monotonic bigint column)
VIEWS = {
    "history": ("pgq.job_history", "seq"),
    "dead_letters": ("pgq.dead_letter_jobs", "seq"),
    "jobs": ("pgq.live_jobs", "ctime"),
}
ROWS_PER_PARTITION = 100_000
MAX_PARTITIONS_PER_NODE = 256


def _view(table_or_view: str) -> tuple[str, str]:
    for name, (view, column) in VIEWS.items():
        if table_or_view in (name, view, view.split(".", 1)[1]):
            return view, column
    raise InvalidArgumentError(
        f"cannot read {table_or_view!r}: choose one of {', '.join(VIEWS)} "
        f"({', '.join(v for v, _ in VIEWS.values())})")


def _bounds(dsn: str, view: str, column: str) -> tuple[int, int, int]:
    """(lower, upper, estimated rows) of ``column`` on one node."""
    with _connect(dsn) as conn:
        if column == "seq":
            low, high = conn.execute(f"SELECT min(seq), max(seq) FROM {view}").fetchone()  # type: ignore[misc]
            if low is None:
                return 0, 0, 0
            return int(low), int(high), int(high) - int(low) + 1
        # The live table: no scan of it for bounds. ctime is creation time,
        # so [an hour ago, now] splits the usual content evenly; older and
        # newer rows fall into the first and last ranges (Spark's rule).
        count = conn.execute("SELECT coalesce(sum(jobs), 0)::bigint FROM pgq.job_counts "
                             "WHERE state <> 'acked'").fetchone()[0]  # type: ignore[index]
        now = time.time_ns() // 1_000_000 * CTIME_PER_MS
        return now - 3_600_000 * CTIME_PER_MS, now, int(count)


def read_jobs(spark: Any, nodes: str | Sequence[str] | None = None,
              table_or_view: str = "history", *, partitions: int | None = None,
              rows_per_partition: int = ROWS_PER_PARTITION) -> Any:
    """A DataFrame of ``table_or_view`` from every node, with a ``node`` column.

    ``table_or_view``: ``"history"`` (acknowledged, deleted, expired and
    dead jobs: :data:`pgq.job_history`), ``"dead_letters"`` or ``"jobs"``
    (jobs not yet acknowledged; read it in short bursts). ``partitions``:
    ranges per node (default: one per ``rows_per_partition`` rows).
    """
    check_session(spark)
    view, column = _view(table_or_view)
    if partitions is not None and (not isinstance(partitions, int) or partitions < 1):
        raise InvalidArgumentError("partitions must be a positive int")
    if not isinstance(rows_per_partition, int) or rows_per_partition < 1:
        raise InvalidArgumentError("rows_per_partition must be a positive int")
    from pyspark.sql import functions as F

    frames = []
    for dsn in resolve_nodes(nodes):
        node = _describe(dsn)
        low, high, rows = _bounds(dsn, view, column)
        count = partitions or max(1, min(MAX_PARTITIONS_PER_NODE, math.ceil(rows / rows_per_partition)))
        target = jdbc_target(node.connected, statement_timeout_ms=READ_STATEMENT_TIMEOUT_MS)
        frame = (spark.read.format("jdbc")
                 .options(**target.options())
                 .option("dbtable", view)
                 .option("partitionColumn", column)
                 .option("lowerBound", str(low))
                 .option("upperBound", str(max(high, low + 1)))
                 .option("numPartitions", str(count))
                 .option("fetchsize", "0")  # whole range in one go: no cursor held open
                 .load()
                 .withColumn("node", F.lit(node.name)))
        frames.append(frame)
    return functools.reduce(lambda a, b: a.unionByName(b), frames)
