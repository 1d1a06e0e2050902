"""Acknowledgement propagation and garbage collection across holders (no I/O).

When a job is acknowledged on a node, every node that may hold a copy must
learn it before the job can be forgotten; otherwise a holder's re-queue timer
would deliver it again. :class:`AckCollector` decides whom to send SETACK to
and when the acked tombstone can go.

Rules (Disque's):

* The acking node sends SETACK (with the holders it knows) to every holder;
  a holder stores the ack durably, then answers GOTACK(known).
* Unanswered holders get SETACK again, backing off 1 s * 2^n up to 3 min.
  An ack is kept as long as any holder has not confirmed (unreachable
  holders included), and at most until the job's TTL. A holder that comes
  back (seen alive again) gets its SETACKs at once (:meth:`AckCollector.peer_back`):
  backed off meanwhile, they reached it minutes after its copies' timers
  had queued the job there again.
* When every holder confirmed, the acking node sends DELJOB to all of them
  and drops its tombstone.
* A *dummy* ack (ACK of an ID this node never held) is sent to every known
  node: a node that knows the job takes over the GC (``known``); if none
  does, the dummy is dropped once every node answered.
* A holder that learns of more holders than the sender knew drives the GC
  for them itself (:func:`take_over`); a dummy ack that reached the only
  holder is complete at once. The sender's DELJOB does not end a GC taken
  over this way (:meth:`AckCollector.on_deljob`).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from pgq.backoff import doubling

__all__ = ["AckCollector", "PendingAck", "Outcome", "TakeOver", "take_over"]

FIRST_RETRY = 1.0
MAX_RETRY = 180.0


@dataclass
class PendingAck:
    job_id: str
    holders: set[str]  # other nodes that may hold a copy
    dummy: bool
    confirmed: set[str] = field(default_factory=set)
    attempt: int = 0
    next_try: float = 0.0


@dataclass(frozen=True)
class Outcome:
    """What to do once a GC finished: DELJOB to ``deljob_to`` (possibly
    nobody), then drop the local tombstone."""

    job_id: str
    deljob_to: tuple[str, ...]


class AckCollector:
    def __init__(self, myself: str) -> None:
        self.myself = myself
        self.pending: dict[str, PendingAck] = {}
        self._back: dict[str, float] = {}  # peer -> until when peer_back ignores it
        # (next try, tie, job id) of every entry, so that sends() touches the
        # due ones only: it walked every pending ACK ten times a second, and
        # ACKs wait for a dead holder until their TTL (millions of them after
        # hours of traffic: the walk starved the node's event loop; found by
        # a read-only review). Items of entries that ended or were
        # rescheduled since stay until they come up, and are skipped.
        self._due: list[tuple[float, int, str]] = []
        self._tie = itertools.count()

    def _schedule(self, entry: PendingAck) -> None:
        heapq.heappush(self._due, (entry.next_try, next(self._tie), entry.job_id))

    def add(self, job_id: str, holders: set[str] | None, now: float,
            everyone: set[str] | None = None) -> None:
        """Start (or widen) the GC of ``job_id``. ``holders`` None means a dummy
        ack: the copy's whereabouts are unknown, so ``everyone`` is asked."""
        dummy = holders is None
        targets = set(everyone or ()) if dummy else set(holders or ())
        targets.discard(self.myself)
        entry = self.pending.get(job_id)
        if entry is None:
            entry = self.pending[job_id] = PendingAck(job_id, targets, dummy, next_try=now)
            self._schedule(entry)
        else:
            new = targets - entry.holders
            if new:
                entry.holders |= new
                entry.next_try = now
                self._schedule(entry)

    def sends(self, now: float, reachable: set[str]) -> dict[str, list[tuple[str, tuple[str, ...]]]]:
        """SETACKs due now, grouped by peer: (job id, holders we know)."""
        out: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
        while self._due and self._due[0][0] <= now:
            when, _tie, job_id = heapq.heappop(self._due)
            entry = self.pending.get(job_id)
            if entry is None or entry.next_try != when:
                continue  # ended, or rescheduled since
            entry.next_try = now + doubling(FIRST_RETRY, entry.attempt, MAX_RETRY)
            entry.attempt += 1
            self._schedule(entry)
            known = () if entry.dummy else tuple(sorted(entry.holders | {self.myself}))
            for peer in entry.holders - entry.confirmed:
                if peer in reachable:
                    out.setdefault(peer, []).append((entry.job_id, known))
        return out

    def got_ack(self, peer: str, job_id: str, known: bool) -> Outcome | None:
        """Record GOTACK; return the outcome if the GC of the job is complete."""
        entry = self.pending.get(job_id)
        if entry is None:
            return None
        if entry.dummy:
            if known:
                # An authoritative holder was reached: it drives the GC now.
                del self.pending[job_id]
                return Outcome(job_id, ())
            entry.confirmed.add(peer)
            if entry.confirmed >= entry.holders:
                del self.pending[job_id]
                return Outcome(job_id, ())
            return None
        if known or peer in entry.holders:
            entry.holders.add(peer)
            entry.confirmed.add(peer)
        if entry.confirmed >= entry.holders:
            del self.pending[job_id]
            return Outcome(job_id, tuple(sorted(entry.holders)))
        return None

    def forget(self, job_id: str) -> None:
        self.pending.pop(job_id, None)

    def peer_back(self, node_id: str, now: float) -> None:
        """``node_id`` is back (alive again, or restarted): the collections
        waiting for it go now. Their back-off is kept, and a peer that
        flaps is served at most once per ``FIRST_RETRY * 2**4`` seconds."""
        if now < self._back.get(node_id, float("-inf")):
            return
        self._back[node_id] = now + FIRST_RETRY * 2**4
        for entry in self.pending.values():
            if node_id in entry.holders and node_id not in entry.confirmed and entry.next_try > now:
                entry.next_try = now
                self._schedule(entry)

    def on_deljob(self, peer: str, job_id: str) -> bool:
        """A DELJOB from ``peer``: its GC of the job is over. A GC this node
        drives for holders the sender never knew (taken over) goes on: True,
        keep the tombstone. Otherwise the job is forgotten here (False).

        Found by a scenario (tests/cluster/test_scenarios.py): the acker's
        DELJOB reached the holder that had just taken the GC over for a node
        that imported the job, and wiped the tombstone before any SETACK
        went out: the importer's copy was never collected."""
        entry = self.pending.get(job_id)
        if entry is not None and not entry.dummy:
            entry.confirmed.add(peer)
            if entry.holders - entry.confirmed - {peer}:
                return True
        self.pending.pop(job_id, None)
        return False

    def forget_node(self, node_id: str) -> list[Outcome]:
        """A node was FORGOTTEN (removed for good): stop waiting for it."""
        done = []
        for entry in list(self.pending.values()):
            entry.holders.discard(node_id)
            entry.confirmed.discard(node_id)
            if entry.confirmed >= entry.holders:
                del self.pending[entry.job_id]
                done.append(Outcome(entry.job_id, () if entry.dummy else tuple(sorted(entry.holders))))
        return done


@dataclass(frozen=True)
class TakeOver:
    """What a holder does after applying SETACKs (see :func:`take_over`)."""

    drive: dict[str, set[str]]  # job -> every holder: this node drives their GC
    finished: list[str]  # jobs whose GC is complete here (a dummy ack reached the only holder)


def take_over(myself: str, applied: list[tuple[str, bool, list[str] | None]],
              told: dict[str, set[str]], askers: dict[str, set[str]]) -> TakeOver:
    """After SETACKs were applied here: ``applied`` is ``(job, known here,
    holders we knew)`` per job, ``told`` the holders the senders named,
    ``askers`` who sent the SETACK. Holders the senders did not know of (all
    of them, for a dummy ack) would never hear of the ack: this node drives
    their GC. A dummy ack (``told`` empty) that reached a holder knowing no
    other holder is complete."""
    drive: dict[str, set[str]] = {}
    finished: list[str] = []
    for job_id, known, local_nodes in applied:
        if not known:
            continue
        named = told.get(job_id, set())
        extra = set(local_nodes or ()) - named - {myself} - askers.get(job_id, set())
        if extra:
            drive[job_id] = set(local_nodes or ()) | named
        elif not named:
            finished.append(job_id)
    return TakeOver(drive, finished)
