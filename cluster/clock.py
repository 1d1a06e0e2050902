"""The clock seam: protocol code reads time only through a :class:`Clock`.

Two readings, never mixed: ``monotonic()`` for every duration and deadline
the node keeps itself (probe timeouts, back-offs, replication grace), and
``wall()`` for what must agree with other processes' clocks (nothing in the
protocol today: the database's own timestamps are compared in SQL). The node
process uses :class:`SystemClock`; the simulation a :class:`VirtualClock`
that only moves when the simulation says so.
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "SystemClock", "VirtualClock"]


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...


class SystemClock:
    """The process's real clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class VirtualClock:
    """Time that moves only by :meth:`advance_to` (the simulation's scheduler).
    Wall time is the monotonic time plus a fixed epoch, plus ``skew``."""

    def __init__(self, start: float = 0.0, epoch: float = 1_800_000_000.0) -> None:
        self.now = start
        self.epoch = epoch
        self.skew = 0.0  # seconds this node's wall clock is off

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.epoch + self.now + self.skew

    def advance_to(self, t: float) -> None:
        if t < self.now:
            raise ValueError(f"virtual time runs forward only ({t} < {self.now})")
        self.now = t
