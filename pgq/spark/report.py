"""What the queue did, per queue: an analysis of job history in Spark.

:func:`queue_report` reads ``pgq.job_history`` and ``pgq.dead_letter_jobs``
of every node (:func:`~pgq.spark.read_jobs`) and computes, per queue: jobs
finished and how (acked, expired, deleted, dead), throughput over the
period, wait time from creation to first delivery (p50, p95), deliveries per
job, re-deliveries, NACKs, and the dead letters still waiting.
:func:`plot_report` draws it as a PNG (matplotlib, no display needed).

Invariants: every figure comes from Spark aggregations over the history the
nodes kept (history is per node: a job acknowledged on a node other than
the one that delivered it is counted once, where it was acknowledged); the
chart is a picture of the same numbers, never computed separately.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .read import read_jobs

__all__ = ["QueueFigures", "Report", "queue_report", "plot_report"]


@dataclass(frozen=True)
class QueueFigures:
    queue: str
    finished: int
    acked: int
    expired: int
    deleted: int
    dead: int
    jobs_per_second: float
    wait_p50_s: float | None
    wait_p95_s: float | None
    deliveries_per_job: float
    redeliveries: int
    nacks: int
    dead_letters_waiting: int


@dataclass(frozen=True)
class Report:
    queues: list[QueueFigures]
    # queue -> [(bucket start as epoch seconds, jobs finished in it)]
    timeline: dict[str, list[tuple[float, int]]]
    bucket_seconds: int

    def as_dict(self) -> dict[str, Any]:
        return {"queues": [asdict(q) for q in self.queues], "timeline": self.timeline,
                "bucket_seconds": self.bucket_seconds}


def queue_report(spark: Any, nodes: str | Sequence[str] | None = None) -> Report:
    """Per-queue figures from the history of ``nodes`` (see the module doc)."""
    from pyspark.sql import functions as F

    history = read_jobs(spark, nodes, "history").withColumn(
        "wait_s", F.col("delivered_at").cast("double") - F.col("created_at").cast("double"))
    dead_letters = read_jobs(spark, nodes, "dead_letters")
    outcome = F.col("outcome")
    figures = (history.groupBy("queue").agg(
        F.count(F.lit(1)).alias("finished"),
        F.sum(outcome.isin("acked", "fastacked").cast("int")).alias("acked"),
        F.sum((outcome == "expired").cast("int")).alias("expired"),
        F.sum((outcome == "deleted").cast("int")).alias("deleted"),
        F.sum((outcome == "dead").cast("int")).alias("dead"),
        F.min("finished_at").cast("double").alias("first"),
        F.max("finished_at").cast("double").alias("last"),
        F.percentile_approx("wait_s", [0.5, 0.95], 1000).alias("wait"),
        F.avg("deliveries").alias("deliveries"),
        F.sum("additional_deliveries").alias("redeliveries"),
        F.sum("nacks").alias("nacks"),
    ).collect())
    waiting = {r["queue"]: r["count"] for r in dead_letters.groupBy("queue").count().collect()}
    queues = []
    first = min((r["first"] for r in figures), default=None)
    last = max((r["last"] for r in figures), default=None)
    for r in sorted(figures, key=lambda row: row["queue"]):
        span = max((r["last"] or 0) - (r["first"] or 0), 1.0)
        wait = r["wait"] or [None, None]
        queues.append(QueueFigures(
            r["queue"], r["finished"], r["acked"], r["expired"], r["deleted"], r["dead"],
            round(r["acked"] / span, 3), _round(wait[0]), _round(wait[1]),
            round(r["deliveries"] or 0.0, 3), int(r["redeliveries"] or 0), int(r["nacks"] or 0),
            int(waiting.pop(r["queue"], 0))))
    for queue, count in sorted(waiting.items()):  # queues with dead letters and no history
        queues.append(QueueFigures(queue, 0, 0, 0, 0, 0, 0.0, None, None, 0.0, 0, 0, int(count)))
    bucket = _bucket_seconds(first, last)
    timeline: dict[str, list[tuple[float, int]]] = {}
    if first is not None:
        rows = (history.groupBy("queue", F.window("finished_at", f"{bucket} seconds").alias("w"))
                .count().select("queue", F.col("w.start").cast("double").alias("start"), "count")
                .orderBy("queue", "start").collect())
        for row in rows:
            timeline.setdefault(row["queue"], []).append((row["start"], row["count"]))
    return Report(queues, timeline, bucket)


def _round(value: float | None) -> float | None:
    return None if value is None else round(float(value), 4)


def _bucket_seconds(first: float | None, last: float | None) -> int:
    """About 60 buckets over the period, in whole seconds."""
    if first is None or last is None:
        return 60
    return max(1, math.ceil((last - first) / 60))


def plot_report(report: Report, path: str | Path) -> Path:
    """Draw the report: jobs finished over time, and wait times, per queue."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    start = min((points[0][0] for points in report.timeline.values() if points), default=0.0)
    for queue, points in sorted(report.timeline.items()):
        left.plot([(t - start) / 60 for t, _ in points],
                  [n / report.bucket_seconds for _, n in points], marker="o", markersize=3,
                  label=queue)
    left.set_title("jobs finished per second")
    left.set_xlabel("minutes since the first")
    left.set_ylabel("jobs/s")
    if report.timeline:
        left.legend(fontsize="small")
    names = [q.queue for q in report.queues]
    p50 = [q.wait_p50_s or 0.0 for q in report.queues]
    p95 = [q.wait_p95_s or 0.0 for q in report.queues]
    positions = range(len(names))
    right.bar([p - 0.2 for p in positions], p50, width=0.4, label="p50")
    right.bar([p + 0.2 for p in positions], p95, width=0.4, label="p95")
    right.set_xticks(list(positions), names, rotation=30, ha="right", fontsize="small")
    right.set_title("wait from creation to delivery")
    right.set_ylabel("seconds")
    right.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
