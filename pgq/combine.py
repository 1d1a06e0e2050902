"""Group commit across concurrent callers: many calls, one statement, one commit.

A combiner takes calls of one kind (adds, claims, acks) from any number of
concurrent callers and hands them to a ``flush`` function in batches. The
caller that makes a flush passes its own *context* (the client whose pool
runs it), so one combiner may serve several clients of the same database.
Its rule, the one Disque applies to its AOF per event-loop turn:

* **No flush in flight: the caller flushes at once**, alone. A lone caller
  pays nothing for the batching (no timer, no hand-off to another thread).
* **A flush in flight: the call waits in the queue.** When the flush ends,
  everything that gathered meanwhile goes in the next flush, made by one
  of the waiting callers (the first one; the others sleep until their
  results are in). So throughput grows with the callers: N callers that
  arrive during one flush share the next one.

Invariants:

* Every call gets exactly its own outcome: a result, or an exception that
  is raised in its caller only (``flush`` returns one outcome per call, in
  order; if ``flush`` itself raises, every call of that batch gets that
  error; if the leader's thread is interrupted, the others an ordinary
  error saying their outcome is unknown).
* A flush runs to its end whatever cancels its leader, anyio's cancel
  scopes or asyncio's ``Task.cancel()`` alike (:mod:`pgq.cancelsafe`); the
  leader's cancellation is raised in the leader only, after the flush.
* A caller interrupted while it waits leaves the queue, and passes on the
  next flush if it was to make it. A caller cancelled while its call is in
  a flush waits for its outcome, as the leader does: anyio's cancellation
  hands it the outcome first (anyio cancels again at its next checkpoint);
  asyncio's, which must not be swallowed, is raised after it, carrying the
  jobs of a delivering combiner's call (claims;
  :func:`pgq.cancelsafe.undelivered`).
* At most ``parallel`` flushes are in flight at once.
* Calls are flushed in arrival order.
* A batch weighs at most ``limit`` (by ``weigh``: an add's body bytes)
  unless its leader's call alone weighs more: the calls past the limit
  wait for the next flush. One statement of many large bodies passed
  PostgreSQL's 1 GiB bound on a value and failed every call of the batch.

The waiting is the only thing that differs between threads and tasks:
:class:`SyncCombiner` (threads, for :class:`pgq.Client`) and
:class:`AsyncCombiner` (anyio tasks, for :class:`pgq.AsyncClient`) share the
queueing rule in :class:`_Queue`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio

from . import cancelsafe
from .errors import DatabaseUnavailableError

__all__ = ["Outcome", "SyncCombiner", "AsyncCombiner", "Failed", "Shared"]

C = TypeVar("C")  # a call
R = TypeVar("R")  # its result


@dataclass(frozen=True, slots=True)
class Failed:
    """The outcome of a call that failed: raised in its caller."""

    error: BaseException


Outcome = Any  # a result, or Failed


@dataclass(eq=False)
class _Slot(Generic[C]):
    call: C
    context: Any = None
    outcome: Outcome = None
    done: bool = False
    lead: bool = False  # chosen to make a flush (on arrival, or woken for the next one)
    gate: Any = None  # SyncCombiner: a held lock its waiting caller blocks on (released once)
    taken: list[Any] | None = None  # a leader's batch, once taken (_Queue.take)


@dataclass
class _Queue(Generic[C]):
    """Who flushes what (no I/O, no waiting): the shared rule."""

    parallel: int = 1
    weigh: Callable[[C], int] | None = None
    limit: int = 0
    waiting: list[_Slot[C]] = field(default_factory=list)
    flushing: int = 0

    def arrive(self, slot: _Slot[C]) -> bool:
        """Queue a call; True if its caller must flush now."""
        self.waiting.append(slot)
        if self.flushing < self.parallel:
            self.flushing += 1
            slot.lead = True
            return True
        return False

    def take(self, leader: _Slot[C]) -> list[_Slot[C]]:
        """The leader's batch: its own call and every waiting call that no
        other leader is about to flush (with ``parallel`` > 1, a leader that
        was just chosen may not have taken its batch yet: its call stays
        for it, or that leader would flush an empty batch and the count of
        flushes in flight would drift)."""
        batch: list[_Slot[C]] = []
        kept: list[_Slot[C]] = []
        weight, full = 0, False
        for slot in self.waiting:
            if slot is not leader and (slot.lead or full):
                kept.append(slot)
                continue
            if self.weigh is not None:
                weight += self.weigh(slot.call)
                if slot is not leader and weight > self.limit and batch:
                    full = True  # it and every later call: the next flush
                    kept.append(slot)
                    continue
            batch.append(slot)
        self.waiting = kept
        leader.taken = batch  # right after: an interrupt then still finds the batch
        return batch

    @staticmethod
    def taken_by(leader: _Slot[C]) -> list[_Slot[C]] | None:
        """The batch ``leader`` took, once: the slot lets go of it (the
        batch holds the leader: kept, each flush's calls and outcomes, its
        bodies and jobs, lived until the cycle collector came by; found by
        a review)."""
        batch, leader.taken = leader.taken, None
        return batch

    def finish(self) -> _Slot[C] | None:
        """A flush ended: the slot whose caller makes the next one, if any."""
        for slot in self.waiting:
            if not slot.lead:
                slot.lead = True
                return slot
        self.flushing -= 1
        return None


def _settle(batch: Sequence[_Slot[Any]], outcomes: Sequence[Outcome] | BaseException) -> None:
    for i, slot in enumerate(batch):
        slot.outcome = outcomes if isinstance(outcomes, BaseException) else outcomes[i]
        if isinstance(slot.outcome, BaseException):
            slot.outcome = Failed(slot.outcome)
        slot.done = True


def _result(slot: _Slot[Any]) -> Any:
    if isinstance(slot.outcome, Failed):
        raise slot.outcome.error
    return slot.outcome


class SyncCombiner(Generic[C]):
    """Batches calls of threads; ``flush(context, calls) -> outcomes`` blocks."""

    def __init__(self, flush: Callable[[Any, list[C]], Sequence[Outcome]],
                 parallel: int = 1, weigh: Callable[[C], int] | None = None,
                 limit: int = 0, usable: Callable[[Any], bool] | None = None) -> None:
        self._flush = flush
        self._queue: _Queue[C] = _Queue(parallel, weigh, limit)
        self._lock = threading.Lock()
        # Whether a context may still run a flush (a client not closed).
        self._usable = usable

    def submit(self, call: C, context: Any = None) -> Any:
        slot = _Slot(call, context)
        # Interrupted anywhere (Ctrl-C, a signal handler's SystemExit), the
        # caller leaves the queue, and if it was to make the next flush that
        # passes on: only the wait for the gate and the flush were guarded,
        # and an interrupt between a leader's wake and its flush left every
        # later call of the process waiting for ever (found by a review).
        try:
            with self._lock:
                lead = self._queue.arrive(slot)
                if not lead:
                    # Each waiting caller blocks on a lock of its own, released
                    # once: when its outcome is in, or when it is to lead the
                    # next flush. Waking only those (a condition's notify_all
                    # woke every waiter at every flush) took a third of the
                    # time 10 threads of get+ack held the GIL.
                    slot.gate = threading.Lock()
                    slot.gate.acquire()
            if not lead:
                slot.gate.acquire()
                lead = slot.lead and not slot.done
            if lead:
                self._lead(slot, context)
        except BaseException:
            self._leave(slot)
            raise
        return _result(slot)

    def _runner(self, context: Any, batch: list[_Slot[C]]) -> Any:
        """The context that runs ``batch``: the leader's, or where that is
        no longer usable, the first usable one of the batch. A caller whose
        client was closed while it waited was made the leader all the same,
        and every call of its batch, other clients' too, failed with "this
        client is closed" (found by a read-only review)."""
        usable = self._usable
        if usable is None or usable(context):
            return context
        return next((s.context for s in batch if usable(s.context)), context)

    def _leave(self, slot: _Slot[C]) -> None:
        """A caller stops waiting: out of the queue, and if it was to make
        the next flush, that passes on (left there, no one made it, and
        every later call of the process waited for ever). A call already in
        a flush is settled by it; its outcome is lost with its caller."""
        following = None
        with self._lock:
            if slot.done or slot not in self._queue.waiting:
                return
            self._queue.waiting.remove(slot)
            if slot.lead:
                following = self._queue.finish()
        if following is not None and following.gate is not None:
            following.gate.release()

    def _lead(self, slot: _Slot[C], context: Any) -> None:
        outcomes: Sequence[Outcome] | BaseException | None = None
        try:
            with self._lock:
                batch = self._queue.take(slot)
            context = self._runner(context, batch)
            try:
                outcomes = self._flush(context, [s.call for s in batch])
            except Exception as exc:  # every call of the batch gets it
                outcomes = exc
        finally:
            # The batch as take() left it on the slot: an interrupt may come
            # before `batch` is assigned. None: interrupted before it was
            # taken; the caller's submit leaves the queue and passes the
            # flush on.
            taken = _Queue.taken_by(slot)
            if taken is not None:
                self._settle_and_pass_on(slot, taken, outcomes)

    def _settle_and_pass_on(self, slot: _Slot[C], batch: list[_Slot[C]],
                            outcomes: Sequence[Outcome] | BaseException | None) -> None:
        if outcomes is None:
            # The leader's thread was interrupted: it alone gets that
            # (raised on from _lead); the others of its batch an ordinary
            # error (a KeyboardInterrupt in a worker thread killed it, and
            # their adds may have committed).
            outcomes = [Failed(DatabaseUnavailableError(
                "the thread that sent this call's batch was interrupted: its outcome is "
                "unknown (an add may have committed; look it up before adding again)"))
                for _ in batch]
        with self._lock:
            _settle(batch, outcomes)
            following = self._queue.finish()
        for done in batch:
            if done is not slot and done.gate is not None:
                done.gate.release()
        if following is not None and following.gate is not None:
            following.gate.release()


