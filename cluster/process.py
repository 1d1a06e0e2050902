"""Running a node process: settings, its state file, signals.

``pgq node start`` ends up in :func:`run_node`. A node's directory
(``--data DIR``) holds::

    DIR/postgres/     the node's embedded PostgreSQL (unless --dsn is given)
    DIR/node.json     name, id, DSN, bus address, pid, state - for `pgq node status`
    DIR/cluster.secret  created on first start if no secret is given

Invariants: the node's identity (40-hex id) lives in its database, so a
restart with the same data keeps it; SIGTERM or SIGINT stop the node cleanly
(``state`` becomes ``stopped``, clients see the node process gone); the
database is migrated before the node serves.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from pgq.errors import InvalidArgumentError

__all__ = ["NodeFiles", "parse_address", "load_secret", "run_node", "read_state"]

log = logging.getLogger("pgq.cluster")
MIN_SECRET = 16


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"expected HOST:PORT, not {text!r}")
    return host, int(port)


def load_secret(secret_file: str | None, data: Path | None) -> bytes:
    """The cluster secret: --secret-file, else $PGQ_CLUSTER_SECRET, else DIR/cluster.secret."""
    if secret_file:
        secret = Path(secret_file).read_bytes().strip()
    elif os.environ.get("PGQ_CLUSTER_SECRET"):
        secret = os.environ["PGQ_CLUSTER_SECRET"].encode()
    elif data is not None:
        path = data / "cluster.secret"
        if not path.exists():
            path.write_text(secrets.token_urlsafe(32) + "\n")
            os.chmod(path, 0o600)
            log.warning("created a new cluster secret in %s: give the same file to every "
                        "other node with --secret-file", path)
        secret = path.read_bytes().strip()
    else:
        raise InvalidArgumentError(
            "a cluster secret is needed: --secret-file FILE or PGQ_CLUSTER_SECRET")
    if len(secret) < MIN_SECRET:
        raise InvalidArgumentError(f"the cluster secret must be at least {MIN_SECRET} bytes")
    return secret


@dataclass
class NodeFiles:
    """The node's state file (``DIR/node.json``)."""

    data: Path

    @property
    def path(self) -> Path:
        return self.data / "node.json"

    def write(self, **state: Any) -> None:
        current = read_state(self.data) or {}
        current.update(state)
        fd, tmp = tempfile.mkstemp(dir=self.data, prefix=".node-")
        with os.fdopen(fd, "w") as handle:
            json.dump(current, handle)
        os.replace(tmp, self.path)


def read_state(data: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(data) / "node.json").read_text())
    except (OSError, ValueError):
        return None


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


def run_node(name: str, bus: str, data: str | None = None, dsn: str | None = None,
             joins: tuple[str, ...] = (), secret_file: str | None = None,
             metrics: str | None = None) -> int:
    """Start a node in the foreground until SIGTERM/SIGINT; returns the exit code."""
    from pgq import embedded
    from pgq.migrate import migrate

    from .node import Node, NodeSettings

    setup_logging(name)
    host, port = parse_address(bus)
    peers = [parse_address(j) for j in joins]
    directory = Path(data).absolute() if data else None
    files = None
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        files = NodeFiles(directory)
        files.write(name=name, bus=f"{host}:{port}", pid=os.getpid(), state="starting")
    if dsn is None:
        if directory is None:
            raise InvalidArgumentError("give the node a database: --data DIR or --dsn DSN")
        dsn = embedded.ensure_running(directory / "postgres", host=host).dsn
    migrate(dsn)
    settings = NodeSettings(name=name, dsn=dsn, bus_host=host, bus_port=port,
                            secret=load_secret(secret_file, directory), joins=peers,
                            metrics=metrics)
    node = Node(settings)

    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                await tasks.start(node.run)
                if files is not None:
                    files.write(id=node.node_id, dsn=dsn, state="running")
                async for _signal in signals:
                    log.info("stopping on signal")
                    tasks.cancel_scope.cancel()
                    break

    try:
        anyio.run(main)
    finally:
        if files is not None:
            files.write(state="stopped")
    return 0
