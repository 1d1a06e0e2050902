"""``pgq spark``: the example data pipeline (needs ``pip install 'pgq-disque[spark]'``).

``pgq spark ingest INPUT --queue Q`` turns the rows of Parquet, CSV or JSON
files into jobs (:func:`pgq.spark.write_jobs`); ``pgq spark report`` prints
per-queue throughput, wait times, deliveries and dead letters and draws
them as a PNG (:mod:`pgq.spark.report`). Both show Spark's progress.

Invariant: ``ingest`` names its ingestion after the input (path, size and
modification time of local files; the URL otherwise) unless ``--ingest-id``
is given, so running the same command again on the same input finishes a
failed run and never adds a job twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from ..arguments import MAX_REPLICATE
from ..errors import PgqError, first_line
from .common import SECONDS, given_dsn, handles_errors, progress_console, table, to_json

FORMATS = ("parquet", "csv", "json")


@click.group("spark")
def spark_group() -> None:
    """Bulk ingestion and analytics with Spark (JDBC to the node databases)."""


def _nodes_option(func: Any) -> Any:
    return click.option("--node", "--dsn", "nodes", multiple=True, metavar="DSN",
                        callback=given_dsn,
                        help="A node database (repeat for several; default: $PGQ_DSN, "
                             "else the embedded server).")(func)


def _master_option(func: Any) -> Any:
    return click.option("--master", envvar="PGQ_SPARK_MASTER",
                        help="Spark master (default: $PGQ_SPARK_MASTER, else local[*]).")(func)


@contextmanager
def _spark_progress(spark: Any, enabled: bool) -> Iterator[Any]:
    """A progress bar fed by Spark's status tracker (tasks of running stages)."""
    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                  TextColumn("{task.fields[tasks]}"), TimeElapsedColumn(),
                  disable=not enabled, transient=False, console=progress_console) as progress:
        task = progress.add_task("starting", total=None, tasks="")
        stop = threading.Event()

        def poll() -> None:
            tracker = spark.sparkContext.statusTracker()
            while not stop.wait(0.3):
                done = total = 0
                for stage in tracker.getActiveStageIds():
                    info = tracker.getStageInfo(stage)
                    if info is not None:
                        done += info.numCompletedTasks
                        total += info.numTasks
                if total:
                    progress.update(task, completed=done, total=total, tasks=f"{done}/{total} tasks")

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()

        def phase(message: str) -> None:
            progress.update(task, description=message, completed=0, total=None, tasks="")

        try:
            yield phase
        finally:
            stop.set()
            watcher.join(1)
            progress.update(task, description="done", completed=1, total=1, tasks="")


def _default_ingest_id(inputs: tuple[str, ...], queue: str) -> str:
    # surrogateescape: a file name need not be UTF-8 (it was a traceback)
    digest = hashlib.sha256(queue.encode(errors="surrogateescape"))
    for item in inputs:
        digest.update(item.encode(errors="surrogateescape"))
        path = Path(item)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if file.exists():
                stat = file.stat()
                digest.update(f"{file}:{stat.st_size}:{stat.st_mtime_ns}".encode(
                    errors="surrogateescape"))
    # At most 200 characters (what an ingest ID may be): a queue name of 184
    # or more (names go to 512 bytes) made one the ingestion refused, for an
    # option never given, once the JVM had started (found by a review). The
    # digest covers the whole name, so a shortened one stays distinct, and
    # shorter names keep the ID they had (a re-run finds its ingestion).
    return f"{queue[:183]}-{digest.hexdigest()[:16]}"


def _input_format(inputs: tuple[str, ...], fmt: str | None) -> str:
    if fmt is not None:
        return fmt
    suffixes = {Path(i).suffix.lower().lstrip(".") for i in inputs}
    suffixes = {"json" if s == "jsonl" else s for s in suffixes}
    if len(suffixes) != 1 or not suffixes <= set(FORMATS):
        raise click.UsageError("cannot tell the input format from the file names: pass --format")
    return suffixes.pop()


def _read_input(spark: Any, inputs: tuple[str, ...], fmt: str) -> Any:
    reader = spark.read
    if fmt == "csv":  # RFC 4180: a header line, quotes doubled inside quoted fields
        reader = reader.option("header", "true").option("escape", '"')
    try:
        return reader.format(fmt).load(list(inputs))
    except Exception as exc:  # Spark's own (a path it cannot read, a bad file): one line
        raise PgqError(f"Spark cannot read {', '.join(inputs)} as {fmt}: {first_line(exc)}") \
            from None


