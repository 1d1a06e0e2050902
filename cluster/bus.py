"""The cluster bus: authenticated TCP links between node processes (anyio).

Each node listens on its bus address and opens one outbound link to every
peer it talks to; a link carries messages one way (see :mod:`.wire`).

Invariants:

* Every socket is bound to the node's own address, inbound and outbound, so
  nodes on one machine (127.0.0.x) are told apart by address.
* Sending never blocks the caller: messages go into a bounded per-peer
  queue that a link task drains; when a peer is unreachable its queue keeps
  the newest messages only. Delivery is best effort: every protocol above
  (replication, ACK GC, re-queue, membership) retries on its own.
* A connection that fails the handshake, sends a bad frame or a malformed
  message is closed and counted in :attr:`Bus.stats`; nothing it sent is
  handed to the node. Messages from one link are handled in order.
"""

from __future__ import annotations

import collections
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
from anyio.abc import SocketStream, TaskStatus
from anyio.streams.buffered import BufferedByteReceiveStream

from .messages import Message, MessageError, decode, encode
from .wire import (
    CHALLENGE_SIZE,
    HELLO_SIZE,
    PROOF_SIZE,
    Acceptor,
    FrameReader,
    FrameWriter,
    Initiator,
    WireError,
)

__all__ = ["Bus", "BusStats"]

log = logging.getLogger("pgq.cluster.bus")
Handler = Callable[[str, Message], Awaitable[None]]
HANDSHAKE_TIMEOUT = 5.0
QUEUE_LIMIT = 20_000


@dataclass
class BusStats:
    """Counters, exposed through INFO and the metrics endpoint."""

    messages_in: collections.Counter[str] = field(default_factory=collections.Counter)
    messages_out: collections.Counter[str] = field(default_factory=collections.Counter)
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)
    dropped: int = 0
    connections_in: int = 0
    connects_out: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "messages_in": dict(self.messages_in), "messages_out": dict(self.messages_out),
            "rejected": dict(self.rejected), "rejected_total": sum(self.rejected.values()),
            "dropped": self.dropped, "connections_in": self.connections_in,
            "connects_out": self.connects_out,
        }


class _Link:
    """Outbound messages for one peer address, drained by one task."""

    def __init__(self) -> None:
        self.queue: collections.deque[bytes] = collections.deque()
        self.kinds: collections.deque[str] = collections.deque()
        self.ready = anyio.Event()


class Bus:
    def __init__(self, node_id: str, secret: bytes, host: str, port: int, handler: Handler,
                 listener: socket.socket | None = None) -> None:
        self.node_id = node_id
        self.secret = secret
        self.host = host
        self.port = port
        self.handler = handler
        self.listener = listener
        self.stats = BusStats()
        self._links: dict[tuple[str, int], _Link] = {}
        self._tasks: anyio.abc.TaskGroup | None = None

    # ------------------------------------------------------------ serving

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen, accept links, and run outbound links until cancelled."""
        if self.listener is not None:  # bound by the process before anything started
            listener: anyio.abc.Listener[SocketStream] = await anyio.abc.SocketListener.from_socket(
                self.listener)
        else:
            listener = await anyio.create_tcp_listener(local_host=self.host,
                                                       local_port=self.port, reuse_port=False)
        async with listener, anyio.create_task_group() as tasks:
            self._tasks = tasks
            task_status.started()
            await listener.serve(self._accept, task_group=tasks)

    async def _accept(self, stream: SocketStream) -> None:
        self.stats.connections_in += 1
        async with stream:
            try:
                peer, reader = await self._handshake_as_acceptor(stream)
                await self._read(stream, peer, reader)
            except (WireError, MessageError) as exc:
                self.stats.rejected[type(exc).__name__] += 1
                log.warning("bus: dropped a connection from %s: %s", _remote(stream), exc)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.IncompleteRead,
                    ConnectionError, TimeoutError):
                pass

    async def _handshake_as_acceptor(self, stream: SocketStream) -> tuple[str, FrameReader]:
        buffered = BufferedByteReceiveStream(stream)
        acceptor = Acceptor(self.secret, self.node_id)
        with anyio.fail_after(HANDSHAKE_TIMEOUT):
            await stream.send(acceptor.challenge(await buffered.receive_exactly(HELLO_SIZE)))
            acceptor.verify(await buffered.receive_exactly(PROOF_SIZE))
        reader = FrameReader(acceptor.session_key)
        leftover = bytes(buffered.buffer)
        if leftover:
            for payload in reader.feed(leftover):
                await self._dispatch(acceptor.peer_id, payload)
        return acceptor.peer_id, reader

    async def _read(self, stream: SocketStream, peer: str, reader: FrameReader) -> None:
        while True:
            data = await stream.receive(65536)
            for payload in reader.feed(data):
                await self._dispatch(peer, payload)

    async def _dispatch(self, peer: str, payload: bytes) -> None:
        message = decode(payload)  # MessageError closes the connection
        self.stats.messages_in[message.KIND] += 1
        try:
            await self.handler(peer, message)
        except Exception:  # a handler bug must not take the link (or the node) down
            log.exception("bus: handling %s from %s failed", message.KIND, peer[:8])

    # ------------------------------------------------------------ sending

    def send(self, host: str, port: int, message: Message) -> None:
        """Queue ``message`` for the node at ``host:port`` (never blocks)."""
        if (host, port) == (self.host, self.port):
            return
        link = self._links.get((host, port))
        if link is None:
            link = self._links[(host, port)] = _Link()
            if self._tasks is not None:
                self._tasks.start_soon(self._drain, host, port, link)
        if len(link.queue) >= QUEUE_LIMIT:
            link.queue.popleft()
            link.kinds.popleft()
            self.stats.dropped += 1
        link.queue.append(encode(message))
        link.kinds.append(message.KIND)
        link.ready.set()

    async def _drain(self, host: str, port: int, link: _Link) -> None:
        backoff = 0.05
        while True:
            await link.ready.wait()
            try:
                stream = await anyio.connect_tcp(host, port, local_host=self.host)
            except OSError:
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            self.stats.connects_out += 1
            try:
                async with stream:
                    writer = await self._handshake_as_initiator(stream)
                    backoff = 0.05
                    while True:
                        if not link.queue:
                            link.ready = anyio.Event()
                            await link.ready.wait()
                        batch, kinds = list(link.queue), list(link.kinds)
                        link.queue.clear()
                        link.kinds.clear()
                        await stream.send(b"".join(writer.frame(p) for p in batch))
                        self.stats.messages_out.update(kinds)
            except WireError as exc:
                self.stats.rejected[f"outbound {type(exc).__name__}"] += 1
                log.warning("bus: %s:%s refused our handshake: %s", host, port, exc)
                await anyio.sleep(1.0)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.IncompleteRead,
                    OSError, TimeoutError):
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _handshake_as_initiator(self, stream: SocketStream) -> FrameWriter:
        buffered = BufferedByteReceiveStream(stream)
        initiator = Initiator(self.secret, self.node_id)
        with anyio.fail_after(HANDSHAKE_TIMEOUT):
            await stream.send(initiator.hello())
            await stream.send(initiator.answer(await buffered.receive_exactly(CHALLENGE_SIZE)))
        return FrameWriter(initiator.session_key)


def _remote(stream: SocketStream) -> str:
    try:
        host, port = stream.extra(anyio.abc.SocketAttribute.remote_address)[:2]
        return f"{host}:{port}"
    except Exception:
        return "?"
