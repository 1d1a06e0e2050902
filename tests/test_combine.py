"""The group-commit combiner on its own (no database): one outcome per call,
batches that grow with the callers, a lone caller served at once, errors
kept to their callers, cancellation that strands nobody."""

from __future__ import annotations

import signal
import threading
import time

import anyio
import anyio.lowlevel
import pytest

from pgq.combine import AsyncCombiner, SyncCombiner, _Queue, _Slot
from pgq.errors import DatabaseUnavailableError


def test_a_lone_caller_flushes_alone_and_at_once():
    batches = []
    combiner = SyncCombiner(lambda _ctx, calls: (batches.append(list(calls)), [c * 2 for c in calls])[1])
    assert combiner.submit(21) == 42
    assert batches == [[21]]


def test_callers_arriving_during_a_flush_share_the_next_one():
    gate = threading.Event()
    entered = threading.Event()
    batches: list[list[int]] = []

    def flush(_ctx: object, calls: list[int]) -> list[int]:
        batches.append(list(calls))
        if len(batches) == 1:
            entered.set()
            assert gate.wait(10)
        return [c + 100 for c in calls]

    combiner = SyncCombiner(flush)
    results: dict[int, int] = {}
    first = threading.Thread(target=lambda: results.__setitem__(0, combiner.submit(0)))
    first.start()
    assert entered.wait(10)  # the first flush is in flight
    others = [threading.Thread(target=lambda i=i: results.__setitem__(i, combiner.submit(i)))
              for i in range(1, 21)]
    for thread in others:
        thread.start()
    # wait (by condition, not time) until all 20 are queued behind the flush
    while len(combiner._queue.waiting) < 20:
        threading.Event().wait(0.001)
    gate.set()
    for thread in [first, *others]:
        thread.join(10)
    assert results == {i: i + 100 for i in range(21)}
    assert batches[0] == [0] and sorted(batches[1]) == list(range(1, 21)) and len(batches) == 2


def test_errors_stay_with_their_callers():
    def flush(_ctx: object, calls: list[int]) -> list[object]:
        return [ValueError(f"bad {c}") if c % 2 else c for c in calls]

    combiner = SyncCombiner(flush)
    assert combiner.submit(2) == 2
    with pytest.raises(ValueError, match="bad 3"):
        combiner.submit(3)


def test_a_failing_flush_fails_its_batch_only():
    calls_seen = []

    def flush(_ctx: object, calls: list[int]) -> list[int]:
        calls_seen.append(calls)
        if calls == [1]:
            raise ConnectionError("lost")
        return calls

    combiner = SyncCombiner(flush)
    with pytest.raises(ConnectionError):
        combiner.submit(1)
    assert combiner.submit(2) == 2  # the combiner goes on


def _blocked_first_flush(then=lambda calls: calls):
    """A combiner whose first flush waits for ``gate``; later ones run ``then``."""
    gate, entered = threading.Event(), threading.Event()
    flushes: list[list[int]] = []

    def flush(_ctx: object, calls: list[int]) -> list[object]:
        flushes.append(list(calls))
        if len(flushes) == 1:
            entered.set()
            assert gate.wait(10)
            return list(calls)
        return then(calls)

    combiner = SyncCombiner(flush)
    first = threading.Thread(target=combiner.submit, args=(0,), daemon=True)
    first.start()
    assert entered.wait(10)
    return combiner, gate, first


def _queued(combiner: SyncCombiner, n: int) -> None:
    while len(combiner._queue.waiting) < n:
        threading.Event().wait(0.001)


def _calls_go_on(combiner: SyncCombiner) -> None:
    """A later call gets its outcome, and no flush is left counted."""
    results: list[int] = []
    later = threading.Thread(target=lambda: results.append(combiner.submit(2)), daemon=True)
    later.start()
    later.join(10)
    assert results == [2] and combiner._queue.flushing == 0


