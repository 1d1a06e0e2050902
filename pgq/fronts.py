"""pgq for other programs, from one process: the HTTP API (:mod:`pgq.httpapi`),
Disque's client protocol (:mod:`pgq.resp`) and the web dashboard
(:mod:`pgq.dashboard`), served on one database by ``pgq serve`` and by a
node process (``pgq node start --http/--resp/--dashboard``).

Invariants:

* One :class:`pgq.AsyncClient` serves the HTTP API and the RESP port: their
  concurrent requests share its group commit (one statement and one commit
  for the adds, claims and acks that arrive together), so a front adds no
  semantics of its own, and its blocked GETJOBs and leases share one LISTEN
  connection (pgq.listener: one registration per queue, one GET woken per
  new job). The dashboard has its own client (its reads must not wait
  behind a burst of adds).
* Every address is bound before anything serves, and those sockets are
  served (:func:`bind_fronts`): a port already taken is
  one :class:`~pgq.errors.PgqError` naming it (uvicorn alone would exit the
  process with status 3, pgq's "nothing found"). So is the database: one
  that cannot be reached, or has no pgq schema, stops the start with the
  client's own error.
* A node process serves its fronts in a thread of their own with their own
  event loop (:class:`FrontsThread`): the node's protocol loop never waits
  for a slow HTTP client, and a front that fails does not stop the node.
* Stopping is graceful: the HTTP servers finish their requests and run
  their shutdown (the dashboard closes its client there), RESP connections
  are cancelled, and the clients' connections are closed even then
  (shielded from the cancellation).
* Secrets: ``token`` guards the HTTP API (bearer) and the RESP port (AUTH);
  ``dashboard_token`` unlocks the dashboard's actions. Whether an address
  beyond loopback may be served without one is the CLI's check
  (:func:`pgq.cli.common.listen_address`), made before anything starts.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import anyio
import anyio.from_thread
import anyio.lowlevel

from . import eventloop
from .errors import PgqError

__all__ = ["Fronts", "serve_fronts", "serve_until_signalled", "FrontsThread"]

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

    def addresses(self) -> dict[str, Address]:
        """The address of each front served, by its field's name."""
        named = {"http": self.http, "resp": self.resp, "dashboard": self.dashboard}
        return {name: address for name, address in named.items() if address is not None}


# What an error calls each front (Fronts.addresses' keys).
ROLES = {"http": "the HTTP API", "resp": "the RESP port", "dashboard": "the dashboard"}


# The listening sockets of each front, bound before anything serves
# (bind_fronts), keyed as Fronts.addresses() is.
Bound = dict[str, list[socket.socket]]
LISTEN_BACKLOG = 2048  # uvicorn's default


def bind_fronts(fronts: Fronts) -> Bound:
    """Bind and listen on every address of ``fronts`` now, or raise PgqError
    naming the one that cannot be listened on (nothing stays bound then).

    Bound up front, and the same sockets served: a probe that bound and
    closed left a window in which another server could take the port (or
    two fronts given the same port both passed it), and the front then
    failed in its own thread while a node went on without it, its RESP
    address advertised all the same (a test saw the RESP port never answer).
    A name (``localhost``) gives a socket per address, as a RESP listener
    made by anyio had."""
    bound: Bound = {}
    try:
        for front, (host, port) in fronts.addresses().items():
            bound[front] = listen(ROLES[front], host, port)
    except BaseException:
        close_bound(bound)
        raise
    return bound


def close_bound(bound: Bound) -> None:
    """Close sockets of :func:`bind_fronts` (idempotent: a served socket may
    have been closed by its server already)."""
    for sockets in bound.values():
        for sock in sockets:
            sock.close()


def _addresses(role: str, host: str, port: int) -> list[tuple[int, tuple[Any, ...]]]:
    """Where to listen for ``host``: an address as it is; a name (or "",
    every interface) as getaddrinfo resolves it for a server, with
    AI_ADDRCONFIG as anyio's listener had (``localhost`` without ::1 on a
    host with no IPv6 address). Not for an address: glibc ignores loopback
    there, so ``::1`` in a container with IPv6 on ``lo`` only was refused
    (found by a review of the first version)."""
    flags = socket.AI_PASSIVE
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        flags |= socket.AI_ADDRCONFIG
    try:
        found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=flags)
    except OSError as exc:
        raise PgqError(f"cannot listen on {host}:{port} for {role}: {exc.strerror or exc} "
                       "(give an address or a name this machine resolves)") from None
    # the whole address: an IPv6 link-local one keeps its scope
    return sorted({(family, address) for family, _, _, _, address in found})


def listen(role: str, host: str, port: int) -> list[socket.socket]:
    """Bound and listening now: a bound socket that does not listen yet
    leaves its port to another socket with SO_REUSEADDR (Linux lets both
    bind), so two fronts given one port would both pass. Connections that
    come before the front serves wait in the backlog."""
    sockets: list[socket.socket] = []
    try:
        for family, address in _addresses(role, host, port):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                # IPv6 only, whatever the bindv6only sysctl says, as uvicorn's
                # and anyio's listeners had: `::` does not take IPv4 too
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:  # a name's addresses share the port picked first
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        why = "it is in use (another server there? choose another port)" \
            if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
        raise PgqError(f"cannot listen on {host}:{port} for {role}: {why}") from None
    return sockets


