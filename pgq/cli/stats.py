"""``pgq stats``: a live table of queues and nodes, with rates.

Rates (jobs in and out per second) are the change of each queue's counters
between two snapshots over the time between them, so even ``--once`` and
``--json`` take two snapshots ``--interval`` apart. The live view quits on
``q`` (or Ctrl-C); keys are read without echo only while it runs, and the
terminal is restored however it ends.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import sys
import time
from collections.abc import Iterator
from typing import Any

import click
import psycopg
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ..arguments import MAX_COUNT
from .common import console, handles_errors, target_options, to_json, wide_console

QUEUES = """
SELECT queue, length, active, jobs_in, jobs_out, round(oldest_age_seconds::numeric, 1) AS oldest,
       paused, blocked
FROM pgq.queue_stats ORDER BY length DESC, queue LIMIT %s
"""
NODES = """
SELECT name, id, host || ':' || port AS bus, status, leaving, myself FROM pgq.cluster_nodes
ORDER BY NOT myself, name
"""
QUEUE_COLUMNS = ("queue", "length", "active", "jobs_in", "jobs_out", "oldest_age_seconds",
                 "paused", "blocked")
NODE_COLUMNS = ("name", "id", "bus", "status", "leaving", "myself")


def _snapshot(dsn: str, limit: int) -> dict[str, Any]:
    with psycopg.connect(dsn, connect_timeout=5) as conn:
        queues = conn.execute(QUEUES, (limit,)).fetchall()
        nodes = conn.execute(NODES).fetchall()
    return {"at": dt.datetime.now(dt.UTC), "clock": time.monotonic(),
            "queues": [dict(zip(QUEUE_COLUMNS, r, strict=True)) for r in queues],
            "nodes": [dict(zip(NODE_COLUMNS, r, strict=True)) for r in nodes]}


def _with_rates(now: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    """``now`` with ``in_per_s`` / ``out_per_s`` per queue (None without a
    previous snapshot, or for a queue it did not show)."""
    previous = {q["queue"]: q for q in before["queues"]} if before else {}
    elapsed = now["clock"] - before["clock"] if before else 0.0
    for queue in now["queues"]:
        old = previous.get(queue["queue"])
        for column, rate in (("jobs_in", "in_per_s"), ("jobs_out", "out_per_s")):
            queue[rate] = (round(max(queue[column] - old[column], 0) / elapsed, 1)
                           if old is not None and elapsed > 0 else None)
    return now


def _render(snapshot: dict[str, Any], live: bool) -> Group:
    stamp = snapshot["at"].astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    title = f"queues at {stamp}" + (" (q to quit)" if live else "")
    queues = Table(title=title, show_edge=False, header_style="bold")
    columns = ("queue", "length", "active", "in/s", "out/s", "jobs in", "jobs out", "oldest (s)",
               "paused", "blocked")
    for column in columns:
        queues.add_column(column, justify="left" if column in ("queue", "paused") else "right")
    for q in snapshot["queues"]:
        values = (q["queue"], q["length"], q["active"], q["in_per_s"], q["out_per_s"], q["jobs_in"],
                  q["jobs_out"], q["oldest_age_seconds"], q["paused"], q["blocked"])
        queues.add_row(*(Text("" if v is None else str(v)) for v in values))  # names are data, not markup
    parts: list[Any] = [queues]
    if snapshot["nodes"]:
        nodes = Table(title="nodes", show_edge=False, header_style="bold")
        for column in ("name", "id", "bus", "status", "leaving"):
            nodes.add_column(column)
        for n in snapshot["nodes"]:
            style = {"alive": "green", "suspect": "yellow"}.get(n["status"], "red")
            nodes.add_row(Text(n["name"] + (" *" if n["myself"] else "")), n["id"][:12], Text(n["bus"]),
                          Text(n["status"], style=style), "yes" if n["leaving"] else "")
        parts.append(nodes)
    return Group(*parts)


def _json(snapshot: dict[str, Any]) -> str:
    return to_json({key: value for key, value in snapshot.items() if key != "clock"})


@contextlib.contextmanager
def _keys() -> Iterator[Any]:
    """A function waiting up to N seconds for a key: returns it, or ''.
    Reads the terminal without echo or line buffering while in use; without
    a terminal on stdin it only waits."""
    if not sys.stdin.isatty():
        def sleep(seconds: float) -> str:
            time.sleep(seconds)
            return ""
        yield sleep
        return
    import select
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def wait(seconds: float) -> str:
        ready, _, _ = select.select([fd], [], [], seconds)
        return sys.stdin.read(1) if ready else ""
    try:
        yield wait
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@click.command()
@click.option("--interval", type=click.FloatRange(0.1, 3600), default=1.0, show_default=True,
              help="Seconds between refreshes (and over which rates are measured).")
@click.option("--once", is_flag=True, help="Print one snapshot (rates over --interval) and exit.")
@click.option("--limit", type=click.IntRange(1, MAX_COUNT), default=30, show_default=True,
              help="Most queues shown.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one snapshot (rates over --interval) as JSON and exit.")
@target_options
@handles_errors
def stats(interval: float, once: bool, limit: int, as_json: bool, dsn: str | None, data: str | None) -> None:
    """Live table of queues (length, rates, oldest job) and nodes; q or Ctrl-C quits.
    Piped or redirected, a snapshot per --interval."""
    from .common import client_for

    with client_for(dsn, data) as client:
        target = client.dsn
    if as_json or once:
        first = _snapshot(target, limit)
        time.sleep(interval)  # rates need a second snapshot
        snapshot = _with_rates(_snapshot(target, limit), first)
        click.echo(_json(snapshot)) if as_json else wide_console().print(_render(snapshot, live=False))
        return
    previous = _with_rates(_snapshot(target, limit), None)
    if not sys.stdout.isatty():  # (rich's is_terminal follows FORCE_COLOR, set in CIs)
        # Piped or redirected (`pgq stats | grep`, `> log`): a live view
        # prints only when it stops, so nothing came out. A snapshot per
        # interval instead, until Ctrl-C or a signal.
        printer = wide_console()
        while True:
            time.sleep(interval)
            previous = _with_rates(_snapshot(target, limit), previous)
            printer.print(_render(previous, live=False))
            sys.stdout.flush()
    with _keys() as key, Live(_render(previous, live=True), console=console,
                              refresh_per_second=4) as view:
        while key(interval).lower() != "q":
            previous = _with_rates(_snapshot(target, limit), previous)
            view.update(_render(previous, live=True))
