"""The cluster bus: encrypted, authenticated TCP links between node processes (anyio).

Each node listens on its bus address and opens one outbound link to every
peer it talks to; a link carries messages one way (see :mod:`.wire`).

Invariants:

* Every socket is bound to the node's own address, inbound and outbound, so
  nodes on one machine (127.0.0.x) are told apart by address.
* Sending never blocks the caller: messages go into a per-peer queue
  (bounded in messages and in bytes) that a link task drains; when a peer is
  unreachable its queue keeps the newest messages only. Delivery is best
  effort: every protocol above (replication, ACK GC, re-queue, membership)
  retries on its own.
* Nothing a peer sends can stop the node or exhaust it: at most
  ``max_pending_handshakes`` connections may be unauthenticated at once
  (past it the oldest is closed to make room, so idle connections from a
  few addresses cannot keep a peer out), at most ``max_pending_per_host``
  of them from one address, each for ``handshake_timeout`` seconds; a failed accept (out of file
  descriptors, say) is counted and retried, never the end of the
  listener; frames are bounded; a link table
  holds at most ``max_links`` peers (idle links are dropped); a message
  too big for a frame is refused where it is sent (senders split batches);
  an address that is not an IP address or an ASCII host name is never
  dialled; any error of a connection or of a handler is contained to it.
* A connection that fails the handshake, sends a bad frame or a malformed
  message is closed and counted in :attr:`Bus.stats`; nothing it sent after
  the failure is handed to the node. Messages from one link are handled in
  order, and a link is not read while the node is still handling what it
  sent (back-pressure instead of an unbounded inbox).
* One live inbound connection per peer id: a second one claiming the same
  id is refused while the first is active, and replaces it once the first
  has been silent for ``stale_after`` seconds (a peer that restarted).
"""

from __future__ import annotations

import collections
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import SocketStream, TaskStatus
from anyio.streams.buffered import BufferedByteReceiveStream

from pgq import accepting

from .addresses import valid_host, valid_port
from .messages import Message, MessageError, UnknownKind, decode, encode
from .secret import stretch
from .wire import (
    ACCEPT_SIZE,
    CHALLENGE_SIZE,
    HELLO_SIZE,
    MAX_FRAME,
    PROOF_SIZE,
    TAG,
    Acceptor,
    FrameReader,
    FrameWriter,
    Initiator,
    WireError,
)

__all__ = ["Bus", "BusStats", "BusLimits", "MAX_MESSAGE"]

log = logging.getLogger("pgq.cluster.bus")
DROP_LOG_EVERY = 1.0  # seconds between lines about dropped connections
Handler = Callable[[str, Message], Awaitable[None]]
MAX_MESSAGE = MAX_FRAME - TAG  # the largest encoded message one frame carries


@dataclass(frozen=True)
class BusLimits:
    handshake_timeout: float = 5.0
    max_pending_handshakes: int = 64
    max_pending_per_host: int = 16  # a local cluster's peers all come from 127.0.0.1
    queue_messages: int = 20_000  # per peer
    queue_bytes: int = 256 * 1024 * 1024  # per peer
    max_links: int = 512
    link_idle: float = 120.0  # an empty, unused link is dropped after this
    stale_after: float = 10.0  # an inbound connection silent this long may be replaced


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
        self.queue: collections.deque[tuple[bytes, str]] = collections.deque()
        self.bytes = 0
        self.ready = anyio.Event()
        self.used = time.monotonic()

    def push(self, payload: bytes, kind: str, limits: BusLimits) -> int:
        """Queue a payload; returns how many old ones were dropped to make room."""
        self.queue.append((payload, kind))
        self.bytes += len(payload)
        self.used = time.monotonic()
        dropped = 0
        while len(self.queue) > 1 and (len(self.queue) > limits.queue_messages
                                       or self.bytes > limits.queue_bytes):
            old, _kind = self.queue.popleft()
            self.bytes -= len(old)
            dropped += 1
        self.ready.set()
        return dropped

    def take(self) -> list[tuple[bytes, str]]:
        batch = list(self.queue)
        self.queue.clear()
        self.bytes = 0
        return batch