# How long a graceful stop lets HTTP requests finish before it cancels them.
# A blocking lease or wait (up to httpapi.MAX_WAIT, 300 s) does not wait for
# it: the stop answers it at once as its timeout would (httpapi's
# ``stopping``). A request cancelled at the end of the grace answers
# nothing (its client retries elsewhere).
HTTP_STOP_GRACE = 10
# A signal this soon after the first is the same Ctrl-C twice (a wrapper
# such as `uv run` forwards it to a process the terminal signalled too),
# not a second one: it would cut the graceful stop short.
SECOND_SIGNAL_AFTER = 1.0


# The most a request's line and headers may take. uvicorn's httptools
# protocol put no bound on them: a URL of 256 MiB, sent before any check
# (Host, token, body size) could run, was copied piece by piece on the one
# event loop the HTTP API, the dashboard and RESP share (found by a
# read-only review). Past it the request gets a 400 and its connection is
# closed. nginx allows 4 x 8 KiB by default; h11, uvicorn's other parser, 16 KiB.
MAX_REQUEST_HEAD = 64 * 1024


def _bounded_http_protocol() -> Any:
    """uvicorn's httptools protocol, counting the bytes of each request's
    line and headers (an error raised in a parser callback is answered 400
    and closes the connection: httptools' HttpParserCallbackError)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpTools(HttpToolsProtocol):
        _head = 0
        _in_head = True  # between a request's first byte and the end of its headers
        _raw = 0  # bytes received while in a request's head (httptools builds each
        #           header whole before on_header sees it: one header of 32 MiB
        #           was read whole, found by a review of the first version)

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                self._raw += len(data)
            super().data_received(data)
            # Judged after the parser read it: a read holds the head and the
            # start of the body alike (a client sends both in one write),
            # and a POST of 100 KB in one read was refused (found by a
            # review of the first version of this).
            if self._in_head and self._raw > MAX_REQUEST_HEAD and not self.transport.is_closing():
                self.send_400_response("Request line and headers too large.")

        def on_message_begin(self) -> None:
            self._head = self._raw = 0
            self._in_head = True
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def _count(self, size: int) -> None:
            self._head += size
            if self._head > MAX_REQUEST_HEAD:
                raise ValueError(f"request line and headers past {MAX_REQUEST_HEAD} bytes")

    return BoundedHttpTools


def _uvicorn(app: Any, address: Address) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # The signals are pgq's (serve_until_signalled): uvicorn's own
            # capture stopped its server alone, then raised the signal again,
            # which ended the process under the other fronts' feet.
            yield

    host, port = address
    # log_config=None: uvicorn's loggers go through ours (text or JSON lines)
    return Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                 log_config=None, timeout_graceful_shutdown=HTTP_STOP_GRACE,
                                 http=_bounded_http_protocol()))


async def serve_fronts(dsn: str | None, fronts: Fronts, stopping: anyio.Event | None = None,
                       bound: Bound | None = None) -> None:
    """Serve ``fronts`` on the database ``dsn`` until cancelled, or until
    ``stopping`` is set (then gracefully). ``bound``: the fronts' sockets,
    from :func:`bind_fronts` (else bound here first); closed at the end."""
    if bound is None:
        bound = bind_fronts(fronts)
    try:
        await _serve_bound(dsn, fronts, stopping, bound)
    finally:
        close_bound(bound)


async def _serve_bound(dsn: str | None, fronts: Fronts, stopping: anyio.Event | None,
                       bound: Bound) -> None:
    from .aio import AsyncClient

    client = AsyncClient(dsn)
    board_client = AsyncClient(dsn) if fronts.dashboard else None
    servers: list[Any] = []
    resp_scope = anyio.CancelScope()  # entered by the RESP task, cancelled on a graceful stop
    listener_scope = anyio.CancelScope()  # the blocked GETs' shared LISTEN (pgq.listener)
    try:
        # The database is reached (and its schema checked) before anything
        # serves: a wrong DSN was found only by the first request, and
        # /health answered 200 meanwhile (its node "").
        await client.open()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(_within, listener_scope, client._serve_listener)
            if fronts.http:
                from .httpapi import create_app
                from .httpjson import hosts_for

                api = create_app(client, fronts.token, allowed_hosts=hosts_for(fronts.http[0]),
                                 stopping=stopping)
                servers.append(_uvicorn(api, fronts.http))
                tasks.start_soon(servers[-1].serve, bound["http"])
                log.info("pgq HTTP API on http://%s:%d (OpenAPI: /openapi.json)", *fronts.http)
            if fronts.dashboard and board_client is not None:
                from .dashboard import create_app as create_dashboard
                from .httpjson import hosts_for

                hosts = hosts_for(fronts.dashboard[0])
                board = create_dashboard(board_client, fronts.dashboard_token, allowed_hosts=hosts,
                                         private=hosts is None)  # beyond loopback: reads need the token
                servers.append(_uvicorn(board, fronts.dashboard))
                tasks.start_soon(servers[-1].serve, bound["dashboard"])
                log.info("pgq dashboard on http://%s:%d/ (%s)", *fronts.dashboard,
                         "actions need the token" if fronts.dashboard_token else "read-only")
            if fronts.resp:
                from .resp import serve as serve_resp

                tasks.start_soon(_within, resp_scope, serve_resp, client, *fronts.resp, fronts.token,
                                 None, bound["resp"])
                log.info("pgq RESP (Disque's protocol) on %s:%d", *fronts.resp)
            if stopping is not None:
                await stopping.wait()
                for server in servers:
                    server.should_exit = True  # finish requests, run the shutdown
                resp_scope.cancel()
                # GETs still blocked then wait by polling until they return.
                listener_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await client.close()
            if board_client is not None:
                await board_client.close()


async def serve_until_signalled(dsn: str | None, fronts: Fronts) -> None:
    """:func:`serve_fronts` until SIGTERM or SIGINT, then a graceful stop:
    HTTP requests in flight end and are answered (blocked leases and waits
    as at their timeout); RESP commands in flight are cancelled between
    their statements (a GETJOB's claimed jobs go back to their queue unless
    its reply's write began; a committed ADDJOB gets no reply).
    SIGTERM's default action had ended `pgq serve --resp` at once, and a
    GETJOB's jobs claimed then went to nobody (a RETRY 0 job for good). A
    second signal during that stop (at least SECOND_SIGNAL_AFTER seconds
    after the first) ends the process at once, quietly, with
    status 128 + the signal's number (130 for a second Ctrl-C): Python's
    KeyboardInterrupt, thrown into the loop, had uvicorn log a traceback
    per task it cut off, and `pgq serve` then exited 0 as if its stop had
    been clean. :func:`serve_fronts` itself leaves the signals to its caller
    (uvicorn's own capture is off)."""
    import signal

    stopping = anyio.Event()
    failure: Exception | None = None
    async with anyio.create_task_group() as tasks:
        async def watch() -> None:
            first = 0.0
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
                async for signum in received:
                    if not stopping.is_set():
                        first = time.monotonic()
                        log.info("stopping gracefully (another signal stops at once)")
                        stopping.set()
                    elif not _repeated(first, time.monotonic()):
                        _end_now(signum)

        tasks.start_soon(watch)
        try:
            await serve_fronts(dsn, fronts, stopping)
        except Exception as exc:  # raised as itself (a port in use), not in an ExceptionGroup
            failure = exc
        tasks.cancel_scope.cancel()
    if failure is not None:
        raise failure


def _repeated(first: float, now: float) -> bool:
    """Whether a signal at ``now`` is the first one's repeat (SECOND_SIGNAL_AFTER)."""
    return now - first < SECOND_SIGNAL_AFTER


def _end_now(signum: int) -> NoReturn:
    """End the process at once for a second signal (see serve_until_signalled)."""
    log.warning("stopped at once by a second signal; requests in flight get no answer")
    logging.shutdown()  # the line above reaches its handlers
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(128 + signum)


async def _within(scope: anyio.CancelScope, function: Any, *args: Any) -> None:
    """Run ``function(*args)`` under ``scope`` (cancelled on its own)."""
    with scope:
        await function(*args)


class FrontsThread:
    """:func:`serve_fronts` in a daemon thread with its own event loop (how a
    node process serves them beside its own loop); :meth:`stop` ends it."""

    def __init__(self, dsn: str, fronts: Fronts, bound: Bound | None = None) -> None:
        self.dsn, self.fronts, self.bound = dsn, fronts, bound
        self._stopping: anyio.Event | None = None
        self._token: Any = None
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="pgq-fronts", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self._stopping, self._token = anyio.Event(), anyio.lowlevel.current_token()
            self._ready.set()
            await serve_fronts(self.dsn, self.fronts, self._stopping, self.bound)
        try:
            eventloop.run(main)
        except BaseException:  # a front that cannot serve must not stop the node
            log.exception("the node's HTTP/RESP/dashboard fronts stopped")
        finally:
            if self.bound is not None:  # a loop that never ran served none of them
                close_bound(self.bound)
            self._ready.set()

    def start(self) -> FrontsThread:
        self.thread.start()
        self._ready.wait(10.0)
        return self

    def stop(self, timeout: float = HTTP_STOP_GRACE + 5.0) -> None:
        stopping, token = self._stopping, self._token
        if stopping is not None and self.thread.is_alive():
            try:
                anyio.from_thread.run_sync(stopping.set, token=token)
            except RuntimeError:  # its loop ended meanwhile
                pass
        self.thread.join(timeout)
