"""Re-queue coordination between the holders of a job (no I/O).

A job replicated to several nodes is queued at one of them at a time; the
others hold *active* copies with a re-queue timer (``cluster_requeue_at``,
run by each holder's node process). When a timer comes due, the holder
must queue its copy without creating a second queued copy elsewhere.
Disque's answer, kept here:

* **WILLQUEUE**: a little before its timer fires (``ANNOUNCE_AHEAD``), a
  holder tells the other holders it is about to queue the job. A holder
  that has the job queued answers QUEUED (so the announcer postpones its
  timer); one that knows it acknowledged answers SETACK. An active copy
  whose timer would race the announcer's stands aside (postpones its own,
  in SQL: ``WILLQUEUE_STATE``), the lower node id going first when both
  are due within the window: a QUEUED alone arrives too late for timers
  closer together than a message takes.
* **QUEUED**: when the timer fires and the job is queued here, every other
  holder is told; each postpones its own timer by ``retry`` and, if it has
  the job queued too (both fired together), keeps it only if it wins the
  tie-break (the lower node id keeps it, in SQL: ``APPLY_QUEUED``).

**Parked copies** (pgq's, schema 0019). The holder that has the job
queued keeps watch: at every retry it says QUEUED again, so that a copy
queued elsewhere meanwhile (announcements lost) yields. In Disque each
QUEUED postpones every other copy's timer by one retry: with a backlog
older than the retry that is a row written on every holder for every
queued job at every retry (measured in the simulation: a 1,000-job backlog
queued on one of three nodes, retry 2 s, ten retries: 16,669 row updates on
each other node before, 1,369 parked). Here a copy that hears QUEUED is
*parked* on the sender:

* its timer goes ``PARKED_RETRIES`` retries out (never past half the TTL
  left: the default retry is a tenth of the TTL, and a timer past the
  expiry would never fire), and the sender's next QUEUEDs leave its row
  alone until less than half of that is left (in SQL: ``APPLY_QUEUED``);
* it comes back to one retry as soon as this node's membership sees the
  sender suspect, dead or gone, and at start for every sender not known
  alive (``UNPARK``): so a job whose queueing holder died is queued
  elsewhere about one retry after the death is suspected, as in Disque;
* a QUEUED from a sender this node does not see alive parks nothing for
  long: the sender's copies are brought back at the next timers step;
* a QUEUED that arrives late (the sender no longer has the job queued), a
  sender whose process runs on without its database, or a DELJOB run on
  the sender alone (not broadcast, as in Disque) delay the job by at most
  the parked timer: ``PARKED_RETRIES`` retries or half the TTL left.

Invariants:

* A timer is announced once per due time: an announcement is repeated only
  when the due time changed (the timer was postponed, then came due again).
* Announcements are forgotten as soon as their job is no longer due soon
  (fired, postponed, acknowledged): the set is bounded by the jobs due
  within ``ANNOUNCE_AHEAD``, and due times are compared with due times only
  (both from the database), never with this process's clock.
* Once re-queues settle, at most one holder has the job queued (the
  simulation checks it); a double re-queue in between costs a duplicate
  delivery, never a lost job.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["Requeues", "ANNOUNCE_AHEAD", "PARKED_RETRIES"]

ANNOUNCE_AHEAD = 0.5  # seconds before a timer fires that its WILLQUEUE goes out
PARKED_RETRIES = 10  # a parked copy's timer, in retries (see "Parked copies")


class Requeues:
    def __init__(self, myself: str) -> None:
        self.myself = myself
        self._announced: dict[str, Any] = {}  # job id -> due time announced

    def announce(self, soon: Iterable[tuple[str, Sequence[str], Any]]) -> dict[str, list[str]]:
        """Jobs due soon ``(id, holders, due)``: the WILLQUEUEs to send now,
        by peer (each job once per due time)."""
        current: dict[str, Any] = {}
        out: dict[str, list[str]] = {}
        for job_id, holders, due in soon:
            current[job_id] = due
            if self._announced.get(job_id) == due:
                continue
            for peer in holders:
                if peer != self.myself:
                    out.setdefault(peer, []).append(job_id)
        self._announced = current
        return out

    def fired(self, rows: Iterable[tuple[str, Sequence[str], bool]]) -> dict[tuple[str, str], list[str]]:
        """Timers that fired ``(id, holders, counted)``: the QUEUED notices to
        send, by (peer, counter to bump there)."""
        out: dict[tuple[str, str], list[str]] = {}
        for job_id, holders, counted in rows:
            self._announced.pop(job_id, None)
            counter = "additional_deliveries" if counted else ""
            for peer in holders:
                if peer != self.myself:
                    out.setdefault((peer, counter), []).append(job_id)
        return out

    def on_willqueue(self, states: Iterable[tuple[str, str, Sequence[str] | None]]
                     ) -> tuple[tuple[str, ...], tuple[tuple[str, tuple[str, ...]], ...]]:
        """A peer announced it will queue jobs; their state here ``(id,
        state, holders)``: the ids to answer QUEUED for (queued here) and the
        SETACK items for those acknowledged here."""
        states = list(states)
        queued = tuple(job_id for job_id, state, _ in states if state == "queued")
        acked = tuple((job_id, tuple(holders or ())) for job_id, state, holders in states
                      if state == "acked")
        return queued, acked
