"""Replication of new jobs to other nodes, as seen by the origin (no I/O).

For each job the origin must copy, :class:`Replicator` decides whom to send
REPLJOB to and when, and reports when enough peers confirmed (GOTJOB).

Rules (Disque's, with its defects avoided):

* A job needing W copies starts with W-1 random reachable peers (W if the
  origin is leaving: it keeps no copy itself).
* While short of confirmations it widens to one more reachable peer every
  ``widen_every`` seconds and re-sends to the peers that stayed silent, so
  a target that died (or came back) does not stall the add.
* A peer confirms only after its copy is committed, so "achieved" means W
  durable copies (the origin's own copy was committed before replication
  started).
* Synchronous jobs are given up only when the client gives up (its timeout)
  or the job expires; the caller then sends DELJOB to every peer it may
  have reached. Asynchronous and transactional jobs are never given up while
  they live: replication continues until W copies exist.
* A node that is leaving keeps no copy: a synchronous add drained while it
  leaves is replicated *externally* (W copies elsewhere), then handed over
  to one holder (:meth:`Pending.heir`), which queues it.
* A job whose W was defaulted carries a *minimum*: once that many peers
  confirmed and ``GRACE`` seconds passed since replication started, the job
  is achieved (:meth:`Replicator.settled`) even if the last targets stay
  silent - a node that is down but not yet declared dead must not stop
  adds. It then stays pending, as an asynchronous job, until its W copies
  exist. A job with an explicit W never settles for less.
* A job that ends (acknowledged, deleted, withdrawn) while REPLJOBs to
  some targets are unconfirmed is remembered with those targets
  (:meth:`Replicator.late_copies`, up to ``LATE_MAX`` jobs, until its
  TTL): a REPLJOB still on its way lands after the end, and the copy it
  stores knew of no ACK; once the origin's tombstone was swept it queued
  the job again at its retry (found by a read-only review). The origin
  answers such a copy's GOTJOB or WILLQUEUE with DELJOB.
* A job short of copies for long (a peer that refuses them silently: its
  queue paused for input, with no other node to widen to) costs little:
  its re-sends back off (``RESEND_EVERY`` doubling up to ``RESEND_MAX``),
  and each step looks only at the jobs due then (a heap by due time, as
  pgq.cluster.acks does): every step walked every pending job four times,
  and re-sent every body each second, so 100,000 of them took 2.5 s of CPU
  a second (found by a read-only review).
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from dataclasses import dataclass, field

from .messages import JobCopy

__all__ = ["Replicator", "Pending", "WIDEN_EVERY", "GRACE"]

WIDEN_EVERY = 0.05  # Disque's DELAYED_JOB_ADD_NODE_MIN_PERIOD
RESEND_EVERY = 1.0  # the first re-send to a silent target; doubling after
RESEND_MAX = 60.0
RESEND_DOUBLINGS = 6  # 2 ** 6 s is past RESEND_MAX
LATE_MAX = 65_536  # ended jobs whose copies may still land (about 13 MB at most)
# How long the last copies of a defaulted-W job may take before a minimum
# suffices: far above a healthy confirmation (a few ms), far below the
# client's replication timeout (5 s).
GRACE = 0.5


@dataclass
class Pending:
    copy: JobCopy
    needed: int  # confirmations from peers needed
    sync: bool
    expires: float  # monotonic deadline (job TTL)
    started: float = 0.0
    minimum: int = 0  # confirmations that suffice after GRACE (0: needed)
    external: bool = False  # a leaving origin: every copy goes elsewhere, none stays here
    sent: set[str] = field(default_factory=set)
    confirmed: set[str] = field(default_factory=set)
    recorded: set[str] = field(default_factory=set)  # targets the origin's row names as holders
    next_widen: float = 0.0
    next_resend: float = 0.0
    resends: int = 0  # re-sends so far (their back-off)
    due: float = 0.0  # when sends() looks at it next (its place in the heap)

    @property
    def achieved(self) -> bool:
        return len(self.confirmed) >= self.needed

    def good_enough(self, now: float, grace: float) -> bool:
        return 0 < self.minimum <= len(self.confirmed) and now >= self.started + grace

    def holders(self, myself: str) -> tuple[str, ...]:
        """Nodes that may hold a copy: the targets, and this node unless external."""
        nodes = set(self.sent)
        if not self.external:
            nodes.add(myself)
        return tuple(sorted(nodes))

    def confirmed_holders(self, myself: str) -> tuple[str, ...]:
        return tuple(sorted(self.confirmed | (set() if self.external else {myself})))

    def heir(self) -> str:
        """The holder an external job is handed to (it queues the job)."""
        return sorted(self.confirmed)[0]


class Replicator:
    """Which REPLJOBs to send, and which jobs reached their copies."""

    def __init__(self, myself: str, rng: random.Random | None = None,
                 widen_every: float = WIDEN_EVERY, grace: float = GRACE) -> None:
        self.myself = myself
        self.rng = rng or random.Random()
        self.widen_every = widen_every
        self.grace = grace
        self.pending: dict[str, Pending] = {}
        # (due, id) and (expires, id), stale entries skipped as they come up;
        # the ids of synchronous jobs that may settle for their minimum.
        self._due: list[tuple[float, str]] = []
        self._expiry: list[tuple[float, str]] = []
        self._soft: set[str] = set()
        self._unrecorded: set[str] = set()
        self._reachable: frozenset[str] = frozenset()  # at the last sends()
        # job -> (targets never confirmed, expires): see late_copies
        self._ended: OrderedDict[str, tuple[frozenset[str], float]] = OrderedDict()

    def add(self, copy: JobCopy, needed: int, sync: bool, now: float, ttl_left: float,
            minimum: int | None = None, external: bool = False) -> None:
        """Replicate ``copy`` to ``needed`` peers; ``minimum`` (< needed) peers
        suffice after the grace period (a defaulted W); ``external``: this
        node keeps no copy (it is leaving)."""
        if copy.id in self.pending or needed <= 0:
            return
        self._ended.pop(copy.id, None)  # stored again under its ID (a retried add): alive
        soft = minimum if minimum is not None and 0 < minimum < needed else 0
        entry = Pending(copy, needed, sync, now + ttl_left, started=now, minimum=soft,
                        external=external, due=now)
        self.pending[copy.id] = entry
        heapq.heappush(self._due, (now, copy.id))
        heapq.heappush(self._expiry, (entry.expires, copy.id))
        if sync and soft:
            self._soft.add(copy.id)

    def resume(self, copy: JobCopy, state: str, confirmed: list[str], repl_min: int | None,
               ttl_left: float, leaving: bool, now: float) -> None:
        """Replicate a job this node stored (drained from the outbox, or
        found unreplicated after a restart): ``state`` 'wait-repl' is a
        synchronous add. External replication (W copies elsewhere, none
        here): the job was stored while this node was leaving (no holder
        recorded, not even us), or is a synchronous add drained while leaving.

        The holders the database knows (``copy.nodes`` delivered,
        ``confirmed``) are where copies already are: they count, and every
        copy sent from now on names them. A restarted origin that forgot
        them sent copies naming only itself and the new target, and holders
        that never heard of each other could not agree on one queued copy
        (found by the simulation, seed 41)."""
        sync = state == "wait-repl"
        external = sync and (not confirmed or leaving)
        mine = 0 if external else 1
        if copy.id in self.pending or copy.repl - mine <= 0:
            return
        soft = None if repl_min is None else int(repl_min) - mine
        self.add(copy, copy.repl - mine, sync, now, ttl_left, minimum=soft, external=external)
        entry = self.pending[copy.id]
        entry.confirmed = set(confirmed) - {self.myself}
        entry.sent = (set(copy.nodes) | entry.confirmed) - {self.myself}
        entry.recorded = set(entry.sent)  # read from the row
        if entry.achieved:  # its copies exist already (an event drained after a restart)
            del self.pending[copy.id]

    def confirmed(self, peer: str, ids: list[str]) -> list[Pending]:
        """Record GOTJOB; return the jobs that just reached their copies."""
        done = []
        for job_id in ids:
            entry = self.pending.get(job_id)
            if entry is None:
                continue
            entry.sent.add(peer)
            entry.confirmed.add(peer)
            if entry.achieved:
                done.append(self.pending.pop(job_id))
            elif peer not in entry.recorded:
                self._unrecorded.add(job_id)
        return done

    def settled(self, now: float) -> list[Pending]:
        """Synchronous jobs that reached their minimum and whose grace ran
        out: achieved now. They stay pending (asynchronous from now on) until
        their W copies exist."""
        done = []
        for job_id in list(self._soft):
            entry = self.pending.get(job_id)
            if entry is None or not entry.sync:
                self._soft.discard(job_id)
            elif entry.good_enough(now, self.grace):
                entry.sync = False
                self._soft.discard(job_id)
                done.append(entry)
        return done

    def unrecorded(self) -> list[Pending]:
        """Jobs sent to targets the origin's row does not name yet: record
        them (RECORD_HOLDERS) before these REPLJOBs go (see :meth:`sends`)."""
        found = [e for i in self._unrecorded if (e := self.pending.get(i)) is not None
                 and e.sent - e.recorded]
        self._unrecorded = {e.copy.id for e in found}  # the caller records them now
        return found

    def forget(self, job_id: str, ended: bool = False) -> Pending | None:
        """Stop replicating (client gave up, job acked or deleted). ``ended``:
        the job is done with, so a copy that lands later must go (its
        unconfirmed targets are remembered for :meth:`late_copies`)."""
        entry = self.pending.pop(job_id, None)
        if ended and entry is not None and entry.sent - entry.confirmed:
            self._ended[job_id] = (frozenset(entry.sent - entry.confirmed), entry.expires)
            self._ended.move_to_end(job_id)
            while len(self._ended) > LATE_MAX:
                self._ended.popitem(last=False)
        return entry

    def late_copies(self, peer: str, ids: list[str] | tuple[str, ...], now: float) -> list[str]:
        """Of ``ids``, which ``peer`` (GOTJOB: it stored them; WILLQUEUE: it
        holds them) must delete: jobs that ended while its REPLJOB was on
        its way. Kept after the answer: a DELJOB may be lost, and the
        copy's next WILLQUEUE gets one again."""
        late = []
        for job_id in ids:
            found = self._ended.get(job_id)
            if found is None:
                continue
            if job_id in self.pending:  # replicated again under its ID: its copies count
                del self._ended[job_id]
                continue
            targets, expires = found
            if expires <= now:
                del self._ended[job_id]
            elif peer in targets:
                late.append(job_id)
        return late

    def expired(self, now: float) -> list[Pending]:
        if len(self._expiry) > 2 * len(self.pending) + 1024:
            # Mostly jobs that got their copies (or were forgotten) long
            # before their TTL: rebuilt, or it grew with every add for a day.
            self._expiry = [(e.expires, i) for i, e in self.pending.items()]
            heapq.heapify(self._expiry)
        gone = []
        while self._expiry and self._expiry[0][0] <= now:
            expires, job_id = heapq.heappop(self._expiry)
            entry = self.pending.get(job_id)
            if entry is not None and entry.expires == expires:
                del self.pending[job_id]
                gone.append(entry)
        return gone

    def sends(self, now: float, reachable: list[str]) -> dict[str, list[JobCopy]]:
        """REPLJOBs to send now, grouped by peer: of the jobs due now only."""
        out: dict[str, list[JobCopy]] = {}
        reachable_now = frozenset(reachable)
        came = reachable_now - self._reachable
        if came:
            # A peer came (back): a job short of copies that never went there
            # may widen to it now, not at its next re-send (up to a minute
            # out). Only those: a peer flapping between suspect and alive
            # re-heaped every pending job each time.
            for entry in self.pending.values():
                widens = bool(came - entry.sent)
                # one it was sent to and never confirmed (its REPLJOB lost
                # while it was away) gets it again now, not at the next
                # re-send of the back-off (up to a minute out)
                resends = bool(came & (entry.sent - entry.confirmed))
                if entry.due > now and (widens or resends):
                    entry.due = now
                    if widens:
                        entry.next_widen = min(entry.next_widen, now)
                    if resends:
                        entry.next_resend = now
                    heapq.heappush(self._due, (now, entry.copy.id))
            if len(self._due) > 2 * len(self.pending) + 1024:
                self._due = [(e.due, i) for i, e in self.pending.items()]
                heapq.heapify(self._due)
        self._reachable = reachable_now
        while self._due and self._due[0][0] <= now:
            due, job_id = heapq.heappop(self._due)
            entry = self.pending.get(job_id)
            if entry is None or entry.due != due:
                continue  # gone, or rescheduled (a later heap entry holds it)
            targets = self._targets(entry, now, reachable)
            self._reschedule(entry, reachable)
            if not targets:
                continue
            entry.sent.update(targets)
            if entry.sent - entry.recorded:
                self._unrecorded.add(job_id)
            copy = JobCopy(**{**_fields(entry.copy), "nodes": entry.holders(self.myself)})
            for target in dict.fromkeys(targets):
                out.setdefault(target, []).append(copy)
        return out

    def _targets(self, entry: Pending, now: float, reachable: list[str]) -> list[str]:
        """Whom ``entry`` goes to now: its first W, one more peer every
        ``widen_every``, and its silent targets again when a re-send is due."""
        if not entry.sent:
            candidates = list(reachable)
            self.rng.shuffle(candidates)
            entry.next_widen = now + self.widen_every
            entry.next_resend = now + RESEND_EVERY
            return candidates[:entry.needed]
        targets: list[str] = []
        if now >= entry.next_widen:
            entry.next_widen = now + self.widen_every
            candidates = [n for n in reachable if n not in entry.sent]
            if candidates:
                targets.append(self.rng.choice(candidates))
        if now >= entry.next_resend:
            entry.next_resend = now + min(RESEND_EVERY * 2 ** entry.resends, RESEND_MAX)
            # Capped: 2.0 ** 1024 overflows (17 h of re-sends), and the job
            # fell out of the heap for good (found by a read-only review).
            entry.resends = min(entry.resends + 1, RESEND_DOUBLINGS)
            targets += [n for n in entry.sent - entry.confirmed if n in reachable]
        return targets

    def _reschedule(self, entry: Pending, reachable: list[str]) -> None:
        """Its next look: at its next widening while a reachable peer is left
        to widen to (or no target at all yet), else at its next re-send."""
        widening = not entry.sent or any(n not in entry.sent for n in reachable)
        entry.due = min(entry.next_widen, entry.next_resend) if widening else entry.next_resend
        heapq.heappush(self._due, (entry.due, entry.copy.id))


def _fields(copy: JobCopy) -> dict[str, object]:
    return {name: getattr(copy, name) for name in copy.__slots__}
