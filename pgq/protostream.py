"""A TCP byte stream on asyncio's Protocol callbacks, for the RESP server.

The RESP server (:mod:`pgq.resp`) reads a request and writes its reply for
every command of every connection. Through anyio's socket stream that cost
about 41 us of the server's CPU per request on this machine (a server that
answered every ADDJOB at once, 50 connections; bench/README.md): each
``receive`` resumed the transport's reading and paused it again (two
``epoll_ctl`` calls), and each ``send`` ended with a turn of the event loop
(anyio's ``cancel_shielded_checkpoint``), a task step per reply. The same
server on a bare ``asyncio.Protocol`` used 12 us. This stream keeps anyio's
interface where the server uses it (``receive``, ``send``, ``aclose``, an
async context manager, anyio's exceptions) and does neither:

* Reading is always on while fewer than :data:`HIGH_WATER` bytes wait
  unread; past it the transport pauses until ``receive`` takes them
  (backpressure: a client that pipelines without reading its replies
  cannot make the server buffer without bound; the server bounds its
  parser's own buffer as before).
* ``send`` writes to the transport, which sends at once when its buffer is
  empty, and waits only while the transport has paused writing (the peer
  reads slowly): the replies a peer does not read are bounded too.

* ``aclose`` lets what was written go out (a QUIT's +OK), for at most
  :data:`CLOSE_GRACE` seconds, then aborts: a peer that never reads its
  last replies cannot keep its socket, past the server's cap on clients
  (whose slot is held until then), nor a stopping server's (a cancelled
  close aborts at once). anyio's stream aborted at once, and waited in
  ``send`` until the transport's buffer was empty.
* ``receive`` yields to the event loop once per :data:`YIELD_EVERY` bytes
  it hands out without waiting, so a client pipelining cheap commands
  (PING) does not hold the loop while its whole buffer is answered.

Invariants: bytes come out of ``receive`` in the order they arrived, and
after the last of them ``receive`` raises ``anyio.EndOfStream`` (the peer
closed) or ``anyio.BrokenResourceError`` (the connection failed), for ever.
``send`` on a closed or failed connection raises ``BrokenResourceError``
(``ClosedResourceError`` after our own ``aclose``), never writes into it.
Only one task receives at a time (a second gets ``anyio.BusyResourceError``,
as with anyio's stream). ``send`` is no cancellation point when it need not
wait (the server has one before each reply: :mod:`pgq.resp`).
"""

from __future__ import annotations

import asyncio
import collections
import socket
from typing import Any

import anyio

__all__ = ["ProtocolStream", "ProtocolListener", "HIGH_WATER", "CLOSE_GRACE", "YIELD_EVERY"]

# Unread bytes at which the transport stops reading (and resumes below it):
# a few requests' worth; the parser holds what receive returned.
HIGH_WATER = 256 * 1024
# Seconds a closed connection's unsent replies get before it is aborted.
CLOSE_GRACE = 5.0
# Bytes receive hands out without waiting before it yields to the loop
# (anyio's yielded at every call, and read 64 KiB at most).
YIELD_EVERY = 64 * 1024