@dataclass
class _Inbound:
    stream: SocketStream
    last_frame: float


class Bus:
    def __init__(self, node_id: str, secret: bytes, host: str, port: int, handler: Handler,
                 listener: socket.socket | None = None, limits: BusLimits | None = None) -> None:
        self.node_id = node_id
        self.key = stretch(secret)  # scrypt once: each handshake uses the stretched key
        self.host = host
        self.port = port
        self.handler = handler
        self.listener = listener
        self.limits = limits or BusLimits()
        self.stats = BusStats()
        self._links: dict[tuple[str, int], _Link] = {}
        self._inbound: dict[str, _Inbound] = {}
        # Handshakes under way, oldest first (evicted in that order when full).
        self._handshaking: dict[object, anyio.CancelScope] = {}
        self._pending_by_host: collections.Counter[str] = collections.Counter()
        self._tasks: anyio.abc.TaskGroup | None = None
        self._drops_unlogged = 0  # dropped connections since the last line about them
        self._drop_logged_at = -DROP_LOG_EVERY

    def _log_drop(self, stream: SocketStream, exc: Exception) -> None:
        """A warning per dropped connection, at most one a DROP_LOG_EVERY
        seconds (the others counted in it and in stats.rejected): anyone
        who could reach the port wrote a line per 77 bytes of garbage, and
        the node's log (never rotated under --detach) filled the disk at
        connection rate (found by a read-only review)."""
        self._drops_unlogged += 1
        now = time.monotonic()
        if now - self._drop_logged_at < DROP_LOG_EVERY:
            return
        more = self._drops_unlogged - 1
        log.warning("bus: dropped a connection from %s: %s%s", _remote(stream), exc,
                    f" (and {more} more since the last such line)" if more else "")
        self._drops_unlogged, self._drop_logged_at = 0, now

    # ------------------------------------------------------------ serving

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen, accept links, and run outbound links until cancelled."""
        if self.listener is not None:  # bound by the process before anything started
            listener: anyio.abc.Listener[SocketStream] = \
                await anyio.abc.SocketListener.from_socket(self.listener)
        else:
            listener = await anyio.create_tcp_listener(local_host=self.host,
                                                       local_port=self.port, reuse_port=False)
        async with listener, anyio.create_task_group() as tasks:
            self._tasks = tasks
            task_status.started()
            # create_tcp_listener may bind several sockets (a MultiListener)
            listeners = list(getattr(listener, "listeners", [listener]))
            for one in listeners[1:]:
                tasks.start_soon(accept_forever, one, self._accept, tasks, self.stats)
            await accept_forever(listeners[0], self._accept, tasks, self.stats)

    async def _accept(self, stream: SocketStream) -> None:
        self.stats.connections_in += 1
        async with stream:
            host = _remote(stream).rpartition(":")[0]
            if self._pending_by_host[host] >= self.limits.max_pending_per_host:
                self.stats.rejected["too many handshakes from one host"] += 1
                return
            if len(self._handshaking) >= self.limits.max_pending_handshakes:
                # The oldest handshake makes room, not the newcomer: refused,
                # a few addresses holding idle connections (13 a second, each
                # kept 5 s) kept every restarted peer out. A real handshake
                # takes milliseconds, so it is never the oldest for long
                # (found by a read-only review).
                self._handshaking.pop(next(iter(self._handshaking))).cancel()
                self.stats.rejected["oldest handshake evicted"] += 1
            peer = ""
            scope, key = anyio.CancelScope(), object()
            try:
                self._handshaking[key] = scope
                self._pending_by_host[host] += 1
                try:
                    with scope:
                        peer, reader = await self._handshake_as_acceptor(stream)
                finally:
                    self._handshaking.pop(key, None)
                    self._pending_by_host[host] -= 1
                    if not self._pending_by_host[host]:
                        del self._pending_by_host[host]
                if scope.cancelled_caught:
                    return  # evicted (counted above)
                await self._read(stream, peer, reader)
            except (WireError, MessageError) as exc:
                self.stats.rejected[type(exc).__name__] += 1
                self._log_drop(stream, exc)
            except TimeoutError:
                self.stats.rejected["handshake timeout"] += 1
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.IncompleteRead,
                    anyio.ClosedResourceError, OSError):
                pass
            except Exception:  # a bug here must cost one connection, never the node
                self.stats.rejected["internal error"] += 1
                log.exception("bus: connection from %s failed", _remote(stream))
            finally:
                current = self._inbound.get(peer)
                if current is not None and current.stream is stream:
                    del self._inbound[peer]

    async def _handshake_as_acceptor(self, stream: SocketStream) -> tuple[str, FrameReader]:
        buffered = BufferedByteReceiveStream(stream)
        acceptor = Acceptor(self.key, self.node_id)
        with anyio.fail_after(self.limits.handshake_timeout):
            await stream.send(acceptor.challenge(await buffered.receive_exactly(HELLO_SIZE)))
            accept = acceptor.verify(await buffered.receive_exactly(PROOF_SIZE))
            self._claim_identity(acceptor.peer_id, stream)
        try:
            with anyio.fail_after(self.limits.handshake_timeout):
                await stream.send(accept)
            reader = FrameReader(acceptor.frame_key)
            leftover = bytes(buffered.buffer)
            if leftover:
                for payload in reader.feed(leftover):
                    await self._dispatch(acceptor.peer_id, payload)
        except BaseException:
            # The caller never learns the id of a handshake that fails here:
            # give the claim back, or the peer's reconnects were refused as
            # "already connected" for stale_after seconds.
            if (claimed := self._inbound.get(acceptor.peer_id)) is not None \
                    and claimed.stream is stream:
                del self._inbound[acceptor.peer_id]
            raise
        return acceptor.peer_id, reader

    def _claim_identity(self, peer: str, stream: SocketStream) -> None:
        """One live inbound connection per peer id (see the module invariants)."""
        current = self._inbound.get(peer)
        now = time.monotonic()
        if current is not None and now - current.last_frame < self.limits.stale_after:
            raise WireError(f"node {peer[:8]} is already connected")
        if current is not None:
            self._tasks_close(current.stream)
        self._inbound[peer] = _Inbound(stream, now)

    def _tasks_close(self, stream: SocketStream) -> None:
        if self._tasks is not None:
            self._tasks.start_soon(_close_quietly, stream)

    async def _read(self, stream: SocketStream, peer: str, reader: FrameReader) -> None:
        while True:
            data = await stream.receive(65536)
            entry = self._inbound.get(peer)
            if entry is None or entry.stream is not stream:
                return  # replaced by a newer connection of the same node
            entry.last_frame = time.monotonic()
            for payload in reader.feed(data):
                await self._dispatch(peer, payload)

    async def _dispatch(self, peer: str, payload: bytes) -> None:
        try:
            message = decode(payload)  # any other MessageError closes the connection
        except UnknownKind:
            # A newer node's kind, authenticated: drop it, keep the link.
            self.stats.rejected["unknown kind"] += 1
            return
        self.stats.messages_in[message.KIND] += 1
        try:
            await self.handler(peer, message)
        except Exception:  # a handler bug must not take the link (or the node) down
            log.exception("bus: handling %s from %s failed", message.KIND, peer[:8])

    # ------------------------------------------------------------ sending

    def send(self, host: str, port: int, message: Message) -> None:
        """Queue ``message`` for the node at ``host:port`` (never blocks, never raises)."""
        if (host, port) == (self.host, self.port):
            return
        if not valid_host(host) or not valid_port(port):
            self.stats.rejected["bad address"] += 1
            return
        payload = encode(message)
        if len(payload) > MAX_MESSAGE:
            self.stats.rejected[f"outbound {message.KIND} too big"] += 1
            log.error("bus: a %d-byte %s message exceeds the frame limit; not sent",
                      len(payload), message.KIND)
            return
        link = self._links.get((host, port))
        if link is None:
            if len(self._links) >= self.limits.max_links:
                self.stats.rejected["too many links"] += 1
                return
            link = self._links[(host, port)] = _Link()
            if self._tasks is not None:
                self._tasks.start_soon(self._drain, host, port, link)
        self.stats.dropped += link.push(payload, message.KIND, self.limits)

    async def _drain(self, host: str, port: int, link: _Link) -> None:
        try:
            await self._drain_link(host, port, link)
        finally:
            if self._links.get((host, port)) is link:
                del self._links[(host, port)]

    async def _drain_link(self, host: str, port: int, link: _Link) -> None:
        backoff = 0.05
        while True:
            if not await self._has_work(link):
                return  # idle: the link goes (a later send makes a new one)
            try:
                stream = await anyio.connect_tcp(host, port, local_host=self.host)
            except Exception:  # OSError, and anything a resolver may raise
                if time.monotonic() - link.used > self.limits.link_idle:
                    # Unreachable, and nothing sent to it for that long (a
                    # node forgotten, an address mistyped): its messages go
                    # with the link, which kept its slot for ever before.
                    self.stats.dropped += len(link.take())
                    return
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            self.stats.connects_out += 1
            try:
                async with stream:
                    writer = await self._handshake_as_initiator(stream)
                    backoff = 0.05
                    while await self._has_work(link):
                        batch = link.take()
                        await stream.send(b"".join(writer.frame(p) for p, _kind in batch))
                        self.stats.messages_out.update(kind for _p, kind in batch)
            except WireError as exc:
                self.stats.rejected[f"outbound {type(exc).__name__}"] += 1
                log.warning("bus: %s:%s refused our handshake: %s", host, port, exc)
                await anyio.sleep(1.0)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.IncompleteRead,
                    anyio.ClosedResourceError, OSError, TimeoutError):
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            except Exception:
                self.stats.rejected["outbound internal error"] += 1
                log.exception("bus: link to %s:%s failed", host, port)
                await anyio.sleep(1.0)

    async def _has_work(self, link: _Link) -> bool:
        """Wait until the link has messages; False once it stayed idle too long."""
        if link.queue:
            return True
        link.ready = anyio.Event()
        with anyio.move_on_after(self.limits.link_idle):
            await link.ready.wait()
        return bool(link.queue)

    async def _handshake_as_initiator(self, stream: SocketStream) -> FrameWriter:
        buffered = BufferedByteReceiveStream(stream)
        initiator = Initiator(self.key, self.node_id)
        with anyio.fail_after(self.limits.handshake_timeout):
            await stream.send(initiator.hello())
            await stream.send(initiator.answer(await buffered.receive_exactly(CHALLENGE_SIZE)))
            initiator.accepted(await buffered.receive_exactly(ACCEPT_SIZE))
        return FrameWriter(initiator.frame_key)


async def _close_quietly(stream: SocketStream) -> None:
    try:
        await stream.aclose()
    except Exception:
        pass


async def accept_forever(listener: Any, handle: Callable[[Any], Coroutine[Any, Any, None]],
                         tasks: anyio.abc.TaskGroup, stats: BusStats) -> None:
    """The bus's accept loop (:func:`pgq.accepting.accept_forever`), with
    each failed accept counted in ``stats``."""
    def failed(_exc: BaseException) -> None:
        stats.rejected["accept failed"] += 1

    await accepting.accept_forever(listener, handle, tasks, "bus", failed)


def _remote(stream: SocketStream) -> str:
    try:
        host, port = stream.extra(anyio.abc.SocketAttribute.remote_address)[:2]
        return f"{host}:{port}"
    except Exception:
        return "?"
