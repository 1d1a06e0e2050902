"""Federation: moving queued jobs to nodes whose consumers wait (no I/O).

When consumers block on a queue that is empty here, the node asks others for
jobs (NEEDJOBS); a node with queued jobs answers with some of them
(YOURJOBS). :class:`Federation` paces the asking and measures imports.

Rules (Disque's):

* Discovery: NEEDJOBS(queue, 1) to every node, backing off 2 s * 2^n up to
  30 s while nothing comes back.
* Ad hoc: NEEDJOBS to the nodes that recently answered (responders expire
  after 5 s), sized by the import rate over the last seconds (5..100 jobs,
  split between responders), backing off 25 ms * 2^n up to 2 s; at once
  when the local queue has just drained and jobs are flowing (``reached_zero``;
  the node's core does not pass it: the ad hoc back-off paces that case too).
* Every received batch resets the ad hoc back-off; a batch from a node that
  was not a responder resets the discovery back-off too.
* A queue no consumer waits on any more, with no responder and nothing
  imported lately, is forgotten (``prune``): one reply queue per request (the
  RPC pattern) left an entry per queue ever waited on, each read 10-50
  times a second.
* A node that is importing a queue does not export it (no ping-pong).
* The exporter answers with at most half its queue (at least one job) and
  keeps its own copies of at-least-once jobs (retry timers still guard
  them); an at-most-once job is moved, never copied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pgq.backoff import doubling

__all__ = ["Federation", "QueueImports", "export_count"]

MIN_REQUEST, MAX_REQUEST = 5, 100
BCAST_MIN, BCAST_MAX = 2.0, 30.0
ADHOC_MIN, ADHOC_MAX = 0.025, 2.0
RESPONDER_TTL = 5.0
RATE_WINDOW = 5.0


def export_count(requested: int, queued: int) -> int:
    """How many jobs to hand over: all asked if we have twice as many, else half."""
    if queued <= 0:
        return 0
    count = requested if queued >= 2 * requested else queued // 2
    return max(count, 1)


@dataclass
class QueueImports:
    """Import bookkeeping and request pacing for one queue."""

    responders: dict[str, float] = field(default_factory=dict)  # node -> last import
    bcast_attempt: int = 0
    bcast_at: float = -math.inf
    adhoc_attempt: int = 0
    adhoc_at: float = -math.inf
    imports: list[tuple[float, int]] = field(default_factory=list)  # (time, count)

    def rate(self, now: float) -> int:
        """Jobs per second imported over the last few seconds (Disque's estimate)."""
        self.imports = [(t, n) for t, n in self.imports if now - t <= RATE_WINDOW]
        if not self.imports:
            return 0
        elapsed = max(now - self.imports[0][0], 0.05)
        return math.ceil(sum(n for _, n in self.imports) / elapsed)

    def live_responders(self, now: float) -> list[str]:
        self.responders = {n: t for n, t in self.responders.items() if now - t <= RESPONDER_TTL}
        return sorted(self.responders)


class Federation:
    def __init__(self) -> None:
        self.queues: dict[str, QueueImports] = {}

    def state(self, queue: str) -> QueueImports:
        return self.queues.setdefault(queue, QueueImports())

    def needs(self, queue: str, now: float, everyone: list[str],
              reached_zero: bool = False) -> list[tuple[list[str], int]]:
        """NEEDJOBS to send for a queue with waiting consumers: [(targets, count)]."""
        q = self.state(queue)
        rate = q.rate(now)
        if reached_zero and rate == 0:
            return []
        responders = q.live_responders(now)
        out: list[tuple[list[str], int]] = []
        bcast_delay = doubling(BCAST_MIN, q.bcast_attempt, BCAST_MAX)
        if now - q.bcast_at > bcast_delay and everyone:
            q.bcast_at = now
            q.bcast_attempt += 1
            out.append((list(everyone), 1))
        adhoc_delay = doubling(ADHOC_MIN, q.adhoc_attempt, ADHOC_MAX)
        if responders and (reached_zero or now - q.adhoc_at > adhoc_delay):
            q.adhoc_at = now
            q.adhoc_attempt += 1
            per_node = rate // len(responders) if rate else MIN_REQUEST
            out.append((responders, max(MIN_REQUEST, min(per_node, MAX_REQUEST))))
        return out

    def imported(self, queue: str, node: str, count: int, now: float) -> None:
        q = self.state(queue)
        if node not in q.responders:
            q.bcast_attempt = 0  # a new source: discovery may go on faster
        q.responders[node] = now
        q.imports.append((now, count))
        q.adhoc_attempt = 0

    def prune(self, waited: set[str], now: float) -> None:
        """Forget the queues not in ``waited`` that import nothing now."""
        for name, q in list(self.queues.items()):
            if name not in waited and not q.live_responders(now) and not q.rate(now):
                del self.queues[name]

    def importing(self, queue: str, now: float) -> bool:
        q = self.queues.get(queue)
        return q is not None and q.rate(now) > 0

    def stats(self, now: float) -> dict[str, tuple[list[str], int]]:
        """Per queue: (import-from nodes, import rate) for QSTAT."""
        out = {}
        for name, q in list(self.queues.items()):
            responders, rate = q.live_responders(now), q.rate(now)
            if responders or rate:
                out[name] = (responders, rate)
        return out
