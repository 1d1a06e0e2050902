"""Running a node process: start-up order, clean failure, signals.

``pgq node start`` ends up in :func:`run_node`. The node's directory, its
lock and its state file are :mod:`.nodedir`'s.

Start-up order, chosen so that a start that cannot succeed changes nothing
and leaves nothing behind:

1. check the arguments and the cluster secret;
2. take the node directory (a second start of the same node stops here:
   "n1 is already running (pid N)");
3. bind the bus address, and check the fronts' and the metrics' (in use:
   one line saying so);
4. start (or find) the node's embedded PostgreSQL, migrate it, and take the
   database's node lock (one node process per database);
5. serve. A failure in 4 or 5 before the node serves (its protocol loop
   started: ``_serve`` says so) stops the PostgreSQL this start launched.

SIGUSR1 writes every thread's Python stack to the node's standard error
(its log under ``pgq demo`` and the local clusters), without stopping it:
how to see where a node that does not come up is waiting.

Invariants: the node's identity (40-hex id) lives in its database, so a
restart with the same data keeps it; SIGTERM or SIGINT stop the node within
a couple of seconds (``state`` becomes ``stopped``, clients see the node
process gone), while it starts too (the start's clean-up runs); the
database is migrated before the node serves.
"""

from __future__ import annotations

import contextlib
import faulthandler
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import anyio

from pgq.contracts import NODE_LOCK_KEY  # held by the node process serving a database
from pgq.errors import InvalidArgumentError, PgqError
from pgq.fronts import Bound, Fronts, FrontsThread, bind_fronts, close_bound
from pgq.metrics import check_free as check_metrics_free

from . import secret as cluster_secret
from .addresses import parse_address
from .messages import MAX_DSN
from .nodedir import NodeDirectory, read_state

__all__ = ["parse_address", "load_secret", "run_node", "read_state", "bind_bus",
           "NODE_LOCK_KEY", "BusAddressInUse"]

log = logging.getLogger("pgq.cluster")


class BusAddressInUse(PgqError):
    """The bus address is taken (by another node, or anything else)."""


def load_secret(secret_file: str | None, data: Path | None) -> bytes:
    """The cluster secret (see :mod:`.secret`)."""
    return cluster_secret.load(secret_file, data)


def refuse_unspecified(host: str) -> None:
    """The bus address is where the node listens *and* the address it gives
    its peers: 0.0.0.0 (or ::) reaches nobody, so peers that learnt it sent
    every reply to themselves and each declared the other dead."""
    try:
        unspecified = ipaddress.ip_address(host.partition("%")[0]).is_unspecified
    except ValueError:
        return  # a host name
    if unspecified:
        raise InvalidArgumentError(
            f"--bus {host} is no address other nodes can reach (the bus address is also "
            "the one this node gives its peers): give this machine's host name or IP "
            "address, e.g. --bus $(hostname):7711")


def bind_bus(host: str, port: int) -> socket.socket:
    """Bind and listen on the bus address now, before anything is started."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise BusAddressInUse(
            f"cannot listen on the bus address {host}:{port}: {exc.strerror or exc} "
            "(another node there? choose another --bus port)") from None
    sock.setblocking(False)
    return sock


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with the node's name (PGQ_LOG_FORMAT=json)."""

    def __init__(self, node: str) -> None:
        super().__init__()
        self.node = node

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"), "node": self.node,
                 "logger": record.name, "level": record.levelname, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(name: str) -> None:
    """Log to stderr with the node (or worker) name: text, or JSON lines."""
    level = os.environ.get("PGQ_LOG_LEVEL", "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("PGQ_LOG_FORMAT", "text").lower() == "json":
        handler.setFormatter(JsonFormatter(name))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {name} %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level, logging.INFO))
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
    logging.getLogger("alembic").setLevel(logging.WARNING)


