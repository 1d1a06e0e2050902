"""When a worker must extend which lease: a schedule, no I/O.

A worker holds many claimed jobs at once. Each job with ``retry > 0`` must
be extended (WORKING) before its lease runs out, or another consumer gets
it. Instead of one sleeping task per job, the worker keeps one schedule for
all of them and one task that sleeps until the earliest extension is due.

Invariants: a job is extended every ``max(retry / 2, min_interval)``
seconds from when it was added, so an extension is sent while at least half
of the lease is left; a discarded job is never reported due again; ``due``
reports each due job once and reschedules it one interval after ``now``
(the extension sent then renews the lease from then).
"""

from __future__ import annotations

import heapq

__all__ = ["LeaseSchedule"]


class LeaseSchedule:
    def __init__(self, min_interval: float = 0.05) -> None:
        self._min_interval = min_interval
        self._heap: list[tuple[float, str]] = []
        self._interval: dict[str, float] = {}
        self._at: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._interval)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._interval

    def add(self, job_id: str, retry: float, now: float) -> None:
        """Start extending ``job_id``, whose lease is ``retry`` seconds."""
        interval = max(retry / 2, self._min_interval)
        self._interval[job_id] = interval
        self._schedule(job_id, now + interval)

    def discard(self, job_id: str) -> None:
        """The job is done (acked, failed, or its lease cannot be extended)."""
        self._interval.pop(job_id, None)
        self._at.pop(job_id, None)  # its heap entry is skipped when it surfaces

    def next_at(self) -> float | None:
        """When the earliest extension is due (None: nothing to extend)."""
        self._drop_stale_entries()
        return self._heap[0][0] if self._heap else None

    def due(self, now: float) -> list[str]:
        """The jobs to extend now; each is rescheduled one interval from now."""
        jobs = []
        self._drop_stale_entries()
        while self._heap and self._heap[0][0] <= now:
            _, job_id = heapq.heappop(self._heap)
            jobs.append(job_id)
            # The extension sent now renews the lease from now.
            self._schedule(job_id, now + self._interval[job_id])
            self._drop_stale_entries()
        return jobs

    def _schedule(self, job_id: str, at: float) -> None:
        self._at[job_id] = at
        heapq.heappush(self._heap, (at, job_id))

    def _drop_stale_entries(self) -> None:
        # Entries of discarded (or rescheduled) jobs stay in the heap until
        # they reach the top: discarding is O(1) and the heap stays valid.
        while self._heap and self._at.get(self._heap[0][1]) != self._heap[0][0]:
            heapq.heappop(self._heap)
