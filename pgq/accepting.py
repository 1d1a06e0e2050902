"""Accepting connections on a listening socket, whatever the shortage: the
one accept loop of the servers pgq runs itself (the RESP port and the
cluster bus; uvicorn has its own for the HTTP fronts).

Invariants:

* An ``accept()`` that fails never ends the loop: out of file descriptors
  (EMFILE), of memory, or a connection reset before it was accepted, it
  waits ``ACCEPT_RETRY`` and accepts again, as asyncio's own servers do.
  anyio's ``Listener.serve`` ends at the first failed accept, and with it
  the server: the node process's bus, or ``pgq serve --resp``, whose
  1,025th connection under the common open-files limit ended it.
* A shortage is logged once, when it starts, not once per retry; every
  failure is counted by the caller's ``failed``.
* Each accepted connection is handled in its own task of the caller's task
  group, so one connection's handler never holds the next accept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import anyio.abc

__all__ = ["accept_forever", "ACCEPT_RETRY"]

log = logging.getLogger("pgq")

ACCEPT_RETRY = 0.1  # seconds after a failed accept (descriptors may come free)


async def accept_forever(listener: Any, handle: Callable[[Any], Coroutine[Any, Any, None]],
                         tasks: anyio.abc.TaskGroup, what: str,
                         failed: Callable[[BaseException], None] | None = None) -> None:
    """Accept connections on ``listener`` (one socket) for ``what`` (named
    in the log) and handle each in a task of ``tasks``, until cancelled."""
    short = False
    while True:
        try:
            stream = await listener.accept()
        except (OSError, anyio.BrokenResourceError) as exc:
            if failed is not None:
                failed(exc)
            if not short:
                log.warning("%s: accepting a connection failed (retrying every %g s): %s",
                            what, ACCEPT_RETRY, exc)
            short = True
            await anyio.sleep(ACCEPT_RETRY)
            continue
        short = False
        tasks.start_soon(handle, stream)
