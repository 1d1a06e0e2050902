"""Periodic jobs: a job added to a queue at every tick of a cron expression.

::

    worker = pgq.Worker(client)

    @worker.periodic("*/5 * * * *", queue="reports", tz="Europe/Paris")
    def make_report(job): ...

    worker.run()        # serves "reports" and adds its job every 5 minutes

or ``pgq periodic add nightly "0 3 * * *" --queue backups`` and any worker
started with ``scheduler=True`` (``pgq worker ... --scheduler``).

Invariants, and why:

* **One job per tick on a database.** Schedules live in ``pgq.periodic``;
  a scheduler adds a tick's job in the same transaction as it moves the
  schedule's ``last_tick`` forward (``CLAIM_TICK``, under the row's lock),
  so however many workers run the schedule, one of them adds it, once.
* **One job per tick in a cluster.** A schedule's name names one schedule
  in the cluster, whichever nodes' databases hold it (workers that declare
  it on every node save it on every node). Every scheduler also claims
  the tick in one place, the *tick home*: the database of the live node
  (not leaving) with the lowest ID, as its own database's membership sees
  it (``pgq.periodic_claims``, ``CLAIM_CLUSTER_TICK``: moved forward
  only). The scheduler adds the job on its own node first, in a savepoint
  of the transaction that holds its schedule's row, then claims: won, it
  commits; lost, the job is rolled back. A home that is its own database
  claims in that transaction; another node's, over the DSN the home
  advertised (``--advertise-dsn``), after checking that the DSN reaches
  that node's database. Hence, and why:

  - an add that is refused (a paused queue, NOREPL) claims nothing, so
    another node's scheduler adds the tick's job;
  - a claim is the claimer's to win again (its reply, or its own commit,
    was lost): that node's next look adds the job, within ``catch_up``;
    if the node never comes back, the tick is lost (a lost tick is the
    failure a periodic task survives; a doubled one may not be);
  - while the nodes' views of the membership differ (a node just failed
    or came back), two homes may each grant a tick once, and a new home
    that never saw a schedule's claims grants the catch-up tick again if
    the claimer's own scheduler missed it;
  - a node whose process is not running sees the membership as it left
    it (its own row says alive): its schedulers add nothing until it runs
    again, and the other nodes' schedulers add the ticks;
  - a home that does not answer (its PostgreSQL unreachable from here
    while the bus says it lives) holds the tick back, a warning at each
    look, until it answers or the membership drops it: each look tries it
    once (5 s to connect, 5 s for the claim), not once per schedule;
  - a home whose DSN is missing, reaches another database, or predates
    the claims (schema 0018) cannot share ticks: each node then adds its
    own job a tick (warned once per home). So do nodes of an earlier
    version, whatever the home, and they do not say so: upgrade the
    workers of every node together.
* **Missed ticks are coalesced.** After downtime (no scheduler running, a
  node down), the scheduler adds one job for the latest missed tick if it
  is at most ``catch_up`` seconds old (an hour by default, per schedule),
  and none for the older ones: a backlog of identical jobs is rarely what a
  periodic task wants. A new schedule, or one whose cron expression or
  time zone changed, starts with the next tick.
* **One schedule's failure is its own.** Each tick is claimed and its job
  added in a transaction of its own: a refused add (a paused queue, say)
  is logged and tried again at the scheduler's next look, and the other
  schedules go on.
* **The database's clock** (``pgq.now()``) decides the ticks, for every
  scheduler of the database and for a schedule's first tick: machines'
  clocks differ, and a fast one claimed ticks early for everyone.
* **Cron expressions** are parsed by ``cronsim`` (five fields, ``@daily``
  and friends, ``L``, ``#``), in the schedule's time zone (``zoneinfo``
  names), so "0 3 * * *" stays at 03:00 local time across DST changes.

:func:`due_tick` is pure (the time is a parameter); :class:`Scheduler`
runs it against a database.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import psycopg

from . import arguments as args
from . import statements as sql
from .errors import InvalidArgumentError, InvalidTypeError, PgqError, first_line

__all__ = ["Schedule", "Scheduler", "TickHome", "tick_home", "due_tick", "latest_tick", "next_tick",
           "DEFAULT_CATCH_UP"]

log = logging.getLogger("pgq.periodic")
DEFAULT_CATCH_UP = 3600.0
ON_TIME = 60.0  # seconds: the scheduler's longest sleep between two looks (_until_next)
HOME_TIMEOUT = 5  # seconds: to connect to the tick home, and for its claim
# A look's own connection to its database: bounded, as the client's pooled
# ones are (a bare connect waited for the TCP timeout, about 2 minutes, on a
# host that dropped packets, and a look waited on a lock for ever; the
# worker's stop waited for the look's thread all that time; found by a
# read-only review). Seconds to connect; milliseconds for a statement (an
# add waits for its copies: pgq's default add timeout is far below) and a
# lock.
LOOK_CONNECT_TIMEOUT = 10
LOOK_STATEMENT_TIMEOUT_MS = 60_000
LOOK_LOCK_TIMEOUT_MS = 10_000
_ADD_OPTIONS = ("replicate", "retry", "ttl")


def _zone(tz: str) -> ZoneInfo:
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError, OSError):  # OSError: a directory ("America")
        raise InvalidArgumentError(f"unknown time zone {tz!r} (use an IANA name like "
                                   "'UTC' or 'Europe/Paris')") from None


# cron's shortcuts, which cronsim does not read itself
_ALIASES = {"@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
            "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
            "@hourly": "0 * * * *"}


def _ticks(cron: str, tz: str, start: dt.datetime, reverse: bool) -> Iterator[dt.datetime]:
    from cronsim import CronSim, CronSimError

    expression = _ALIASES.get(cron.strip().lower(), cron)
    if len(expression.split()) != 5:
        # cronsim also reads six fields (seconds first), without its DST
        # correction: "0 30 2 * * *" in Europe/Paris fired twice one autumn
        # night and never one spring night. pgq's schedules are minutes.
        raise InvalidArgumentError(f"invalid cron expression {cron!r}: give five fields "
                                   "(minute hour day-of-month month day-of-week) or @daily, "
                                   "@hourly, @weekly, @monthly, @yearly")
    try:
        return iter(CronSim(expression, start.astimezone(_zone(tz)), reverse=reverse))
    except CronSimError as exc:
        raise InvalidArgumentError(f"invalid cron expression {cron!r}: {exc}") from None


def _first(cron: str, tz: str, start: dt.datetime, reverse: bool) -> dt.datetime:
    try:
        return next(_ticks(cron, tz, start, reverse))
    except StopIteration:
        # cronsim searches 50 years, then gives up: "0 0 */31 * 1#5" (the
        # 1st of a month that is its 5th Monday) raised StopIteration, which
        # killed every worker whose scheduler loaded the row
        raise InvalidArgumentError(f"cron expression {cron!r} never fires") from None


def _instant(now: dt.datetime) -> dt.datetime:
    """``now`` in UTC, where adding seconds and subtracting datetimes count
    real time. In the schedule's own zone (the database session's time zone
    when it is the same: zoneinfo caches one object per zone) Python does
    both by wall clock and drops DST's fold: during the repeated autumn
    hour `now + 1 s` landed an hour back, and that hour's ticks were lost,
    or fired 45 minutes early; `next - now` was 0 for up to an hour, and the
    scheduler looked 20 times a second (found by a read-only review)."""
    return now.astimezone(dt.UTC)


def latest_tick(cron: str, tz: str, now: dt.datetime) -> dt.datetime:
    """The latest tick at or before ``now``."""
    return _first(cron, tz, _instant(now).replace(microsecond=0) + dt.timedelta(seconds=1), True)


def next_tick(cron: str, tz: str, now: dt.datetime) -> dt.datetime:
    """The first tick after ``now``. Compared as instants: during the
    repeated autumn hour cronsim's forward search (from the hour's second
    pass) gave the hour's first-pass tick, up to an hour in the past; the
    scheduler's wait was then 0 and it looked 20 times a second, each look
    a new connection, for up to an hour (found by a read-only review)."""
    instant = _instant(now)
    ticks = _ticks(cron, tz, instant, False)
    for _ in range(_PAST_TICKS):
        try:
            tick = next(ticks)
        except StopIteration:
            break
        if tick.astimezone(dt.UTC) > instant:
            return tick
    return _first(cron, tz, instant + dt.timedelta(hours=1), False)


# Ticks a forward search may give before ``now`` (those of one repeated
# hour: at most 60 of a minute-by-minute schedule) before it is restarted
# an hour on, past the repeated hour.
_PAST_TICKS = 61


def due_tick(cron: str, tz: str, last_tick: dt.datetime | None, now: dt.datetime,
             catch_up: float = DEFAULT_CATCH_UP) -> dt.datetime | None:
    """The tick whose job is due now, if any: the latest tick at or before
    ``now``, when it is after ``last_tick`` and at most ``catch_up``
    seconds old (older missed ticks are skipped). A tick at most
    ``ON_TIME`` seconds old is never missed, whatever ``catch_up``: the
    scheduler wakes just after a tick, and looks at least that often."""
    now = _instant(now)
    tick = latest_tick(cron, tz, now)
    # Compared as instants: two datetimes of one time zone compare by wall
    # clock, ignoring DST's fold, so the second 02:00 of an autumn night
    # (last_tick read back in the session's zone) looked no later than the
    # first, and the hour's ticks were dropped.
    if last_tick is not None and tick.astimezone(dt.UTC) <= last_tick.astimezone(dt.UTC):
        return None
    if (now - tick).total_seconds() > max(catch_up, ON_TIME):
        return None
    return tick


@dataclass(frozen=True)
class Schedule:
    """A periodic job: ``body`` to ``queue`` at every tick of ``cron``."""

    name: str
    cron: str
    queue: str
    body: bytes = b""
    tz: str = "UTC"
    options: dict[str, Any] = field(default_factory=dict)  # replicate, retry, ttl, catch_up

    def __post_init__(self) -> None:
        """Everything is checked here, when the schedule is made or loaded:
        a value the add would refuse at each tick (a bad retry, a queue name)
        or a catch_up that is no number made every scheduler on the database
        fail, tick after tick, and stopped the schedules after it."""
        if not isinstance(self.name, str) or not self.name or len(self.name) > 200:
            raise InvalidArgumentError("a schedule needs a name (1 to 200 characters)")
        args.text("a schedule's name", self.name, 200)  # no NUL, no lone surrogate
        unknown = set(self.options) - {*_ADD_OPTIONS, "catch_up"}
        if unknown:
            raise InvalidArgumentError(f"unknown schedule option(s) {sorted(unknown)}: "
                                       f"choose among {', '.join((*_ADD_OPTIONS, 'catch_up'))}")
        if not isinstance(self.cron, str) or not isinstance(self.tz, str):
            raise InvalidTypeError("a schedule's cron expression and time zone are strings")
        if not isinstance(self.body, bytes):
            raise InvalidTypeError(f"a schedule's body is bytes, not {type(self.body).__name__}")
        args.queue_name(self.queue)
        args.body_bytes(self.body, args.HARD_MAX_BODY_SIZE)
        args.job_params(replicate=self.options.get("replicate"), delay=0,
                        retry=self.options.get("retry"), ttl=self.options.get("ttl"),
                        maxlen=None, asynchronous=False, timeout=None)
        args.seconds("catch_up", self.options.get("catch_up", DEFAULT_CATCH_UP))
        latest_tick(self.cron, self.tz, dt.datetime.now(dt.UTC))  # checks both

    @property
    def catch_up(self) -> float:
        return float(self.options.get("catch_up", DEFAULT_CATCH_UP))

    def add_options(self) -> dict[str, Any]:
        return {k: v for k, v in self.options.items() if k in _ADD_OPTIONS}


def database_now(conn: psycopg.Connection[Any]) -> dt.datetime:
    """The database's clock (``pgq.now()``), which every scheduler of it
    shares: each machine's own clock decided the ticks, so a scheduler on a
    host running 2 minutes fast claimed every tick 2 minutes early, and a
    schedule saved from a host whose clock was past 03:00 at 02:55 skipped
    that night's tick."""
    row = conn.execute(sql.DB_NOW).fetchone()
    assert row is not None
    now: dt.datetime = row[0]
    return _instant(now)  # (psycopg answers in the session's time zone)