@spark_group.command("ingest")
@click.argument("inputs", nargs=-1, required=True)
@click.option("--queue", required=True, help="Queue the jobs go to.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), help="Input format (default: from the extension).")
@click.option("--body-column", default="body", show_default=True,
              help="Column holding the job body (string or binary).")
@click.option("--replicate", type=click.IntRange(1, MAX_REPLICATE),
              help="Copies per job (default: min(3, the cluster's nodes): give a --node each; 1 alone).")
@click.option("--delay", type=SECONDS, default=0, show_default=True, help="Seconds before jobs are queued.")
@click.option("--retry", type=SECONDS, help="Seconds before an unacknowledged job is re-queued.")
@click.option("--ttl", type=SECONDS, help="Seconds a job lives (default 86400).")
@click.option("--ingest-id", help="Name of this ingestion (default: derived from the local "
              "input files; required for a URL).")
@click.option("--partitions", type=click.IntRange(1), help="Repartition the input into this many partitions first.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_nodes_option
@_master_option
@handles_errors
def ingest(inputs: tuple[str, ...], queue: str, fmt: str | None, body_column: str,  # type: ignore[no-untyped-def]
           replicate, delay, retry, ttl, ingest_id, partitions, as_json, nodes, master) -> None:
    """Turn the rows of INPUTS (Parquet, CSV or JSON files or directories) into jobs.

    Running it again on the same input is safe: it completes a failed run
    and adds nothing that was added.
    """
    from ..spark import spark_session, write_jobs

    fmt = _input_format(inputs, fmt)  # before Spark starts: a usage error costs nothing
    for item in inputs:  # a local path (no URL scheme) that is not there: say so now
        if "://" not in item and not Path(item).exists():
            raise click.UsageError(f"no such file or directory: {item}")
    if ingest_id is None and any("://" in item for item in inputs):
        # The default id hashes local files' sizes and times; of a URL only
        # its text, so a daily run on one prefix said "done already" and
        # added nothing new.
        raise click.UsageError("an input given as a URL needs --ingest-id (the same id for a "
                               "run again of the same data, a new one for new data)")
    ingest_id = ingest_id or _default_ingest_id(inputs, queue)
    spark = spark_session(master, app_name="pgq-ingest")
    try:
        df = _read_input(spark, inputs, fmt)
        with _spark_progress(spark, enabled=not as_json) as phase:
            result = write_jobs(df, queue, nodes=list(nodes) or None, replicate=replicate,
                                delay=delay, retry=retry, ttl=ttl, body_col=body_column,
                                ingest_id=ingest_id, partitions=partitions, progress=phase)
    finally:
        spark.stop()
    data = {"ingest_id": result.ingest_id, "queue": result.queue, "jobs": result.jobs,
            "replicate": result.replicate, "already_done": result.already_done,
            "copies_by_node": result.copies_by_node, "seconds": round(result.seconds, 2)}
    if as_json:
        click.echo(to_json(data))
    elif result.already_done:
        click.echo(f"ingestion {result.ingest_id} was done already: nothing added")
    else:
        rate = result.jobs / result.seconds if result.seconds else 0.0
        click.echo(f"added {result.jobs:,} jobs to {queue} (replicate={result.replicate}) in "
                   f"{result.seconds:.1f} s ({rate:,.0f} jobs/s); ingestion id {result.ingest_id}")


@spark_group.command("report")
@click.option("--out", type=click.Path(file_okay=False), default="pgq-report", show_default=True,
              help="Directory for report.png and report.json.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@_nodes_option
@_master_option
@handles_errors
def report(out: str, as_json: bool, nodes: tuple[str, ...], master: str | None) -> None:
    """Per-queue throughput, wait times, deliveries and dead letters, from job history."""
    from ..spark import spark_session
    from ..spark.report import plot_report, queue_report

    spark = spark_session(master, app_name="pgq-report")
    started = time.perf_counter()
    try:
        with _spark_progress(spark, enabled=not as_json) as phase:
            phase("reading history")
            figures = queue_report(spark, list(nodes) or None)
    finally:
        spark.stop()
    os.makedirs(out, exist_ok=True)
    chart = plot_report(figures, Path(out) / "report.png")
    (Path(out) / "report.json").write_text(json.dumps(figures.as_dict(), indent=2))
    if as_json:
        click.echo(to_json(figures.as_dict()))
        return
    columns = ("queue", "finished", "acked", "expired", "dead", "jobs/s", "wait p50 s",
               "wait p95 s", "deliveries", "redelivered", "nacks", "dead letters")
    rows = [(q.queue, q.finished, q.acked, q.expired, q.dead, q.jobs_per_second,
             "" if q.wait_p50_s is None else q.wait_p50_s, "" if q.wait_p95_s is None else q.wait_p95_s,
             q.deliveries_per_job, q.redeliveries, q.nacks, q.dead_letters_waiting)
            for q in figures.queues]
    if not rows:
        click.echo("no job history yet: jobs appear here once acknowledged, expired or dead-lettered")
    else:
        table(rows, columns, False, title="pgq queues")
    click.echo(f"chart: {chart}  ({time.perf_counter() - started:.1f} s)")
