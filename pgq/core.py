"""What :class:`pgq.Client` and :class:`pgq.AsyncClient` share: options, the
node's DSN, argument validation, and turning a public call into a command.

The two public clients differ only in how they run a command (blocking or
``await``); everything a user can get wrong is checked here, once, before
any I/O. Invariant: every ``*_command`` method either raises a typed
argument error or returns a ready-to-run command factory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

import psycopg

from . import arguments as args
from . import commands
from .arguments import JobParams
from .connecting import FIRST_CONNECT_TIMEOUT
from .dsn import host_and_port as _host_and_port
from .dsn import libpq_url
from .errors import (
    DatabaseUnavailableError,
    InvalidArgumentError,
    InvalidTypeError,
    SchemaNotReadyError,
    TransactionAbortedError,
)
from .floors import Floors
from .ids import validate_job_id, validate_job_ids
from .protocol import ClusterView, Command, Session
from .statements import SESSION_OPTIONS, SWEEP_TABLES_TO_VACUUM
from .vacuum import DEAD_MIN, Vacuumer

__all__ = ["ClientOptions", "ClientCore", "translate_database_error"]

T = TypeVar("T")
CommandFactory = Callable[[Session], Command[T]]


@dataclass(frozen=True)
class ClientOptions:
    """Options of :class:`pgq.Client` / :class:`pgq.AsyncClient` (all keyword-only).

    * ``pool_size``: most connections the client opens. The blocking
      clients of one database in a process (same settings, one DSN each)
      share one pool of up to the sum of their ``pool_size``
      (pgq.sharedpool): together they open no more, and one busy client
      may use the others' share. A blocked
      ``get_job`` waits on the client's one LISTEN connection and holds none
      of these meanwhile (one of an :class:`pgq.AsyncClient` not opened
      with ``async with`` LISTENs on, and holds, one of them).
    * ``turbo``: commit pgq's writes with ``synchronous_commit=off``: faster,
      and a power loss may lose the last few milliseconds of adds and acks.
    * ``listen``: wake blocked consumers with LISTEN/NOTIFY (else poll only).
    * ``poll_interval``: longest pause between claim attempts of a blocked
      consumer (the fallback when no notification arrives).
    * ``prepare``: use server-side prepared statements.
    * ``pgbouncer``: running behind PgBouncer in transaction mode: implies
      ``listen=False`` and ``prepare=False``.
    * ``max_body_size``: largest job body accepted, in bytes (≤ 512 MiB).
    * ``reconnect_timeout``: how long a call keeps retrying while the
      database is unreachable before raising ``DatabaseUnavailableError``.
    * ``connect_timeout``: how long the client's first connection keeps
      trying a server that does not answer (refused, unreachable, starting
      up); 0 tries each DSN once. A server that refuses pgq (password,
      database) fails at once. Also bounded by ``reconnect_timeout``.
    * ``migrate``: apply pending migrations on connect (default: only for
      the embedded server).
    * ``sweep_interval``: how often this client runs the timer/expiry sweep.
    * ``home``: the embedded server's directory (default ``$PGQ_HOME``).
    * ``application_name``: shown in ``pg_stat_activity``.
    * ``replication_timeout``: how long a replicated ``add_job`` waits for its
      copies when it passes no ``timeout`` (cluster).
    * ``direct_copies``: a synchronous replicated add writes its copies
      into the other nodes' databases itself, when they advertised them
      (``pgq node start --advertise-dsn``), instead of through the node
      processes: fewer hops (cluster). ``False``: always through the nodes.
    """

    pool_size: int = 10
    turbo: bool = False
    listen: bool = True
    poll_interval: float = 0.5
    prepare: bool = True
    pgbouncer: bool = False
    max_body_size: int = args.DEFAULT_MAX_BODY_SIZE
    reconnect_timeout: float = 30.0
    connect_timeout: float = FIRST_CONNECT_TIMEOUT
    migrate: bool | None = None
    sweep_interval: float = 1.0
    home: str | None = None
    application_name: str = "pgq"
    replication_timeout: float = 5.0
    direct_copies: bool = True

    @classmethod
    def from_kwargs(cls, options: Mapping[str, Any]) -> ClientOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidTypeError(
                f"unknown client option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}"
            )
        result = cls(**options)
        result._check()
        if result.pgbouncer:
            result = replace(result, listen=False, prepare=False)
        return result

    def _check(self) -> None:
        args.positive_int("pool_size", self.pool_size, maximum=1000)
        args.positive_int("max_body_size", self.max_body_size, maximum=args.HARD_MAX_BODY_SIZE)
        args.seconds("poll_interval", self.poll_interval, minimum=0.001, maximum=3600)
        args.seconds("reconnect_timeout", self.reconnect_timeout, maximum=86400)
        args.seconds("connect_timeout", self.connect_timeout, maximum=86400)
        args.seconds("sweep_interval", self.sweep_interval, minimum=0.01, maximum=3600)
        args.seconds("replication_timeout", self.replication_timeout, minimum=0.001,
                     maximum=args.MAX_TTL, allow_minimum=True)
        for name in ("turbo", "listen", "prepare", "pgbouncer", "direct_copies"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidTypeError(f"{name} must be a bool")
        if self.migrate is not None and not isinstance(self.migrate, bool):
            raise InvalidTypeError("migrate must be a bool or None")
        if self.home is not None:  # Path() raised Python's own TypeError (a review)
            path = os.fspath(self.home) if isinstance(self.home, (str, os.PathLike)) else None
            if not isinstance(path, str):
                raise InvalidTypeError(f"home must be a directory path (a str or an os.PathLike "
                                       f"of one), not {type(self.home).__name__}")
            if not path or "\x00" in path:
                raise InvalidArgumentError("home must be a directory path, not empty and "
                                           "without NUL characters")
        # libpq sends it as a C string: a NUL cut it short, a lone surrogate
        # failed every connection (30 s later, as "database unavailable").
        args.text("application_name", self.application_name, max_chars=len(self.application_name))


def translate_database_error(exc: psycopg.Error) -> Exception | None:
    """A typed pgq error for database failures that are not pgq bugs, else None."""
    if isinstance(exc, (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedFunction,
                        psycopg.errors.InvalidSchemaName)):
        return SchemaNotReadyError(
            f"the pgq schema is missing or incomplete ({exc.diag.message_primary}); "
            "run `pgq migrate --dsn DSN` or pgq.migrate(dsn)"
        )
    if isinstance(exc, psycopg.errors.InFailedSqlTransaction):
        return TransactionAbortedError(
            "the connection's transaction is aborted by an earlier error: roll it back first"
        )
    if isinstance(exc, psycopg.OperationalError):
        return DatabaseUnavailableError(f"database connection failed: {exc}")
    return None


_FLOORS: dict[str, Floors] = {}
_VACUUMER = Vacuumer(SESSION_OPTIONS)  # one per process: one vacuum at a time
SWEEP_PARAMS = {"dead_min": DEAD_MIN}  # sql.SWEEP's


def _floors_of(dsn: str) -> Floors:
    """The claim floors of one database, shared by every client of it in the
    process (pgq.floors): each claim starts where the last one got."""
    floors = _FLOORS.get(dsn)
    if floors is None:
        floors = _FLOORS.setdefault(dsn, Floors())
    return floors


def pool_closed_error(closed: object, current: object,
                      exc: BaseException) -> DatabaseUnavailableError | None:
    """A client's call found its pool ``closed`` before sending anything:
    None when another call failed over meanwhile (retry on ``current``, the
    client's pool now), else the error to raise."""
    if current is not None and current is not closed:
        return None
    if current is None:
        return DatabaseUnavailableError("this client is closed")
    return DatabaseUnavailableError(f"the connection pool was closed: {exc}")


# ADDJOB option values whose checked JobParams a client keeps (ClientCore._job_params):
# immutable, hashable, compared by value; at most this many combinations.
_MEMOIZABLE = frozenset({type(None), bool, int, float, str})
_PARAMS_MEMO_SIZE = 256


class ClientCore:
    """Options, DSN and command construction shared by both clients."""

    def __init__(self, dsn: str | Sequence[str] | None, options: Mapping[str, Any]) -> None:
        self.options = ClientOptions.from_kwargs(options)
        self._embedded = False
        if dsn is None:
            dsn = os.environ.get("PGQ_DSN") or None
        if dsn is None:
            from . import embedded

            dsn = embedded.ensure_running(self.options.home).dsn
            self._embedded = True
        dsns = [dsn] if isinstance(dsn, str) else list(dsn) if isinstance(dsn, (list, tuple)) else None
        if not dsns or not all(isinstance(d, str) for d in dsns):
            raise InvalidTypeError(
                "dsn must be a str (a libpq URL or key=value string) or a list of them "
                f"(several nodes to fail over between), not {type(dsn).__name__}")
        # Several DSNs: the client uses the first that answers and moves on
        # to the next when its node's database becomes unreachable.
        self._dsns = [libpq_url(d) for d in dsns]
        self._dsn_index = 0
        self._dsn = self._dsns[0]
        self._host, self._port = _host_and_port(self._dsn)
        self._node_id = ""
        self._last_sweep = 0.0
        self._params_memo: dict[tuple[tuple[object, ...], tuple[type, ...]], JobParams] = {}
        self._returned = 0  # pooled connections given back (see _busy_pool)
        self._cluster = ClusterView(max_age=min(self.options.sweep_interval, 1.0))

    @property
    def dsn(self) -> str:
        """The libpq URL of the node database in use (usable by psycopg, SQLAlchemy, JDBC tooling)."""
        return self._dsn

    @property
    def pool_timeout(self) -> float:
        """How long to wait for a connection before failing over (or giving up)."""
        if len(self._dsns) > 1:
            return min(self.options.reconnect_timeout, 3.0)
        return self.options.reconnect_timeout

    @property
    def first_connect_timeout(self) -> float:
        """How long the first connection may take before the client gives up."""
        return min(self.options.connect_timeout, self.options.reconnect_timeout)

    def use_dsn(self, index: int) -> None:
        """Talk to ``self._dsns[index]`` from now on."""
        if index != self._dsn_index:
            self._dsn_index = index
            self._dsn = self._dsns[index]
            self._host, self._port = _host_and_port(self._dsn)
            self._cluster.fetched_at = float("-inf")

    def next_dsn(self) -> bool:
        """Move to the next DSN; False if there is only one."""
        if len(self._dsns) < 2:
            return False
        self._dsn_index = (self._dsn_index + 1) % len(self._dsns)
        self._dsn = self._dsns[self._dsn_index]
        self._host, self._port = _host_and_port(self._dsn)
        self._cluster.fetched_at = float("-inf")
        return True

    @property
    def node_id(self) -> str:
        """The 40-hex ID of the node this client talks to."""
        return self._node_id

    @property
    def should_migrate(self) -> bool:
        return self.options.migrate if self.options.migrate is not None else self._embedded

    def session(self, *, owned: bool) -> Session:
        return Session(
            owned=owned, node_id=self._node_id, clock=time.monotonic,
            can_listen=owned and self.options.listen, poll_interval=self.options.poll_interval,
            host=self._host, port=self._port, cluster=self._cluster,
            replication_timeout=self.options.replication_timeout,
            floors=_floors_of(self._dsn), direct=owned and self.options.direct_copies,
        )

    def swept(self, row: Sequence[Any] | None) -> None:
        """After the periodic sweep (``sql.SWEEP``): vacuum the tables it
        found mostly dead, and prune the history past its retention (at most
        once a minute), in the background (pgq.vacuum)."""
        if row is not None:
            _VACUUMER.request(self._dsn, row[SWEEP_TABLES_TO_VACUUM], self.options.pgbouncer)

    def sweep_due(self) -> bool:
        now = time.monotonic()
        if now - self._last_sweep < self.options.sweep_interval:
            return False
        self._last_sweep = now
        return True

    def _connection_returned(self) -> None:
        """A pooled connection of this client came back to its pool."""
        self._returned += 1

    def _busy_pool(self, pool_stats: Mapping[str, int], max_size: int, returned_before: int) -> bool:
        """Whether a pool timeout came from a node that is busy, not down:
        every connection of the pool was out, and some came back while the
        call waited (their statements ended: the node answers; others in
        line took them). A client of several DSNs failed over on such a
        timeout, so a burst of calls moved it off a healthy node. A node
        whose connections all hang returns none, and is failed over as
        before."""
        full = pool_stats.get("pool_size", 0) >= max_size and pool_stats.get("pool_available", 0) == 0
        return full and self._returned != returned_before

    def unavailable(self, cause: BaseException, pool_stats: Mapping[str, int],
                    max_size: int | None = None) -> DatabaseUnavailableError:
        """The error for a call that found no usable connection in time
        (``max_size``: of the pool it waited on, when other clients share it)."""
        size = self.options.pool_size if max_size is None else max_size
        busy = pool_stats.get("pool_size", 0) >= size and pool_stats.get("pool_available", 0) == 0
        if busy:
            whose = "of this client" if size == self.options.pool_size else \
                "this process's clients of that database share"
            return DatabaseUnavailableError(
                f"all {size} connections {whose} stayed busy for "
                f"{self.options.reconnect_timeout:g} s: raise Client(pool_size=...) or run "
                "fewer calls at once (a blocked get_job of an AsyncClient not opened with "
                "`async with` holds one)"
            )
        return DatabaseUnavailableError(
            f"cannot reach the pgq database at {self._host}:{self._port} after "
            f"{self.options.reconnect_timeout:g} s: {cause}"
        )

    # ------------------------------------------------------------ commands

    def add_call(self, queue: object, bodies: Iterable[object], *, replicate: object,
                 delay: object, retry: object, ttl: object, maxlen: object,
                 asynchronous: object, timeout: object, priority: object = 0,
                 key: object = None) -> commands.AddCall:
        """An ADDJOB, validated (see :func:`pgq.commands.add_jobs`)."""
        name = args.queue_name(queue)
        if isinstance(bodies, (str, bytes, bytearray, memoryview)):
            raise InvalidTypeError("add_jobs takes an iterable of bodies; use add_job for one body")
        data = [args.body_bytes(body, self.options.max_body_size) for body in _iterable(bodies, "bodies")]
        params = self._job_params(replicate, delay, retry, ttl, maxlen, asynchronous, timeout,
                                  priority)
        if key is not None:  # kept out of the memo: most keyed adds name a new key
            params = replace(params, key=args.idempotency_key(key))
        if params.key is not None and len(data) != 1:
            raise InvalidArgumentError(
                "an idempotency key names one job: add keyed jobs one at a time with add_job")
        return commands.AddCall(name, data, params)

    def _job_params(self, *options: object) -> JobParams:
        """ADDJOB's options checked (:func:`pgq.arguments.job_params`), with
        this client's default timeout, carried by the call: a batch of the
        group commit (shared by the clients of one database in the process)
        waited as long as its leader's client said.

        Kept by their values and types (1 and 1.0 and True are one dict key
        but need not give the same answer): a producer passes the same few
        every time, and checking them again was about a tenth of the CPU a
        batched add costs the RESP server (with the dataclass copy that
        applied the default timeout). JobParams is immutable; a value of
        another type (a Decimal, a numpy number) is checked every time."""
        types = tuple(map(type, options))
        key = (options, types) if _MEMOIZABLE.issuperset(types) else None
        known = None if key is None else self._params_memo.get(key)
        if known is not None:
            return known
        replicate, delay, retry, ttl, maxlen, asynchronous, timeout, priority = options
        params = args.job_params(
            replicate=replicate, delay=delay, retry=retry, ttl=ttl, maxlen=maxlen,
            asynchronous=asynchronous, timeout=timeout, priority=priority,
        )
        if params.timeout is None:
            params = replace(params, timeout=self.options.replication_timeout)
        if key is not None:
            if len(self._params_memo) >= _PARAMS_MEMO_SIZE:
                self._params_memo.clear()
            self._params_memo[key] = params
        return params

    def add_jobs_command(self, queue: object, bodies: Iterable[object], *, replicate: object,
                         delay: object, retry: object, ttl: object, maxlen: object,
                         asynchronous: object, timeout: object,
                         priority: object = 0) -> CommandFactory[list[str]]:
        call = self.add_call(queue, bodies, replicate=replicate, delay=delay, retry=retry,
                             ttl=ttl, maxlen=maxlen, asynchronous=asynchronous, timeout=timeout,
                             priority=priority)
        return self.add_command(call)

    @staticmethod
    def add_command(call: commands.AddCall) -> CommandFactory[list[str]]:
        if not call.bodies:
            return lambda session: _empty_list()
        return lambda session: commands.add_jobs(session, call.queue, call.bodies, call.params,
                                                 call.ids)

    def get_request(self, queues: tuple[object, ...], *, count: object, timeout: object,
                    nohang: object, withcounters: object) -> GetRequest:
        """A GETJOB, validated."""
        names = args.queue_names(queues)
        how_many = args.count(count)
        wait = args.timeout(timeout)
        for flag, value in (("nohang", nohang), ("withcounters", withcounters)):
            if not isinstance(value, bool):
                raise InvalidTypeError(f"{flag} must be a bool, not {type(value).__name__}")
        return GetRequest(commands.ClaimCall(tuple(names), how_many, bool(withcounters)),
                          wait, bool(nohang))

    def get_jobs_command(self, queues: tuple[object, ...], *, count: object, timeout: object,
                         nohang: object, withcounters: object) -> CommandFactory[list[Any]]:
        request = self.get_request(queues, count=count, timeout=timeout, nohang=nohang,
                                   withcounters=withcounters)
        return request.command()

    @staticmethod
    def job_ids(ids: tuple[object, ...]) -> list[str]:
        return _job_ids(ids)

    def ids_command(self, name: str, ids: tuple[object, ...], **extra: Any) -> CommandFactory[int]:
        checked = _job_ids(ids)
        run = getattr(commands, name)
        return lambda session: run(session, checked, **extra)

    def nack_command(self, ids: tuple[object, ...], delay: object) -> CommandFactory[int]:
        wait = args.seconds("delay", delay, maximum=args.MAX_TTL)
        return self.ids_command("nack_jobs", ids, delay=wait)

    def dead_letter_command(self, ids: tuple[object, ...], reason: object) -> CommandFactory[int]:
        text = args.text("reason", reason, max_chars=10_000)
        return self.ids_command("dead_letter_jobs", ids, reason=text)

    def dead_letters_command(self, queue: object, after: object,
                             count: object) -> CommandFactory[list[dict[str, Any]]]:
        name = None if queue is None else args.queue_name(queue)
        if not isinstance(after, int) or isinstance(after, bool) or after < 0:
            raise InvalidArgumentError("after must be 0 or the seq of the last dead letter seen")
        page = args.positive_int("count", count, maximum=args.MAX_COUNT)
        return lambda session: commands.dead_letters(session, name, after, page)

    def requeue_dead_letters_command(self, queue: object, ids: object, count: object,
                                     ttl: object) -> CommandFactory[list[str]]:
        name = None if queue is None else args.queue_name(queue)
        if isinstance(ids, str):  # one ID, not its characters
            ids = [ids]
        checked = None if ids is None else _job_ids(tuple(_iterable(ids, "ids")))
        page = args.positive_int("count", count, maximum=args.MAX_COUNT)
        params = args.job_params(replicate=None, delay=0, retry=None, ttl=ttl, maxlen=None,
                                 asynchronous=True, timeout=None)
        return lambda session: commands.requeue_dead_letters(session, name, checked, page, params)

    def wait_replicated_command(self, ids: Iterable[object], timeout: object) -> CommandFactory[None]:
        if isinstance(ids, str):
            ids = [ids]
        checked = _job_ids(tuple(_iterable(ids, "ids")))  # at most MAX_IDS, as everywhere
        wait = args.seconds("timeout", timeout, maximum=args.MAX_TTL)
        return lambda session: commands.wait_replicated(session, checked, wait)

    def working_command(self, job_id: object) -> CommandFactory[int | float]:
        checked = validate_job_id(job_id)
        return lambda session: commands.working(session, checked)

    def store_result_command(self, job_id: object, value: object, error: object,
                             keep: object) -> CommandFactory[None]:
        checked = validate_job_id(job_id)
        if value is not None and not isinstance(value, (bytes, bytearray, memoryview)):
            raise InvalidTypeError(f"a result is bytes (or None), not {type(value).__name__}")
        if error is not None and not isinstance(error, str):
            raise InvalidTypeError(f"an error is a str (or None), not {type(error).__name__}")
        # Checked as every other text and body the API stores: a NUL or a lone
        # surrogate in the error came back as psycopg's own DataError or
        # UnicodeEncodeError, and a result had no size limit (found by a
        # read-only review).
        text = None if error is None else args.text("error", error, max_chars=args.MAX_RESULT_ERROR)
        data = None if value is None else bytes(value)
        if data is not None and len(data) > self.options.max_body_size:
            raise InvalidArgumentError(f"a result is at most {self.options.max_body_size} bytes "
                                       f"(the client's max_body_size), not {len(data)}")
        seconds = args.seconds("keep", keep, maximum=args.MAX_TTL, allow_minimum=False)
        return lambda session: commands.store_result(session, checked, data, text, seconds)

    @staticmethod
    def cluster_meet_command(address: object) -> CommandFactory[None]:
        from .cluster.addresses import parse_address

        if not isinstance(address, str):
            raise InvalidTypeError(f"address must be a 'HOST:PORT' str, not {type(address).__name__}")
        parse_address(address)
        return lambda session: commands.cluster_meet(session, address)

    @staticmethod
    def cluster_leaving_command(leaving: object) -> CommandFactory[None]:
        if not isinstance(leaving, bool):
            raise InvalidTypeError(f"leaving must be a bool, not {type(leaving).__name__}")
        return lambda session: commands.cluster_leaving(session, leaving)

    def wait_job_command(self, job_id: object, timeout: object) -> CommandFactory[bool]:
        checked = validate_job_id(job_id)
        wait = None if timeout is None else args.seconds("timeout", timeout, maximum=args.MAX_TTL)
        return lambda session: commands.wait_job(session, checked, wait)

    def wait_result_command(self, job_id: object, timeout: object
                            ) -> CommandFactory[tuple[bytes | None, str | None] | None]:
        checked = validate_job_id(job_id)
        wait = None if timeout is None else args.seconds("timeout", timeout, maximum=args.MAX_TTL)
        return lambda session: commands.wait_result(session, checked, wait)

    def show_command(self, job_id: object) -> CommandFactory[dict[str, Any] | None]:
        checked = validate_job_id(job_id)
        return lambda session: commands.show(session, checked)

    def qlen_command(self, queue: object) -> CommandFactory[int]:
        name = args.queue_name(queue)
        return lambda session: commands.qlen(session, name)

    def qpeek_command(self, queue: object, count: object) -> CommandFactory[list[Any]]:
        name = args.queue_name(queue)
        if not isinstance(count, int) or isinstance(count, bool):
            raise InvalidTypeError(f"count must be an int, not {type(count).__name__}")
        if count == 0 or abs(count) > args.MAX_COUNT:
            raise InvalidArgumentError(
                f"count must be between 1 and {args.MAX_COUNT} (negative: newest first), not {count}")
        return lambda session: commands.qpeek(session, name, count)

    def qstat_command(self, queue: object) -> CommandFactory[dict[str, Any] | None]:
        name = args.queue_name(queue)
        return lambda session: commands.qstat(session, name)

    def qscan_command(self, cursor: object, *, count: object, minlen: object, maxlen: object,
                      importrate: object) -> CommandFactory[tuple[int, list[str]]]:
        start = _cursor(cursor)
        page = args.positive_int("count", count, maximum=args.MAX_COUNT)
        bounds = {}
        for label, value in (("minlen", minlen), ("maxlen", maxlen), ("importrate", importrate)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise InvalidTypeError(f"{label} must be an int or None")
            bounds[label] = value
        return lambda session: commands.qscan(session, start, page, bounds["minlen"],
                                              bounds["maxlen"], bounds["importrate"])

    def jscan_command(self, cursor: object, *, count: object, queue: object, states: object,
                      reply: object) -> CommandFactory[tuple[int, list[Any]]]:
        start = _cursor(cursor)
        page = args.positive_int("count", count, maximum=args.MAX_COUNT)
        name = None if queue is None else args.queue_name(queue)
        if isinstance(states, str):
            states = (states,)
        if not isinstance(states, Iterable):
            raise InvalidTypeError("states must be a sequence of state names")
        states = tuple(states)
        if not all(isinstance(state, str) for state in states):
            raise InvalidTypeError("states must be a sequence of state names (str)")
        wanted = tuple(dict.fromkeys(states))
        bad = [s for s in wanted if s not in commands.JOB_STATES]
        if bad:
            raise InvalidArgumentError(
                f"unknown job state(s) {bad}; allowed: {', '.join(commands.JOB_STATES)}")
        if reply not in ("id", "all"):
            raise InvalidArgumentError(f"reply must be 'id' or 'all', not {reply!r}")
        return lambda session: commands.jscan(session, start, page, name, wanted, str(reply))

    def pause_command(self, queue: object, flags: tuple[object, ...]) -> CommandFactory[str]:
        name = args.queue_name(queue)
        if not flags:
            raise InvalidArgumentError(
                f"pause needs at least one flag: {', '.join(commands.PAUSE_FLAGS)}")
        checked = []
        for flag in flags:
            if not isinstance(flag, str) or flag.lower() not in commands.PAUSE_FLAGS:
                raise InvalidArgumentError(
                    f"unknown pause flag {flag!r}; allowed: {', '.join(commands.PAUSE_FLAGS)}")
            checked.append(flag.lower())
        return lambda session: commands.pause(session, name, checked)


@dataclass(frozen=True)
class GetRequest:
    """A validated GETJOB: its claim, and what to do when it finds nothing."""

    call: commands.ClaimCall
    timeout: float | None
    nohang: bool

    def command(self, claimed: bool | commands.Due = False) -> CommandFactory[list[Any]]:
        call = self.call
        return lambda session: commands.get_jobs(session, list(call.queues), call.count,
                                                 self.timeout, self.nohang, call.withcounters,
                                                 claimed=claimed)


def _iterable(values: object, what: str) -> Iterable[Any]:
    """``values`` if it can be iterated, else a typed error (``add_jobs(q,
    5)`` raised Python's own TypeError from deep inside)."""
    try:
        iter(values)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidTypeError(f"{what} must be a list (or any iterable), not "
                               f"{type(values).__name__}") from None
    return values  # type: ignore[return-value]


def _job_ids(ids: tuple[object, ...]) -> list[str]:
    """Job IDs given as arguments or as one sequence; validated, deduplicated."""
    if len(ids) == 1 and isinstance(ids[0], (list, tuple, set, frozenset)):
        ids = tuple(ids[0])
    if len(ids) > args.MAX_IDS:
        raise InvalidArgumentError(f"at most {args.MAX_IDS} job IDs per call, not {len(ids)}")
    return list(dict.fromkeys(validate_job_ids(ids)))


def _cursor(value: object) -> int:
    """A scan cursor: 0, or one a previous call returned (it encodes the last
    key seen: a UTF-8 queue name or job ID, without NUL)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgumentError(
            f"cursor must be 0 or a cursor returned by the previous call, not a {type(value).__name__}")
    problem = value < 0 or value.bit_length() > 8 * args.MAX_QUEUE_NAME_BYTES
    if not problem:
        try:
            problem = "\x00" in commands.decode_cursor(value)
        except UnicodeDecodeError:
            problem = True
    if problem:
        raise InvalidArgumentError("cursor must be 0 or a cursor returned by the previous call")
    return value


def _empty_list() -> Command[list[str]]:
    yield from ()
    return []