def cluster_size(conn: psycopg.Connection[Any]) -> int:
    """The nodes this database knows in its cluster (1 alone), left ones aside."""
    row = conn.execute(sql.CLUSTER_SIZE).fetchone()
    return int(row[0]) if row else 1


@dataclass(frozen=True)
class TickHome:
    """Where the schedulers of a cluster claim their ticks (see the module
    doc): the live node with the lowest ID."""

    node: str  # its node ID
    myself: bool  # the database this scheduler runs on
    dsn: str | None  # the DSN it advertised (None: this node's, or none advertised)
    me: str  # this node's ID (the claim names it)
    stale: bool = False  # this node has peers and its process is not running: its view is old


def tick_home(conn: psycopg.Connection[Any]) -> TickHome | None:
    """The tick home as this node's database sees it; None when the
    database is no node of a cluster."""
    row = conn.execute(sql.TICK_HOME).fetchone()
    if row is None:
        return None
    node, myself, dsn, me, stale = row
    return TickHome(node, bool(myself), dsn, me or "", bool(stale))


def save(conn: psycopg.Connection[Any], schedule: Schedule, now: dt.datetime | None = None) -> None:
    """Create or change a schedule (its next job: at its next tick after
    ``now``, by default the database's clock)."""
    now = now or database_now(conn)
    conn.execute(sql.UPSERT_SCHEDULE, {
        "name": schedule.name, "cron": schedule.cron, "tz": schedule.tz, "queue": schedule.queue,
        "body": schedule.body, "options": json.dumps(schedule.options),
        "start_tick": latest_tick(schedule.cron, schedule.tz, now)})


