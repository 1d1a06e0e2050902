"""A node's directory (``pgq node start --data DIR``) and who owns it.

::

    DIR/node.lock       held (flock) by the node process while it runs; holds its pid
    DIR/node.json       name, id, DSN, bus address, pid, state - for `pgq node status`
    DIR/node.log        the output of a node started with --detach
    DIR/postgres/       the node's embedded PostgreSQL (unless --dsn is given)
    DIR/cluster.secret  created on first start if no secret is given

Invariants:

* At most one node process runs per directory: it takes an exclusive
  ``flock`` on ``node.lock`` before it writes anything, and keeps it until
  it exits (the kernel drops it then, even on kill -9). A second start finds
  the lock held, says who holds it, and changes nothing.
* "Is a node running here?" is answered by the lock, never by a pid in a
  file (pids are recycled; a killed process may linger as a zombie). The
  question takes a shared lock for an instant; a start that meets one
  waits for it to go (a probe is no running node).
* Files are replaced atomically and created 0600.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pgq.embedded import write_private
from pgq.errors import PgqError

__all__ = ["NodeDirectory", "NodeRunningError", "read_state"]


class NodeRunningError(PgqError):
    """Another node process already runs in this directory."""


def read_state(data: Path) -> dict[str, Any] | None:
    try:
        state = json.loads((Path(data) / "node.json").read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _lock_exclusive(handle: IO[str], patience: float = 2.0) -> bool:
    """Take ``handle``'s exclusive flock: False if a node process holds it.

    A status probe (:meth:`NodeDirectory.running_pid`, `pgq node status`, a
    harness polling for "serving") holds a shared lock for an instant, and
    a start that tried once in that instant said "already running (pid ?)"
    and exited. Whether the holder is a probe is told by taking a shared
    lock: it fails only against an exclusive holder, a node. Probes come
    and go, so the exclusive lock is tried again; ``patience`` seconds of
    probes that never leave a gap count as a holder."""
    deadline = time.monotonic() + patience
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # held exclusively: a node process runs here
        fcntl.flock(handle, fcntl.LOCK_UN)
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)  # a probe holds its lock for microseconds


@dataclass
class NodeDirectory:
    path: Path
    _lock: IO[str] | None = field(default=None, repr=False)

    @property
    def state_file(self) -> Path:
        return self.path / "node.json"

    @property
    def lock_file(self) -> Path:
        return self.path / "node.lock"

    @property
    def log_file(self) -> Path:
        return self.path / "node.log"

    @property
    def postgres(self) -> Path:
        return self.path / "postgres"

    def open_file(self, path: Path, mode: str) -> IO[Any]:
        """Make the directory if need be and open one of its files; a
        directory that cannot be one (/dev/null/n1, another user's) is a
        PgqError that names it, not a traceback."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            return open(path, mode)
        except OSError as exc:
            raise PgqError(f"cannot use {self.path} as the node's directory: "
                           f"{exc.strerror or exc}") from None

    def is_node_directory(self) -> bool:
        return self.state_file.exists() or self.lock_file.exists()

    # ------------------------------------------------------------ the lock

    def acquire(self, name: str) -> None:
        """Take the directory for this process, or raise NodeRunningError."""
        handle = self.open_file(self.lock_file, "a+")
        os.chmod(self.lock_file, 0o600)
        if not _lock_exclusive(handle):
            handle.seek(0)
            holder = handle.read().strip() or "?"
            handle.close()
            raise NodeRunningError(
                f"{name} is already running in {self.path} (pid {holder}): stop it first "
                f"(`pgq node stop --data {self.path}`)") from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self._lock = handle

    def release(self) -> None:
        if self._lock is not None:
            with contextlib.suppress(OSError):
                self._lock.close()
            self._lock = None

    def running_pid(self) -> int | None:
        """The pid of the node process that holds the directory, or None."""
        try:
            handle = open(self.lock_file)
        except FileNotFoundError:
            return None
        except OSError as exc:  # not a directory, another user's node: say so, no traceback
            raise PgqError(f"cannot read {self.lock_file}: {exc.strerror or exc}") from None
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = handle.read().strip()
                return int(text) if text.isdigit() else -1
            fcntl.flock(handle, fcntl.LOCK_UN)
            return None

    # ------------------------------------------------------------ node.json

    def read(self) -> dict[str, Any] | None:
        return read_state(self.path)

    def write(self, **state: Any) -> None:
        current = self.read() or {}
        current.update(state)
        write_private(self.state_file, json.dumps(current))