class NodeLock:
    """The node lock of the database (pgq.contracts), held by a connection of
    its own while the node runs. A crash of PostgreSQL alone (an OOM kill of
    one backend restarts them all) ends that connection and the lock with
    it: clients then read "no node process" and withdraw a replicated add
    after 50 ms, and a second node process could start on the database. The
    node checks it and takes it again (:meth:`take`, pgq.cluster.node)."""

    def __init__(self, dsn: str, name: str) -> None:
        self.dsn, self.name = dsn, name
        self.conn: Any = None

    def take(self) -> None:
        """Take the lock on a new connection (PgqError: another process has it)."""
        self.release()
        self.conn = _database_lock(self.dsn, self.name)

    def release(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


def _database_lock(dsn: str, name: str) -> Any:
    """Take the node lock of the database (held while this connection lives)."""
    import psycopg

    conn = psycopg.connect(dsn, autocommit=True, connect_timeout=10)
    taken = conn.execute("SELECT pg_try_advisory_lock(%s)", (NODE_LOCK_KEY,)).fetchone()
    if not taken or not taken[0]:
        holder = conn.execute("SELECT pgq.meta_value('process_pid')").fetchone()
        conn.close()
        raise PgqError(
            f"another node process (pid {holder[0] if holder else '?'}) already serves "
            f"this database: stop it before starting {name} on it")
    return conn


class _Terminated(BaseException):
    """SIGTERM before the node serves (see :func:`run_node`)."""


def _terminated(signum: int, frame: Any) -> None:
    # Once: a second SIGTERM during the clean-up (pg_ctl stop) cut it
    # short, and the server this start launched ran on.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Terminated


def run_node(name: str, bus: str, data: str | None = None, dsn: str | None = None,
             joins: tuple[str, ...] = (), secret_file: str | None = None,
             metrics: str | None = None, fronts: Fronts | None = None,
             advertise_dsn: str | None = None) -> int:
    """Start a node in the foreground until SIGTERM/SIGINT; returns the exit code
    (``fronts``: its HTTP API, RESP port and dashboard, :mod:`pgq.fronts`;
    ``advertise_dsn``: see :func:`advertised`).

    SIGTERM's default action killed a node that was still starting (an
    embedded server's initdb takes seconds) without its clean-up: the
    PostgreSQL it had launched ran on, and node.json said "starting" for
    ever. Until the node serves (anyio then takes the signal), SIGTERM
    raises here like SIGINT does, and the start's clean-up runs."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main else None
    try:
        return _run_node(name, bus, data, dsn, joins, secret_file, metrics, fronts, advertise_dsn)
    except _Terminated:
        log.info("%s: stopped by SIGTERM while starting", name)
        return 128 + signal.SIGTERM
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)


def _run_node(name: str, bus: str, data: str | None, dsn: str | None, joins: tuple[str, ...],
              secret_file: str | None, metrics: str | None, fronts: Fronts | None,
              advertise_dsn: str | None) -> int:
    from pgq import embedded
    from pgq.migrate import migrate

    setup_logging(name)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    host, port = parse_address(bus, "--bus")
    refuse_unspecified(host)
    peers = [parse_address(j, "--join") for j in joins]
    advertised(advertise_dsn, "")  # a bad DSN fails before anything starts
    if dsn is None and data is None:
        raise InvalidArgumentError("give the node a database: --data DIR or --dsn DSN")
    directory = NodeDirectory(Path(data).absolute()) if data else None
    secret = load_secret(secret_file, directory.path if directory else None)
    if directory is not None:
        directory.acquire(name)
    listener: socket.socket | None = None
    bound: Bound = {}  # the fronts' sockets, served by their thread
    lock: NodeLock | None = None
    launched = False  # this start launched the embedded PostgreSQL
    served = threading.Event()  # the node serves (set by _serve): a failure leaves PostgreSQL up
    try:
        listener = bind_bus(host, port)
        # Every address before PostgreSQL starts. A front's taken port was
        # found by the fronts' thread, which logged a traceback while the
        # node went on without any front (its RESP address advertised all
        # the same); a metrics port in use ended the start with PostgreSQL
        # left running (found by a read-only review). The fronts' sockets
        # are bound here and served as they are: a probe left the port to
        # whoever bound it next (see pgq.fronts.bind_fronts).
        if fronts:
            bound = bind_fronts(fronts)
        if metrics:
            check_metrics_free(metrics)
        if directory is not None:
            directory.write(name=name, bus=f"{host}:{port}", pid=os.getpid(), state="starting")
        if dsn is None:
            assert directory is not None
            launched = not embedded.status(directory.postgres)["running"]
            dsn = embedded.ensure_running(directory.postgres, host=host).dsn
        migrate(dsn)
        lock = NodeLock(dsn, name)
        lock.take()
        served_fronts = FrontsThread(dsn, fronts, bound).start() if fronts else None
        try:
            return _serve(name, dsn, host, port, peers, secret, metrics, listener, directory,
                          advertised(advertise_dsn, dsn), resp_address(fronts, host), lock,
                          served)
        finally:
            if served_fronts is not None:
                served_fronts.stop()
    except BaseException:
        if launched and not served.is_set() and directory is not None:
            with contextlib.suppress(Exception):
                embedded.stop(directory.postgres)
        raise
    finally:
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.close()
        close_bound(bound)
        if lock is not None:
            lock.release()
        if directory is not None:
            with contextlib.suppress(OSError):
                directory.write(state="stopped")
            directory.release()


def resp_address(fronts: Fronts | None, bus_host: str) -> str:
    """HOST:PORT where other nodes' Disque clients reach this node's RESP
    front (HELLO lists it), "" without one. A front listening on every
    interface is reached at the host the node gives its peers for the bus."""
    if fronts is None or fronts.resp is None:
        return ""
    host, port = fronts.resp
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = bus_host
    if ":" in host and not host.startswith("["):  # IPv6: [::1]:7711, as clients read it
        host = f"[{host}]"
    return f"{host}:{port}"


def advertised(option: str | None, dsn: str) -> str:
    """The DSN a node advertises to the cluster's clients (``--advertise-dsn``):
    its own by default, none for ``none`` (""), else the option, checked."""
    if option is None:
        return dsn
    if option.strip().lower() == "none":
        return ""
    from pgq.dsn import libpq_url

    try:
        libpq_url(option)  # its message never quotes the password
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"--advertise-dsn is not a libpq DSN ({exc}); give a "
                                   "postgresql:// URL or key=value string, or none") from None
    if len(option) > MAX_DSN:
        raise InvalidArgumentError(f"--advertise-dsn is longer than {MAX_DSN} characters")
    return option


def _serve(name: str, dsn: str, host: str, port: int, peers: list[tuple[str, int]],
           secret: bytes, metrics: str | None, listener: socket.socket,
           directory: NodeDirectory | None, advertise_dsn: str, advertise_resp: str,
           lock: NodeLock, served: threading.Event) -> int:
    from .node import Node, NodeSettings

    settings = NodeSettings(name=name, dsn=dsn, bus_host=host, bus_port=port,
                            secret=secret, joins=peers, metrics=metrics,
                            advertise_dsn=advertise_dsn, advertise_resp=advertise_resp)
    node = Node(settings, listener=listener, relock=lock.take)

    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                await tasks.start(node.run)
                served.set()
                if directory is not None:
                    directory.write(id=node.node_id, dsn=dsn, state="running")
                async for _signal in signals:
                    log.info("stopping on signal")
                    tasks.cancel_scope.cancel()
                    break

    try:
        # asyncio's own loop, not pgq.eventloop's: _terminated (SIGTERM
        # while starting) raises from a signal handler, which uvloop would
        # log and drop while idle; and the node's loop measured no faster.
        anyio.run(main)
    except BaseExceptionGroup as group:  # the node stopped itself (another took its database)
        if group.subgroup(_Terminated) is not None:
            # SIGTERM before anyio's receiver took the signal, raised in a task
            raise _Terminated from None
        stopped = group.subgroup(PgqError)
        if stopped is None:
            raise
        while isinstance(stopped, BaseExceptionGroup):
            stopped = stopped.exceptions[0]
        raise stopped from None
    return 0