def test_a_waiting_caller_interrupted_leaves_the_queue_and_calls_go_on():
    # Ctrl-C (or a SIGTERM handler's SystemExit) in a thread waiting for
    # its batch left its slot queued: chosen to make the next flush, it
    # made none, and every later call of the process waited for ever.
    combiner, gate, first = _blocked_first_flush()

    def interrupt_when_queued() -> None:
        _queued(combiner, 1)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    killer = threading.Thread(target=interrupt_when_queued, daemon=True)
    killer.start()
    with pytest.raises(KeyboardInterrupt):
        combiner.submit(1)  # the main thread waits behind the first flush
    killer.join(10)
    gate.set()
    first.join(10)
    _calls_go_on(combiner)


def test_an_interrupted_leader_keeps_the_interrupt_to_itself():
    def interrupted(calls: list[int]) -> list[int]:
        raise KeyboardInterrupt

    combiner, gate, first = _blocked_first_flush(then=interrupted)
    outcomes: dict[int, BaseException] = {}

    def call(i: int) -> None:
        try:
            combiner.submit(i)
        except BaseException as exc:  # what each caller got
            outcomes[i] = exc

    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in (1, 2, 3)]
    for queued, thread in enumerate(threads, 1):
        thread.start()
        _queued(combiner, queued)  # in this order: 1 leads the next batch
    gate.set()
    for thread in [first, *threads]:
        thread.join(10)
    assert isinstance(outcomes[1], KeyboardInterrupt)  # the leader of [1, 2, 3]
    assert all(isinstance(outcomes[i], DatabaseUnavailableError) for i in (2, 3)), outcomes
    assert "outcome is unknown" in str(outcomes[2])


def test_a_leader_interrupted_before_its_flush_passes_the_next_flush_on():
    # Only the wait for the gate and the flush were guarded: an interrupt
    # between a leader's wake and its flush (here, choosing where the batch
    # runs) left its flush counted and no one to make the next: every later
    # call of the process waited for ever (found by a read-only review).
    interrupted = []

    def runner(context, batch):
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return context

    combiner = SyncCombiner(lambda _context, calls: list(calls))
    combiner._runner = runner  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        combiner.submit(1)
    _calls_go_on(combiner)


def test_a_leader_interrupted_just_after_taking_its_batch_settles_it():
    # The batch was taken outside the guarded part: an interrupt right
    # after left it unsettled and its flush counted (found by a review).
    combiner = SyncCombiner(lambda _context, calls: list(calls))
    queue = combiner._queue
    take = queue.take
    interrupted = []

    def taking(leader):
        batch = take(leader)
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return batch

    queue.take = taking  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        combiner.submit(1)
    _calls_go_on(combiner)


def test_async_batches_share_flushes_and_survive_cancellation():
    batches: list[list[int]] = []

    async def main() -> None:
        gate = anyio.Event()

        async def flush(_ctx: object, calls: list[int]) -> list[int]:
            batches.append(list(calls))
            if len(batches) == 1:
                await gate.wait()
            return [c * 10 for c in calls]

        combiner = AsyncCombiner(flush)
        results: dict[int, int] = {}

        async def call(i: int) -> None:
            results[i] = await combiner.submit(i)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(call, 0)
            await anyio.wait_all_tasks_blocked()
            with anyio.CancelScope() as doomed:  # noqa: ASYNC100 (cancelled on purpose)
                doomed.cancel()
                # a caller cancelled while queued leaves no trace
                tasks.start_soon(call, 99)
            for i in range(1, 6):
                tasks.start_soon(call, i)
            await anyio.wait_all_tasks_blocked()
            gate.set()
        assert {k: v for k, v in results.items() if k != 99} == {i: i * 10 for i in range(6)}

    anyio.run(main)
    assert batches[0] == [0] and sorted(c for c in batches[1] if c != 99) == [1, 2, 3, 4, 5]


