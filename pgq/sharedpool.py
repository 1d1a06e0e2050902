"""One connection pool per node database for all the pgq.Clients of a process.

Threads that each make their own :class:`pgq.Client` already share its
group commit (``pgq.combine.Shared``): one flush carries many threads'
calls. Each flush runs on a connection of its leader's client. With a pool
per client, 50 threads with 50 clients spread their flushes over 50 server
backends, each one cold when its turn comes, where one shared client uses
the few its pool holds. Measured here (2026-11-27, 50 threads in a closed
loop, 4 s each): a pool per client ran 4.6-5.8k adds and 2.9-3.5k get+acks
per s, p99 28-63 ms (3 rounds); one pool for all the clients 6.0-6.9k and
4.1-4.2k, p99 13-25 ms (2 rounds), with one shared client at 6.6-9.4k and
4.9-5.4k in the same runs.

Invariants:

* Clients share a pool only when their connections would be alike: the
  same DSN, the same session settings (``prepare``, ``turbo``,
  ``application_name``), the same wait for a connection, in the same
  process (a forked child starts with none). A client given several DSNs
  keeps its own (``PoolKey.owner``): it fails over when its pool stays
  busy, and another client's load must not move it to another node.
* A shared pool may open as many connections as its members' ``pool_size``
  add up to: sharing never lowers how many connections the clients may hold
  at once, only how many sit idle and how many serve the flushes.
* A pool is closed when its last member leaves it (closed, or failed over
  to another DSN), and only then: a member that fails over leaves the
  others on it until they find the failure themselves. A member that
  leaves lowers the pool's size; connections over it close once idle for
  ``MAX_IDLE`` (psycopg_pool shrinks a pool one idle connection at a time).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from psycopg_pool import ConnectionPool

__all__ = ["PoolKey", "acquire", "release"]

# How long closing the last member's pool waits for connections in use.
CLOSE_TIMEOUT = 1.0
# An idle connection over the pool's minimum is closed after this long
# (psycopg_pool's default is 10 minutes: a pool left by most of its members
# would keep their connections for hours).
MAX_IDLE = 60.0


@dataclass(frozen=True, slots=True)
class PoolKey:
    """What two clients' connections must agree on to share a pool."""

    dsn: str
    prepare: bool
    turbo: bool
    application_name: str
    timeout: float
    owner: int = 0  # not 0: the one client this pool serves (it is not shared)
    pid: int = 0  # filled by acquire: the process that opened the pool


@dataclass(slots=True)
class _Entry:
    pool: ConnectionPool
    members: int
    max_size: int  # the sum of the members' pool_size


_lock = threading.Lock()
_pools: dict[PoolKey, _Entry] = {}


def acquire(key: PoolKey, pool_size: int,
            make: Callable[[PoolKey, int], ConnectionPool]) -> ConnectionPool:
    """The pool for ``key``, made by ``make(key, max_size)`` if this process
    has none open; this member's ``pool_size`` is added to its size."""
    key = PoolKey(key.dsn, key.prepare, key.turbo, key.application_name, key.timeout,
                  key.owner, os.getpid())
    with _lock:
        entry = _pools.get(key)
        if entry is None or entry.pool.closed:
            entry = _pools[key] = _Entry(make(key, pool_size), 1, pool_size)
            return entry.pool
        entry.members += 1
        entry.max_size += pool_size
        entry.pool.resize(entry.pool.min_size, entry.max_size)
        return entry.pool


def release(pool: ConnectionPool, pool_size: int) -> None:
    """One member leaves ``pool``; the last one closes it."""
    with _lock:
        key = next((k for k, e in _pools.items() if e.pool is pool), None)
        if key is None:
            return  # closed already, or a pool of the parent process (after a fork)
        entry = _pools[key]
        entry.members -= 1
        entry.max_size -= pool_size
        if entry.members > 0:
            pool.resize(pool.min_size, max(entry.max_size, pool.min_size))
            return
        del _pools[key]
    pool.close(timeout=CLOSE_TIMEOUT)  # outside the lock: it may wait


def _forget_in_child() -> None:
    """A forked child starts with no pool: the parent's serve the parent
    (their threads did not survive the fork), and the lock may have been
    held by one of those threads."""
    global _lock
    _lock = threading.Lock()
    _pools.clear()


os.register_at_fork(after_in_child=_forget_in_child)
