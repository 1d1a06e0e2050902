"""An in-memory network and the transport on it (the TCP bus's twin).

:class:`Network` decides, with its own seeded random generator, what
happens to each message between two nodes: delivered after a delay,
delivered twice, delayed long enough to overtake later ones (reordering),
lost, or cut by a partition. It keeps no clock and delivers nothing itself:
it returns *routes* ``(delay, destination)``, and whoever drives time
delivers them (the simulation's scheduler, or :class:`MemoryTransport` on
anyio).

Invariants: a message reaches only a registered node, never one cut off
from the sender by a partition (checked when it is sent); every decision
comes from the network's generator, so a seed replays the same fate for
the same sequence of messages.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from . import messages as m
from .bus import BusStats

__all__ = ["NetworkFaults", "Network", "MemoryTransport"]


@dataclass
class NetworkFaults:
    drop: float = 0.0  # probability that a message is lost
    duplicate: float = 0.0  # probability that it arrives twice
    slow: float = 0.0  # probability of a long delay (it overtakes later messages)
    delay: tuple[float, float] = (0.0002, 0.002)  # one-way latency, seconds
    slow_delay: tuple[float, float] = (0.02, 0.4)

    @property
    def lossy(self) -> bool:
        return self.drop > 0 or self.slow > 0


@dataclass
class Network:
    rng: random.Random
    faults: NetworkFaults = field(default_factory=NetworkFaults)
    nodes: dict[tuple[str, int], str] = field(default_factory=dict)  # address -> node name
    cut: set[frozenset[str]] = field(default_factory=set)  # pairs that cannot talk

    def register(self, name: str, host: str, port: int) -> None:
        self.nodes[(host, port)] = name

    def partition(self, *groups: set[str]) -> None:
        """Cut every pair of nodes that are in different groups."""
        for i, a in enumerate(groups):
            for b in groups[i + 1:]:
                self.cut |= {frozenset((x, y)) for x in a for y in b}

    def heal(self) -> None:
        self.cut.clear()

    def can_talk(self, a: str, b: str) -> bool:
        return frozenset((a, b)) not in self.cut

    def route(self, sender: str, host: str, port: int) -> list[tuple[float, str]]:
        """What becomes of one message: ``[(delay, destination)]``, empty when lost."""
        target = self.nodes.get((host, port))
        if target is None or not self.can_talk(sender, target):
            return []
        faults = self.faults
        if faults.drop and self.rng.random() < faults.drop:
            return []
        copies = 2 if faults.duplicate and self.rng.random() < faults.duplicate else 1
        out = []
        for _ in range(copies):
            slow = faults.slow and self.rng.random() < faults.slow
            low, high = faults.slow_delay if slow else faults.delay
            out.append((self.rng.uniform(low, high), target))
        return out


class MemoryTransport:
    """:class:`~.transport.Transport` over a :class:`Network`, for node
    processes running in one anyio event loop (no sockets, no crypto).
    Messages are encoded and decoded as on the wire, so what a node sends
    is checked as the bus would check it."""

    def __init__(self, network: Network, registry: dict[str, MemoryTransport], name: str,
                 node_id: str, host: str, port: int,
                 handler: Callable[[str, m.Message], Awaitable[None]]) -> None:
        self.network = network
        self.registry = registry  # node name -> transport, shared by the nodes of one network
        self.name = name
        self.node_id = node_id
        self.handler = handler
        self.stats = BusStats()
        self._tasks: Any = None
        network.register(name, host, port)
        registry[name] = self

    async def serve(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            task_status.started()
            await anyio.sleep_forever()

    def send(self, host: str, port: int, message: m.Message) -> None:
        payload = m.encode(message)
        self.stats.messages_out[message.KIND] += 1
        for delay, target in self.network.route(self.name, host, port):
            peer = self.registry.get(target)
            if peer is not None and peer._tasks is not None:
                peer._tasks.start_soon(peer._deliver, delay, self.node_id, payload)

    async def _deliver(self, delay: float, sender: str, payload: bytes) -> None:
        await anyio.sleep(delay)
        message = m.decode(payload)
        self.stats.messages_in[message.KIND] += 1
        await self.handler(sender, message)
