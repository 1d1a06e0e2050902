"""Tasks: plain functions called with arguments through a queue.

::

    app = pgq.Tasks(client)

    @app.task(queue="emails", retry=60, replicate=2)
    def send_email(to: str, subject: str = "Welcome") -> None: ...

    send_email.defer(to="ada@example.com")                  # a job; its ID
    send_email.using(conn=conn, delay=10).defer(to="ada@example.com")  # in your transaction
    send_email.defer_many([{"to": "a@x"}, {"to": "b@x"}])   # one round trip
    app.worker(concurrency=8).run()                         # calls send_email(to=...)
    app.result(job_id, timeout=30)                          # what it returned

What a task's job holds, and why:

* Its body is the serializer's encoding of ``{"task": NAME, "kwargs": {...}}``
  (JSON by default: any language can add or read one). NAME is the
  function's ``module.qualname`` unless ``name=`` says otherwise; the worker
  finds the function by that name, so a renamed function keeps its old name
  with ``name=`` while jobs of the old name remain.
* Arguments are keyword arguments only: a job outlives the code that
  queued it, and names survive a change of argument order where positions
  do not. They are checked against the function's signature when the job is
  deferred (a wrong call fails in the caller, not later in a worker).
* A task's options (queue, retry, replicate, ttl, delay, ...) are
  :meth:`pgq.Client.add_job`'s; ``using()`` overrides them for one call and
  passes ``conn=`` to add inside the caller's transaction.
* A task's return value is kept (``keep_results`` seconds, a day by
  default) in ``pgq.results`` of the node whose worker ran it, as
  ``{"result": value}``; a task that ends in the dead letters keeps its
  error and traceback instead, which :meth:`Tasks.result` raises as
  :class:`~pgq.errors.TaskFailedError`.
* The worker is a :class:`pgq.Worker`: its guarantees (leases, back-off,
  dead letters, shutdown) hold. A job naming a task this worker does not
  know fails like any handler error (and ends in the dead letters), so a
  deploy that removes a task with jobs still queued loses nothing silently.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, ParamSpec, Protocol, TypeVar

from . import tracing
from .arguments import queue_name
from .errors import InvalidArgumentError, InvalidTypeError, ResultNotKeptError, TaskFailedError
from .job import Job

__all__ = ["Tasks", "Task", "Serializer", "JsonSerializer", "UnknownTaskError"]

P = ParamSpec("P")
R = TypeVar("R")

_ADD_OPTIONS = ("replicate", "delay", "retry", "ttl", "maxlen", "asynchronous", "timeout",
                "priority")
# using() only: an idempotency key names one call (a second defer while its
# job lives adds nothing and returns that job's ID).
_CALL_OPTIONS = (*_ADD_OPTIONS, "key")


class UnknownTaskError(InvalidArgumentError):
    """A job names a task this worker does not know (or its body is not a task's)."""


class Serializer(Protocol):
    """How a task's call travels in a job body."""

    def dumps(self, call: dict[str, Any]) -> bytes: ...

    def loads(self, body: bytes) -> dict[str, Any]: ...


class JsonSerializer:
    """JSON, UTF-8: readable from SQL (``convert_from(body, 'UTF8')::jsonb``)
    and from any language."""

    def dumps(self, call: dict[str, Any]) -> bytes:
        try:
            # allow_nan=False: NaN and Infinity are not JSON; jsonb and other
            # languages refuse them.
            text = json.dumps(call, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidTypeError(f"task arguments must be JSON values: {exc} "
                                   "(pass ids or plain data, or give Tasks a serializer)") from None
        _string_keys(call)  # after dumps: it refused cycles, which this walk would follow
        return text.encode()

    def loads(self, body: bytes) -> dict[str, Any]:
        value = json.loads(bytes(body).decode())
        if not isinstance(value, dict):
            raise ValueError("not an object")
        return value


def _string_keys(value: Any) -> None:
    """Refuse a dict key that is not a str: json.dumps writes 1, 1.5, True
    and None as strings, so {1: 'a', '1': 'b'} came back {'1': 'b'} (a key
    changed, an entry lost) without a word (found by a read-only review)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, inner in item.items():
                if not isinstance(key, str):
                    raise InvalidTypeError(
                        f"task arguments must be JSON values: a dict key of type "
                        f"{type(key).__name__} ({key!r}), and JSON keys are strings "
                        "(use str keys, or give Tasks a serializer)")
                stack.append(inner)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


@dataclass(frozen=True)
class _Options:
    queue: str
    add: Mapping[str, Any] = field(default_factory=dict)
    conn: Any = None


class Task(Generic[P, R]):
    """A function that may also be called through a queue (see the module doc)."""

    def __init__(self, app: Tasks, fn: Callable[P, R], name: str, options: _Options) -> None:
        self.app = app
        self.fn = fn
        self.name = name
        self.options = options
        self._signature = inspect.signature(fn)
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", name)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the function here and now, as if it were not a task."""
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<pgq task {self.name} on queue {self.options.queue!r}>"

    def using(self, *, conn: object = None, queue: str | None = None, **add: Any) -> Task[P, R]:
        """The same task with options for one call: ``conn`` (add inside the
        caller's transaction), ``queue``, add_job's options (``priority``
        too), and ``key``: an idempotency key (while the job of a defer of
        this task with that key lives, another adds nothing and returns its
        ID; stored as ``"<task name>:<key>"``, so two tasks sharing a queue
        never share a key)."""
        unknown = set(add) - set(_CALL_OPTIONS)
        if unknown:
            raise InvalidArgumentError(f"unknown option(s) {sorted(unknown)}: "
                                       f"choose among conn, queue, {', '.join(_CALL_OPTIONS)}")
        # None keeps the task's queue; any other value must be a queue name
        # ("" fell back to the task's queue without a word).
        chosen = self.options.queue if queue is None else queue_name(queue)
        # A later using() without conn keeps the one given before: dropping
        # it committed the job outside the caller's transaction.
        options = replace(self.options, queue=chosen, add={**self.options.add, **add},
                          conn=self.options.conn if conn is None else conn)
        return Task(self.app, self.fn, self.name, options)

    def body(self, kwargs: Mapping[str, Any]) -> bytes:
        """The job body of a call with ``kwargs`` (checked against the signature)."""
        try:
            self._signature.bind(**kwargs)
        except TypeError as exc:
            raise InvalidArgumentError(f"{self.name}: {exc}") from None
        call: dict[str, Any] = {"task": self.name, "kwargs": dict(kwargs)}
        carrier = tracing.inject()
        if carrier:  # the worker's span links to the one that deferred the call
            call["trace"] = carrier
        try:
            return self.app.serializer.dumps(call)
        except InvalidTypeError:
            raise
        except RecursionError:  # nested about a thousand deep
            raise InvalidTypeError(f"{self.name}: the arguments nest too deeply to serialize") \
                from None
        except Exception as exc:  # a serializer of the user's: say whose call it was
            raise InvalidTypeError(f"{self.name}: the arguments cannot be serialized: "
                                   f"{type(exc).__name__}: {exc}") from exc

    def defer(self, **kwargs: Any) -> str:
        """Queue a call with these keyword arguments; returns the job's ID."""
        add = self.options.add
        if add.get("key") is not None:
            # A key names a call of this task: stored as "<task name>:<key>".
            # Keys are per queue, and tasks may share one: send_sms's defer
            # with the key of a live send_email job added nothing and
            # returned that job's ID (and its result), found by a review.
            add = {**add, "key": f"{self.name}:{add['key']}"}
        job_id: str = self.app.client.add_job(self.options.queue, self.body(kwargs),
                                              conn=self.options.conn, **add)
        return job_id

    def defer_many(self, calls: Iterable[Mapping[str, Any]]) -> list[str]:
        """Queue many calls (one mapping of keyword arguments each) in one
        round trip; their IDs, in order."""
        if "key" in self.options.add:
            raise InvalidArgumentError("an idempotency key names one call: defer() it alone")
        bodies = [self.body(kwargs) for kwargs in calls]
        ids: list[str] = self.app.client.add_jobs(self.options.queue, bodies,
                                                  conn=self.options.conn, **self.options.add)
        return ids


class Tasks:
    """A registry of tasks on a :class:`pgq.Client` (see the module doc)."""

    def __init__(self, client: Any, serializer: Serializer | None = None,
                 keep_results: float | None = 86400.0) -> None:
        from .aio import AsyncClient
        from .client import Client

        if isinstance(client, AsyncClient):
            # defer() returned an un-awaited coroutine (nothing added) and
            # result() failed inside.
            raise InvalidTypeError("Tasks needs a blocking pgq.Client (an AsyncClient's calls "
                                   "are coroutines): make one with pgq.Client(dsn)")
        if not isinstance(client, Client):
            # A DSN (pgq.Worker takes one) was accepted, and defer() failed
            # with AttributeError: 'str' object has no attribute 'add_job'.
            raise InvalidTypeError(f"Tasks needs a pgq.Client, not {type(client).__name__}: "
                                   "make one with pgq.Client(dsn)")
        self.client = client
        self.serializer: Serializer = serializer or JsonSerializer()
        self.keep_results = keep_results  # seconds a task's result is kept (None: not kept)
        self.tasks: dict[str, Task[Any, Any]] = {}

    def task(self, queue: str | None = None, *, name: str | None = None,
             **add: Any) -> Callable[[Callable[P, R]], Task[P, R]]:
        """Decorator: the function becomes a :class:`Task` on ``queue``
        (default: its name) with add_job's options (retry, replicate, ...)."""
        unknown = set(add) - set(_ADD_OPTIONS)
        if unknown:
            raise InvalidArgumentError(f"unknown task option(s) {sorted(unknown)}: "
                                       f"choose among {', '.join(_ADD_OPTIONS)}")

        def register(fn: Callable[P, R]) -> Task[P, R]:
            if not callable(fn):
                raise InvalidTypeError("a task must be a function")
            task_name = name or f"{getattr(fn, '__module__', None)}.{_qualname(fn)}"
            if task_name in self.tasks:
                raise InvalidArgumentError(f"a task named {task_name!r} exists already "
                                           "(give one of them name=...)")
            task: Task[P, R] = Task(self, fn, task_name,
                                    _Options(queue_name(queue) if queue is not None
                                             else _default_queue(fn), dict(add)))
            self.tasks[task_name] = task
            return task

        return register

    def queues(self) -> list[str]:
        return list(dict.fromkeys(t.options.queue for t in self.tasks.values()))

    def decode(self, job: Job) -> tuple[Task[Any, Any], dict[str, Any]]:
        """The task a job calls and its keyword arguments."""
        try:
            call = self.serializer.loads(job.body)
            name, kwargs = call["task"], call["kwargs"]
        except Exception:
            raise UnknownTaskError(f"job {job.id} of {job.queue} is not a task call") from None
        task = self.tasks.get(name) if isinstance(name, str) else None  # (a list: unhashable)
        if task is None or not isinstance(kwargs, dict):
            raise UnknownTaskError(f"job {job.id} calls task {name!r}, unknown to this worker "
                                   f"(it knows {sorted(self.tasks) or 'none'})")
        return task, kwargs

    def run(self, job: Job) -> Any:
        """Call the task a job names (what the worker does with each job, in
        a thread; an async task among sync ones runs on a loop of its own)."""
        task, kwargs = self.decode(job)
        result = task.fn(**kwargs)
        if inspect.isawaitable(result):
            import asyncio

            result = asyncio.run(_awaited(result))
        return result

    async def run_async(self, job: Job) -> Any:
        task, kwargs = self.decode(job)
        result = task.fn(**kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result

    def worker(self, queues: Sequence[str] = (), **options: Any) -> Any:
        """A :class:`pgq.Worker` serving every task's queue, and ``queues``
        besides (those that calls sent elsewhere with ``using(queue=...)``;
        no worker reads them otherwise); other options as Worker's."""
        from .worker import Worker

        if options.get("transactional"):
            # Tasks.run takes the job alone: a transactional handler is
            # called with (job, conn), which failed every job into the
            # dead letters.
            raise InvalidArgumentError("Tasks.worker() cannot be transactional: use "
                                       "pgq.Worker with a handler fn(job, conn) for that")
        if not self.tasks:
            raise InvalidArgumentError("no task registered: decorate functions with @tasks.task()")
        # all async: run on the worker's loop; otherwise sync handlers in
        # threads (an async one among them gets a loop of its own)
        is_async = all(inspect.iscoroutinefunction(t.fn) for t in self.tasks.values())
        handler = self.run_async if is_async else self.run
        options.setdefault("keep_results", self.keep_results)
        options.setdefault("trace_context", self._trace_context)
        options.setdefault("encode_result", self._encode_result)
        if isinstance(queues, str):
            queues = [queues]
        served = list(dict.fromkeys([*self.queues(), *(queue_name(q) for q in queues)]))
        return Worker(self.client, queues=served, handler=handler, **options)

    def _trace_context(self, job: Job) -> dict[str, str] | None:
        carrier = self.serializer.loads(job.body).get("trace")
        return carrier if isinstance(carrier, dict) else None

    def _encode_result(self, value: Any) -> bytes:
        return self.serializer.dumps({"result": value})

    def result(self, job_id: str, timeout: float | None = None) -> Any:
        """What the task of ``job_id`` returned, waiting up to ``timeout``
        seconds for a worker to finish it. Raises :class:`TaskFailedError`
        (its error and traceback) if the job ended in the dead letters,
        :class:`~pgq.errors.ResultNotKeptError` if it succeeded but what it
        returned could not be encoded or stored (a datetime for JSON, a
        value past the worker's max_body_size), :class:`TimeoutError` if
        no result came in time, and :class:`~pgq.errors.NoJobError` if
        none will come (the job is gone
        with no result kept: see :meth:`pgq.Client.wait_result`). Results are
        kept ``keep_results`` seconds on the node whose worker ran the job."""
        stored = self.client.wait_result(job_id, timeout)
        if stored is None:
            raise TimeoutError(f"no result for job {job_id} within {timeout:g} s"
                               if timeout is not None else f"no result for job {job_id}")
        value, error = stored
        if error is not None:
            from .worker import RESULT_NOT_KEPT

            if error.startswith(RESULT_NOT_KEPT):  # it succeeded: do not run it again
                raise ResultNotKeptError(error)
            raise TaskFailedError(error)
        return None if value is None else self.serializer.loads(value)["result"]


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _qualname(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
               or type(fn).__name__)


def _default_queue(fn: Callable[..., Any]) -> str:
    """A task's queue when none is given: its function's name (a callable
    without one, a partial say, raised AttributeError)."""
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str):
        raise InvalidArgumentError(f"{fn!r} has no name to make its queue: give the task queue=...")
    return queue_name(name)
