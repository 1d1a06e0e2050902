"""pgq for other programs, from one process: the HTTP API (:mod:`pgq.httpapi`),
Disque's client protocol (:mod:`pgq.resp`) and the web dashboard
(:mod:`pgq.dashboard`), served on one database by ``pgq serve`` and by a
node process (``pgq node start --http/--resp/--dashboard``).

Invariants:

* One :class:`pgq.AsyncClient` serves the HTTP API and the RESP port: their
  concurrent requests share its group commit (one statement and one commit
  for the adds, claims and acks that arrive together), so a front adds no
  semantics of its own. The dashboard has its own client (its reads must
  not wait behind a burst of adds).
* A node process serves its fronts in a thread of their own with their own
  event loop (:class:`FrontsThread`): the node's protocol loop never waits
  for a slow HTTP client, and a front that fails does not stop the node.
* Secrets: ``token`` guards the HTTP API (bearer) and the RESP port (AUTH);
  ``dashboard_token`` unlocks the dashboard's actions. Whether an address
  beyond loopback may be served without one is the CLI's check
  (:func:`pgq.cli.common.listen_address`), made before anything starts.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel

__all__ = ["Fronts", "serve_fronts", "FrontsThread"]

log = logging.getLogger("pgq.fronts")

Address = tuple[str, int]


@dataclass(frozen=True)
class Fronts:
    """What to serve, where (None: not served)."""

    http: Address | None = None
    resp: Address | None = None
    dashboard: Address | None = None
    token: str | None = None  # HTTP bearer token and RESP AUTH password
    dashboard_token: str | None = None  # unlocks the dashboard's actions

    def __bool__(self) -> bool:
        return any((self.http, self.resp, self.dashboard))


def _uvicorn(app: Any, address: Address) -> Any:
    import uvicorn

    host, port = address
    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))


async def serve_fronts(dsn: str | None, fronts: Fronts) -> None:
    """Serve ``fronts`` on the database ``dsn`` until cancelled."""
    from .aio import AsyncClient

    client = AsyncClient(dsn)
    try:
        async with anyio.create_task_group() as tasks:
            if fronts.http:
                from .httpapi import create_app

                tasks.start_soon(_uvicorn(create_app(client, fronts.token), fronts.http).serve)
                log.info("pgq HTTP API on http://%s:%d (OpenAPI: /openapi.json)", *fronts.http)
            if fronts.resp:
                from .resp import serve as serve_resp

                tasks.start_soon(serve_resp, client, *fronts.resp, fronts.token)
                log.info("pgq RESP (Disque's protocol) on %s:%d", *fronts.resp)
            if fronts.dashboard:
                from .dashboard import create_app as create_dashboard

                board = create_dashboard(AsyncClient(dsn), fronts.dashboard_token)
                tasks.start_soon(_uvicorn(board, fronts.dashboard).serve)
                log.info("pgq dashboard on http://%s:%d/ (%s)", *fronts.dashboard,
                         "actions need the token" if fronts.dashboard_token else "read-only")
    finally:
        await client.close()


class FrontsThread:
    """:func:`serve_fronts` in a daemon thread with its own event loop (how a
    node process serves them beside its own loop); :meth:`stop` ends it."""

    def __init__(self, dsn: str, fronts: Fronts) -> None:
        self.dsn, self.fronts = dsn, fronts
        self._scope: anyio.CancelScope | None = None
        self._token: Any = None
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="pgq-fronts", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            with anyio.CancelScope() as scope:
                self._scope, self._token = scope, anyio.lowlevel.current_token()
                self._ready.set()
                await serve_fronts(self.dsn, self.fronts)
        try:
            anyio.run(main)
        except Exception:  # a front that cannot serve (its port taken...) must not stop the node
            log.exception("the node's HTTP/RESP/dashboard fronts stopped")
        finally:
            self._ready.set()

    def start(self) -> FrontsThread:
        self.thread.start()
        self._ready.wait(10.0)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        scope, token = self._scope, self._token
        if scope is not None and self.thread.is_alive():
            try:
                anyio.from_thread.run_sync(scope.cancel, token=token)
            except RuntimeError:  # its loop ended meanwhile
                pass
        self.thread.join(timeout)