def test_async_promoted_caller_cancelled_passes_the_flush_on():
    async def main() -> None:
        gate = anyio.Event()
        flushed: list[list[int]] = []

        async def flush(_ctx: object, calls: list[int]) -> list[int]:
            flushed.append(list(calls))
            if len(flushed) == 1:
                await gate.wait()
            return calls

        combiner = AsyncCombiner(flush)
        got: dict[int, int] = {}
        # 10 s: far more than this needs; a stranded flush would hang forever
        with anyio.fail_after(10):
            await run(combiner, gate, got)
        assert got == {2: 2}

    async def run(combiner: AsyncCombiner, gate: anyio.Event, got: dict[int, int]) -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(lambda: combiner.submit(0))
            await anyio.wait_all_tasks_blocked()
            scope = anyio.CancelScope()

            async def doomed() -> None:
                with scope:
                    await combiner.submit(1)  # first in line: would lead the next flush

            async def survivor() -> None:
                got[2] = await combiner.submit(2)

            tasks.start_soon(doomed)
            tasks.start_soon(survivor)
            await anyio.wait_all_tasks_blocked()
            scope.cancel()
            await anyio.wait_all_tasks_blocked()
            gate.set()

    anyio.run(main)


@pytest.mark.parametrize("delivers", [True, False])
def test_an_async_caller_cancelled_while_its_call_is_sent_still_gets_its_outcome(delivers):
    # A claim's jobs, taken by a flush in flight when its caller was
    # cancelled, went to nobody (they waited out their lease; a retry-0
    # job never came back). The caller gets its outcome; anyio cancels it
    # again at its next checkpoint. So does an add's caller: it left at
    # once while its job committed, and could not tell (a review found it).
    async def main() -> None:
        first_gate, second_gate, second_began = anyio.Event(), anyio.Event(), anyio.Event()
        flushed: list[list[int]] = []

        async def flush(_ctx: object, calls: list[int]) -> list[int]:
            flushed.append(list(calls))
            if len(flushed) == 2:
                second_began.set()
            await (first_gate if len(flushed) == 1 else second_gate).wait()
            return [c * 10 for c in calls]

        combiner = AsyncCombiner(flush, delivers=delivers)
        got: dict[int, object] = {}
        scope = anyio.CancelScope()

        async def doomed() -> None:
            with scope:
                got[2] = await combiner.submit(2)  # led by 1, in the second flush
                await anyio.lowlevel.checkpoint()  # cancelled here, with its outcome
                got["after"] = True

        async def caller(i: int) -> None:
            got[i] = await combiner.submit(i)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(caller, 0)
                await anyio.wait_all_tasks_blocked()
                tasks.start_soon(caller, 1)
                tasks.start_soon(doomed)
                await anyio.wait_all_tasks_blocked()
                first_gate.set()
                await second_began.wait()  # the second flush holds [1, 2]
                assert flushed == [[0], [1, 2]]
                scope.cancel()
                await anyio.wait_all_tasks_blocked()
                second_gate.set()
        assert got == {0: 0, 1: 10, 2: 20}

    anyio.run(main)


def test_each_flush_runs_with_the_leading_callers_context():
    contexts = []
    combiner = SyncCombiner(lambda ctx, calls: (contexts.append(ctx), calls)[1])
    assert combiner.submit(1, context="client A") == 1
    assert combiner.submit(2, context="client B") == 2
    assert contexts == ["client A", "client B"]


def test_parallel_leaders_each_flush_their_own_call_and_the_count_never_drifts():
    # Two callers arrive together with parallel=2: both lead. If the first
    # to take its batch took the other leader's call too, that leader would
    # flush nothing and the count of flushes in flight would stay one too
    # high for ever (parallel 2 would act as 1).
    queue: _Queue[int] = _Queue(parallel=2)
    a, b, c = _Slot(1), _Slot(2), _Slot(3)
    assert queue.arrive(a) and queue.arrive(b)
    assert queue.take(a) == [a]  # b stays for its own leader
    assert not queue.arrive(c)  # two flushes in flight: c waits
    assert queue.finish() is c  # a's flush ended: c makes the next one, not b
    assert queue.take(b) == [b] and queue.take(c) == [c]
    assert queue.finish() is None and queue.finish() is None
    assert queue.flushing == 0 and queue.waiting == []


