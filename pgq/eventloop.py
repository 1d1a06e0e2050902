"""The event loop of pgq's own servers.

``pgq serve`` and ``pgq dashboard`` (the RESP, HTTP and dashboard fronts),
and the fronts a node process serves in a thread of its own, run their
async code through :func:`run`: on uvloop when it imports (a dependency of
pgq where it builds: Linux and macOS), on asyncio's own loop otherwise, or
when ``PGQ_EVENT_LOOP=asyncio`` asks for it (to rule the loop out when
debugging).

Why: such a server is one process near a full core, much of it in the
loop's own machinery (a RESP reply is one socket write, a statement one
wait on its socket), which uvloop does in C: the RESP rows of bench/ ran
2-14% faster. Library code (``pgq.AsyncClient``, ``pgq.Tasks``,
``pgq.Worker``, which runs the application's handlers) never picks a loop.
The node process's own loop stays asyncio's (cluster/process.py says why).

Invariant: the choice changes only speed. Both loops are asyncio's
interface (anyio's asyncio backend, psycopg's async connections and
pgq.cancelsafe rely on asyncio's tasks, which uvloop keeps).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

__all__ = ["run", "loop_name"]

T = TypeVar("T")

ENV = "PGQ_EVENT_LOOP"

log = logging.getLogger("pgq")


def loop_name() -> str:
    """``"uvloop"`` or ``"asyncio"``: the loop :func:`run` uses here."""
    wanted = os.environ.get(ENV, "").strip().lower()
    if wanted not in ("", "uvloop", "asyncio"):
        log.warning("%s=%s is neither uvloop nor asyncio: using the default", ENV, wanted)
    if wanted == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError as exc:  # not installed, or a broken build: a slower loop, not a failure
        missing = isinstance(exc, ModuleNotFoundError) and exc.name == "uvloop"
        if wanted == "uvloop" or not missing:
            log.warning("uvloop does not import (%s): asyncio's event loop instead", exc)
        return "asyncio"
    return "uvloop"


def run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``anyio.run(fn, *args)`` on the loop of :func:`loop_name`."""
    return anyio.run(fn, *args, backend_options={"use_uvloop": loop_name() == "uvloop"})
