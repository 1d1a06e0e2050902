"""One connection pool per node database for all the pgq.Clients of a process.

Threads that each make their own :class:`pgq.Client` already share its
group commit (``pgq.combine.Shared``): one flush carries many threads'
calls. Each flush runs on a connection of its leader's client. With a pool
per client, 50 threads with 50 clients spread their flushes over 50 server
backends, each one cold when its turn comes, where one shared client uses
the few its pool holds. Measured here (2026-11-27, 50 threads in a closed
loop, 4 s each, 3 rounds): a pool per client ran 4.6-5.8k adds and 2.9-3.5k
get+acks per s, p99 28-63 ms; one pool for all the clients 6.9-7.9k and
4.5-4.8k, p99 12-24 ms; one shared client 7.9-8.9k and 5.1-5.7k.

Invariants:

* Clients share a pool only when their connections would be alike: the
  same DSN, the same session settings (``prepare``, ``turbo``,
  ``application_name``), the same wait for a connection, in the same
  process (a forked child makes its own).
* A shared pool may open as many connections as its members' ``pool_size``
  add up to: sharing never lowers how many connections the clients may hold
  at once, only how many sit idle and how many serve the flushes.
* A pool is closed when its last member leaves it (closed, or failed over
  to another DSN), and only then: a member that fails over leaves the
  others on it until they find the failure themselves.
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


@dataclass(frozen=True, slots=True)
class PoolKey:
    """What two clients' connections must agree on to share a pool."""

    dsn: str
    prepare: bool
    turbo: bool
    application_name: str
    timeout: float
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
                  os.getpid())
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
        entry = _pools.get(key) if key is not None else None
        if entry is not None:
            entry.members -= 1
            entry.max_size -= pool_size
            if entry.members > 0:
                pool.resize(pool.min_size, max(entry.max_size, pool.min_size))
                return
            del _pools[key]  # type: ignore[arg-type]
    pool.close(timeout=CLOSE_TIMEOUT)  # outside the lock: it may wait