def load(conn: psycopg.Connection[Any], broken: list[tuple[str, str]] | None = None,
         ) -> list[tuple[Schedule, dt.datetime | None]]:
    """Every valid schedule of the database, with its last tick. A row made
    invalid by hand (its cron, time zone or options) is logged and left
    out: it must not stop the others. ``broken`` gets ``(name, why)`` of
    each such row (``pgq periodic list`` shows them: hidden, their names
    could not be found to remove them)."""
    out = []
    for name, cron, tz, queue, body, options, last in conn.execute(sql.SCHEDULES).fetchall():
        try:
            if not isinstance(options, dict | None):
                raise InvalidTypeError(f"its options are {type(options).__name__}, not an object")
            out.append((Schedule(name, cron, queue, bytes(body), tz, dict(options or {})), last))
        except (InvalidArgumentError, InvalidTypeError) as exc:
            log.warning("periodic: schedule %s is skipped: %s", name, exc)
            if broken is not None:
                broken.append((name, str(exc)))
    return out


def remove(conn: psycopg.Connection[Any], name: str) -> bool:
    args.text("a schedule's name", name, 200)
    return conn.execute(sql.REMOVE_SCHEDULE, {"name": name}).rowcount > 0


class _TickTaken(Exception):
    """Another node's scheduler claimed the tick (rolls the job back)."""


