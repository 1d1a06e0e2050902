"""Cluster commands: ``pgq node start|stop|status`` and
``pgq cluster meet|nodes|forget|leaving|leave``.

The CLI reaches a node through its database, like any client: commands
for the node process go through its outbox (and doorbell).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from .. import contracts
from ..errors import DatabaseUnavailableError, PgqError
from .common import (
    SECONDS,
    check_metrics,
    emit,
    fail,
    fronts_of,
    fronts_options,
    given_dsn,
    handles_errors,
    json_logs_option,
    json_option,
    node_dsn,
    progress_console,
    report,
    to_json,
)

F = TypeVar("F", bound=Callable[..., Any])


def _node_target(func: F) -> F:
    func = click.option("--dsn", callback=given_dsn, help="The node's database DSN.")(func)
    func = click.option("--data", type=click.Path(file_okay=False),
                        help="The node's data directory.")(func)
    return func


def _tell_node(dsn: str, kind: str, arg: str | None = None, queue: str | None = None) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        conn.execute(contracts.TELL_NODE, {"kind": kind, "queue": queue, "arg": arg})


def _require_node(dsn: str) -> str:
    """``dsn``, refused unless a node process ever served that database:
    the commands that leave word for the node process would do nothing on
    a plain one but say they did (and a plain database marked leaving kept
    every add from being stored)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        row = conn.execute(contracts.IS_MEMBER).fetchone()
    if not row or not row[0]:
        fail(PgqError("this database is not a cluster node (no node process ever served it): "
                      "start one with `pgq node start`, or give a node's --data or --dsn"))
    return dsn