def test_parallel_flushes_run_at_once_and_batch_the_rest():
    gate = threading.Event()
    running: list[int] = []
    batches: list[list[int]] = []
    lock = threading.Lock()

    def flush(_ctx: object, calls: list[int]) -> list[int]:
        with lock:
            batches.append(list(calls))
            running.append(len(batches))
        assert gate.wait(10)
        return calls

    combiner = SyncCombiner(flush, parallel=3)
    threads = [threading.Thread(target=combiner.submit, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while (len(running) < 3 or len(combiner._queue.waiting) < 9) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert len(running) == 3  # three flushes in flight, the other nine calls wait
    gate.set()
    for thread in threads:
        thread.join(10)
    assert sorted(c for batch in batches for c in batch) == list(range(12))
    assert max(len(batch) for batch in batches) > 1 and combiner._queue.flushing == 0


def test_a_batch_stops_at_its_weight_limit_in_arrival_order():
    # Calls are weights here. Whatever arrived behind a flush goes out in
    # batches of at most `limit`, in order; a leader's call heavier than the
    # limit goes alone. (Many large bodies in one batch passed PostgreSQL's
    # 1 GiB bound on a value and failed every call of it.)
    queue: _Queue[int] = _Queue(weigh=lambda call: call, limit=10)
    first = _Slot(1)
    assert queue.arrive(first) and queue.take(first) == [first]  # a flush in flight
    slots = [_Slot(w) for w in (4, 5, 3, 12, 2, 2)]
    assert not any(queue.arrive(slot) for slot in slots)  # all behind it
    batches = []
    leader = queue.finish()
    while leader is not None:
        batches.append([slot.call for slot in queue.take(leader)])
        leader = queue.finish()
    assert batches == [[4, 5], [3], [12], [2, 2]]
    assert queue.flushing == 0 and queue.waiting == []


def test_without_a_weight_every_waiting_call_shares_the_flush():
    queue: _Queue[int] = _Queue()
    first = _Slot(1)
    assert queue.arrive(first) and queue.take(first) == [first]
    for weight in (10**9, 10**9):
        queue.arrive(_Slot(weight))
    leader = queue.finish()
    assert leader is not None and len(queue.take(leader)) == 2


# asyncio's own cancellation (Task.cancel(): asyncio.wait_for, asyncio.timeout,
# TaskGroup, web frameworks) passes anyio's shields. These cancel natively.

def test_a_leader_cancelled_by_asyncio_keeps_its_cancellation_to_itself():
    # The flush raised CancelledError half-way, and every caller of its
    # batch got it: tasks nobody had cancelled.
    import asyncio

    async def main() -> None:
        gate = asyncio.Event()
        flushed: list[tuple[list[int], str]] = []

        async def flush(_ctx: object, calls: list[int]) -> list[int]:
            await gate.wait()
            flushed.append((list(calls), "ended"))
            return [c * 10 for c in calls]

        combiner = AsyncCombiner(flush)
        leader = asyncio.create_task(combiner.submit(1))
        await asyncio.sleep(0)  # the leader is in its flush, alone
        waiting = [asyncio.create_task(combiner.submit(i)) for i in (2, 3)]
        await asyncio.sleep(0)
        leader.cancel()
        await asyncio.sleep(0)
        assert not leader.done()  # it waits for its flush to end
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await leader
        assert await asyncio.wait_for(asyncio.gather(*waiting), 10) == [20, 30]
        assert flushed == [([1], "ended"), ([2, 3], "ended")]

    asyncio.run(main())


def test_a_claim_cancelled_by_asyncio_in_its_flush_raises_carrying_its_jobs():
    # Swallowing asyncio's cancellation to hand the jobs over would leave a
    # task running that its owner believes stopped; raising it bare lost
    # the jobs. It is raised, carrying them, for the client to put back.
    import asyncio

    from pgq import cancelsafe

    async def main() -> None:
        gate = asyncio.Event()

        async def flush(_ctx: object, calls: list[int]) -> list[list[int]]:
            await gate.wait()
            return [[c] for c in calls]

        combiner = AsyncCombiner(flush, delivers=True)
        first = asyncio.create_task(combiner.submit(0))
        await asyncio.sleep(0)
        leader, follower = (asyncio.create_task(combiner.submit(i)) for i in (1, 2))
        await asyncio.sleep(0)
        gate.set()
        gate.clear()
        assert await first == [0]
        await asyncio.sleep(0)  # the second flush holds [1, 2]
        leader.cancel()
        follower.cancel()
        gate.set()
        for task, jobs in ((leader, [1]), (follower, [2])):
            with pytest.raises(asyncio.CancelledError) as raised:
                await task
            assert cancelsafe.undelivered(raised.value) == jobs

    asyncio.run(main())


def test_a_batch_whose_leader_s_client_closed_runs_with_an_open_client_of_it():
    # Every Client of a database in a process shares its combiners. A
    # caller waiting when its client closed was made the next leader all the
    # same, and every call of its batch, other clients' too, failed with
    # "this client is closed" (found by a read-only review).
    class Ctx:
        def __init__(self, name: str) -> None:
            self.name, self.closed = name, False

    gate, entered = threading.Event(), threading.Event()
    ran: list[tuple[str, list[int]]] = []

    def flush(ctx: Ctx, calls: list[int]) -> list[object]:
        ran.append((ctx.name, list(calls)))
        if len(ran) == 1:
            entered.set()
            assert gate.wait(10)
        return [DatabaseUnavailableError("this client is closed") if ctx.closed else c
                for c in calls]

    one, two = Ctx("one"), Ctx("two")
    combiner = SyncCombiner(flush, usable=lambda ctx: not ctx.closed)
    results: dict[int, object] = {}

    def call(i: int, ctx: Ctx) -> None:
        try:
            results[i] = combiner.submit(i, ctx)
        except DatabaseUnavailableError as exc:
            results[i] = exc

    threads = [threading.Thread(target=call, args=(0, one))]
    threads[0].start()
    assert entered.wait(10)
    threads += [threading.Thread(target=call, args=(1, two)), threading.Thread(target=call, args=(2, one))]
    threads[1].start()
    while len(combiner._queue.waiting) < 1:  # 1 first: it leads the next flush
        threading.Event().wait(0.001)
    threads[2].start()
    while len(combiner._queue.waiting) < 2:
        threading.Event().wait(0.001)
    two.closed = True
    gate.set()
    for thread in threads:
        thread.join(10)
    assert ran == [("one", [0]), ("one", [1, 2])] and results == {0: 0, 1: 1, 2: 2}


def test_a_forked_child_gets_combiners_of_its_own():
    # A flush in flight in the parent at the fork is never finished in the
    # child: a client the child made queued its first call behind it for
    # ever (found by a read-only review).
    import os

    from pgq.combine import Shared

    gate, entered = threading.Event(), threading.Event()

    def flush(_ctx: object, calls: list[int]) -> list[int]:
        if calls == [0]:
            entered.set()
            assert gate.wait(10)
        return calls

    shared: Shared[SyncCombiner[int]] = Shared(lambda: SyncCombiner(flush))
    parent = threading.Thread(target=shared.get("db").submit, args=(0,))
    parent.start()
    assert entered.wait(10)  # the parent's flush is in flight
    pid = os.fork()
    if pid == 0:  # the child: one call, then out (status 0 only if it returned)
        os._exit(0 if shared.get("db").submit(1) == 1 else 1)
    try:
        deadline = time.monotonic() + 10  # the child's call takes microseconds
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            threading.Event().wait(0.01)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, "the child hung"
    finally:
        gate.set()
        parent.join(10)


def test_a_flushed_batch_is_freed_when_its_calls_return():
    # The leader's slot kept its batch (which holds the slot): every flush's
    # calls and outcomes, bodies and claimed jobs, lived until the cycle
    # collector came by (found by a review).
    import gc
    import weakref

    class Call:
        pass

    combiner = SyncCombiner(lambda _context, calls: [object() for _ in calls])
    gc.disable()
    try:
        call = Call()
        seen = weakref.ref(call)
        combiner.submit(call)
        del call
        assert seen() is None
    finally:
        gc.enable()
