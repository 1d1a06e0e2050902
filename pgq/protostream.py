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

Invariants: bytes come out of ``receive`` in the order they arrived, and
after the last of them ``receive`` raises ``anyio.EndOfStream`` (the peer
closed) or ``anyio.BrokenResourceError`` (the connection failed), for ever.
``send`` on a closed or failed connection raises ``BrokenResourceError``
(``ClosedResourceError`` after our own ``aclose``), never writes into it.
Only one task receives at a time, as with anyio's stream. Neither call is a
cancellation point when it need not wait (the server has one before each
reply: :mod:`pgq.resp`).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import anyio

__all__ = ["ProtocolStream", "ProtocolListener", "HIGH_WATER"]

# Unread bytes at which the transport stops reading (and resumes below it):
# a few requests' worth; the parser holds what receive returned.
HIGH_WATER = 256 * 1024


class ProtocolStream(asyncio.Protocol):
    """One accepted connection (see the module's docstring)."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._chunks: list[bytes] = []
        self._unread = 0
        self._reading_paused = False
        self._ended: BaseException | None = None  # EndOfStream or BrokenResourceError
        self._closed = False  # by aclose
        self._readable: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self.local_address: Any = None  # (host, port, ...) on TCP

    # ------------------------------------------------------------ callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport's subclasses)
        self._transport = transport  # type: ignore[assignment]
        self.local_address = transport.get_extra_info("sockname")

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
        self._end(anyio.EndOfStream() if exc is None else anyio.BrokenResourceError(str(exc)))
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)  # send sees the end and raises

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    def _end(self, ended: BaseException) -> None:
        if self._ended is None:
            self._ended = ended
        self._wake_reader()

    def _wake_reader(self) -> None:
        readable, self._readable = self._readable, None
        if readable is not None and not readable.done():
            readable.set_result(None)

    # ------------------------------------------------------------ the stream

    async def receive(self, max_bytes: int = 65536) -> bytes:
        """The next bytes (at most ``max_bytes``), waiting for them if none
        are unread; EndOfStream / BrokenResourceError after the last."""
        while not self._chunks:
            if self._closed:
                raise anyio.ClosedResourceError
            if self._ended is not None:
                raise self._ended
            self._readable = asyncio.get_running_loop().create_future()
            try:
                await self._readable
            finally:
                self._readable = None
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        if len(data) > max_bytes:
            data, rest = data[:max_bytes], data[max_bytes:]
            self._chunks = [rest]
        else:
            self._chunks = []
        self._unread -= len(data)
        if self._reading_paused and self._unread < HIGH_WATER and self._ended is None:
            self._reading_paused = False
            self._transport.resume_reading()  # type: ignore[union-attr]
        return data

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
        """Close: what was written is still sent (a QUIT's +OK, the error
        before a protocol error's close), then the connection ends."""
        self._closed = True
        if self._transport is not None:
            self._transport.close()

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