def _set_leaving(dsn: str, leaving: bool) -> str:
    """The flag in the node's database and the word to its process, in one
    transaction (as CLUSTER LEAVING's): apart, a failure between the two
    left the database refusing copies while its process never told the
    cluster it was leaving (found by a review of the protocol's doc).
    Returns the node's id."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        with conn.transaction():
            conn.execute(contracts.SET_LEAVING, {"leaving": leaving})
            conn.execute(contracts.TELL_NODE, {"kind": contracts.OUTBOX_LEAVING, "queue": None,
                                               "arg": "yes" if leaving else "no"})
        myself = conn.execute(contracts.NODE_ID).fetchone()
    return str(myself[0]) if myself else ""


def _cluster_state(dsn: str) -> dict[str, Any]:
    import psycopg
    from psycopg.rows import dict_row

    with psycopg.connect(dsn, connect_timeout=5, row_factory=dict_row) as conn:
        row = conn.execute(contracts.CLUSTER_STATE).fetchone()
    assert row is not None
    return row


@click.group("node")
def node_group() -> None:
    """Run and inspect cluster nodes (a node = one database + one node process)."""


@node_group.command("start")
@click.option("--name", required=True, help="Node name (for logs and `cluster nodes`).")
@click.option("--data", type=click.Path(file_okay=False),
              help="Node directory: embedded PostgreSQL, node.json, secret.")
@click.option("--dsn", callback=given_dsn, help="Use this database instead of an embedded one.")
@click.option("--bus", required=True, help="Bus address HOST:PORT this node listens on.")
@click.option("--join", "joins", multiple=True, help="HOST:PORT of a node to join (repeatable).")
@click.option("--secret-file", type=click.Path(dir_okay=False, exists=True),
              help="File holding the cluster secret (default: $PGQ_CLUSTER_SECRET or DIR/cluster.secret).")
@click.option("--metrics", metavar="HOST:PORT", envvar="PGQ_METRICS",
              help="Serve Prometheus metrics on this address.")
@click.option("--advertise-dsn", metavar="DSN|none", envvar="PGQ_ADVERTISE_DSN",
              help="The libpq DSN other nodes' clients use to write copies of replicated jobs "
                   "straight into this node's database (default: the DSN this node uses, "
                   "password included; 'none': copies go through the node processes).")
@fronts_options
@click.option("--detach", is_flag=True,
              help="Run in the background (log in DIR/node.log) and return once the node serves.")
@click.option("--wait-timeout", type=SECONDS, default=90.0, show_default=True,
              help="With --detach: seconds to wait for the node to serve.")
@json_logs_option
@handles_errors
def node_start(name: str, data: str | None, dsn: str | None, bus: str, joins: tuple[str, ...],
               secret_file: str | None, metrics: str | None, advertise_dsn: str | None,
               http_listen: str | None,
               resp_listen: str | None, token_file: str | None, dashboard_listen: str | None,
               dashboard_token_file: str | None, detach: bool, wait_timeout: float) -> None:
    """Start a node (in the foreground; stop it with SIGTERM or `pgq node stop`).
    With --http, --resp or --dashboard it also serves other programs on its
    database, as `pgq serve` does."""
    from ..cluster.process import run_node
    from ..dsn import libpq_url

    if not data and not dsn:
        raise click.UsageError("give the node a database: --data DIR or --dsn DSN")
    if dsn:
        libpq_url(dsn)  # a typed error now (a DSN that is not UTF-8 was a traceback)
    # (--advertise-dsn, which may be 'none', is checked by run_node before anything starts)
    check_metrics(metrics)
    fronts = fronts_of(http_listen, resp_listen, token_file, dashboard_listen, dashboard_token_file)
    if detach:
        if not data:
            raise click.UsageError("--detach needs --data DIR (its node.log and node.json)")
        _start_detached(Path(data), wait_timeout)
        return
    try:
        sys.exit(run_node(name, bus, data=data, dsn=dsn, joins=joins, secret_file=secret_file,
                          metrics=metrics, fronts=fronts, advertise_dsn=advertise_dsn))
    except PgqError as exc:
        fail(exc)


def _start_detached(data: Path, timeout: float) -> None:
    """Run this same `node start` without --detach in a new session."""
    import subprocess

    from ..cluster.nodedir import NodeDirectory

    args = [a for a in sys.argv[1:] if a != "--detach"]
    directory = NodeDirectory(data.absolute())
    with directory.open_file(directory.log_file, "ab") as log:
        child = subprocess.Popen([sys.executable, "-m", "pgq.cli", *args], stdin=subprocess.DEVNULL,
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        state = _wait_serving(directory, timeout, child)
    except KeyboardInterrupt:  # it runs on, in a session of its own: say where
        click.echo(f"interrupted; the node (pid {child.pid}) goes on starting: "
                   f"`pgq node stop --data {data}` stops it", err=True)
        raise
    as_json = os.environ.get("PGQ_LOG_FORMAT") == "json"  # set by --json
    report({"name": state.get("name"), "pid": child.pid, "id": state.get("id"), "bus": state.get("bus"),
            "log": str(directory.log_file)}, as_json,
           f"{state.get('name')} serves (pid {child.pid}, id {str(state.get('id'))[:12]}, "
           f"bus {state.get('bus')}); log: {directory.log_file}")


def _wait_serving(directory: Any, timeout: float, child: Any = None) -> dict[str, Any]:
    """Wait until the node of ``directory`` serves; fail with its log if it
    exits (or does not serve) first."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        state = directory.read() or {}
        pid = directory.running_pid()
        # The process holding the node's lock is the one node.json says runs
        # (after a kill -9 it still says "running", with the dead pid, until
        # the new process writes), and, with --detach, the one started here:
        # a node already running made the child exit, and this said the
        # child served.
        ours = pid is not None and state.get("pid") == pid and (child is None or pid == child.pid)
        if ours and state.get("state") == "running" and state.get("dsn"):
            return state
        exited = child is not None and child.poll() is not None
        if exited or time.monotonic() >= deadline:
            tail = ""
            if directory.log_file.exists():
                tail = "\n".join(directory.log_file.read_text(errors="replace").splitlines()[-5:])
            what = "exited" if exited else f"did not serve within {timeout:g} s"
            if not exited and child is None and not directory.is_node_directory():
                # A typo waited its whole timeout to say only that.
                what += (" (no node.json there: no node was started in that directory; "
                         "`pgq node start --data DIR` starts one)")
            if child is not None and not exited:
                # --detach: it runs on in its own session and may serve yet
                what += (f" (pid {child.pid} goes on starting: `pgq node wait --data "
                         f"{directory.path}` waits more, `pgq node stop --data {directory.path}` "
                         "stops it)")
            fail(PgqError(f"the node in {directory.path} {what}" + (f":\n{tail}" if tail else "")))
        time.sleep(0.1)


@node_group.command("wait")
@click.option("--data", type=click.Path(file_okay=False), required=True, help="Node directory.")
@click.option("--timeout", type=SECONDS, default=90.0, show_default=True, help="Seconds to wait.")
@json_option
@handles_errors
def node_wait(data: str, timeout: float, as_json: bool) -> None:
    """Wait until the node in DIR serves (after `pgq node start ... &`)."""
    from ..cluster.nodedir import NodeDirectory

    state = _wait_serving(NodeDirectory(Path(data).absolute()), timeout)
    report({"name": state.get("name"), "id": state.get("id"), "bus": state.get("bus")}, as_json,
           f"{state.get('name')} serves (id {str(state.get('id'))[:12]}, bus {state.get('bus')})")


