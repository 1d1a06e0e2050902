"""Claim floors: where a claim starts walking a queue (no I/O).

Why: a claim walks a queue's ready index in ``ctime`` order. Every job
claimed before leaves a dead entry at the front of that index until VACUUM
removes it, and while another session holds an old snapshot (a long
transaction: the "xmin horizon") nothing can remove it, not even the hint
bits that let later scans skip it. A claim that starts at the front then
pays for every job ever claimed: behind a held horizon, four burn-downs of
100k jobs in a row (10 consumers) ran at 40k, 25k, 18k and 14k jobs/s here;
with floors, at 46k, 46k, 45k and 48k.

So a client remembers, per queue, a *floor*: a ctime at or below every job
it may still have to claim, and claims ``ctime >= floor``.

* After a claim, the floor of each queue becomes the highest ctime of the
  jobs it took from the ready index, minus ``MARGIN``. Below it, every job
  was taken by this claim or was locked by another statement (SKIP LOCKED);
  the margin covers adds that committed a few milliseconds after jobs
  created later (ctime is taken when the row is written, visibility comes
  at commit).
* Whatever may leave a job queued below a floor advances the database's
  *queue epoch* (schema 0007), which every claim reads: a statement that
  leaves a job with an older ctime queued (NACK, ENQUEUE, a due lease moved
  by the sweep, an import, a Spark ingestion, the first rows of a long COPY,
  an update that held the row's lock while a claim walked past it), and a
  claim that locked ready jobs it did not take. A client that sees the
  epoch move walks from the front for ``DIRTY_FOR`` seconds: the epoch
  moves just before the writer commits.
* A walk from the front that takes jobs below the floor found such jobs:
  the next claim walks from the front again, and so on until one takes
  none below it. One epoch move (a NACK of a thousand jobs, a sweep after
  a worker crash, a Spark merge) can leave more jobs below the floor than
  the claims of ``DIRTY_FOR`` take: they were then served COUNT at a time
  every ``FULL_WALK_EVERY`` seconds (found by a read-only review).
* What is left (a claim in a caller's transaction that rolled back, an add
  committed later than the margin inside a caller's transaction) is found
  by a *full walk*, made at least every ``FULL_WALK_EVERY`` seconds. Full
  walks cost at most ``FULL_WALK_SHARE`` of the time: one that took 0.3 s
  (a huge held horizon) waits 3 s before the next. Such a job is delivered
  late by that much; none is lost (FIFO is best effort, as in Disque).
* The state is per process (one :class:`Floors` per database): it costs no
  write anywhere and cannot bloat anything itself.
* The claim caps the floor at ``MARGIN`` before the database's now
  (``pgq.floor_cap()``, schema 0017): a job whose ctime lies ahead of that
  clock (from a node, or a Spark driver, whose clock is ahead) moved the
  floor past every job added after it, for as long as the clocks differed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Floors", "FROM_THE_FRONT", "MARGIN", "FULL_WALK_EVERY", "FULL_WALK_SHARE",
           "DIRTY_FOR"]

FROM_THE_FRONT = -(2**63)  # a floor below every ctime: a full walk
MARGIN = 50 * 1_000_000  # 50 ms in ctime units (ms * 10^6 + sequence); schema 0007's LATE_MS
FULL_WALK_EVERY = 2.0  # seconds
FULL_WALK_SHARE = 0.1  # of the time, at most, spent walking from the front
DIRTY_FOR = 0.25  # seconds of full walks after the epoch moved


@dataclass
class _Queue:
    floor: int = FROM_THE_FRONT
    walked_at: float = float("-inf")  # when the last full walk started
    cost: float = 0.0  # how long it took
    below: bool = False  # the last walk from the front took jobs below the floor: more may wait
    walked_from: int = FROM_THE_FRONT  # the floor in force when the last walk from the front began


class Floors:
    def __init__(self) -> None:
        self._queues: dict[str, _Queue] = {}
        self._epoch: int | None = None
        self._dirty_until = float("-inf")
        self._lock = threading.Lock()

    @property
    def epoch(self) -> int | None:
        """The queue epoch the last claim read (None before the first)."""
        return self._epoch

    def floor(self, queue: str) -> int:
        """The floor of ``queue`` (FROM_THE_FRONT if none yet)."""
        with self._lock:
            state = self._queues.get(queue)
            return FROM_THE_FRONT if state is None else state.floor

    def for_claim(self, queues: Sequence[str], now: float) -> list[int]:
        """The floor of each queue for a claim starting now (FROM_THE_FRONT
        where a full walk is due)."""
        with self._lock:
            floors = []
            for name in queues:
                state = self._queues.setdefault(name, _Queue())
                paced = max(FULL_WALK_EVERY, state.cost / FULL_WALK_SHARE)
                since = now - state.walked_at
                cheap_enough = since >= state.cost / FULL_WALK_SHARE
                dirty = (now < self._dirty_until or state.below) and cheap_enough
                if since >= paced or dirty:
                    state.walked_at = now
                    state.walked_from = state.floor
                    floors.append(FROM_THE_FRONT)  # this claim only: the floor stays
                else:
                    floors.append(state.floor)
            return floors

    def claimed(self, queues: Sequence[str], floors: Sequence[int],
                ready_ctimes: Iterable[tuple[str, int]], started: float, now: float,
                epoch: int | None = None) -> None:
        """Record a claim that started at ``started`` with ``floors``: it took,
        from the ready index, jobs of these (queue, ctime), and read ``epoch``."""
        highest: dict[str, int] = {}
        lowest: dict[str, int] = {}
        for name, ctime in ready_ctimes:
            highest[name] = max(highest.get(name, ctime), ctime)
            lowest[name] = min(lowest.get(name, ctime), ctime)
        with self._lock:
            if epoch is not None and epoch != self._epoch:
                if self._epoch is not None:
                    self._dirty_until = now + DIRTY_FOR
                self._epoch = epoch
            for name, used in zip(queues, floors, strict=True):
                state = self._queues.setdefault(name, _Queue())
                if used == FROM_THE_FRONT:
                    state.cost = now - started
                    # Against the floor this walk began with: concurrent
                    # claims of the process raise the floor meanwhile, past
                    # jobs this walk took in their place (no hole at all),
                    # and every claim walked from the front (found by a
                    # review of this rule: 70-86% of the claims with 16 to
                    # 64 consumers sharing the floors, against 0.1%).
                    state.below = name in lowest and lowest[name] < state.walked_from
                if name in highest:
                    state.floor = max(state.floor, highest[name] - MARGIN)

    def forget(self, queues: Iterable[str]) -> None:
        """Walk these queues from the front at the next claim."""
        with self._lock:
            for name in queues:
                self._queues.pop(name, None)