class AsyncCombiner(Generic[C]):
    """Batches calls of anyio tasks; ``flush(context, calls) -> outcomes`` is awaited."""

    def __init__(self, flush: Callable[[Any, list[C]], Awaitable[Sequence[Outcome]]],
                 parallel: int = 1, weigh: Callable[[C], int] | None = None,
                 limit: int = 0, delivers: bool = False) -> None:
        self._flush = flush
        self._queue: _Queue[C] = _Queue(parallel, weigh, limit)
        self._changed = anyio.Event()
        # Outcomes that are jobs handed to the caller (claims): a caller
        # cancelled by asyncio while its call is in a flush raises carrying them.
        self._delivers = delivers

    async def submit(self, call: C, context: Any = None) -> Any:
        slot = _Slot(call, context)
        lead = self._queue.arrive(slot)
        try:
            while not lead and not slot.done and not slot.lead:
                await self._changed.wait()
        except BaseException as exc:  # cancelled while waiting
            if slot in self._queue.waiting:  # not sent yet: leave the queue cleanly
                self._queue.waiting.remove(slot)
                if slot.lead:  # it was to make the next flush: pass that on
                    self._queue.finish()
                    self._notify()
                raise
            # In a flush already (or settled): the statement ends first, then
            # the cancellation goes on, as for the flush's leader. A claim's
            # jobs are not left to nobody (they waited out their lease, and a
            # retry-0 job never came back), nor an add's IDs (the caller
            # left at once while its job committed, and could not tell).
            # anyio cancels again at the caller's next checkpoint, so the
            # outcome goes to the caller; asyncio's cancellation came once
            # and must not be swallowed, so it goes on, carrying a claim's
            # jobs for the client to put back (pgq.cancelsafe).
            by_anyio = cancelsafe.anyio_cancelled()  # decided now, before the wait
            _, again = await cancelsafe.finish(self._outcome_of, slot)
            native = again if by_anyio else exc
            if native is None:
                return _result(slot)
            if self._delivers and not isinstance(slot.outcome, Failed):
                cancelsafe.attach(native, slot.outcome)
            raise native from None
        if lead or (slot.lead and not slot.done):
            await self._lead(slot, context)
        return _result(slot)

    async def _outcome_of(self, slot: _Slot[C]) -> None:
        while not slot.done:
            await self._changed.wait()

    def _notify(self) -> None:
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    async def _lead(self, slot: _Slot[C], context: Any) -> None:
        batch = self._queue.take(slot)
        slot.taken = None  # (only the sync combiner reads it; see _Queue.taken_by)
        # Run to its end whatever cancels the leader: the other callers of
        # its batch get their own outcomes, never the leader's cancellation
        # (asyncio's went through anyio's shield, and every caller of the
        # batch got a CancelledError, in tasks nobody had cancelled). The
        # flush's own task settles the batch and wakes the others itself:
        # they need not wait for the leader's task to be scheduled again.
        _, _, cancelled = await cancelsafe.settle(self._flush_batch, context, batch, slot)
        if cancelled is not None:  # the leader's own call: as a waiting caller's above
            if self._delivers and not isinstance(slot.outcome, Failed):
                cancelsafe.attach(cancelled, slot.outcome)
            raise cancelled

    async def _flush_batch(self, context: Any, batch: list[_Slot[C]], leader: _Slot[C]) -> None:
        try:
            outcomes: Sequence[Outcome] | BaseException = \
                await self._flush(context, [s.call for s in batch])
        except Exception as exc:  # every call of the batch gets it
            outcomes = exc
        except BaseException as exc:  # the flush's task was cancelled (the loop's end)
            outcomes = [exc if s is leader else Failed(DatabaseUnavailableError(
                "the task that sent this call's batch was cancelled: its outcome is "
                "unknown (an add may have committed; look it up before adding again)"))
                for s in batch]
        _settle(batch, outcomes)
        self._queue.finish()
        self._notify()


class Shared(Generic[C]):
    """Sync combiners shared by every client of one database in a process,
    so that threads that each made their own :class:`pgq.Client` batch
    together too. Keyed by what makes two clients' statements the same
    (the DSN and the options that change them). Combiners hold no
    resources: each flush runs on the pool of the client that makes it.
    A forked child gets none of its parent's."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._by_key: dict[Any, Any] = {}
        if hasattr(os, "register_at_fork"):  # not on Windows (no fork there)
            os.register_at_fork(after_in_child=self._forget_in_child)

    def _forget_in_child(self) -> None:
        """A forked child starts with combiners of its own, as with pools
        (pgq.sharedpool): a flush in flight in the parent at the fork is
        never finished in the child, whose every call then queued behind it
        for ever (found by a read-only review); a lock held then would be
        held for ever too."""
        self._lock = threading.Lock()
        self._by_key = {}

    def get(self, key: Any) -> Any:
        found = self._by_key.get(key)
        if found is None:
            with self._lock:
                found = self._by_key.setdefault(key, self._make())
        return found
