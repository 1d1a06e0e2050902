"""The node's inbox of job messages, with back-pressure.

The bus hands each job message of a peer's link to :meth:`Inbox.put`,
which waits while the inbox is full (``limit`` messages or ``max_bytes``
of them, as ``weight`` counts): the bus does not read that link again
until then, so a flood costs the flooder. The node's inbox loop takes
everything at once (:meth:`Inbox.take`), which makes room for every link
waiting.

Invariant: the links waiting for room all wait on one event, which only
:meth:`take` replaces, before it sets the old one, so no waiter misses its
wake-up. Each waiter used to make an event of its own in its turn, and the
taker set only the last one: a link that waited first was never read
again, and its node's replies (GOTJOB, SETACK, GOTACK, QUEUED) were lost
for good while its membership stayed alive (found by a read-only review).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import anyio

__all__ = ["Inbox"]

T = TypeVar("T")


class Inbox(Generic[T]):
    def __init__(self, limit: int, max_bytes: int, weight: Callable[[T], int]) -> None:
        self.limit = limit
        self.max_bytes = max_bytes
        self.weight = weight
        self._items: list[T] = []
        self._bytes = 0
        self._ready = anyio.Event()
        self._room = anyio.Event()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def full(self) -> bool:
        return len(self._items) >= self.limit or self._bytes >= self.max_bytes

    async def put(self, item: T) -> None:
        """Queue ``item`` once there is room (the caller's link waits)."""
        while self.full:
            await self._room.wait()
        self._items.append(item)
        self._bytes += self.weight(item)
        self._ready.set()

    async def take(self) -> list[T]:
        """Everything queued, once there is something; room for every waiter."""
        await self._ready.wait()
        self._ready = anyio.Event()
        items, self._items, self._bytes = self._items, [], 0
        room, self._room = self._room, anyio.Event()
        room.set()
        return items