def _address(sockname: Any) -> Any:
    """(host, port) as anyio gave it: an IPv6 address with its scope id
    (``fe80::1%2``), the flow and scope fields cut off."""
    if isinstance(sockname, tuple) and len(sockname) == 4:
        host, port, _flow, scope = sockname
        return (f"{host.split('%')[0]}%{scope}" if scope else host), port
    return sockname


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class ProtocolStream(asyncio.Protocol):
    """One accepted connection (see the module's docstring)."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._unread = 0
        self._handed = 0  # bytes receive handed out since it last yielded
        self._receiving = False  # a receive is under way (waiting or yielding)
        self._reading_paused = False
        self._ended: BaseException | None = None  # EndOfStream or BrokenResourceError
        self._closed = False  # by aclose
        self._readable: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._lost: asyncio.Future[None] | None = None  # done when the transport is gone
        self.local_address: Any = None  # (host, port) on TCP

    # ------------------------------------------------------------ callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport's subclasses)
        self._transport = transport  # type: ignore[assignment]
        self._lost = asyncio.get_running_loop().create_future()
        self.local_address = _address(transport.get_extra_info("sockname"))

    def data_received(self, data: bytes) -> None:
        self._chunks.append(data)
        self._unread += len(data)
        if self._unread >= HIGH_WATER and not self._reading_paused:
            self._reading_paused = True
            self._transport.pause_reading()  # type: ignore[union-attr]
        self._wake_reader()

    def eof_received(self) -> bool:
        self._end(anyio.EndOfStream())
        # Half-closed: the replies to what came before the EOF are still
        # written (`printf 'PING\r\n' | nc -N` gets its +PONG); aclose ends it.
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None:
            self._end(anyio.EndOfStream())
        else:
            broken = anyio.BrokenResourceError(str(exc))
            broken.__cause__ = exc  # what the logs should show
            self._end(broken)
        _wake(self._lost)
        self.resume_writing()  # a waiting send sees the end and raises

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        writable, self._writable = self._writable, None
        _wake(writable)

    def _end(self, ended: BaseException) -> None:
        if self._ended is None:
            self._ended = ended
        self._wake_reader()

    def _wake_reader(self) -> None:
        readable, self._readable = self._readable, None
        _wake(readable)

    # ------------------------------------------------------------ the stream

    async def receive(self, max_bytes: int = 65536) -> bytes:
        """The next bytes (at most ``max_bytes``), waiting for them if none
        are unread; EndOfStream / BrokenResourceError after the last."""
        if self._receiving:
            raise anyio.BusyResourceError("reading from")
        if self._closed:
            raise anyio.ClosedResourceError
        self._receiving = True
        try:
            return await self._receive(max_bytes)
        finally:
            self._receiving = False

    async def _receive(self, max_bytes: int) -> bytes:
        waited = False
        while not self._chunks:
            if self._closed:
                raise anyio.ClosedResourceError
            if self._ended is not None:
                raise self._ended
            waited = True
            self._readable = asyncio.get_running_loop().create_future()
            try:
                await self._readable
            finally:
                self._readable = None
        if not waited and self._handed >= YIELD_EVERY:
            self._handed = 0
            await asyncio.sleep(0)  # others' turn (the data stays: nobody else reads)
            if self._closed:
                raise anyio.ClosedResourceError
        data = self._take(max_bytes)
        self._handed = 0 if waited else self._handed + len(data)
        self._unread -= len(data)
        if self._reading_paused and self._unread < HIGH_WATER and self._ended is None:
            self._reading_paused = False
            self._transport.resume_reading()  # type: ignore[union-attr]
        return data

    def _take(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` from the front, joining whole chunks and
        splitting only the one at the front (not all that is buffered)."""
        chunks = self._chunks
        first = chunks[0]
        if len(first) >= max_bytes:
            chunks.popleft()
            if len(first) > max_bytes:
                chunks.appendleft(first[max_bytes:])
                return first[:max_bytes]
            return first
        taken, size = [chunks.popleft()], len(first)
        while chunks and size + len(chunks[0]) <= max_bytes:
            size += len(chunks[0])
            taken.append(chunks.popleft())
        return taken[0] if len(taken) == 1 else b"".join(taken)

    async def send(self, data: bytes) -> None:
        """Write ``data``; wait while the peer is slow to read it."""
        self._check_open()
        self._transport.write(data)  # type: ignore[union-attr]
        while self._writable is not None:
            await asyncio.shield(self._writable)
            self._check_open()

    def _check_open(self) -> None:
        if self._closed:
            raise anyio.ClosedResourceError
        transport = self._transport
        if transport is None or transport.is_closing() or isinstance(
                self._ended, anyio.BrokenResourceError):
            raise anyio.BrokenResourceError("the connection is closed")

    async def aclose(self) -> None:
        """Close: what was written still goes out (a QUIT's +OK, the error
        before a protocol error's close) for up to CLOSE_GRACE seconds; then,
        or at once if this close is cancelled (the server's stop), abort."""
        self._closed = True
        transport, lost = self._transport, self._lost
        if transport is None or lost is None:
            return
        transport.close()
        if lost.done() or not transport.get_write_buffer_size():
            return
        try:
            with anyio.move_on_after(CLOSE_GRACE):
                await asyncio.shield(lost)
        finally:
            if not lost.done():
                transport.abort()

    async def __aenter__(self) -> ProtocolStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class ProtocolListener:
    """Accepts connections on one listening socket as ProtocolStreams (the
    interface :func:`pgq.accepting.accept_forever` takes: ``accept``)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._socket = sock

    async def accept(self) -> ProtocolStream:
        loop = asyncio.get_running_loop()
        conn, _ = await loop.sock_accept(self._socket)
        try:
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _, stream = await loop.connect_accepted_socket(ProtocolStream, conn)
        except BaseException:
            conn.close()
            raise
        return stream

    async def aclose(self) -> None:
        self._socket.close()
