"""Work that must finish although its task is cancelled, whoever cancels it.

pgq's async side shields what must not stop half-way (a statement on a
pooled connection, a flush of the group commit, a connection going back to
its pool) with anyio's shielded cancel scopes. Those stop anyio's
cancellation only. asyncio's own, ``Task.cancel()`` (what ``asyncio.wait_for``,
``asyncio.timeout``, a ``TaskGroup`` and web frameworks use), is thrown into
whatever the task awaits, shield or not. Under it, found by a read-only
review: a flush leader's CancelledError was handed to every caller of its
batch (tasks nobody had cancelled), statements were abandoned half-way, and
the jobs a committed claim took went to nobody (a retry-0 job for good).

The rule, for both kinds:

* :func:`settle` and :func:`finish` run the work in a task of its own, which
  no cancellation of the caller reaches, and wait for it whatever arrives.
  anyio's cancellation is held off by a shield as before (anyio delivers it
  again at the caller's next checkpoint); asyncio's, which comes once, is
  handed back to the caller with the work's outcome, to raise when it may.
  Work already running in such a task (a flush) runs in place: nothing can
  cancel it there, and a task per statement would cost for nothing.
* Jobs that a cancelled caller will never receive ride on its
  CancelledError (:func:`attach`, :func:`undelivered`); the client puts them
  back in their queue before the cancellation goes on.

Invariant: a call through this module never returns while a cancellation of
asyncio's is swallowed: the caller gets it back and raises it (a swallowed
``Task.cancel()`` leaves a task running that its owner believes stopped,
and a shutdown waits for it for ever).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

__all__ = ["settle", "finish", "complete", "anyio_cancelled", "attach", "undelivered"]

T = TypeVar("T")

# True inside a task started here: nothing cancels it (but the loop's end).
_PROTECTED: contextvars.ContextVar[bool] = contextvars.ContextVar("pgq_protected", default=False)

_UNDELIVERED = "pgq_undelivered"


def _on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # trio: anyio's shields stop every cancellation there
        return False
    return True


async def _protected(fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> T:
    _PROTECTED.set(True)  # this task's own context (a copy of its creator's)
    return await fn(*args)


def _wake(waiter: asyncio.Future[None], _task: object) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def _until_done(loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
    """Wait for ``task`` to end without cancelling it when the waiting is
    cancelled (awaiting a task directly passes the cancellation on to it;
    asyncio.shield costs a wrapper future and two callbacks more)."""
    if not task.done():
        waiter = loop.create_future()
        task.add_done_callback(functools.partial(_wake, waiter))
        await waiter


async def settle(fn: Callable[..., Awaitable[T]], *args: Any
                 ) -> tuple[bool, T | BaseException, BaseException | None]:
    """Run ``await fn(*args)`` to its end; return ``(ok, result or error,
    asyncio's cancellation of the caller that arrived meanwhile or None)``.
    The error is any exception of the work's own (a CancelledError only
    when its task was cancelled from outside: the event loop's end)."""
    if _PROTECTED.get() or not _on_asyncio():
        with anyio.CancelScope(shield=True):
            try:
                return True, await fn(*args), None
            except BaseException as exc:  # handed to the caller
                return False, exc, None
    loop = asyncio.get_running_loop()
    task = loop.create_task(_protected(fn, args))
    cancelled: BaseException | None = None
    try:
        await _until_done(loop, task)
    except asyncio.CancelledError as exc:
        if not anyio_cancelled():
            cancelled = exc  # asyncio's: it comes once
        # anyio's comes again at every turn of the loop while a task waits,
        # hence a shield (set up only now: it costs a few microseconds a
        # call). asyncio's could come again too.
        with anyio.CancelScope(shield=True):
            while True:
                try:
                    await _until_done(loop, task)
                    break
                except asyncio.CancelledError as again:
                    cancelled = cancelled or again
    if task.cancelled():
        return False, asyncio.CancelledError("pgq: the work's own task was cancelled"), cancelled
    error = task.exception()
    if error is not None:
        return False, error, cancelled
    return True, task.result(), cancelled


async def finish(fn: Callable[..., Awaitable[T]], *args: Any) -> tuple[T, BaseException | None]:
    """:func:`settle`, raising the work's error: ``(result, asyncio's
    cancellation or None)``. A work that failed while its caller was
    cancelled raises the cancellation (the error as its context)."""
    ok, value, cancelled = await settle(fn, *args)
    if ok:
        return value, cancelled  # type: ignore[return-value]
    assert isinstance(value, BaseException)
    if cancelled is not None:
        raise cancelled from value
    raise value


async def complete(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """:func:`finish`, then asyncio's cancellation that arrived meanwhile
    raised at once: for work whose caller has nothing to hand over after it
    (closing a pool)."""
    value, cancelled = await finish(fn, *args)
    if cancelled is not None:
        raise cancelled
    return value


def anyio_cancelled() -> bool:
    """Whether an anyio cancel scope around the caller is cancelled (so
    anyio delivers the cancellation again at its next checkpoint, and a
    result may still be handed over first)."""
    return anyio.current_effective_deadline() == -math.inf


def attach(cancelled: BaseException, jobs: object) -> BaseException:
    """Mark ``cancelled`` as carrying jobs its caller will not receive."""
    setattr(cancelled, _UNDELIVERED, jobs)
    return cancelled


def undelivered(exc: BaseException) -> Any:
    """The jobs ``exc`` carries (:func:`attach`), or None."""
    return getattr(exc, _UNDELIVERED, None)
