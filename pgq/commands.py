"""Every client command of Disque, written once, free of I/O.

Each function here takes already-validated arguments (see
:mod:`pgq.arguments`) and a :class:`~pgq.protocol.Session`, and returns a
generator that yields :mod:`pgq.protocol` requests. The sync and async
drivers run the same generators, so the semantics cannot diverge between
:class:`pgq.Client` and :class:`pgq.AsyncClient`.

Each command documents the Disque rule it implements; the SQL it relies on
is in :mod:`pgq.statements`, with the reasons it is safe.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from . import statements as sql
from .arguments import JobParams
from .errors import MaxLenError, NoJobError, NoReplError, PausedError, TooLateError
from .ids import is_at_least_once_id, new_job_id, ttl_seconds_from_id
from .job import Job
from .protocol import (
    Begin,
    Command,
    Commit,
    Copy,
    Housekeeping,
    Listen,
    Query,
    Result,
    Session,
    Wait,
)

__all__ = [
    "add_jobs", "get_jobs", "ack_jobs", "fast_ack_jobs", "nack_jobs", "enqueue_jobs",
    "dequeue_jobs", "del_jobs", "working", "show", "qlen", "qpeek", "qstat", "qscan",
    "jscan", "pause", "info", "hello", "sweep", "COPY_THRESHOLD", "JOB_STATES",
]

# Below this many bodies one INSERT ... unnest() is cheapest; above it COPY is.
COPY_THRESHOLD = 2000
JOB_STATES = ("wait-repl", "active", "queued", "acked")
REACHABLE_NODES_ALONE = 1


# ---------------------------------------------------------------------- add


def add_jobs(session: Session, queue: str, bodies: Sequence[bytes], params: JobParams,
             reachable_nodes: int = REACHABLE_NODES_ALONE) -> Command[list[str]]:
    """ADDJOB for one or many bodies; returns their IDs in order.

    Disque rules: NOREPL if fewer than W nodes are reachable; PAUSED if the
    queue is paused for input; MAXLEN if the queue already holds ``maxlen``
    jobs (for a bulk add: if the bulk would take it past ``maxlen``; nothing
    is added then). A delayed job stays active until ``now + delay``.
    """
    if params.replicate > reachable_nodes:
        raise NoReplError(
            f"not enough reachable nodes for replicate={params.replicate}: "
            f"{reachable_nodes} reachable (add nodes to the cluster or ask for fewer copies)"
        )
    ids = [new_job_id(session.node_id, params.ttl, params.retry) for _ in bodies]
    if len(bodies) >= COPY_THRESHOLD:
        yield from _copy_jobs(session, queue, ids, bodies, params)
        return ids
    locking = params.maxlen is not None
    if locking:
        yield Begin()
        yield Query(sql.LOCK_QUEUE_FOR_MAXLEN, {"queue": queue}, Result.NONE)
    row = yield Query(sql.ADD_JOBS, {
        "queue": queue, "ids": ids, "bodies": list(bodies), "n": len(bodies),
        "maxlen": params.maxlen, "repl": params.replicate, "retry": params.retry,
        "delay": params.delay, "ttl": params.ttl, "always_notify": not session.owned,
    }, Result.ROW)
    if locking:
        yield Commit()
    paused, full, _added, _notified = row
    _raise_if_refused(queue, paused, full, params.maxlen)
    return ids


def _raise_if_refused(queue: str, paused: bool, full: bool, maxlen: int | None) -> None:
    if paused:
        raise PausedError(f"queue {queue!r} is paused for input: resume it with pause(queue, 'none')")
    if full:
        raise MaxLenError(f"queue {queue!r} already holds {maxlen} or more jobs (maxlen={maxlen})")


def _copy_jobs(session: Session, queue: str, ids: list[str], bodies: Sequence[bytes],
               params: JobParams) -> Command[None]:
    """The bulk path: check, COPY and notify in one transaction."""
    yield Begin()
    if params.maxlen is not None:
        yield Query(sql.LOCK_QUEUE_FOR_MAXLEN, {"queue": queue}, Result.NONE)
    paused, length = yield Query(sql.ADD_CHECK, {"queue": queue}, Result.ROW)
    full = params.maxlen is not None and length + len(bodies) > params.maxlen
    _raise_if_refused(queue, paused, full, params.maxlen)
    now: dt.datetime = yield Query(sql.DB_NOW, None, Result.VALUE)
    expires = now + dt.timedelta(seconds=params.ttl)
    if params.delay > 0:
        state, requeue, queued, enqueues = "active", now + dt.timedelta(seconds=params.delay), None, 0
    else:
        state, requeue, queued, enqueues = "queued", None, now, 1
    rows = [
        (job_id, queue, state, body, params.replicate, params.retry, params.delay,
         expires, requeue, queued, enqueues)
        for job_id, body in zip(ids, bodies, strict=True)
    ]
    yield Copy(sql.COPY_JOBS, sql.COPY_JOBS_TYPES, rows)
    if state == "queued":
        yield Query(sql.NOTIFY_QUEUE, {"queue": queue, "always_notify": not session.owned},
                    Result.NONE)
    yield Commit()


# ---------------------------------------------------------------------- get


def _poll_wait(polls: int, interval: float) -> float:
    """Back-off between claim attempts while blocked: 50 ms doubling up to ``interval``.

    Short at first because a job committed while we were registering as a
    waiter could not notify us; after that NOTIFY wakes us and polling is only
    the fallback (and the whole mechanism behind PgBouncer's transaction mode).
    """
    return min(0.05 * (2 ** min(polls, 10)), interval)


def get_jobs(session: Session, queues: list[str], count: int, timeout: float | None,
             nohang: bool, withcounters: bool) -> Command[list[Job]]:
    """GETJOB: up to ``count`` jobs, queues served left to right.

    Returns as many jobs as are ready (up to ``count``) as soon as there is
    at least one. With ``nohang`` returns ``[]`` at once when none is ready;
    otherwise blocks until one is, or ``timeout`` seconds pass (``None``
    blocks forever), then returns ``[]``.
    """
    claim = sql.CLAIM_RELAXED if session.owned else sql.CLAIM
    params = {"queues": queues, "count": count}
    deadline = None if timeout is None else session.clock() + timeout
    listening = False
    polls = 0
    while True:
        rows = yield Query(claim, params, Result.ROWS)
        if rows:
            return _jobs_in_priority_order(rows, queues, withcounters)
        if nohang:
            return []
        now = session.clock()
        if deadline is not None and now >= deadline:
            return []
        if session.can_listen and not listening:
            yield Listen(tuple(queues))
            listening = True
            continue  # claim again: a job may have been added before LISTEN took effect
        due_in = yield Query(sql.NEXT_DUE, {"queues": queues}, Result.VALUE)
        wait = _poll_wait(polls, session.poll_interval)
        if due_in is not None:
            wait = min(wait, max(due_in, 0.001))
        if deadline is not None:
            wait = min(wait, max(deadline - now, 0.0))
        polls += 1
        yield Wait(wait)
        yield Housekeeping()


def _jobs_in_priority_order(rows: list[tuple[Any, ...]], queues: list[str],
                            withcounters: bool) -> list[Job]:
    # RETURNING order is unspecified; restore (queue position, ctime, id).
    position = {name: i for i, name in enumerate(queues)}
    rows = sorted(rows, key=lambda r: (position[r[0]], r[5], r[1]))
    if withcounters:
        return [Job(r[1], r[0], r[2], r[3], r[4]) for r in rows]
    return [Job(r[1], r[0], r[2]) for r in rows]


# ---------------------------------------------------------- ack / nack / del


def ack_jobs(session: Session, ids: list[str]) -> Command[int]:
    """ACKJOB: number of known, not yet acknowledged jobs that were acknowledged."""
    dummies = [i for i in ids if is_at_least_once_id(i)]
    acked = yield Query(sql.ACK, {
        "ids": ids, "outcome": "acked", "dummy_ids": dummies,
        "dummy_ttls": [float(ttl_seconds_from_id(i)) for i in dummies],
    }, Result.VALUE)
    return int(acked)


def fast_ack_jobs(session: Session, ids: list[str]) -> Command[int]:
    """FASTACK: delete the jobs now, without leaving a tombstone."""
    deleted = yield Query(sql.DELETE_JOBS, {"ids": ids, "outcome": "fastacked",
                                            "with_acks": False}, Result.VALUE)
    return int(deleted)


def del_jobs(session: Session, ids: list[str]) -> Command[int]:
    """DELJOB: delete the jobs in any state (acked tombstones included), locally."""
    deleted = yield Query(sql.DELETE_JOBS, {"ids": ids, "outcome": "deleted",
                                            "with_acks": True}, Result.VALUE)
    return int(deleted)


def _requeue(session: Session, ids: list[str], nack: bool) -> Command[int]:
    row = yield Query(sql.REQUEUE, {"ids": ids, "nack": nack,
                                    "always_notify": not session.owned}, Result.ROW)
    return int(row[0])


def nack_jobs(session: Session, ids: list[str]) -> Command[int]:
    """NACK: put active jobs back in the queue now, counting a nack each."""
    return (yield from _requeue(session, ids, nack=True))


def enqueue_jobs(session: Session, ids: list[str]) -> Command[int]:
    """ENQUEUE: queue active jobs now (an additional delivery if queued before)."""
    return (yield from _requeue(session, ids, nack=False))


def dequeue_jobs(session: Session, ids: list[str]) -> Command[int]:
    """DEQUEUE: take queued jobs out of the queue; their retry timer re-queues them."""
    count = yield Query(sql.DEQUEUE, {"ids": ids}, Result.ROWCOUNT)
    return int(count)


def working(session: Session, job_id: str) -> Command[int | float]:
    """WORKING: postpone the next re-queue; returns the retry time in seconds
    (an int for a whole number of seconds, as Disque replies)."""
    state, retry, too_late, acked = yield Query(sql.WORKING, {"id": job_id}, Result.ROW)
    if state is None:
        if acked:
            raise NoJobError(f"job {job_id} is already acknowledged: there is nothing to postpone")
        raise NoJobError(f"job {job_id} is not known on this node (acknowledged, expired or never added)")
    if too_late:
        raise TooLateError(
            f"half of job {job_id}'s TTL has elapsed: its delivery can no longer be "
            "postponed (finish it, or NACK it)"
        )
    seconds = float(retry)
    return int(seconds) if seconds.is_integer() else seconds


# -------------------------------------------------------------- introspection

_SHOW_KEYS = ("id", "queue", "state", "repl", "ttl", "ctime", "delay", "retry", "nacks",
              "additional_deliveries", "deliveries", "next_requeue_within",
              "next_awake_within", "body")


def _job_dict(row: Sequence[Any], node_id: str) -> dict[str, Any]:
    info = dict(zip(_SHOW_KEYS, row, strict=True))
    info["nodes_delivered"] = [node_id]
    info["nodes_confirmed"] = [node_id]
    return info


def _ack_dict(row: Sequence[Any]) -> dict[str, Any]:
    job_id, queue, _acked_at, _dummy, ttl = row
    return {
        "id": job_id, "queue": queue, "state": "acked", "repl": None, "ttl": ttl,
        "ctime": None, "delay": None, "retry": None, "nacks": None,
        "additional_deliveries": None, "deliveries": None, "next_requeue_within": None,
        "next_awake_within": ttl, "body": None, "nodes_delivered": [], "nodes_confirmed": [],
    }


def show(session: Session, job_id: str) -> Command[dict[str, Any] | None]:
    """SHOW: everything known about a job, or None."""
    row = yield Query(sql.SHOW, {"id": job_id}, Result.ROW)
    if row is not None:
        return _job_dict(row, session.node_id)
    acked = yield Query(sql.SHOW_ACKED, {"id": job_id}, Result.ROW)
    return _ack_dict(acked) if acked is not None else None


def qlen(session: Session, queue: str) -> Command[int]:
    """QLEN: number of jobs queued (due re-queues and expiries applied first)."""
    yield Query(sql.SWEEP_QUEUE, {"queue": queue}, Result.NONE)
    length = yield Query(sql.QLEN, {"queue": queue}, Result.VALUE)
    return int(length)


def qpeek(session: Session, queue: str, count: int) -> Command[list[Job]]:
    """QPEEK: up to ``abs(count)`` queued jobs, oldest first (newest first if count < 0)."""
    yield Query(sql.SWEEP_QUEUE, {"queue": queue}, Result.NONE)
    statement = sql.QPEEK_NEWEST if count < 0 else sql.QPEEK_OLDEST
    rows = yield Query(statement, {"queue": queue, "count": abs(count)}, Result.ROWS)
    return [Job(r[1], r[0], r[2], r[3], r[4]) for r in rows]


def qstat(session: Session, queue: str) -> Command[dict[str, Any] | None]:
    """QSTAT: statistics of one queue, or None if the queue does not exist."""
    yield Query(sql.SWEEP_QUEUE, {"queue": queue}, Result.NONE)
    row = yield Query(sql.QSTAT, {"queue": queue}, Result.ROW)
    if row is None:
        return None
    name, length, _created, _last, blocked, jobs_in, jobs_out, paused, age, idle = row
    return {
        "name": name, "len": int(length), "age": age, "idle": idle, "blocked": int(blocked),
        "import_from": [], "import_rate": 0, "jobs_in": int(jobs_in),
        "jobs_out": int(jobs_out), "pause": paused,
    }


def encode_cursor(key: str) -> int:
    """A stateless scan cursor: the last returned key, as an integer (0 = start/done)."""
    return int.from_bytes(key.encode("utf-8"), "big")


def decode_cursor(cursor: int) -> str:
    if cursor == 0:
        return ""
    return cursor.to_bytes((cursor.bit_length() + 7) // 8, "big").decode("utf-8")


def qscan(session: Session, cursor: int, count: int, minlen: int | None, maxlen: int | None,
          importrate: int | None) -> Command[tuple[int, list[str]]]:
    """QSCAN: iterate over queue names; every queue present for the whole scan is returned."""
    yield Query(sql.SWEEP_ALL_QUEUES, None, Result.NONE)
    rows = yield Query(sql.QSCAN, {"after": decode_cursor(cursor), "count": count}, Result.ROWS)
    names = [
        name for name, length in rows
        if (minlen is None or length >= minlen) and (maxlen is None or length <= maxlen)
        and (importrate is None or importrate <= 0)  # nothing is imported on one node
    ]
    next_cursor = encode_cursor(rows[-1][0]) if len(rows) == count else 0
    return next_cursor, names


def jscan(session: Session, cursor: int, count: int, queue: str | None,
          states: Sequence[str], reply: str) -> Command[tuple[int, list[Any]]]:
    """JSCAN: iterate over jobs (and acked tombstones) by ID, optionally filtered."""
    yield Query(sql.SWEEP_ALL_QUEUES, None, Result.NONE)
    after = decode_cursor(cursor)
    wanted = list(states) or None
    params = {"after": after, "count": count, "queue": queue,
              "states": [s for s in states if s != "acked"] or None}
    entries: list[tuple[str, Any]] = []
    live_rows: list[Any] = []
    if wanted is None or any(s != "acked" for s in wanted):
        live_rows = yield Query(sql.JSCAN_JOBS, params, Result.ROWS)
        entries += [(r[0], _job_dict(r, session.node_id)) for r in live_rows]
    acked_rows: list[Any] = []
    if wanted is None or "acked" in wanted:
        acked_rows = yield Query(sql.JSCAN_ACKS, params, Result.ROWS)
        entries += [(r[0], _ack_dict(r)) for r in acked_rows]
    entries.sort(key=lambda e: e[0])
    page = entries[:count]
    # Done only when no source may hold more rows after the last one returned.
    more = len(live_rows) == count or len(acked_rows) == count or len(entries) > count
    next_cursor = encode_cursor(page[-1][0]) if more and page else 0
    if reply == "id":
        return next_cursor, [job_id for job_id, _ in page]
    return next_cursor, [info for _, info in page]


# -------------------------------------------------------------------- pause

PAUSE_FLAGS = ("in", "out", "all", "none", "state", "bcast")


def pause(session: Session, queue: str, flags: Sequence[str]) -> Command[str]:
    """PAUSE: change (or just report) whether a queue accepts input / gives output."""
    paused_in = paused_out = False
    update = False
    for flag in flags:
        if flag == "none":
            paused_in = paused_out = False
            update = True
        elif flag in ("in", "out", "all"):
            paused_in |= flag in ("in", "all")
            paused_out |= flag in ("out", "all")
            update = True
    if not update:
        state = yield Query(sql.PAUSE_STATE, {"queue": queue}, Result.VALUE)
        return str(state)
    state = {(False, False): "none", (True, False): "in", (False, True): "out",
             (True, True): "all"}[(paused_in, paused_out)]
    yield Query(sql.SET_PAUSE, {"queue": queue, "state": state}, Result.NONE)
    return state


# --------------------------------------------------------------- node level


def hello(session: Session) -> Command[dict[str, Any]]:
    """HELLO: this node's ID and every node it knows (just itself on one node)."""
    yield from ()
    return {
        "version": 1,
        "id": session.node_id,
        "nodes": [{"id": session.node_id, "host": session.host, "port": session.port,
                   "priority": 1}],
    }


def info(session: Session, version: str) -> Command[dict[str, Any]]:
    """INFO: the node, its server and its jobs."""
    row = yield Query(sql.INFO, None, Result.ROW)
    counts = yield Query(sql.JOB_COUNTS, None, Result.ROWS)
    server_version, database, uptime, queues, blocked, sync_commit, fsync = row
    jobs = {state: int(n) for state, n in counts}
    return {
        "pgq_version": version,
        "node_id": session.node_id,
        "server_version": server_version,
        "database": database,
        "uptime": uptime,
        "queues": int(queues),
        "blocked_clients": int(blocked),
        "registered_jobs": sum(n for state, n in jobs.items() if state != "acked"),
        "jobs": jobs,
        "synchronous_commit": sync_commit,
        "fsync": fsync,
    }


def sweep(session: Session) -> Command[tuple[int, int, int]]:
    """Run the periodic sweep now: (expired jobs, re-queued jobs, expired acks)."""
    row = yield Query(sql.SWEEP, None, Result.ROW)
    return int(row[0]), int(row[1]), int(row[2])