@node_group.command("stop")
@click.option("--data", type=click.Path(file_okay=False), required=True, help="Node directory.")
@click.option("--timeout", type=SECONDS, default=30.0, show_default=True, help="Seconds to wait.")
@click.option("--postgres/--no-postgres", default=True, show_default=True,
              help="Also stop the node's embedded PostgreSQL.")
@json_option
@handles_errors
def node_stop(data: str, timeout: float, postgres: bool, as_json: bool) -> None:
    """Stop the node running in DIR: its process (SIGTERM, then wait), then
    its embedded PostgreSQL. Exit 3 when nothing runs there."""
    import signal
    import time

    from .. import embedded
    from ..cluster.nodedir import NodeDirectory

    directory = NodeDirectory(Path(data).absolute())
    if not directory.is_node_directory():
        fail(PgqError(f"{data} is not a node directory (no node.json): nothing to stop"))
    name = (directory.read() or {}).get("name") or str(data)
    stopped = []
    pid = directory.running_pid()
    if pid is not None:
        # -1: the lock is held but the pid not written yet (the node is
        # starting): signalled once it is known. (Printed as is, `kill -9 -1`
        # would kill every process of the user.)
        signalled = False
        deadline = time.monotonic() + timeout
        while (now := directory.running_pid()) is not None:  # the lock goes when it exits
            if now > 0:
                pid = now
                if not signalled:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
                    signalled = True
            if time.monotonic() >= deadline:
                how = f"`kill -9 {pid}` stops it for sure" if pid > 0 else \
                    "it has not written its pid yet: look for it with `ps`"
                fail(PgqError(f"{name} ({f'pid {pid}' if pid > 0 else 'starting'}) did not stop "
                              f"within {timeout:g} s; {how}"))
            time.sleep(0.05)
        stopped.append(f"node process (pid {pid})" if pid > 0 else "node process")
    if postgres and directory.postgres.exists() and embedded.stop(directory.postgres):
        stopped.append("its PostgreSQL")
    report({"name": name, "stopped": stopped}, as_json, f"stopped {name}: " + " and ".join(stopped),
           found=bool(stopped), missing=f"{name} is not running")


@node_group.command("status")
@_node_target
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--show-password", is_flag=True, help="Show the DSN with its password (default: masked).")
@handles_errors
def node_status(data: str | None, dsn: str | None, as_json: bool, show_password: bool) -> None:
    """Report a node's id, DSN, bus address and state (exit 1 when its database does
    not answer: what its directory says is printed all the same)."""
    from ..cluster.nodedir import NodeDirectory
    from ..dsn import redact

    if data and dsn:  # (node_dsn's refusal below is taken for "no DSN yet" there)
        raise click.UsageError("--dsn and --data both name the node: give one")
    info: dict[str, Any] = {}
    if data:
        directory = NodeDirectory(Path(data).absolute())
        info.update(directory.read() or {})
        pid = directory.running_pid()
        if info and pid is None and info.get("state") in ("starting", "running"):
            info["state"] = "dead"  # no process holds the directory
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
        info["database_error"] = redact(str(exc).splitlines()[0])
    if not info:
        fail(PgqError("no node found"))
    if info.get("dsn") and not show_password:
        info["dsn"] = redact(str(info["dsn"]))
    emit(info, as_json)
    if "database_error" in info:
        # What the state file says is printed, but a script must tell a node
        # whose database is down from a healthy one (it exited 0).
        fail(DatabaseUnavailableError(f"the node's database did not answer: "
                                      f"{info['database_error']}"))


@click.group("cluster")
def cluster_group() -> None:
    """Cluster membership: meet, nodes, forget, leaving, leave."""


@cluster_group.command("secret")
@json_option
def cluster_secret(as_json: bool) -> None:
    """Print a new cluster secret (32 random bytes): `pgq cluster secret > FILE`,
    then give FILE to every node with --secret-file."""
    from ..cluster.secret import new_secret

    secret = new_secret()
    report({"secret": secret}, as_json, secret)