class _NodeDown(PgqError):
    """This node has peers and its process does not run: no tick is added."""


class Scheduler:
    """Adds the due jobs of every schedule of a database (see the module doc)."""

    def __init__(self, client: Any) -> None:
        self.client = client  # a pgq.Client on the database
        self.next_in = 60.0  # after fire_due: seconds until the next tick of any schedule
        self._unshared: set[str] = set()  # tick homes that cannot share ticks (warned once)
        self._silent: set[str] = set()  # tick homes that did not answer in this look

    def fire_due(self, now: dt.datetime | None = None) -> list[tuple[str, dt.datetime, str]]:
        """Add the job of every due tick (by the database's clock unless
        ``now`` is given); ``(schedule, tick, job id)`` of each job this call
        added (another scheduler may have added some)."""
        added = []
        self._silent.clear()
        # Autocommit: each schedule's tick is its own transaction, so one
        # whose add is refused (a paused queue, NOREPL) is logged and
        # retried at the next look, and the others' jobs are added (one
        # transaction for all rolled every schedule back, and stopped them).
        with look_connection(self.client.dsn) as conn:
            now = now or database_now(conn)
            schedules = load(conn)
            for schedule, last in schedules:
                tick = due_tick(schedule.cron, schedule.tz, last, now, schedule.catch_up)
                if tick is None:
                    continue
                try:
                    job_id = self._fire(conn, schedule, tick)
                except (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled) as exc:
                    # This schedule's row or queue waited past the look's
                    # bounds (another scheduler holds it): the others go on,
                    # this one at the next look (both are OperationalErrors,
                    # which ended the whole look).
                    log.warning("periodic: %s waited too long for its tick %s (tried again at "
                                "the next look): %s", schedule.name, tick.isoformat(), exc)
                    continue
                except psycopg.OperationalError:
                    raise  # the connection: no schedule can go on
                except _NodeDown as exc:  # so it is for every schedule: one warning a look
                    log.warning("periodic: no job added for the due ticks of this look: %s", exc)
                    break
                except (PgqError, psycopg.Error) as exc:
                    log.warning("periodic: %s could not add its job for its tick %s: %s",
                                schedule.name, tick.isoformat(), exc)
                    continue
                if job_id is None:
                    continue  # another scheduler took this tick
                added.append((schedule.name, tick, job_id))
                log.info("periodic: %s added job %s for its tick %s", schedule.name, job_id,
                         tick.isoformat())
        self.next_in = _until_next(schedules, now)
        return added

    def _fire(self, conn: psycopg.Connection[Any], schedule: Schedule,
              tick: dt.datetime) -> str | None:
        """Claim ``tick`` and add its job, in one transaction: the job's ID,
        or None if another scheduler claimed it first (or the schedule
        changed since it was read: the next look reads it again).

        In a cluster the job is added first, in a savepoint, and the tick
        claimed at the home last: an add that is refused (a paused queue,
        NOREPL) then claims nothing, and another node's scheduler adds the
        tick's job; a claim that is lost drops the job. The home is reached
        (and checked) before the add, so the add's outbox event waits for
        one statement at the home only (a node's drain counts an event's
        age: one held back for seconds looked like a stuck node)."""
        with conn.transaction():
            row = conn.execute(sql.CLAIM_TICK, {
                "name": schedule.name, "tick": tick, "cron": schedule.cron, "tz": schedule.tz,
                "queue": schedule.queue, "body": schedule.body,
                "options": json.dumps(schedule.options)}).fetchone()
            if row is None:
                return None
            home = tick_home(conn)
            if home is not None and home.stale:
                raise _NodeDown("this node's process is not running, so its view of the cluster "
                               "is old: its schedulers add no periodic jobs until it runs (the "
                               "other nodes' schedulers add the ticks of the schedules they "
                               "hold; a schedule held here only waits for it)")
            with self._home(conn, home) as claim:
                try:
                    with conn.transaction():  # a savepoint
                        job_id: str = self.client.add_job(schedule.queue, schedule.body,
                                                          conn=conn, **schedule.add_options())
                        if claim is not None and not claim(schedule.name, tick):
                            raise _TickTaken
                except _TickTaken:
                    return None  # another node's scheduler took it: last_tick moves, no job
                return job_id

    @contextlib.contextmanager
    def _home(self, conn: psycopg.Connection[Any],
              home: TickHome | None) -> Iterator[Callable[[str, dt.datetime], bool] | None]:
        """How to claim a tick at the tick home (see the module doc): a
        function (name, tick) -> won, or None when there is nothing to claim
        (no cluster) or the home cannot share its ticks. A claim won before
        by this node is won again (its reply, or its job's commit, was
        lost). A home that does not answer is a PgqError: the caller's
        transaction rolls back, and the tick is tried again at the next
        look (once per look: the look's other schedules do not wait for it
        again)."""
        if home is None:
            yield None
            return
        params = {"node": home.me}
        if home.myself:
            yield lambda name, tick: conn.execute(
                sql.CLAIM_CLUSTER_TICK, {**params, "name": name, "tick": tick}).fetchone() is not None
            return
        if home.dsn is None:
            self._cannot_share(home, "it advertised no DSN (--advertise-dsn)")
            yield None
            return
        if home.node in self._silent:
            raise _no_answer(home, "earlier in this look")
        try:
            remote = psycopg.connect(home.dsn, autocommit=True, connect_timeout=HOME_TIMEOUT)
        except psycopg.Error as exc:
            raise self._silenced(home, exc) from None
        with remote:
            why = self._not_shareable(remote, home)
            if why is not None:
                self._cannot_share(home, why)
                yield None
                return

            def claim(name: str, tick: dt.datetime) -> bool:
                try:
                    row = remote.execute(sql.CLAIM_CLUSTER_TICK,
                                         {**params, "name": name, "tick": tick}).fetchone()
                except psycopg.Error as exc:
                    raise PgqError(f"the cluster's tick home, node {home.node[:8]}, could not "
                                   f"claim the tick ({first_line(exc)}); it is tried again at "
                                   "the next look") from None
                return row is not None

            yield claim

    def _not_shareable(self, remote: psycopg.Connection[Any], home: TickHome) -> str | None:
        """Why the database ``remote`` reached cannot take ``home``'s claims
        (None: it can). Two nodes that advertise "localhost" reach their own
        databases: each claim won there, and every node added a job."""
        try:
            remote.execute(f"SET statement_timeout = '{HOME_TIMEOUT}s'")
            found = remote.execute(sql.NODE_ID).fetchone()
            remote.execute(sql.HAS_CLAIMS).fetchone()
        except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedFunction,
                psycopg.errors.InvalidSchemaName):
            return "its database has no pgq.periodic_claims (an older pgq)"
        except psycopg.Error as exc:
            raise self._silenced(home, exc) from None
        if found is None or found[0] != home.node:
            return (f"the DSN it advertised reaches another database (node "
                    f"{str(found[0] if found else None)[:8]}): set --advertise-dsn")
        return None

    def _silenced(self, home: TickHome, exc: psycopg.Error) -> PgqError:
        """``home`` did not answer: not tried again in this look."""
        self._silent.add(home.node)
        return _no_answer(home, f"({first_line(exc)})")

    def _cannot_share(self, home: TickHome, why: str) -> None:
        """Warn (once per home) that ``home`` cannot share ticks; each node
        then adds its own job a tick, as before schema 0018."""
        if home.node not in self._unshared:
            self._unshared.add(home.node)
            log.warning("periodic: the cluster's tick home, node %s, cannot share ticks: %s. "
                        "Each node adds its own job a tick", home.node[:8], why)

    def seconds_to_next(self, now: dt.datetime | None = None) -> float:
        """Until the next tick of any schedule (at most 60 s: schedules change)."""
        with look_connection(self.client.dsn) as conn:
            return _until_next(load(conn), now or database_now(conn))


