"""The event loop of pgq's own long-running processes.

``pgq serve`` (the RESP, HTTP and dashboard fronts), the node process and
``pgq worker`` run their async code through :func:`run`: on uvloop when it
is installed (a dependency of pgq where it builds: Linux and macOS), on
asyncio's own loop otherwise, or when ``PGQ_EVENT_LOOP=asyncio`` asks for
it (to rule the loop out when debugging).

Why: these processes spend much of their time in the loop's own machinery
(a RESP reply is one socket write, a statement one wait on its socket), and
uvloop does that work in C. Library code (``pgq.AsyncClient``,
``pgq.Tasks``) never picks a loop: it runs on the caller's.

Invariant: the choice changes only speed. Both loops are asyncio's
interface (anyio's asyncio backend, psycopg's async connections and
pgq.cancelsafe rely on asyncio's tasks, which uvloop keeps).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

__all__ = ["run", "loop_name"]

T = TypeVar("T")

ENV = "PGQ_EVENT_LOOP"


def loop_name() -> str:
    """``"uvloop"`` or ``"asyncio"``: the loop :func:`run` uses here."""
    wanted = os.environ.get(ENV, "").strip().lower()
    if wanted == "asyncio":
        return "asyncio"
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``anyio.run(fn, *args)`` on the loop of :func:`loop_name`."""
    return anyio.run(fn, *args, backend_options={"use_uvloop": loop_name() == "uvloop"})
