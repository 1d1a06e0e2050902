"""Cluster commands: ``pgq node start|stop|status`` and
``pgq cluster meet|nodes|forget|leaving|leave``.

The CLI reaches a node through its database, like any client: commands
for the node process go through its outbox (and doorbell).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from ..errors import PgqError
from .common import emit, fail, node_dsn


def _node_target(func):  # type: ignore[no-untyped-def]
    func = click.option("--dsn", help="The node's database DSN.")(func)
    func = click.option("--data", type=click.Path(file_okay=False),
                        help="The node's data directory.")(func)
    return func


def _tell_node(dsn: str, kind: str, arg: str | None = None, queue: str | None = None) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO pgq.outbox (kind, queue, arg) VALUES (%s, %s, %s)", (kind, queue, arg))
        conn.execute("SELECT pg_notify('pgq_node', '')")


def _cluster_state(dsn: str) -> dict[str, Any]:
    import psycopg

    with psycopg.connect(dsn, connect_timeout=5) as conn:
        row = conn.execute("SELECT node_id, active, leaving, reachable_nodes, bus_host, bus_port "
                           "FROM pgq.cluster_state").fetchone()
    assert row is not None
    keys = ("id", "active", "leaving", "reachable_nodes", "bus_host", "bus_port")
    return dict(zip(keys, row, strict=True))


@click.group("node")
def node_group() -> None:
    """Run and inspect cluster nodes (a node = one database + one node process)."""


@node_group.command("start")
@click.option("--name", required=True, help="Node name (for logs and `cluster nodes`).")
@click.option("--data", type=click.Path(file_okay=False),
              help="Node directory: embedded PostgreSQL, node.json, secret.")
@click.option("--dsn", help="Use this database instead of an embedded one.")
@click.option("--bus", required=True, help="Bus address HOST:PORT this node listens on.")
@click.option("--join", "joins", multiple=True, help="HOST:PORT of a node to join (repeatable).")
@click.option("--secret-file", type=click.Path(dir_okay=False, exists=True),
              help="File holding the cluster secret (default: $PGQ_CLUSTER_SECRET or DIR/cluster.secret).")
@click.option("--metrics", metavar="HOST:PORT", envvar="PGQ_METRICS",
              help="Serve Prometheus metrics on this address.")
def node_start(name: str, data: str | None, dsn: str | None, bus: str, joins: tuple[str, ...],
               secret_file: str | None, metrics: str | None) -> None:
    """Start a node in the foreground (stop it with SIGTERM or `pgq node stop`)."""
    from ..cluster.process import run_node

    if not data and not dsn:
        raise click.UsageError("give the node a database: --data DIR or --dsn DSN")
    try:
        sys.exit(run_node(name, bus, data=data, dsn=dsn, joins=joins, secret_file=secret_file,
                          metrics=metrics))
    except PgqError as exc:
        fail(exc)


@node_group.command("stop")
@click.option("--data", type=click.Path(file_okay=False), required=True, help="Node directory.")
@click.option("--timeout", type=float, default=30.0, show_default=True, help="Seconds to wait.")
@click.option("--postgres/--no-postgres", default=True, show_default=True,
              help="Also stop the node's embedded PostgreSQL.")
def node_stop(data: str, timeout: float, postgres: bool) -> None:
    """Stop the node running in DIR (SIGTERM, then wait)."""
    import signal
    import time

    from .. import embedded
    from ..cluster.process import read_state

    state = read_state(Path(data)) or {}
    pid = state.get("pid")
    if pid and state.get("state") != "stopped":
        try:
            os.kill(int(pid), signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                os.kill(int(pid), 0)
                time.sleep(0.1)
            fail(PgqError(f"node pid {pid} did not stop within {timeout:g} s"))
        except ProcessLookupError:
            pass
    if postgres and (Path(data) / "postgres").exists():
        embedded.stop(Path(data) / "postgres")
    click.echo("stopped")


@node_group.command("status")
@_node_target
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def node_status(data: str | None, dsn: str | None, as_json: bool) -> None:
    """Report a node's id, DSN, bus address and state."""
    from ..cluster.process import read_state

    info: dict[str, Any] = {}
    if data:
        info.update(read_state(Path(data)) or {})
        pid = info.get("pid")
        if pid and info.get("state") in ("starting", "running"):
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                info["state"] = "dead"
    try:
        target = node_dsn(data, dsn)
        cluster = _cluster_state(target)
        info.update(dsn=target, id=cluster["id"], active=cluster["active"],
                    leaving=cluster["leaving"], reachable_nodes=cluster["reachable_nodes"])
        if cluster["bus_host"]:
            info.setdefault("bus", f"{cluster['bus_host']}:{cluster['bus_port']}")
    except click.UsageError:
        if not info:
            raise
    except Exception as exc:  # database down: report what the state file says
        info["database_error"] = str(exc).splitlines()[0]
    if not info:
        fail(PgqError("no node found"))
    emit(info, as_json)


