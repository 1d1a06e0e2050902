"""``pgq stats``: a live table of queues and nodes."""

from __future__ import annotations

import time
from typing import Any

import click
import psycopg
from rich.console import Group
from rich.live import Live
from rich.table import Table

from .common import console, handles_errors, target_options, to_json

QUEUES = """
SELECT queue, length, active, jobs_in, jobs_out, round(oldest_age_seconds::numeric, 1),
       paused, blocked
FROM pgq.queue_stats ORDER BY length DESC, queue LIMIT %s
"""
NODES = """
SELECT name, id, host || ':' || port, status, leaving, myself FROM pgq.cluster_nodes
ORDER BY NOT myself, name
"""


def _snapshot(dsn: str, limit: int) -> dict[str, list[Any]]:
    with psycopg.connect(dsn, connect_timeout=5) as conn:
        queues = conn.execute(QUEUES, (limit,)).fetchall()
        nodes = conn.execute(NODES).fetchall()
    return {"queues": queues, "nodes": nodes}


def _render(snapshot: dict[str, list[Any]]) -> Group:
    queues = Table(title="queues", show_edge=False, header_style="bold")
    for column in ("queue", "length", "active", "jobs in", "jobs out", "oldest (s)", "paused", "blocked"):
        queues.add_column(column, justify="right" if column not in ("queue", "paused") else "left")
    for row in snapshot["queues"]:
        queues.add_row(*("" if v is None else str(v) for v in row))
    parts: list[Any] = [queues]
    if snapshot["nodes"]:
        nodes = Table(title="nodes", show_edge=False, header_style="bold")
        for column in ("name", "id", "bus", "status", "leaving"):
            nodes.add_column(column)
        for name, node_id, bus, status, leaving, myself in snapshot["nodes"]:
            style = {"alive": "green", "suspect": "yellow"}.get(status, "red")
            nodes.add_row(name + (" *" if myself else ""), node_id[:12], bus,
                          f"[{style}]{status}[/]", "yes" if leaving else "")
        parts.append(nodes)
    return Group(*parts)


@click.command()
@click.option("--interval", type=float, default=1.0, show_default=True, help="Seconds between refreshes.")
@click.option("--once", is_flag=True, help="Print one snapshot and exit.")
@click.option("--limit", type=int, default=30, show_default=True, help="Most queues shown.")
@click.option("--json", "as_json", is_flag=True, help="Print one snapshot as JSON and exit.")
@target_options
@handles_errors
def stats(interval: float, once: bool, limit: int, as_json: bool, dsn: str | None, data: str | None) -> None:
    """Live table of queues and nodes (Ctrl-C to quit)."""
    from .common import client_for

    with client_for(dsn, data) as client:
        target = client.dsn
    if as_json:
        snap = _snapshot(target, limit)
        click.echo(to_json({
            "queues": [dict(zip(("queue", "length", "active", "jobs_in", "jobs_out",
                                 "oldest_age_seconds", "paused", "blocked"), r, strict=True))
                       for r in snap["queues"]],
            "nodes": [dict(zip(("name", "id", "bus", "status", "leaving", "myself"), r, strict=True))
                      for r in snap["nodes"]],
        }))
        return
    if once:
        console.print(_render(_snapshot(target, limit)))
        return
    with Live(_render(_snapshot(target, limit)), console=console, refresh_per_second=4) as live:
        while True:
            time.sleep(interval)
            live.update(_render(_snapshot(target, limit)))
