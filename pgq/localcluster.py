"""A throwaway local cluster: N node processes, each with its own embedded
PostgreSQL, under one temporary directory (used by ``pgq demo``, the
benchmarks, the crash tests and the chaos test).

Each node may have its own loopback address (its bus and its PostgreSQL
listen there, and the bus connects from there), its own environment and its
own launcher command: what a fault injector needs to partition nodes by
address pair, skew one node's clock, or kill and restart its postmaster as
a supervisor would.

Invariant: :meth:`LocalCluster.close` stops every process it started (node
processes with SIGTERM, then their PostgreSQL servers) and removes the
directory, whatever happened before.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from . import embedded, ports

__all__ = ["LocalNode", "LocalCluster", "StartRetried"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port for a node's bus (see pgq.ports: never one an outgoing
    connection may take before the node binds it)."""
    return ports.free_port(host)


@dataclass
class LocalNode:
    name: str
    data: Path
    bus_port: int
    secret: Path
    join: str | None
    host: str = "127.0.0.1"
    process: subprocess.Popen[bytes] | None = None
    dsn: str = ""
    env: dict[str, str] = field(default_factory=dict)  # added to the process's environment
    launcher: list[str] = field(default_factory=lambda: [sys.executable, "-m", "pgq.cli"])

    @property
    def bus(self) -> str:
        return f"{self.host}:{self.bus_port}"

    @property
    def postgres(self) -> Path:
        """The node's embedded PostgreSQL home (``pgq node start --data``)."""
        return self.data / "postgres"

    def start(self) -> None:
        """Start the node process. Refused while the one started before
        runs: its handle would be lost, and with it the way to stop it
        (a cluster entered with ``with`` is started already)."""
        if self.alive():
            assert self.process is not None
            raise RuntimeError(f"{self.name}'s process runs already (pid {self.process.pid}): "
                               "stop it first (a `with LocalCluster(...)` block starts the cluster)")
        args = [*self.launcher, "node", "start", "--name", self.name,
                "--data", str(self.data), "--bus", self.bus, "--secret-file", str(self.secret)]
        if self.join:
            args += ["--join", self.join]
        self.data.mkdir(parents=True, exist_ok=True)
        log = open(self.log, "a")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **self.env})
        log.close()

    def postmaster_pid(self) -> int | None:
        """The pid of the node's live postmaster. postmaster.pid outlives a
        killed server, and its pid may since belong to another process
        (kill_postgres signalled whatever had it): the process must be a
        postmaster of this data directory (embedded._owns)."""
        data = self.postgres / "data"
        postmaster = embedded.read_postmaster(data)
        if postmaster is None or embedded._owns(postmaster, data) is False:
            return None
        return postmaster.pid

    def alive(self) -> bool:
        """Does the node process run (a stopped one counts)?"""
        return self.process is not None and self.process.poll() is None

    def postgres_running(self) -> bool:
        """Does the node's postmaster run (a zombie does not count)?"""
        return self.postmaster_pid() is not None

    def kill_postgres(self, sig: int = signal.SIGKILL) -> bool:
        """Signal the node's postmaster (False if none runs)."""
        pid = self.postmaster_pid()
        if pid is None:
            return False
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True

    def start_postgres(self) -> None:
        """Start the node's PostgreSQL again, as its supervisor would (with
        the node's environment and launcher, so a skewed clock stays skewed)."""
        subprocess.run([*self.launcher, "embedded", "start", "--home", str(self.postgres)],
                       env={**os.environ, **self.env},
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=True, timeout=120)

    def kill(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def serving(self) -> bool:
        """Our process holds the node directory and says it serves (a state
        file left by a killed process says "running" too: the lock tells)."""
        from .cluster.nodedir import NodeDirectory

        if self.process is None or NodeDirectory(self.data).running_pid() != self.process.pid:
            return False
        try:
            state = json.loads((self.data / "node.json").read_text())
        except (OSError, ValueError):
            return False
        if state.get("state") != "running" or not state.get("dsn") \
                or state.get("pid") != self.process.pid:
            return False
        self.dsn = state["dsn"]
        return True

    @property
    def log(self) -> Path:
        """The node process's output (appended to by every start)."""
        return self.data.parent / f"{self.name}.log"

    def log_tail(self, lines: int = 30) -> str:
        """The end of the node's log, then of its PostgreSQL's."""
        return (_tail(self.log, lines) + f"\n-- {self.name}'s PostgreSQL log ends:\n"
                + _tail(self.postgres / "log" / "postgres.log", 15))

    def wait_serving(self, timeout: float, also: Callable[[], bool] = lambda: True) -> None:
        """Wait until the node serves (and ``also`` holds). Fails at once if
        its process exits, and either way with the tail of its log: the
        cluster's directory is removed on close, so this is all a failed
        run leaves to read."""
        def ready() -> bool:
            if self.process is not None and self.process.poll() is not None:
                raise _Exited(self.process.returncode)
            return self.serving() and also()

        try:
            wait_for(ready, timeout, f"{self.name} to serve")
        except _Exited as exited:
            raise RuntimeError(f"{self.name}'s process exited with status {exited.args[0]} "
                               f"before serving; its log ends:\n{self.log_tail()}") from None
        except TimeoutError:
            self._dump_stacks()
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {self.name} to serve; "
                               f"its log ends:\n{self.log_tail(80)}") from None

    def serve_or_restart(self, timeout: float, also: Callable[[], bool] = lambda: True) -> None:
        """Wait (up to half of ``timeout``) for the node process just started
        to serve; if it exits or hangs, warn with its log and start it once
        more (the other half). A node that fails to come up twice fails the
        caller. Once in some hundred starts on this machine a node process
        never served (a chaos run's cluster start, with no log left to say
        why): a harness must not fail a whole run on one such start, nor
        hide it, hence the warning, which pytest reports in its summary."""
        try:
            self.wait_serving(timeout / 2, also)
        except (TimeoutError, RuntimeError) as failed:
            warnings.warn(StartRetried(f"{self.name} did not start; starting it once more. "
                                       f"{failed}"), stacklevel=2)
            self.kill(signal.SIGKILL)
            self.start()
            self.wait_serving(timeout / 2, also)

    def _dump_stacks(self) -> None:
        """Ask a node process that does not come up for its threads' stacks
        (SIGUSR1, see cluster.process); they go to its log. Waits until the
        log stops growing, at most 3 s: the dump is written by a signal
        handler, with no completion to wait for."""
        if self.process is None or self.process.poll() is not None:
            return
        before = self.log.stat().st_size if self.log.exists() else 0
        self.process.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 3.0
        size = before
        while time.monotonic() < deadline:
            time.sleep(0.1)
            grown = self.log.stat().st_size if self.log.exists() else 0
            if grown > before and grown == size:
                return
            size = grown

    def cluster_view(self) -> dict[str, str]:
        """node name -> status, as this node's database shows it."""
        with psycopg.connect(self.dsn, connect_timeout=5) as conn:
            rows = conn.execute("SELECT name, status FROM pgq.cluster_nodes WHERE NOT myself").fetchall()
        return dict(rows)


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


