"""First contact with a node's database: fail fast, and say why.

A client's first connection decides whether it can work at all. Errors
fall in two kinds, told apart by what libpq reports:

* **refused by the server** (``FATAL``: wrong password, unknown role or
  database, no ``pg_hba.conf`` entry): retrying cannot help, so the first
  failure raises at once;
* **not reached** (connection refused, timeout, a server starting up or
  shutting down, too many clients): worth retrying for a few seconds, since
  a server may be (re)starting; then it raises.

Either way the caller gets one :class:`~pgq.errors.DatabaseUnavailableError`
whose message carries libpq's own cause (password masked) and what to do,
instead of a pool that keeps retrying quietly for the whole reconnect
timeout. Later outages of a working client are the pool's business
(``reconnect_timeout``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg

from .backoff import doubling
from .dsn import host_and_port, redact
from .errors import DatabaseUnavailableError

__all__ = ["FIRST_CONNECT_TIMEOUT", "is_permanent", "first_connection",
           "first_connection_async", "attempts", "cause_of", "unavailable"]

T = TypeVar("T")
FIRST_CONNECT_TIMEOUT = 5.0

# Server replies that pass on their own: worth another try.
_TRANSIENT = ("starting up", "shutting down", "in recovery mode", "too many clients",
              "remaining connection slots", "not yet accepting connections",
              "is not currently accepting connections")


def cause_of(exc: BaseException) -> str:
    """libpq's message, one line per reason, without the password."""
    text = str(exc).strip()
    for prefix in ("connection failed: ",):
        text = text.removeprefix(prefix)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return redact("; ".join(lines))


def is_permanent(exc: BaseException) -> bool:
    """Did the server itself refuse us (so that retrying is pointless)?"""
    text = str(exc)
    return "FATAL" in text and not any(phrase in text for phrase in _TRANSIENT)


def _advice(exc: BaseException) -> str:
    text = str(exc)
    if "password authentication failed" in text or "authentication" in text:
        return "check the user and password in the DSN"
    if "does not exist" in text and "database" in text:
        return "create the database, or fix its name in the DSN"
    if "does not exist" in text and "role" in text:
        return "create the role, or fix the user in the DSN"
    if "pg_hba.conf" in text:
        return "allow this client in the server's pg_hba.conf, or connect as another user"
    return "check that PostgreSQL runs there and accepts TCP connections (host, port, firewall)"


def unavailable(dsn: str, exc: BaseException, waited: float | None = None) -> DatabaseUnavailableError:
    """The one error a caller sees for a database it cannot use."""
    host, port = host_and_port(dsn)
    if is_permanent(exc):
        return DatabaseUnavailableError(
            f"the pgq database at {host}:{port} refused the connection: {cause_of(exc)} "
            f"({_advice(exc)})")
    after = f" after {waited:.0f} s" if waited and waited >= 1 else ""
    return DatabaseUnavailableError(
        f"cannot reach the pgq database at {host}:{port}{after}: {cause_of(exc)} "
        f"({_advice(exc)})")


@dataclass(frozen=True)
class Connect:
    """Try ``dsns[index]`` with this libpq connect_timeout (seconds)."""

    index: int
    timeout: int


@dataclass(frozen=True)
class Pause:
    seconds: float


def attempts(dsns: list[str], timeout: float, start: int,
             clock: Callable[[], float] = time.monotonic
             ) -> Generator[Connect | Pause, BaseException | None, None]:
    """The retry policy, free of I/O: yields what to try next and receives
    the attempt's error (None: connected, and the plan ends)."""
    began = clock()
    deadline = began + timeout
    attempt = 0
    last: tuple[str, BaseException] | None = None
    while True:
        for offset in range(len(dsns)):
            index = (start + offset) % len(dsns)
            left = max(deadline - clock(), 1.0)
            error = yield Connect(index, max(int(min(left, timeout)), 1))
            if error is None:
                return
            if is_permanent(error):
                raise unavailable(dsns[index], error) from None
            last = (dsns[index], error)
        if clock() >= deadline:
            assert last is not None
            raise unavailable(last[0], last[1], clock() - began) from None
        yield Pause(min(doubling(0.1, attempt, 1.0), max(deadline - clock(), 0.0)))
        attempt += 1


def first_connection(dsns: list[str], work: Callable[[psycopg.Connection[Any]], T], *,
                     timeout: float = FIRST_CONNECT_TIMEOUT,
                     start: int = 0) -> tuple[int, T]:
    """Connect to the first DSN that answers (from ``start``, in turn), run
    ``work`` on the connection and return (index of that DSN, its result).

    Raises at once on a refusal by a server (see the module doc), and after
    ``timeout`` seconds when none could be reached.
    """
    plan = attempts(dsns, timeout, start)
    step = next(plan)
    while True:
        if isinstance(step, Pause):
            time.sleep(step.seconds)
            step = next(plan)
            continue
        try:
            conn = psycopg.connect(dsns[step.index], autocommit=True, connect_timeout=step.timeout)
        except psycopg.OperationalError as exc:
            step = plan.send(exc)
            continue
        plan.close()
        with conn:
            return step.index, work(conn)


async def first_connection_async(dsns: list[str], work: Callable[[Any], Any], *,
                                 timeout: float = FIRST_CONNECT_TIMEOUT,
                                 start: int = 0) -> tuple[int, Any]:
    """:func:`first_connection` for :class:`psycopg.AsyncConnection` (``work``
    is a coroutine function)."""
    import anyio

    plan = attempts(dsns, timeout, start)
    step = next(plan)
    while True:
        if isinstance(step, Pause):
            await anyio.sleep(step.seconds)
            step = next(plan)
            continue
        try:
            conn = await psycopg.AsyncConnection.connect(
                dsns[step.index], autocommit=True, connect_timeout=step.timeout)
        except psycopg.OperationalError as exc:
            step = plan.send(exc)
            continue
        plan.close()
        async with conn:
            return step.index, await work(conn)
