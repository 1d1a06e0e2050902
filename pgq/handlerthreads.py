"""Threads that run a worker's synchronous handlers, kept between jobs.

A worker runs every ``def`` handler in a thread so that it may block. Which
threads:

* **Not a new thread per job.** Starting one, and handing its result back
  through the event loop, cost more than the claim and the ack together: a
  burn-down with a no-op ``def`` handler ran at 4.4k jobs/s with a thread per
  job, against 15k with ``async def``.
* **Not anyio's worker threads.** They are not daemons: a handler abandoned at
  shutdown (still running after the worker's grace period, its job already
  NACKed) would keep the process alive until it returns.

So: daemon threads, each running one call at a time, parked between calls
and reused, created when no parked one is left, gone after ``idle_seconds``
without a call.

Invariants:

* a call is handed only to a parked thread or to a new one, so a handler
  that never returns delays no other (it keeps its thread; the next call
  gets another);
* a parked thread is in ``_parked`` exactly while it waits for a call: a
  thread that gives up after ``idle_seconds`` leaves only if no caller took
  it from there meanwhile (that caller's call is already on its way);
* a thread parks itself before it wakes its caller, so calls made one
  after another run in one thread;
* the awaiting task gets the handler's return value or its exception, and a
  task cancelled while waiting leaves the call to finish alone; such calls
  still running are counted (``abandoned``): a worker keeps their slots
  taken, or a handler that hangs past its timeout ran again beside itself,
  and threads (and a transactional handler's connections) grew past the
  worker's concurrency.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel

__all__ = ["HandlerThreads"]


class HandlerThreads:
    """Daemon threads for blocking calls awaited by async code."""

    def __init__(self, name: str = "pgq-handler", idle_seconds: float = 30.0) -> None:
        self.name = name
        self.idle_seconds = idle_seconds
        self._parked: list[_Thread] = []
        self._lock = threading.Lock()
        self.started = 0  # threads started so far (for tests and metrics)
        self.abandoned = 0  # calls still running whose awaiting task gave up

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in one of the threads, in a copy of the caller's
        context (its context variables: the worker's tracing span, a
        logging or error-reporting scope); its result, or its exception."""
        done = anyio.Event()
        box: dict[str, Any] = {}
        wake = _waker(done)
        context = contextvars.copy_context()

        def call() -> None:
            try:
                box["result"] = context.run(fn, *args)
            except BaseException as exc:  # handed to the awaiting task
                box["error"] = exc
            finally:
                with self._lock:
                    box["returned"] = True
                    if box.get("abandoned"):
                        self.abandoned -= 1

        self._hand(call, wake)
        try:
            await done.wait()
        except BaseException:  # cancelled (a timeout, a shutdown): the call goes on alone
            with self._lock:
                if not box.get("returned"):
                    box["abandoned"] = True
                    self.abandoned += 1
            raise
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def _hand(self, call: Callable[[], None], wake: Callable[[], None]) -> None:
        with self._lock:
            thread = self._parked.pop() if self._parked else None
            if thread is None:
                self.started += 1
        if thread is None:
            thread = _Thread(self, f"{self.name}-{self.started}")
            thread.start()
        thread.inbox.put((call, wake))

    def _park(self, thread: _Thread) -> None:
        with self._lock:
            self._parked.append(thread)

    def _leave(self, thread: _Thread) -> bool:
        """May an idle thread exit? Not if a caller took it meanwhile."""
        with self._lock:
            if thread in self._parked:
                self._parked.remove(thread)
                return True
            return False


class _Thread(threading.Thread):
    def __init__(self, owner: HandlerThreads, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.owner = owner
        self.inbox: queue.SimpleQueue[tuple[Callable[[], None], Callable[[], None]]] = \
            queue.SimpleQueue()

    def run(self) -> None:
        while True:
            try:
                call, wake = self.inbox.get(timeout=self.owner.idle_seconds)
            except queue.Empty:
                if self.owner._leave(self):
                    return
                continue  # taken while we gave up: its call is coming
            call()
            # Parked before the caller wakes: a caller that calls again at
            # once finds this thread instead of starting another.
            self.owner._park(self)
            wake()
            del call, wake  # drop the handler's frame and result


def _waker(done: anyio.Event) -> Callable[[], None]:
    """How a thread sets ``done`` in the awaiting task's event loop. On
    asyncio, without waiting for the loop to run it (the thread is free for
    its next call at once); elsewhere through anyio, which waits."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # another backend (trio)
        loop = None
    if loop is not None:
        def wake() -> None:
            try:
                loop.call_soon_threadsafe(done.set)
            except RuntimeError:
                pass  # the loop is closed: nobody waits for this call any more
        return wake

    token = anyio.lowlevel.current_token()

    def wake_through_anyio() -> None:
        try:
            anyio.from_thread.run_sync(done.set, token=token)
        except Exception:
            pass  # the worker stopped waiting for us long ago
    return wake_through_anyio