class StartRetried(RuntimeWarning):
    """A node process did not come up and was started once more."""


class _Exited(Exception):
    """A node process exited while we waited for it to serve."""


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (psycopg.Error, OSError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


class LocalCluster:
    def __init__(self, size: int = 3, prefix: str = "pgq-cluster-",
                 hosts: list[str] | None = None) -> None:
        self.root = Path(tempfile.mkdtemp(prefix=prefix))
        os.chmod(self.root, 0o711)  # the PostgreSQL user must traverse it
        self.secret = self.root / "cluster.secret"
        self.secret.write_text(secrets.token_urlsafe(32))
        self.nodes: list[LocalNode] = []
        first = None
        for i in range(size):
            host = hosts[i] if hosts else "127.0.0.1"
            node = LocalNode(f"n{i + 1}", self.root / f"n{i + 1}", free_port(host), self.secret,
                             first, host=host)
            first = first or node.bus
            self.nodes.append(node)

    def start(self, timeout: float = 90) -> LocalCluster:
        for node in self.nodes:
            node.start()
        for node in self.nodes:
            node.serve_or_restart(timeout)
        others = len(self.nodes) - 1
        wait_for(lambda: all(set(n.cluster_view().values()) <= {"alive"} and  # {} for a lone node
                             len(n.cluster_view()) == others for n in self.nodes),
                 timeout, "the nodes to see each other")
        return self

    def close(self) -> None:
        for node in self.nodes:
            node.kill(signal.SIGTERM)
        for node in self.nodes:
            if (node.data / "postgres").exists():
                try:
                    embedded.stop(node.data / "postgres")
                except Exception:
                    pass
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:  # __exit__ does not run then: stop what did start
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
