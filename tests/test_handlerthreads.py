"""pgq.handlerthreads: the threads a worker runs `def` handlers in are kept
between jobs, never shared by two running calls, and leave when idle."""

from __future__ import annotations

import threading

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

from pgq.handlerthreads import HandlerThreads


def test_one_thread_serves_calls_made_one_after_another():
    threads = HandlerThreads()

    async def main() -> list[str]:
        return [await threads.run(lambda: threading.current_thread().name) for _ in range(100)]

    names = anyio.run(main)
    assert set(names) == {"pgq-handler-1"} and threads.started == 1


def test_a_blocked_call_delays_no_other_and_errors_reach_the_caller():
    threads = HandlerThreads()
    release = threading.Event()

    def fail() -> None:
        raise ValueError("from the handler")

    async def main() -> tuple[object, object]:
        async with anyio.create_task_group() as tasks:
            blocked: dict[str, object] = {}

            async def wait_blocked() -> None:
                blocked["value"] = await threads.run(lambda: release.wait(60) and "released")

            tasks.start_soon(wait_blocked)
            await anyio.lowlevel.checkpoint()  # the blocked call takes its thread first
            with pytest.raises(ValueError, match="from the handler"):
                await threads.run(fail)
            other = await threads.run(lambda: "ran beside it")
            release.set()
        return other, blocked["value"]

    assert anyio.run(main) == ("ran beside it", "released")
    assert threads.started == 2


def test_idle_threads_leave_and_a_cancelled_wait_leaves_its_call_to_finish():
    threads = HandlerThreads(idle_seconds=0.05)
    release = threading.Event()
    ran_in: list[threading.Thread] = []

    def slow() -> None:
        ran_in.append(threading.current_thread())
        release.wait(60)

    async def main() -> None:
        with anyio.move_on_after(0.01):  # the caller gives up; the call goes on
            await threads.run(slow)
        release.set()
        # the thread finishes the call, parks, and leaves once idle for 50 ms
        await anyio.to_thread.run_sync(ran_in[0].join, 60)
        assert not ran_in[0].is_alive()
        assert await threads.run(lambda: 7) == 7

    anyio.run(main)
    assert threads.started == 2  # the second call needed a new thread