@cluster_group.command("meet")
@click.argument("address")
@_node_target
@json_option
@handles_errors
def cluster_meet(address: str, data: str | None, dsn: str | None, as_json: bool) -> None:
    """Make the node contact another node at ADDRESS (HOST:PORT) and join its cluster."""
    from ..cluster.addresses import parse_address

    try:
        parse_address(address)
    except PgqError as exc:  # bad usage (exit 2), as every other malformed argument
        raise click.BadParameter(str(exc), param_hint="'ADDRESS'") from None
    try:
        _tell_node(_require_node(node_dsn(data, dsn)), contracts.OUTBOX_MEET, address)
        report({"meeting": address}, as_json, f"meeting {address}")
    except PgqError as exc:
        fail(exc)


@cluster_group.command("nodes")
@_node_target
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@handles_errors
def cluster_nodes(data: str | None, dsn: str | None, as_json: bool) -> None:
    """List the nodes this node knows, with their state."""
    import psycopg
    from psycopg.rows import dict_row

    with psycopg.connect(node_dsn(data, dsn), row_factory=dict_row, connect_timeout=10) as conn:
        nodes = conn.execute(contracts.NODES).fetchall()
    if as_json:
        click.echo(to_json(nodes))
        return
    for n in nodes:
        flags = ("myself " if n["myself"] else "") + ("leaving" if n["leaving"] else "")
        click.echo(f"{n['id']}  {n['name']:<12} {n['host']}:{n['port']:<6} {n['status']:<8} {flags}")


@cluster_group.command("forget")
@click.argument("node_id")
@_node_target
@json_option
@handles_errors
def cluster_forget(node_id: str, data: str | None, dsn: str | None, as_json: bool) -> None:
    """Remove NODE_ID from the cluster (the nodes alive now drop it and refuse it for a minute)."""
    import psycopg

    from ..ids import is_node_id

    if not is_node_id(node_id):
        raise click.BadParameter(f"{node_id!r} is not a 40-hex node id (see `pgq cluster nodes`)",
                                 param_hint="'NODE_ID'")
    target = _require_node(node_dsn(data, dsn))
    with psycopg.connect(target, autocommit=True, connect_timeout=10) as conn:
        myself = conn.execute(contracts.NODE_ID).fetchone()
    if myself is not None and myself[0] == node_id.lower():
        fail(PgqError(f"{node_id} is this node: forget it from another node, or take it "
                      "out with `pgq cluster leave`"))
    _tell_node(target, contracts.OUTBOX_FORGET, node_id)
    report({"forgetting": node_id}, as_json, f"forgetting {node_id}")


@cluster_group.command("leaving")
@click.argument("flag", type=click.Choice(["yes", "no"]))
@_node_target
@json_option
@handles_errors
def cluster_leaving(flag: str, data: str | None, dsn: str | None, as_json: bool) -> None:
    """Mark the node as leaving (it takes no new copies and drains) or not."""
    _set_leaving(_require_node(node_dsn(data, dsn)), flag == "yes")
    report({"leaving": flag == "yes"}, as_json, f"leaving: {flag}")


@cluster_group.command("leave")
@_node_target
@click.option("--timeout", type=SECONDS, default=600.0, show_default=True, help="Seconds to wait.")
@json_option
@handles_errors
def cluster_leave(data: str | None, dsn: str | None, timeout: float, as_json: bool) -> None:
    """Mark the node leaving and wait until it holds no jobs; then it is safe to stop."""
    import time

    import psycopg

    target = _require_node(node_dsn(data, dsn))
    myself = _set_leaving(target, True)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    deadline = time.monotonic() + timeout
    interactive = sys.stderr.isatty()
    with psycopg.connect(target, autocommit=True, connect_timeout=10) as conn, \
            Progress(TextColumn("draining"), BarColumn(), MofNCompleteColumn(),
                     transient=True, disable=not interactive, console=progress_console) as progress:
        start = conn.execute(contracts.HELD_BY_NODE, {"myself": myself}).fetchone()[0]  # type: ignore[index]
        task = progress.add_task("drain", total=max(start, 1))
        while True:  # looked at once at least: --timeout 0 said "still holds -1 jobs"
            held = conn.execute(contracts.HELD_BY_NODE, {"myself": myself}).fetchone()[0]  # type: ignore[index]
            progress.update(task, completed=max(start - held, 0))
            if held == 0 or time.monotonic() >= deadline:
                break
            if not interactive:
                click.echo(f"waiting: the node still holds {held} jobs or acks", err=True)
            time.sleep(1.0)
    if held == 0:
        report({"held": 0}, as_json, "the node holds no jobs: it is safe to stop it now")
        return
    fail(PgqError(f"the node still holds {held} jobs or acks after {timeout:g} s"))