@click.group("cluster")
def cluster_group() -> None:
    """Cluster membership: meet, nodes, forget, leaving, leave."""


@cluster_group.command("meet")
@click.argument("address")
@_node_target
def cluster_meet(address: str, data: str | None, dsn: str | None) -> None:
    """Make the node contact another node at ADDRESS (HOST:PORT) and join its cluster."""
    from ..cluster.process import parse_address

    try:
        parse_address(address)
        _tell_node(node_dsn(data, dsn), "meet", address)
        click.echo(f"meeting {address}")
    except PgqError as exc:
        fail(exc)


@cluster_group.command("nodes")
@_node_target
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def cluster_nodes(data: str | None, dsn: str | None, as_json: bool) -> None:
    """List the nodes this node knows, with their state."""
    import psycopg

    with psycopg.connect(node_dsn(data, dsn)) as conn:
        rows = conn.execute("SELECT id, name, host, port, myself, status, leaving, priority "
                            "FROM pgq.cluster_nodes ORDER BY NOT myself, id").fetchall()
    nodes = [dict(zip(("id", "name", "host", "port", "myself", "status", "leaving", "priority"),
                      r, strict=True)) for r in rows]
    if as_json:
        click.echo(json.dumps(nodes))
        return
    for n in nodes:
        flags = ("myself " if n["myself"] else "") + ("leaving" if n["leaving"] else "")
        click.echo(f"{n['id']}  {n['name']:<12} {n['host']}:{n['port']:<6} {n['status']:<8} {flags}")


@cluster_group.command("forget")
@click.argument("node_id")
@_node_target
def cluster_forget(node_id: str, data: str | None, dsn: str | None) -> None:
    """Remove NODE_ID from the cluster (every node refuses it for a minute)."""
    from ..ids import is_node_id

    if not is_node_id(node_id):
        fail(PgqError(f"{node_id!r} is not a 40-hex node id (see `pgq cluster nodes`)"))
    _tell_node(node_dsn(data, dsn), "forget", node_id)
    click.echo(f"forgetting {node_id}")


@cluster_group.command("leaving")
@click.argument("flag", type=click.Choice(["yes", "no"]))
@_node_target
def cluster_leaving(flag: str, data: str | None, dsn: str | None) -> None:
    """Mark the node as leaving (it takes no new copies and drains) or not."""
    import psycopg

    target = node_dsn(data, dsn)
    with psycopg.connect(target, autocommit=True) as conn:
        conn.execute("INSERT INTO pgq.meta VALUES ('leaving', %s) "
                     "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                     ("true" if flag == "yes" else "false",))
    _tell_node(target, "leaving", flag)
    click.echo(f"leaving: {flag}")


@cluster_group.command("leave")
@_node_target
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds to wait.")
def cluster_leave(data: str | None, dsn: str | None, timeout: float) -> None:
    """Mark the node leaving and wait until it holds no jobs; then it is safe to stop."""
    import time

    import psycopg

    target = node_dsn(data, dsn)
    with psycopg.connect(target, autocommit=True) as conn:
        conn.execute("INSERT INTO pgq.meta VALUES ('leaving', 'true') "
                     "ON CONFLICT (key) DO UPDATE SET value = excluded.value")
        myself = conn.execute("SELECT pgq.meta_value('node_id')").fetchone()[0]  # type: ignore[index]
    _tell_node(target, "leaving", "yes")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    deadline = time.monotonic() + timeout
    held = -1
    query = ("SELECT (SELECT count(*) FROM pgq.jobs WHERE nodes_delivered IS NULL"
             " OR %(me)s = ANY (nodes_delivered)) + (SELECT count(*) FROM pgq.acks)")
    interactive = sys.stderr.isatty()
    with psycopg.connect(target, autocommit=True) as conn, \
            Progress(TextColumn("draining"), BarColumn(), MofNCompleteColumn(),
                     transient=True, disable=not interactive) as progress:
        start = conn.execute(query, {"me": myself}).fetchone()[0]  # type: ignore[index]
        task = progress.add_task("drain", total=max(start, 1))
        while time.monotonic() < deadline:
            held = conn.execute(query, {"me": myself}).fetchone()[0]  # type: ignore[index]
            progress.update(task, completed=max(start - held, 0))
            if held == 0:
                break
            if not interactive:
                click.echo(f"waiting: the node still holds {held} jobs or acks", err=True)
            time.sleep(1.0)
    if held == 0:
        click.echo("the node holds no jobs: it is safe to stop it now")
        return
    fail(PgqError(f"the node still holds {held} jobs or acks after {timeout:g} s"))