def look_connection(dsn: str) -> psycopg.Connection[Any]:
    """A connection for one look at the schedules (see LOOK_CONNECT_TIMEOUT),
    autocommit: each schedule's tick is its own transaction."""
    from psycopg.conninfo import conninfo_to_dict

    from .dsn import connection_settings

    bounds = f"-c statement_timeout={LOOK_STATEMENT_TIMEOUT_MS} -c lock_timeout={LOOK_LOCK_TIMEOUT_MS}"
    # the DSN's own connect_timeout stands (a keyword argument replaced it)
    timeout = conninfo_to_dict(dsn).get("connect_timeout") or LOOK_CONNECT_TIMEOUT
    return psycopg.connect(dsn, autocommit=True, connect_timeout=timeout,
                           **connection_settings(dsn, bounds, "pgq-scheduler"))


def _no_answer(home: TickHome, how: str) -> PgqError:
    return PgqError(f"the cluster's tick home, node {home.node[:8]}, did not answer {how}; "
                    "the tick is tried again at the next look")


def _until_next(schedules: list[tuple[Schedule, dt.datetime | None]], now: dt.datetime) -> float:
    """Seconds until the next tick of any of ``schedules`` (at most 60)."""
    wait, now = 60.0, _instant(now)
    for schedule, _last in schedules:
        wait = min(wait, (next_tick(schedule.cron, schedule.tz, now) - now).total_seconds())
    return max(wait, 0.0)
