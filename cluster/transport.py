"""The transport seam: how a node's messages reach other nodes.

A transport delivers :mod:`.messages` to ``host:port`` addresses and hands
every message it receives, with the sender's authenticated node id, to the
node's handler. The node relies on nothing more: messages may be lost,
delayed, duplicated or reordered between two nodes (the protocols re-send
what matters), and a peer's id is whatever the transport authenticated.

Implementations: :class:`.bus.Bus` (TCP, encrypted and authenticated
frames) and :class:`.mock_transport.MemoryTransport` (in-process, on a
:class:`.mock_transport.Network` that can drop, delay, duplicate, reorder
and partition).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from .messages import Message

__all__ = ["Transport", "Handler"]

# (sender's node id, message): may wait (back-pressure on that sender).
Handler = Callable[[str, Message], Awaitable[None]]


class Transport(Protocol):
    stats: Any  # counters: messages in/out by kind, rejected, dropped (see bus.BusStats)

    def send(self, host: str, port: int, message: Message) -> None:
        """Queue ``message`` for the node at ``host:port``; never blocks."""

    async def serve(self, *, task_status: Any = ...) -> None:
        """Accept and deliver messages until cancelled; ``task_status.started()``
        once the node can be reached."""
