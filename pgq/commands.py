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

import dataclasses
import datetime as dt
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from . import contracts
from . import statements as sql
from .arguments import JobParams
from .backoff import doubling
from .copydata import binary_copy
from .errors import (
    InvalidArgumentError,
    LeavingError,
    MaxLenError,
    NoJobError,
    NoReplError,
    PausedError,
    TooLateError,
)
from .floors import FROM_THE_FRONT
from .ids import is_at_least_once_id, millis_from_id, new_job_ids, ttl_seconds_from_id
from .job import Job
from .protocol import (
    Begin,
    ClusterView,
    Command,
    Commit,
    Copy,
    Housekeeping,
    Listen,
    ListenReplication,
    PeerUnreached,
    PeerWrite,
    Query,
    Result,
    Rollback,
    Session,
    Wait,
)

__all__ = [
    "add_jobs", "get_jobs", "ack_jobs", "fast_ack_jobs", "nack_jobs", "enqueue_jobs",
    "dequeue_jobs", "del_jobs", "working", "show", "qlen", "qpeek", "qstat", "qscan",
    "jscan", "pause", "info", "hello", "sweep", "wait_replicated", "cluster_view",
    "dead_letter_jobs", "dead_letters", "requeue_dead_letters",
    "COPY_THRESHOLD", "JOB_STATES",
]

# Below this many bodies one INSERT ... unnest() is cheapest; above it COPY is.
COPY_THRESHOLD = 2000
JOB_STATES = ("wait-repl", "active", "queued", "acked")
DEFAULT_REPLICATION = 3
MAX_CLAIM = 100_000  # the largest COUNT (arguments.MAX_COUNT): a batch claims no more
NODE_STUCK_AFTER = 3.0  # an outbox event this old: the node process is not running
MAX_REPLICATED_BODY = 48 * 2**20  # below the bus's 64 MiB frame, with room to spare
# Direct copies (see _add_direct): how long the writes into peers may take
# before the add goes through the node process instead (a healthy peer
# answers in milliseconds), and how long a peer they failed on is left out.
DIRECT_TIMEOUT = 2.0
PEER_BACKOFF = 5.0


def cluster_view(session: Session, fresh: bool = False) -> Command[ClusterView]:
    """The node's cluster state, read again when the cached one is stale (or
    when ``fresh``: a decision about to fail re-reads before it fails)."""
    view = session.cluster
    now = session.clock()
    if fresh or view.stale(now):
        row = yield Query(sql.CLUSTER_STATE, None, Result.ROW)
        if row is not None:
            active, leaving, reachable, member, peer_ids, peer_dsns = row
            view.active, view.leaving, view.reachable, view.member = (
                bool(active), bool(leaving), int(reachable), bool(member))
            view.peers = tuple(zip(peer_ids or (), peer_dsns or (), strict=True))
        view.fetched_at = now
    return view


def _ring(session: Session, events: int) -> Command[None]:
    """Wake the node process after outbox events committed (own connections:
    a separate cheap statement; a caller's transaction rang in-statement)."""
    if events and session.owned:
        yield Query(sql.RING_NODE, None, Result.NONE)


# ---------------------------------------------------------------------- add


def add_jobs(session: Session, queue: str, bodies: Sequence[bytes],
             params: JobParams, memo: dict[str, list[str]] | None = None) -> Command[list[str]]:
    """ADDJOB for one or many bodies; returns their IDs in order.

    Disque rules: NOREPL if fewer than W nodes are reachable; PAUSED if the
    queue is paused for input; MAXLEN if the queue already holds ``maxlen``
    jobs (for a bulk add: if the bulk would take it past ``maxlen``; nothing
    is added then). A delayed job stays active until ``now + delay``.

    W defaults to min(3, reachable nodes) (1 for an at-most-once job). On a
    node served by a node process, a job with W > 1 is replicated: a plain
    add returns once W nodes committed it (NOREPL after ``timeout``, the
    job withdrawn); an asynchronous add, or one inside the caller's
    transaction, is queued at once and copied in the background (see
    ``wait_replicated``). A leaving node keeps no copy: it replicates new
    jobs to W other nodes.

    ``memo`` (the call's, see :class:`AddCall`) keeps the IDs made at the
    first attempt on each node: run again after a lost connection, the add
    stores none of the jobs the attempt before stored, whether they are
    still here or already done with (:func:`_kept_before`).
    """
    view = yield from cluster_view(session)
    wanted, minimum = _copies(params, view)
    if wanted > view.available or (view.member and not view.active and wanted > 1):
        view = yield from cluster_view(session, fresh=True)  # decide on what HELLO shows now
        wanted, minimum = _copies(params, view)
    if view.member and not view.active and (params.replicate is None or wanted > 1):
        raise NoReplError(
            "the node process of this database is not running, so it cannot make copies: "
            "start it (`pgq node start`), add through another node, or pass replicate=1 "
            "to keep the job here only", node_down=True).for_cli(
            "the node process of this database is not running, so it cannot make copies: "
            "start it (`pgq node start`), add through another node, or add with "
            "--replicate 1 to keep the job here only")
    if wanted > view.available:
        raise NoReplError(
            f"not enough reachable nodes for replicate={wanted}: {view.available} can take a copy "
            "(start or join more nodes, or ask for fewer copies)"
        )
    replicated = view.active and (wanted > 1 or view.leaving)
    if replicated and any(len(body) > MAX_REPLICATED_BODY for body in bodies):
        raise InvalidArgumentError(
            f"a replicated job's body is at most {MAX_REPLICATED_BODY // 2**20} MiB (copies "
            "travel in one bus frame): store big payloads elsewhere and queue a reference")
    retried = memo is not None and session.node_id in memo
    ids = _ids(session, params, len(bodies), memo)
    if memo is not None and retried:
        stored, done = yield from _kept_before(session, ids)
        if stored or done:
            return (yield from _add_rest(session, queue, ids, bodies, params, (stored, done),
                                         (wanted, minimum) if replicated else None))
        if replicated:
            yield from _forsake_ids(session, queue, ids, params, memo)
    if replicated and not view.leaving and replicated_batchable(AddCall(queue, bodies, params)):
        taken = [_Taken(0, ids, wanted, minimum)]
        targets = _direct_targets(session, view, taken)
        if targets:
            outcomes: list[Any] = [REROUTE]
            timeout = _replication_timeout(session, params)
            started = session.clock()
            if (yield from _add_direct(session, [AddCall(queue, bodies, params)], taken,
                                       outcomes, targets, timeout)):
                if isinstance(outcomes[0], Exception):
                    raise outcomes[0]
                return ids
            # The node's way gets what the attempt left of the timeout.
            params = dataclasses.replace(
                params, timeout=max(timeout - (session.clock() - started), 0.001))
    if replicated:
        existing = yield from _add_replicated(session, queue, ids, bodies, params, wanted, minimum)
        if existing is None:
            return ids
        # An asynchronous add waits too: the key's job may be a synchronous
        # add's, still replicating, and withdrawn if that add fails (its ID
        # answered at once named a job that no longer existed).
        if session.owned:
            if not (yield from _await_copies_of(session, existing,
                                                _replication_timeout(session, params))):
                # withdrawn (its own add failed) or done with: the key is free
                return (yield from add_jobs(session, queue, bodies, params))
        return [existing]
    leaving, existing = yield from _store_here(session, queue, ids, bodies, params)
    if existing:
        return [existing]  # the idempotency key's live job: nothing was added
    if leaving:
        # The node was marked leaving after our view was read: it keeps no
        # new copy (nothing was stored); the add goes to other nodes, through
        # its node process. Without one, nothing can hand it on (the call
        # came back here for ever).
        view = yield from cluster_view(session, fresh=True)
        if not view.active:
            raise LeavingError(
                "this database is marked leaving and no node process serves it to hand new "
                "jobs on: add through another node, or clear the mark (`pgq cluster leaving "
                "no`)")
        return (yield from add_jobs(session, queue, bodies, params))
    return ids


# How far before its IDs' time a retried add looks for its jobs' end (see
# sql.RETRIED_ADD): the round trip that measures the clocks' difference, and
# a client clock slewed or stepped a little between the attempts.
RETRY_SLACK = 10.0
# The memo's key (beside each node's IDs) of IDs a replicated add gave up
# on this node whose tombstones may not be written yet (_forsake_ids).
_FORSAKEN = "forsaken:"


def _kept_before(session: Session, ids: list[str]) -> Command[tuple[set[str], set[str]]]:
    """An add run again after a lost connection: which of its jobs the
    attempt before stored, as (still here, done with since).

    In a cluster, a job done with on another node loses its copy here
    unlogged (SETACK, a FASTACK's DELJOB); its tombstone stays here, at the
    node that made its ID, for a minute after the DELJOB that ends its
    collection (cluster.sql.RETRY_WINDOW). A retry later than that, or of an
    at-most-once job federation moved away, stores the job again."""
    yield Begin()
    yield Query(sql.RETRY_PLAN, None, Result.NONE)
    stored, done = yield Query(sql.RETRIED_ADD, {
        "ids": ids, "first": millis_from_id(ids[0]) / 1000, "client_now": session.wall(),
        "slack": RETRY_SLACK}, Result.ROW)
    yield Commit()
    return set(stored), set(done)


def _forsake_ids(session: Session, queue: str, ids: list[str], params: JobParams,
                 memo: dict[str, list[str]]) -> Command[None]:
    """A replicated add run again that found nothing of its attempt before:
    that attempt may have written direct copies into peers and lost its own
    commit with the connection. Such copies re-queue after their retry, and
    under the same IDs they are a second delivery of this add's job that
    its ACK does not reach when this add draws other peers. The add goes on
    under new IDs, and the old IDs leave tombstones here (WITHDRAWN_HERE):
    such a copy's WILLQUEUE is answered SETACK.

    The IDs are renewed in place (the memo holds the list) before the
    tombstones are written: a later run must never find its own IDs
    tombstoned and call them done. The IDs given up stay in the memo until
    their tombstones committed, so a connection lost meanwhile leaves none
    of them without one."""
    forsaken = memo.setdefault(_FORSAKEN + session.node_id, [])
    forsaken.extend(ids)
    ids[:] = _new_ids(session, params, len(ids))
    yield Query(sql.WITHDRAWN_HERE, {
        "ids": forsaken, "queues": [queue] * len(forsaken),
        "expires": [session.wall() + params.ttl + RETRY_SLACK] * len(forsaken)}, Result.NONE)
    del forsaken[:]


def _add_rest(session: Session, queue: str, ids: list[str], bodies: Sequence[bytes],
              params: JobParams, kept: tuple[set[str], set[str]],
              copies: tuple[int, int] | None) -> Command[list[str]]:
    """An add run again whose attempt before stored jobs (``kept``: still
    here, done with): those are not stored again (one consumed meanwhile
    would be delivered a second time, after its ACK returned). The others go
    in now under their IDs, the chunks a large replicated add did not get
    to (it stores chunk by chunk, each in its own transaction), with the W
    and minimum of ``copies`` (None: kept here only). A synchronous add then
    waits once for the copies its jobs still lack; NOREPL names the jobs
    withdrawn, and every other job of the call as added (a client with
    several nodes then adds none of them again elsewhere)."""
    stored, done = kept
    rest = [n for n, job_id in enumerate(ids) if job_id not in stored and job_id not in done]
    result = list(ids)
    if rest:
        rest_ids, rest_bodies = [ids[n] for n in rest], [bodies[n] for n in rest]
        if copies is not None:
            yield from _add_replicated(session, queue, rest_ids, rest_bodies, params, *copies,
                                       confirm=False)
            stored |= set(rest_ids)
        elif (yield from _store_here(session, queue, rest_ids, rest_bodies, params))[0]:
            # The node is leaving now: it kept none of them; other nodes do.
            yield from cluster_view(session, fresh=True)
            for n, job_id in zip(rest, (yield from add_jobs(session, queue, rest_bodies, params)),
                                 strict=True):
                result[n] = job_id
    if stored and session.owned and not params.asynchronous:
        rows = yield Query(sql.REPLICATION_DONE, {"ids": sorted(stored)}, Result.ROWS)
        waiting = [row[0] for row in rows if not (row[1] or row[2])]
        if waiting:
            if session.can_listen:
                yield ListenReplication()
            timeout = _replication_timeout(session, params)
            failed, stuck = yield from _copies_or_withdraw(session, waiting, timeout)
            if failed:
                raise _withdrawn(result, failed, timeout, stuck)
    return result


def _store_here(session: Session, queue: str, ids: list[str], bodies: Sequence[bytes],
                params: JobParams) -> Command[tuple[bool, str | None]]:
    """Jobs kept here only, under these IDs: one INSERT, or COPY for many.
    Returns (the node turned out to be leaving: nothing stored, the ID of
    the live job holding the add's key: nothing added)."""
    if len(bodies) >= COPY_THRESHOLD:
        return (yield from _copy_jobs(session, queue, ids, bodies, params)), None
    return (yield from _insert_jobs(session, queue, ids, bodies, params))


def _copies(params: JobParams, view: ClusterView) -> tuple[int, int]:
    """(W, the copies that suffice when the last targets do not answer in time).

    W defaults to min(3, reachable nodes) (1 for an at-most-once job). A
    defaulted W is soft: min(2, W) copies suffice once the others had
    ``REPLICATION_GRACE`` to confirm (a node that is down but not yet
    declared dead must not stop adds). An explicit ``replicate`` is strict.
    """
    if params.replicate is not None:
        return params.replicate, params.replicate
    if params.retry == 0:
        return 1, 1
    wanted = max(1, min(DEFAULT_REPLICATION, view.available))
    return wanted, min(2, wanted)


def _insert_jobs(session: Session, queue: str, ids: list[str], bodies: Sequence[bytes],
                 params: JobParams) -> Command[tuple[bool, str | None]]:
    """One INSERT of jobs held here only. Returns (refused because the node
    is leaving, the ID of the live job holding the add's key: nothing added)."""
    locking = yield from _lock_for_add(queue, params)
    row = yield Query(sql.ADD_JOBS, {
        "queue": queue, "ids": ids, "bodies": list(bodies), "n": len(bodies),
        "maxlen": params.maxlen, "repl": 1, "retry": params.retry,
        "delay": params.delay, "ttl": params.ttl, "always_notify": not session.owned,
        "priority": params.priority, "key": params.key,
    }, Result.ROW)
    if locking:
        yield Commit()
    paused, full, _added, _notified, existing, leaving = row
    if existing:
        return False, existing
    if leaving:
        return True, None
    _raise_if_refused(queue, paused, full, params.maxlen)
    return False, None


def _lock_for_add(queue: str, params: JobParams) -> Command[bool]:
    """Open a transaction for an add that must be serialised with others,
    and take its locks; True if one was opened (the caller commits it).

    MAXLEN: producers of one queue, so two cannot both see room for one
    more job. An idempotency key: adds of that key in that queue, so the
    add's own statement, whose snapshot is taken after the lock, sees a job
    a concurrent add of the key committed. (Inside a caller's transaction
    at REPEATABLE READ or SERIALIZABLE, the snapshot is the transaction's:
    two such adds racing on one key may both add; READ COMMITTED, the
    default, is exact.)
    """
    if params.maxlen is None and params.key is None:
        return False
    yield Begin()
    if params.maxlen is not None:
        yield Query(sql.LOCK_QUEUE_FOR_MAXLEN, {"queue": queue}, Result.NONE)
    if params.key is not None:
        yield Query(sql.LOCK_IDEMPOTENCY_KEY, {"queue": queue, "key": params.key}, Result.NONE)
    return True


@dataclass(frozen=True, slots=True)
class AddCall:
    """One caller's validated ADDJOB, as :func:`add_batch` takes it."""

    queue: str
    bodies: Sequence[bytes]
    params: JobParams
    # its job IDs per node, made at its first attempt there (see _ids)
    ids: dict[str, list[str]] = field(default_factory=dict, compare=False)


# The outcome of a call a batch cannot take (copies, MAXLEN, a leaving
# node...): its caller runs :func:`add_jobs` on its own.
REROUTE = "reroute"
# Replicated batches in flight at once per database and client process:
# a batch holds its connection while it waits for copies (a few ms), and
# the calls that arrive meanwhile gather for the next one. Two keep the
# node process fed while a batch waits; measured here (3 local nodes, 10
# and 50 callers), 2 beat 1, 3, 4 and 8: more batches in flight split the
# same callers into smaller batches, each paying the whole pipeline's
# fixed cost (a drain, a REPLJOB and a commit per peer, a confirmation).
REPLICATED_FLUSHES = 2


# The body bytes one batch of adds gathers from its callers (a caller's own
# call may weigh more): PostgreSQL refuses a value over 1 GiB, and the
# batch's bodies travel as one array.
BATCH_BYTES = 64 * 1024 * 1024


def call_bytes(call: AddCall) -> int:
    """An add's weight in a batch (see BATCH_BYTES)."""
    return sum(map(len, call.bodies))


def batchable(call: AddCall) -> bool:
    """Worth a batch before knowing the cluster: small, no lock (MAXLEN, key)."""
    return (call.params.maxlen is None and call.params.key is None
            and len(call.bodies) < COPY_THRESHOLD)


def _run_again(session: Session, call: AddCall) -> bool:
    """Has this call been tried on this node before (a batch run again after
    its connection broke, or one that stored nothing)? Such a call goes its
    own way, which finds what the attempt before stored (REROUTE)."""
    return session.node_id in call.ids


def _new_ids(session: Session, params: JobParams, count: int) -> list[str]:
    return new_job_ids(session.node_id, params.ttl, params.retry, count,
                       millis=int(session.wall() * 1000), random_bytes=session.random_bytes)


def _ids(session: Session, params: JobParams, count: int,
         memo: dict[str, list[str]] | None) -> list[str]:
    """The call's job IDs on this node: made once per node and kept in
    ``memo`` (the call's), so that a client that runs the command again after
    a lost connection stores the same IDs, which the INSERTs' ON CONFLICT
    DO NOTHING then take once. New IDs at each attempt added the jobs a
    second time when the first attempt had committed (a synchronous
    replicated add whose connection broke while it waited for its copies;
    a batch whose second statement's connection broke)."""
    if memo is None:
        return _new_ids(session, params, count)
    ids = memo.get(session.node_id)
    if ids is None:
        ids = memo[session.node_id] = _new_ids(session, params, count)
    return ids


def add_batch(session: Session, calls: Sequence[AddCall]) -> Command[list[Any]]:
    """ADDJOB of many callers in one statement and one commit (group commit).

    Takes the jobs held here only (a single node, or ``replicate=1``), and
    asynchronous replicated ones (queued at once and copied in the
    background: a second statement, with their outbox events). Each call
    gets its IDs, a PausedError, or REROUTE (synchronous replicated, MAXLEN,
    a key, too few reachable nodes, a cluster node without its process, a
    leaving node): nothing of a rerouted call was stored.
    """
    view = yield from cluster_view(session)
    outcomes: list[Any] = [REROUTE] * len(calls)
    if view.leaving or (view.member and not view.active):
        return outcomes
    here: list[_Taken] = []
    copied: list[_Taken] = []
    for index, call in enumerate(calls):
        if not batchable(call) or _run_again(session, call):
            continue
        wanted, minimum = _copies(call.params, view)
        if wanted == 1:
            here.append(_Taken(index, _ids(session, call.params, len(call.bodies), call.ids), 1, 1))
        elif call.params.asynchronous and _copyable(call, wanted, view):
            copied.append(_Taken(index, _ids(session, call.params, len(call.bodies), call.ids),
                                 wanted, minimum))
    if here:
        yield from _store_batch(session, calls, here, outcomes, None)
    if copied:
        events = yield from _store_batch(session, calls, copied, outcomes, False)
        yield from _ring(session, events)
    return outcomes


class _Taken(NamedTuple):
    """A call a batch took: its position in the batch, its new IDs, its W and
    the copies that suffice (see :func:`_copies`)."""

    position: int
    ids: list[str]
    wanted: int
    minimum: int


def _copyable(call: AddCall, wanted: int, view: ClusterView) -> bool:
    """A replicated call a batch can take: the node process runs and
    reaches W nodes, and every body fits in one bus frame."""
    return (view.active and view.member and 1 < wanted <= view.available
            and all(len(body) <= MAX_REPLICATED_BODY for body in call.bodies))


def _store_batch(session: Session, calls: Sequence[AddCall], taken: list[_Taken],
                 outcomes: list[Any], wait: bool | None) -> Command[int]:
    """One statement storing the taken calls' jobs: kept here only (``wait``
    None, ADD_MANY) or replicated (ADD_MANY_REPLICATED: ``wait`` for the
    copies, or not). Sets each call's outcome (its IDs, or PAUSED); on a
    leaving node nothing is stored and the calls stay REROUTE. Returns the
    outbox events written."""
    rows = _batch_rows(calls, taken)
    params = _batch_params(calls, taken, rows)
    if wait is None:
        paused, leaving, _woken = yield _add_query(sql.ADD_MANY, sql.ADD_ONE,
                                                      sql.ADD_ONE_NAMES, params)
        events = 0
    else:
        params.update(repls=[t.wanted for *_, t in rows], wait=wait, announce=True,
                      repl_mins=[t.minimum if t.minimum < t.wanted else None for *_, t in rows],
                      holders=[session.node_id] * len(rows))
        paused, leaving, events, _woken, _stored = yield _add_query(
            sql.ADD_MANY_REPLICATED, sql.ADD_ONE_REPLICATED, sql.ADD_ONE_REPLICATED_NAMES, params)
    if leaving:
        return 0  # nothing stored: every call goes the long way
    _set_outcomes(calls, taken, outcomes, paused)
    return int(events)


_Row = tuple[AddCall, str, bytes, _Taken]


def _batch_rows(calls: Sequence[AddCall], taken: list[_Taken]) -> list[_Row]:
    """One (call, job id, body, taken) per job of the taken calls, in order."""
    return [(calls[t.position], job_id, body, t) for t in taken
            for job_id, body in zip(t.ids, calls[t.position].bodies, strict=True)]


def _batch_params(calls: Sequence[AddCall], taken: list[_Taken], rows: list[_Row]) -> dict[str, Any]:
    """ADD_MANY's parameters (ADD_MANY_REPLICATED takes a few more)."""
    return {
        "ids": [job_id for _c, job_id, _b, _t in rows], "queues": [c.queue for c, *_ in rows],
        "bodies": [body for _c, _i, body, _t in rows],
        "retries": [c.params.retry for c, *_ in rows], "delays": [c.params.delay for c, *_ in rows],
        "ttls": [c.params.ttl for c, *_ in rows], "priorities": [c.params.priority for c, *_ in rows],
        "names": sorted({calls[t.position].queue for t in taken}),
    }


def _add_query(many: str, one: str, names: dict[str, str], params: dict[str, Any]) -> Query:
    """The batch's statement: ``many`` with its arrays, or, for one job,
    ``one`` with that job's values, named by ``names`` (cheaper to send and
    to run: pgq.contracts.batch_rows)."""
    if len(params["ids"]) != 1:
        return Query(many, params, Result.ROW)
    return Query(one, _one_row(params, names, drop="names"), Result.ROW)


def _one_row(params: dict[str, Any], names: dict[str, str], drop: str = "") -> dict[str, Any]:
    """A batch's parameters for its only row: each array that ``names``
    lists becomes its one value, under the singular name it gives; the
    other parameters stay as they are (but ``drop``)."""
    return {names.get(name, name): value[0] if name in names else value
            for name, value in params.items() if name != drop}


def _set_outcomes(calls: Sequence[AddCall], taken: list[_Taken], outcomes: list[Any],
                  paused: Sequence[str]) -> None:
    for t in taken:
        queue = calls[t.position].queue
        outcomes[t.position] = paused_error(queue) if queue in paused else t.ids


def _direct_targets(session: Session, view: ClusterView,
                    taken: list[_Taken]) -> list[tuple[str, str]]:
    """The peers (id, DSN) a client writes the taken calls' copies into
    itself, W-1 of them drawn at random among those that advertised a
    database and did not fail lately; empty: the node process copies them
    (the driver cannot write to peers, or too few peers advertised)."""
    if not (session.direct and session.owned and view.active):
        return []
    need = max(t.wanted for t in taken) - 1
    candidates = view.direct_peers(session.clock())
    if need < 1 or len(candidates) < need:
        return []
    draw = random.Random(int.from_bytes(session.random_bytes(8), "big"))
    return draw.sample(candidates, need)


def _add_direct(session: Session, calls: Sequence[AddCall], taken: list[_Taken],
                outcomes: list[Any], targets: list[tuple[str, str]],
                timeout: float) -> Command[bool]:
    """Synchronous replicated adds whose copies the client writes itself:

    1. this node's rows go in (queued, their holders listed) inside a
       transaction left open: nobody sees them yet;
    2. each target peer stores its copies (DIRECT_COPIES: the statement
       its node process runs for a REPLJOB, but an ID already there is
       left alone and fails the peer) in its own durable transaction, all
       peers at once;
    3. only when every copy committed, this node's transaction commits: the
       add is confirmed once W databases hold the job, and the node process
       was not on the way.

    If a peer fails, refuses a copy (its queue paused for input, the peer
    leaving, its database not the node's, the ID there already) or does not answer within
    DIRECT_TIMEOUT (or half the add's timeout), this node's rows are rolled
    back, the copies are withdrawn from every peer written to (best effort,
    as Disque's DELJOB of partial copies: a copy left behind is an extra
    holder, which re-queues the job after its retry), the failed peer is
    left out for PEER_BACKOFF seconds, and False tells the caller to go
    through the node process (nothing stored) with the time left. A
    crash between 2 and 3 leaves copies whose origin has no row: they
    re-queue after their retry, as the jobs of a client that crashed while
    waiting for its copies do. Sets each call's outcome (its IDs, or
    PAUSED) and returns True when the adds are done.
    """
    rows = _batch_rows(calls, taken)
    holders = [contracts.holders_arg(sorted([session.node_id,
                                             *(p for p, _ in targets[:t.wanted - 1])]))
               for *_, t in rows]
    params = _batch_params(calls, taken, rows)
    params.update(repls=[t.wanted for *_, t in rows], repl_mins=[None] * len(rows), wait=False,
                  announce=False, holders=holders)
    yield Begin()
    paused, leaving, _events, _woken, stored = yield _add_query(
        sql.ADD_MANY_REPLICATED, sql.ADD_ONE_REPLICATED, sql.ADD_ONE_REPLICATED_NAMES, params)
    if leaving:
        yield Rollback()
        return False
    kept = {job_id: (int(ctime), float(expires)) for job_id, ctime, expires in stored or ()}
    if any(job_id not in kept and call.queue not in paused for call, job_id, _body, _t in rows):
        # A row of this add is here already: an attempt before a lost
        # connection committed it. Whether its copies exist only the node
        # path knows (it waits on the row's state); confirmed here, such an
        # add once returned with the one copy of a first attempt that went
        # through the node process and had not been replicated yet.
        yield Rollback()
        return False
    writes = _copy_writes(rows, holders, kept, targets)
    if writes:
        bound = min(DIRECT_TIMEOUT, max(timeout / 2, 0.001))
        done = yield _store_copies(writes, bound)
        failed = _failed_peers(writes, done)
        if failed:
            yield Rollback()
            _renew_ids(session, calls, taken)
            now = session.clock()
            for peer in failed:
                session.cluster.failing[peer] = now + PEER_BACKOFF
            # From every peer written to, the failed ones too: one that
            # refused part of its copies (a queue paused there) stored the
            # others, and one the caller stopped waiting for may have
            # committed (rarely: its server ends the statement first, see
            # pgq.peers). Not from a peer nothing reached: a second wait
            # for a silent host would eat the time the node's way needs.
            reached = tuple((peer, dsn, {"ids": copies["ids"], "myself": peer})
                            for peer, dsn, copies in writes
                            if not isinstance(done.get(peer), PeerUnreached))
            if reached:
                yield PeerWrite(sql.WITHDRAW_COPIES, reached, bound)
            # A copy the withdrawal missed is told SETACK when it announces
            # itself (see WITHDRAWN_HERE; a review of the new IDs found it).
            withdrawn = [(call.queue, job_id) for call, job_id, _body, _t in rows if job_id in kept]
            yield Query(sql.WITHDRAWN_HERE, {"ids": [i for _q, i in withdrawn],
                                             "queues": [q for q, _i in withdrawn],
                                             "expires": [kept[i][1] for _q, i in withdrawn]},
                        Result.NONE)
            return False
    yield Commit()
    _set_outcomes(calls, taken, outcomes, paused)
    return True


def _renew_ids(session: Session, calls: Sequence[AddCall], taken: list[_Taken]) -> None:
    """New IDs, in place (the calls' memos hold the same lists), for adds
    whose direct copies are being withdrawn: the node's way must not store
    them under the withdrawn IDs. A withdrawal that reached a slow peer
    after its node process had stored the node's copy there (REPLJOB, the
    same ID) deleted a copy the add was confirmed with (found by a
    read-only review). Nothing of the old IDs was committed here."""
    for t in taken:
        t.ids[:] = _new_ids(session, calls[t.position].params, len(t.ids))


def _copy_writes(rows: list[_Row], holders: list[str], kept: dict[str, tuple[int, float]],
                 targets: list[tuple[str, str]]) -> list[tuple[str, str, dict[str, Any]]]:
    """Per target peer, DIRECT_COPIES' parameters for the copies it takes:
    the jobs stored here whose W reaches that peer (the i-th target holds
    the jobs with W > i + 1), with what only this node's insert knew (ctime,
    expiry) and every holder."""
    writes = []
    for index, (peer, dsn) in enumerate(targets):
        mine = [(call, job_id, body, t.wanted, holders[n])
                for n, (call, job_id, body, t) in enumerate(rows)
                if job_id in kept and t.wanted > index + 1]
        if not mine:
            continue
        writes.append((peer, dsn, {
            "ids": [job_id for _c, job_id, *_ in mine], "queues": [c.queue for c, *_ in mine],
            "bodies": [body for _c, _i, body, *_ in mine],
            "ctimes": [kept[job_id][0] for _c, job_id, *_ in mine],
            "repls": [wanted for *_, wanted, _h in mine],
            "retries": [c.params.retry for c, *_ in mine], "delays": [c.params.delay for c, *_ in mine],
            "expires": [kept[job_id][1] for _c, job_id, *_ in mine],
            "nacks": [0] * len(mine), "adds": [0] * len(mine), "nodes": [h for *_, h in mine],
            "priorities": [c.params.priority for c, *_ in mine], "keys": [None] * len(mine),
            "myself": peer,
        }))
    return writes


def _store_copies(writes: list[tuple[str, str, dict[str, Any]]], bound: float) -> PeerWrite:
    """The peer writes of :func:`_add_direct`: DIRECT_COPIES, or DIRECT_COPY
    when every peer takes one copy (a lone add: plain values, no arrays)."""
    if any(len(copies["ids"]) != 1 for _peer, _dsn, copies in writes):
        return PeerWrite(contracts.DIRECT_COPIES, tuple(writes), bound)
    return PeerWrite(contracts.DIRECT_COPY, tuple(
        (peer, dsn, _one_row(copies, contracts.ONE_COPY_NAMES)) for peer, dsn, copies in writes),
        bound)


def _failed_peers(writes: list[tuple[str, str, dict[str, Any]]], done: dict[str, Any]) -> set[str]:
    """The peers that did not store every copy they were sent: an error, no
    answer, or a refusal (DIRECT_COPIES stores nothing for a paused queue,
    a leaving node, or an ID already there; a brand-new job cannot be
    acknowledged anywhere yet)."""
    failed = set()
    for peer, _dsn, copies in writes:
        result = done.get(peer)
        if isinstance(result, BaseException) or result is None:
            failed.add(peer)
            continue
        stored = {job_id for kind, job_id, _nodes in result if kind == "stored"}
        if not stored.issuperset(copies["ids"]):
            failed.add(peer)
    return failed


def replicated_batchable(call: AddCall) -> bool:
    """Worth a synchronous replicated batch: small and unlocked
    (:func:`batchable`), synchronous, and not kept here only."""
    return batchable(call) and not call.params.asynchronous and call.params.replicate != 1


def batches_for(call: AddCall, view: ClusterView) -> tuple[str, ...]:
    """The group-commit batches that may take this call, the likeliest
    first, as far as the client's cached cluster view tells (a wrong guess
    costs one REROUTE): "adds" (:func:`add_batch`: jobs kept here only, and
    asynchronous replicated ones) and "replicated" (:func:`add_replicated_batch`:
    synchronous replicated ones). Empty: the call runs alone."""
    if not batchable(call):
        return ()
    if not replicated_batchable(call):
        return ("adds",)
    if not view.leaving and _copyable(call, _copies(call.params, view)[0], view):
        return ("replicated", "adds")
    return ("adds", "replicated")


def add_replicated_batch(session: Session, calls: Sequence[AddCall]) -> Command[list[Any]]:
    """Synchronous replicated ADDJOBs of many callers (group commit for the
    replicated path: callers that arrive while a batch is under way share
    the next one, so the statements and commits per add fall as callers
    grow). The client writes the batch's copies itself when the peers
    advertised their databases (:func:`_add_direct`: one INSERT here, one
    write per peer, one commit); else, or when that fails, one statement
    and one commit store them all, the node process copies them in one
    drain (one REPLJOB and one commit per peer), and this connection waits
    once for every copy.

    Each call gets its IDs; a PausedError; a NoReplError naming its jobs
    that were withdrawn (they missed their copies within its timeout: the
    same rule as :func:`add_jobs`); or REROUTE (anything :func:`add_jobs`
    must decide alone: W of 1, too few reachable nodes, a leaving node or
    one without its process, big bodies, MAXLEN, a key; and a timeout other
    than the first call's, since the batch waits for all its copies at once
    and each caller must give up at its own moment). Nothing of a rerouted
    call was stored.
    """
    view = yield from cluster_view(session)
    outcomes: list[Any] = [REROUTE] * len(calls)
    if view.leaving or not calls:
        return outcomes
    timeout = _replication_timeout(session, calls[0].params)
    taken: list[_Taken] = []
    for index, call in enumerate(calls):
        wanted, minimum = _copies(call.params, view)
        if (replicated_batchable(call) and not _run_again(session, call)
                and _copyable(call, wanted, view)
                and _replication_timeout(session, call.params) == timeout):
            taken.append(_Taken(index, _ids(session, call.params, len(call.bodies), call.ids),
                                wanted, minimum))
    if not taken:
        return outcomes
    targets = _direct_targets(session, view, taken)
    started = session.clock()
    if targets and (yield from _add_direct(session, calls, taken, outcomes, targets, timeout)):
        return outcomes
    timeout = max(timeout - (session.clock() - started), 0.001)  # what the attempt left
    if session.can_listen:
        yield ListenReplication()
    events = yield from _store_batch(session, calls, taken, outcomes, True)
    yield from _ring(session, events)
    stored = [t for t in taken if isinstance(outcomes[t.position], list)]
    failed, stuck = yield from _copies_or_withdraw(
        session, [job_id for t in stored for job_id in t.ids], timeout)
    for t in stored:
        if not failed.isdisjoint(t.ids):
            outcomes[t.position] = _withdrawn(t.ids, failed & set(t.ids), timeout, stuck)
    return outcomes


def _add_replicated(session: Session, queue: str, ids: list[str], bodies: Sequence[bytes],
                    params: JobParams, wanted: int, minimum: int,
                    confirm: bool = True) -> Command[str | None]:
    """Store the jobs here with an outbox event for the node process, and
    (``confirm``) wait for the copies of a synchronous add. Returns the ID
    of the live job holding the add's key (nothing added: that job's own
    add waits for its copies), else None."""
    sync = session.owned and not params.asynchronous
    if sync and session.can_listen:
        yield ListenReplication()
    locking = yield from _lock_for_add(queue, params)
    for start in range(0, len(ids), COPY_THRESHOLD):
        chunk = slice(start, start + COPY_THRESHOLD)
        row = yield Query(sql.ADD_JOBS_CLUSTER, {
            "queue": queue, "ids": ids[chunk], "bodies": list(bodies[chunk]),
            "n": len(bodies) if start == 0 else 0, "maxlen": params.maxlen, "repl": wanted,
            "repl_min": minimum if minimum < wanted else None, "retry": params.retry,
            "delay": params.delay, "ttl": params.ttl,
            "always_notify": not session.owned, "wait": sync, "myself": session.node_id,
            "ring": not session.owned, "priority": params.priority, "key": params.key,
        }, Result.ROW)
        paused, full, _added, _notified, existing, _rang = row
        if existing:  # a keyed add is one job: nothing else was stored
            if locking:
                yield Commit()
            return str(existing)
        _raise_if_refused(queue, paused, full, params.maxlen)
    if locking:
        yield Commit()
    yield from _ring(session, len(ids))
    if sync and confirm:
        yield from _wait_for_copies(session, ids, _replication_timeout(session, params))
    return None


def _replication_timeout(session: Session, params: JobParams) -> float:
    """How long a synchronous add waits for copies: its timeout, else the
    client's; 0 means until replicated or expired (Disque)."""
    timeout = params.timeout if params.timeout is not None else session.replication_timeout
    return timeout or params.ttl


def _wait_for_copies(session: Session, ids: list[str], timeout: float) -> Command[None]:
    """Wait for the node process to confirm W copies of every job, or give
    up: the jobs still lacking copies are withdrawn and NoReplError says so
    (see :func:`_copies_or_withdraw`)."""
    failed, stuck = yield from _copies_or_withdraw(session, ids, timeout)
    if failed:
        raise _withdrawn(ids, failed, timeout, stuck)


def _copies_or_withdraw(session: Session, ids: list[str],
                        timeout: float) -> Command[tuple[set[str], bool]]:
    """Wait for W copies of every job; withdraw those still waiting at the
    end. Returns (the IDs withdrawn, whether the node process is stuck).

    Gives up early when the node process is not running (its node lock is
    free: killed, crashed, stopped) or stuck (its outbox, which it drains
    continuously, holds an event older than ``NODE_STUCK_AFTER`` seconds: a
    paused process). A client with several node DSNs can then add the
    withdrawn jobs through another node at once.
    """
    deadline = session.clock() + timeout
    pending = set(ids)
    polls = 0
    stuck = False
    while pending and session.clock() < deadline and not stuck:
        received = yield Wait(min(_poll_wait(polls, 0.5), max(deadline - session.clock(), 0.0)))
        polls += 1
        pending -= {payload for channel, payload in received if channel.startswith("pgq_r")}
        if pending and (not received or polls % 4 == 0):
            rows = yield Query(sql.REPLICATION_DONE, {"ids": sorted(pending)}, Result.ROWS)
            # A job that vanished was replicated first (a 'wait-repl' job is
            # never delivered), then acknowledged, deleted or expired.
            pending -= {r[0] for r in rows if r[1] or r[2]}
            stuck = bool(rows) and _node_stuck(*rows[0][3:5])
    if not pending:
        return set(), False
    removed = yield Query(sql.ABORT_REPLICATION, {"ids": sorted(pending)}, Result.ROWS)
    failed = {r[0] for r in removed}  # a job confirmed in the meantime stays (and counts)
    yield from _ring(session, len(failed))
    return failed, stuck


def _node_stuck(outbox_lag: float | None, node_running: bool) -> bool:
    """Is the node process gone or stuck (see REPLICATION_DONE)?"""
    return not node_running or (outbox_lag or 0.0) > NODE_STUCK_AFTER


def _withdrawn(ids: list[str], failed: set[str], timeout: float, stuck: bool) -> NoReplError:
    """NOREPL for an add whose ``failed`` jobs were withdrawn, with the way out."""
    if stuck:
        return NoReplError(
            f"the node process of this database is not running (or stopped draining its outbox "
            f"for over {NODE_STUCK_AFTER:g} s), so {len(failed)} of {len(ids)} jobs could not be "
            "copied and were withdrawn: is it running? (a client given several node DSNs "
            "adds through another node)",
            removed=tuple(sorted(failed)), added=tuple(i for i in ids if i not in failed),
            node_down=True)
    lost = f"{len(failed)} of {len(ids)} jobs did not reach their copies within {timeout:g} s and were withdrawn"
    return NoReplError(
        f"{lost} (too few live nodes? raise timeout= or lower replicate=)",
        removed=tuple(sorted(failed)), added=tuple(i for i in ids if i not in failed),
    ).for_cli(f"{lost} (too few live nodes? raise --timeout or lower --replicate)")


def _await_copies_of(session: Session, job_id: str, timeout: float) -> Command[bool]:
    """A keyed add (asynchronous too) found the key's job: answer its ID only once
    that job has its copies (another add may still be waiting for them, and
    withdraw it on failure). True when it has them; False when it vanished
    (withdrawn, or replicated and done with since); NoReplError on timeout,
    leaving that job to its own add."""
    deadline = session.clock() + timeout
    polls = 0
    while True:
        rows = yield Query(sql.REPLICATION_DONE, {"ids": [job_id]}, Result.ROWS)
        _id, replicated, gone, _lag, _running = rows[0]
        if replicated or gone:
            return bool(replicated)
        if not (yield from _pause(session, deadline, polls)):
            raise NoReplError(
                f"job {job_id}, which holds this add's key, did not get its copies within "
                f"{timeout:g} s (too few live nodes? raise timeout= or lower replicate=)",
                removed=(), added=())
        polls += 1


def wait_replicated(session: Session, ids: list[str], timeout: float) -> Command[None]:
    """Wait until these jobs (added asynchronously or in a transaction) have
    their W copies; raise NoReplError on timeout. Jobs already acknowledged
    or deleted count as done: they need no copies."""
    deadline = session.clock() + timeout
    polls = 0
    while True:
        missing = yield Query(sql.MISSING_COPIES, {"ids": ids}, Result.ROWS)
        if not missing:
            return
        if session.clock() >= deadline:
            raise NoReplError(
                f"{len(missing)} of {len(ids)} jobs still lack copies after {timeout:g} s; "
                "they stay queued and the node keeps replicating them",
                removed=(), added=tuple(r[0] for r in missing),
            )
        yield Wait(min(_poll_wait(polls, 0.5), max(deadline - session.clock(), 0.0)))
        polls += 1


def _paused_message(queue: str) -> str:
    return f"queue {queue!r} is paused for input: resume it with pause(queue, 'none')"


def paused_error(queue: str) -> PausedError:
    """PAUSED, with the way out in the API's and in the shell's terms."""
    return PausedError(_paused_message(queue)).for_cli(
        f"queue {queue!r} is paused for input: resume it with `pgq pause {queue} none`")


def _raise_if_refused(queue: str, paused: bool, full: bool, maxlen: int | None) -> None:
    if paused:
        raise paused_error(queue)
    if full:
        raise MaxLenError(f"queue {queue!r} already holds {maxlen} or more jobs (maxlen={maxlen})")


def _copy_jobs(session: Session, queue: str, ids: list[str], bodies: Sequence[bytes],
               params: JobParams) -> Command[bool]:
    """The bulk path: check, COPY and notify in one transaction; True (and
    nothing stored) if the node turned out to be leaving. COPY has no ON
    CONFLICT: a retry whose first attempt committed never comes here
    (:func:`_kept_before`)."""
    yield Begin()
    if params.maxlen is not None:
        yield Query(sql.LOCK_QUEUE_FOR_MAXLEN, {"queue": queue}, Result.NONE)
    paused, length, leaving = yield Query(sql.ADD_CHECK, {"queue": queue}, Result.ROW)
    if leaving:
        yield Commit()
        return True
    full = params.maxlen is not None and length + len(bodies) > params.maxlen
    _raise_if_refused(queue, paused, full, params.maxlen)
    now: dt.datetime = yield Query(sql.DB_NOW, None, Result.VALUE)
    expires = now + dt.timedelta(seconds=params.ttl)
    if params.delay > 0:
        state, requeue, queued, enqueues = "active", now + dt.timedelta(seconds=params.delay), None, 0
    else:
        state, requeue, queued, enqueues = "queued", None, now, 1
    constants = (queue, state, 1, params.retry, params.delay, expires, requeue, queued, enqueues,
                 params.priority)
    yield Copy(sql.COPY_JOBS, binary_copy(sql.COPY_JOBS_CONSTANT_TYPES, constants, ids, bodies))
    # Queued or delayed alike: a blocked GET learns from its claim when a
    # delayed job is due (see statements._ADD_REPLY).
    yield Query(sql.NOTIFY_QUEUE, {"queue": queue, "always_notify": not session.owned}, Result.NONE)
    yield Commit()
    return False


# ---------------------------------------------------------------------- get


def _poll_wait(polls: int, interval: float) -> float:
    """Back-off between claim attempts while blocked: 50 ms doubling up to ``interval``.

    Short at first because a job committed while we were registering as a
    waiter could not notify us; after that NOTIFY wakes us and polling is only
    the fallback (and the whole mechanism behind PgBouncer's transaction mode).
    """
    return doubling(0.05, polls, interval)


def get_jobs(session: Session, queues: list[str], count: int, timeout: float | None,
             nohang: bool, withcounters: bool, claimed: bool | Due = False) -> Command[list[Job]]:
    """GETJOB: up to ``count`` jobs, queues served left to right.

    Returns as many jobs as are ready (up to ``count``) as soon as there is
    at least one. With ``nohang`` returns ``[]`` at once when none is ready;
    otherwise blocks until one is, or ``timeout`` seconds pass (``None``
    blocks forever), then returns ``[]``. ``claimed``: a claim just found
    nothing (a batch of :func:`claim_batch`; a :class:`Due` if it said when
    a job is due next), so start by waiting.
    """
    deadline = None if timeout is None else session.clock() + timeout
    listening = False
    polls = 0
    due = claimed if isinstance(claimed, Due) else None  # what the last claim said
    while True:
        if not claimed:
            rows, due = yield from _claim(session, queues, count)
            if rows:
                return _jobs_in_priority_order(rows, queues, withcounters)
        claimed = False
        if nohang:
            return []
        now = session.clock()
        if deadline is not None and now >= deadline:
            return []
        view = yield from cluster_view(session)
        if view.active and view.leaving:
            leaving = "this node is leaving the cluster and does not block consumers: get jobs from another node"
            raise LeavingError(f"{leaving} (or use nohang=True)").for_cli(f"{leaving} (or use --nohang)")
        if session.can_listen and not listening:
            unnoticed = yield Listen(tuple(queues), None if deadline is None else deadline - now)
            listening = True
            if unnoticed is not False:
                continue  # claim again: a job may have been added before LISTEN took effect
        looked = due is None  # no claim of ours said (the first wait after a combined claim)
        if due is None:
            due = Due((yield Query(sql.NEXT_DUE, {"queues": queues}, Result.VALUE)))
        due_in, due = due.seconds, None
        wait = _poll_wait(polls, session.poll_interval)
        # A claim that came up short yet saw a job due now could not take
        # it: another transaction holds its row (SKIP LOCKED passed it; an
        # ack in a caller's open transaction, say). Claiming again at once
        # spun some 600 claims a second for as long as that transaction
        # lasted (found by a read-only review): the usual back-off then.
        if due_in is not None and (due_in > 0 or looked):
            wait = min(wait, max(due_in, 0.001))
        if deadline is not None:
            wait = min(wait, max(deadline - now, 0.0))
        polls += 1
        yield Wait(wait)
        yield Housekeeping()


@dataclass(frozen=True, slots=True)
class ClaimCall:
    """One caller's GETJOB attempt, as :func:`claim_batch` takes it."""

    queues: tuple[str, ...]
    count: int
    withcounters: bool


def claim_batch(session: Session, calls: Sequence[ClaimCall]) -> Command[list[list[Job] | Due]]:
    """One claim attempt of many callers: one statement per distinct list of
    queues, COUNT summed; the jobs go to the callers in arrival order, each
    up to its COUNT, in priority order. A caller left without jobs blocks
    on its own (``get_jobs(..., claimed=...)``); where the claim came up
    short, the callers it left without a job get the claim's :class:`Due`
    instead of ``[]``, so that their first wait needs no query of its own."""
    outcomes: list[list[Job] | Due] = [[] for _ in calls]
    groups: dict[tuple[str, ...], list[int]] = {}
    for index, call in enumerate(calls):
        groups.setdefault(call.queues, []).append(index)
    for queues, members in groups.items():
        total = min(sum(calls[i].count for i in members), MAX_CLAIM)
        rows, due = yield from _claim(session, list(queues), total)
        ordered = _in_priority_order(rows, list(queues))
        start = 0
        for index in members:
            mine = ordered[start:start + calls[index].count]
            start += len(mine)
            outcomes[index] = _jobs(mine, calls[index].withcounters) if mine or due is None else due
    return outcomes


class Claimed(NamedTuple):
    """A row of ``sql.CLAIM`` / ``sql.CLAIM_RELAXED``: a claimed job (``epoch``
    None), or the one row with no ``id`` that carries the queue epoch."""

    queue: str
    id: str | None
    body: bytes
    nacks: int
    additional_deliveries: int
    ctime: int
    retry: float
    ttl: float
    from_ready: bool  # taken from the ready index (not a due lease): moves the floor
    priority: int
    epoch: int | None
    due_in: float | None  # the epoch row of a claim that came up short: seconds until a job is due


@dataclass(frozen=True, slots=True)
class Due:
    """When a job of the claimed queues becomes due (a lease runs out, a
    delay ends), as the last claim saw it: ``seconds`` from then (negative:
    already), or None when none will."""

    seconds: float | None


def _claim(session: Session, queues: list[str], count: int) -> Command[tuple[list[Claimed], Due | None]]:
    """One claim from the queues' floors (see pgq.floors); returns the
    claimed jobs (and, if it took fewer than ``count``, when a job is due
    next) and moves the floors on. If the queue epoch moved since the last claim (a job may
    be queued behind a floor) and the claim came up short, it claims again
    at once from the front."""
    floors = session.floors
    if floors is None:
        jobs, _epoch, due = yield from _claim_from(session, queues, [FROM_THE_FRONT] * len(queues), count)
        return jobs, due
    known = floors.epoch
    starts = floors.for_claim(queues, session.clock())
    started = session.clock()
    jobs, epoch, due = yield from _claim_from(session, queues, starts, count)
    # A claim in the caller's transaction (conn=) may roll back: its jobs
    # then come back below a floor it moved, hidden from every claim of the
    # process until the next full walk (up to FULL_WALK_EVERY, 2 s; found
    # by a read-only review). It reads the floors, and moves none.
    if session.owned:
        floors.claimed(queues, starts, [(j.queue, j.ctime) for j in jobs if j.from_ready],
                       started, session.clock(), epoch=epoch)
    if known is not None and epoch != known and len(jobs) < count \
            and any(start != FROM_THE_FRONT for start in starts):
        more, _epoch, due = yield from _claim_from(session, queues, [FROM_THE_FRONT] * len(queues),
                                                   count - len(jobs))
        jobs += more
    return jobs, due


def _claim_from(session: Session, queues: list[str], floors: list[int],
                count: int) -> Command[tuple[list[Claimed], int | None, Due | None]]:
    if len(queues) == 1:  # one queue as plain values (see CLAIM_ONE)
        statement = sql.CLAIM_ONE_RELAXED if session.owned else sql.CLAIM_ONE
        params: dict[str, Any] = {"queue": queues[0], "floor": floors[0], "count": count}
    else:
        statement = sql.CLAIM_RELAXED if session.owned else sql.CLAIM
        params = {"queues": queues, "floors": floors, "count": count}
    rows = yield Query(statement, params, Result.ROWS, delivers=True)
    claimed = [Claimed(*row) for row in rows]
    marks = [row for row in claimed if row.id is None]
    jobs = [row for row in claimed if row.id is not None]
    if not marks:
        return jobs, None, None
    # The probe ran only if the claim came up short (see sql._CLAIM_RESULT):
    # a full claim's NULL due_in means "not asked", not "none will be due".
    return jobs, marks[0].epoch, (Due(marks[0].due_in) if len(jobs) < count else None)


def _in_priority_order(rows: list[Claimed], queues: list[str]) -> list[Claimed]:
    # RETURNING order is unspecified; restore (queue position, job priority, ctime, id).
    position = {name: i for i, name in enumerate(queues)}
    return sorted(rows, key=lambda r: (position[r.queue], -r.priority, r.ctime, r.id))


def _jobs(rows: list[Claimed], withcounters: bool) -> list[Job]:
    if withcounters:
        return [Job(r.id or "", r.queue, r.body, r.nacks, r.additional_deliveries, r.retry, r.ttl)
                for r in rows]
    return [Job(r.id or "", r.queue, r.body, retry=r.retry, ttl=r.ttl) for r in rows]


def _jobs_in_priority_order(rows: list[Claimed], queues: list[str],
                            withcounters: bool) -> list[Job]:
    return _jobs(_in_priority_order(rows, queues), withcounters)


# ---------------------------------------------------------- ack / nack / del


def ack_jobs(session: Session, ids: list[str]) -> Command[int]:
    """ACKJOB: number of known, not yet acknowledged jobs that were acknowledged."""
    acked = yield from _ack(session, ids)
    return len(acked)


def ack_batch(session: Session, calls: list[list[str]]) -> Command[list[int]]:
    """ACKJOB of many callers in one statement and one commit (group commit).
    A job named by several calls counts for the first one only, as if they
    had run one after the other."""
    acked = set((yield from _ack(session, list(dict.fromkeys(i for ids in calls for i in ids)))))
    counts = []
    for ids in calls:
        mine = acked.intersection(ids)
        acked -= mine
        counts.append(len(mine))
    return counts


def _ack(session: Session, ids: list[str]) -> Command[list[str]]:
    view = yield from cluster_view(session)
    dummies = [i for i in ids if is_at_least_once_id(i)]
    ttls = [float(ttl_seconds_from_id(i)) for i in dummies]
    common = {"outcome": "acked", "cluster": view.active, "ring": not session.owned}
    if len(ids) == 1:  # one ID as a plain value (see ACK_ONE)
        query = Query(sql.ACK_ONE, {"id": ids[0], "dummy_id": dummies[0] if dummies else None,
                                    "dummy_ttl": ttls[0] if ttls else None, **common}, Result.ROW)
    else:
        query = Query(sql.ACK, {"ids": ids, "dummy_ids": dummies, "dummy_ttls": ttls, **common},
                      Result.ROW)
    acked, events, _rang = yield query
    yield from _ring(session, events)
    return list(acked)


def _delete(session: Session, ids: list[str], outcome: str, fast: bool) -> Command[int]:
    view = yield from cluster_view(session)
    deleted, events, _rang = yield Query(sql.DELETE_JOBS, {
        "ids": ids, "outcome": outcome, "with_acks": not fast, "broadcast": fast,
        "cluster": view.active, "ring": not session.owned,
    }, Result.ROW)
    yield from _ring(session, events)
    return int(deleted)


def fast_ack_jobs(session: Session, ids: list[str]) -> Command[int]:
    """FASTACK: delete the jobs now, without leaving a tombstone; other holders
    are told to delete theirs (best effort)."""
    return (yield from _delete(session, ids, "fastacked", fast=True))


def del_jobs(session: Session, ids: list[str]) -> Command[int]:
    """DELJOB: delete the jobs in any state (acked tombstones included), locally."""
    return (yield from _delete(session, ids, "deleted", fast=False))


def _requeue(session: Session, ids: list[str], nack: bool, delay: float = 0.0) -> Command[int]:
    requeued, _woken, events, _rang = yield Query(sql.REQUEUE, {
        "ids": ids, "nack": nack, "delay": delay, "always_notify": not session.owned,
        "ring": not session.owned}, Result.ROW)
    yield from _ring(session, events)
    return int(requeued)


def nack_jobs(session: Session, ids: list[str], delay: float = 0.0) -> Command[int]:
    """NACK: put active jobs back in the queue, counting a nack each; now, or
    after ``delay`` seconds (a back-off, a pgq extension)."""
    return (yield from _requeue(session, ids, nack=True, delay=delay))


def enqueue_jobs(session: Session, ids: list[str]) -> Command[int]:
    """ENQUEUE: queue active jobs now (an additional delivery if queued before)."""
    return (yield from _requeue(session, ids, nack=False))


def give_back_jobs(session: Session, ids: list[str]) -> Command[int]:
    """Put back in their queue jobs claimed for a caller that never got
    them (pgq.cancelsafe): as ENQUEUE, and the at-most-once ones too, which
    ENQUEUE refuses (sql.GIVE_BACK_AT_MOST_ONCE). Returns how many went back."""
    requeued = yield from _requeue(session, ids, nack=False)
    given, _woken = yield Query(sql.GIVE_BACK_AT_MOST_ONCE, {"ids": ids}, Result.ROW)
    return requeued + int(given)


def dead_letter_jobs(session: Session, ids: list[str], reason: str) -> Command[int]:
    """Give up on jobs: done everywhere like an ACK, kept in pgq.dead_letters."""
    moved, events, _rang = yield Query(sql.DEAD_LETTER, {
        "ids": ids, "reason": reason, "ring": not session.owned}, Result.ROW)
    yield from _ring(session, events)
    return int(moved)


def dead_letters(session: Session, queue: str | None, after: int, count: int) -> Command[list[dict[str, Any]]]:
    """A page of dead letters (oldest first), optionally of one queue."""
    rows = yield Query(sql.DEAD_LETTERS, {"queue": queue, "after": after, "count": count},
                       Result.ROWS)
    keys = ("seq", "id", "queue", "reason", "nacks", "additional_deliveries", "deliveries",
            "died_at", "body")
    return [dict(zip(keys, r, strict=True)) for r in rows]


def requeue_dead_letters(session: Session, queue: str | None, ids: list[str] | None,
                         count: int, params: JobParams) -> Command[list[str]]:
    """Put dead letters back as new jobs (same queue and body), atomically."""
    # The adds run inside this command's transaction, as in a caller's: an
    # owned session's separate doorbell (RING_NODE) relaxes the commit of
    # the transaction it runs in, which made this one lose its new jobs (and
    # bring the dead letters back) in a crash after it answered.
    session = dataclasses.replace(session, owned=False)
    yield Begin()
    rows = yield Query(sql.TAKE_DEAD_LETTERS, {"queue": queue, "ids": ids, "count": count},
                       Result.ROWS)
    new_ids: list[str] = []
    # One add per queue, retry and priority (each keyed job alone: a key
    # names one job), each with its priority and key again (schema 0020;
    # a dead letter came back at priority 0 and without its key).
    groups: dict[tuple[str, float, int, str | None], list[bytes]] = {}
    for _seq, name, body, retry, priority, key in rows:
        groups.setdefault((name, retry, priority, key), []).append(bytes(body))
    for (name, retry, priority, key), bodies in groups.items():
        for part in ([[b] for b in bodies] if key is not None else [bodies]):
            job_params = JobParams(params.replicate, 0.0, retry, params.ttl, None, True, None,
                                   priority=priority, key=key)
            new_ids += yield from add_jobs(session, name, part, job_params)
    yield Commit()
    return new_ids


def dequeue_jobs(session: Session, ids: list[str]) -> Command[int]:
    """DEQUEUE: take queued jobs out of the queue; their retry timer re-queues them."""
    count = yield Query(sql.DEQUEUE, {"ids": ids}, Result.ROWCOUNT)
    return int(count)


def working(session: Session, job_id: str) -> Command[int | float]:
    """WORKING: postpone the next re-queue; returns the retry time in seconds
    (an int for a whole number of seconds, as Disque replies)."""
    state, retry, too_late, acked, events, _rang = yield Query(
        sql.WORKING, {"id": job_id, "ring": not session.owned}, Result.ROW)
    yield from _ring(session, events)
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
              "next_awake_within", "body", "nodes_delivered", "nodes_confirmed", "priority",
              "key")


def _job_dict(row: Sequence[Any], node_id: str) -> dict[str, Any]:
    info = dict(zip(_SHOW_KEYS, row, strict=True))
    info["nodes_delivered"] = sorted(info["nodes_delivered"] or [node_id])
    info["nodes_confirmed"] = sorted(info["nodes_confirmed"] or [node_id])
    return info


def _ack_dict(row: Sequence[Any]) -> dict[str, Any]:
    """A tombstone as SHOW tells it: ``nodes_delivered`` are the holders the
    node still has to reach with the ACK (empty once collected, or when no
    other node held the job); ``nodes_confirmed`` is kept for Disque's shape."""
    job_id, queue, _acked_at, _dummy, ttl, holders = row
    return {
        "id": job_id, "queue": queue, "state": "acked", "repl": None, "ttl": ttl,
        "ctime": None, "delay": None, "retry": None, "nacks": None,
        "additional_deliveries": None, "deliveries": None, "next_requeue_within": None,
        "next_awake_within": ttl, "body": None, "nodes_delivered": sorted(holders),
        "nodes_confirmed": [],
        "priority": None, "key": None,
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
    """QPEEK: up to ``abs(count)`` queued jobs in delivery order (highest
    priority, then oldest, first); the reverse if count < 0."""
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
    name, length, _created, _last, blocked, jobs_in, jobs_out, paused, age, idle, imp_from, rate = row
    return {
        "name": name, "len": int(length), "age": age, "idle": idle, "blocked": int(blocked),
        "import_from": list(imp_from), "import_rate": int(rate), "jobs_in": int(jobs_in),
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
        name for name, length, rate in rows
        if (minlen is None or length >= minlen) and (maxlen is None or length <= maxlen)
        and (importrate is None or rate >= importrate)  # Disque: at least this import rate
    ]
    next_cursor = encode_cursor(rows[-1][0]) if len(rows) == count else 0
    return next_cursor, names


def jscan(session: Session, cursor: int, count: int, queue: str | None,
          states: Sequence[str], reply: str) -> Command[tuple[int, list[Any]]]:
    """JSCAN: iterate over jobs (and acked tombstones) by ID, optionally filtered."""
    yield Query(sql.SWEEP_ALL_QUEUES, None, Result.NONE)
    after = decode_cursor(cursor)
    wanted = list(states) or None
    live_states = [s for s in states if s != "acked"] or None
    params = {"after": after, "count": count, "queue": queue}
    entries: list[tuple[str, Any]] = []
    live_rows: list[Any] = []
    if wanted is None or any(s != "acked" for s in wanted):
        live_rows = yield Query(sql.JSCAN_JOBS, params, Result.ROWS)
        entries += [(r[0], _job_dict(r, session.node_id)) for r in live_rows
                    if live_states is None or r[2] in live_states]  # r[2]: its state
    acked_rows: list[Any] = []
    if wanted is None or "acked" in wanted:
        acked_rows = yield Query(sql.JSCAN_ACKS, params, Result.ROWS)
        entries += [(r[0], _ack_dict(r)) for r in acked_rows]
    entries.sort(key=lambda e: e[0])
    page = entries[:count]
    # The next cursor: as far as every source was read. A full page of a
    # source may have more after its last row; a truncated merge stops at
    # its last entry returned. None of them: the scan is done.
    reached = [rows[-1][0] for rows in (live_rows, acked_rows) if len(rows) == count]
    if len(entries) > count:
        reached.append(page[-1][0])
    next_cursor = encode_cursor(min(reached)) if reached else 0
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
        state = str((yield Query(sql.PAUSE_STATE, {"queue": queue}, Result.VALUE)))
        if "bcast" in flags:
            # Disque's PAUSE broadcasts the queue's flags whenever BCAST is
            # given: the way to push a pause in force to the other nodes.
            view = yield from cluster_view(session)
            if view.active:
                row = yield Query(sql.SET_PAUSE, {"queue": queue, "state": state, "bcast": True},
                                  Result.ROW)
                yield from _ring(session, row[2])
        return state
    state = {(False, False): "none", (True, False): "in", (False, True): "out",
             (True, True): "all"}[(paused_in, paused_out)]
    view = yield from cluster_view(session)
    row = yield Query(sql.SET_PAUSE, {"queue": queue, "state": state,
                                      "bcast": view.active and "bcast" in flags}, Result.ROW)
    yield from _ring(session, row[2])
    return state


# --------------------------------------------------------------- node level


def hello(session: Session) -> Command[dict[str, Any]]:
    """HELLO: this node's ID and every node it knows, with Disque's priorities
    (1 ok, 10 suspected, 100 failed or leaving); just itself on one node."""
    view = yield from cluster_view(session)
    nodes = [{"id": session.node_id, "host": session.host, "port": session.port, "priority": 1,
              "resp": None, "status": "alive", "leaving": False}]
    if view.active:
        rows = yield Query(sql.HELLO_NODES, None, Result.ROWS)
        nodes = [{"id": r[0], "host": r[1], "port": r[2], "priority": r[3], "resp": r[4],
                  "status": r[5], "leaving": bool(r[6])} for r in rows]
    return {"version": 1, "id": session.node_id, "nodes": nodes}


def _node_process_needed(view: ClusterView, what: str) -> None:
    if not view.member:
        raise InvalidArgumentError(
            f"{what}: this database is not a cluster node (start one with `pgq node start`, "
            "which also serves this protocol with --resp)")


def cluster_meet(session: Session, address: str) -> Command[None]:
    """CLUSTER MEET: ask this node's process to contact the node at
    ``address`` (HOST:PORT, checked by the caller) and join its cluster."""
    view = yield from cluster_view(session)
    _node_process_needed(view, "CLUSTER MEET")
    yield Query(contracts.TELL_NODE, {"kind": contracts.OUTBOX_MEET, "queue": None,
                                      "arg": address}, Result.NONE)


def cluster_leaving(session: Session, leaving: bool) -> Command[None]:
    """CLUSTER LEAVING yes|no: the flag in this node's database (read by
    every add from then on), then the word to its process, which tells the
    cluster; in one transaction."""
    view = yield from cluster_view(session)
    _node_process_needed(view, "CLUSTER LEAVING")
    yield Begin()
    yield Query(contracts.SET_LEAVING, {"leaving": leaving}, Result.NONE)
    yield Query(contracts.TELL_NODE, {"kind": contracts.OUTBOX_LEAVING, "queue": None,
                                      "arg": "yes" if leaving else "no"}, Result.NONE)
    yield Commit()
    yield from cluster_view(session, fresh=True)


def info(session: Session, version: str) -> Command[dict[str, Any]]:
    """INFO: the node, its server and its jobs."""
    row = yield Query(sql.INFO, None, Result.ROW)
    counts = yield Query(sql.JOB_COUNTS, None, Result.ROWS)
    server_version, database, uptime, queues, blocked, sync_commit, fsync, bus_stats = row
    jobs = {state: int(n) for state, n in counts}
    view = yield from cluster_view(session)
    return {
        "cluster": {"active": view.active, "reachable_nodes": view.reachable,
                    "leaving": view.leaving,
                    "bus": json.loads(bus_stats) if bus_stats and view.active else None},
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
    row = yield Query(sql.SWEEP, {"dead_min": 0}, Result.ROW)
    return int(row[0]), int(row[1]), int(row[2])


def _pause(session: Session, deadline: float | None, polls: int) -> Command[bool]:
    """Between two polls of a wait (WAIT_JOB, results, a keyed add's): False once
    ``deadline`` passed, else wait 50 ms doubling to the poll interval
    (never past the deadline) and True."""
    now = session.clock()
    if deadline is not None and now >= deadline:
        return False
    wait = _poll_wait(polls, max(session.poll_interval, 0.05))
    yield Wait(wait if deadline is None else min(wait, deadline - now))
    return True


def _done_before(job_id: str) -> Command[bool]:
    """Whether this node knows the job was done with (sql.WAITED_GONE)."""
    yield Begin()
    yield Query(sql.RETRY_PLAN, None, Result.NONE)
    done = yield Query(sql.WAITED_GONE, {"id": job_id, "made": millis_from_id(job_id) / 1000.0},
                       Result.VALUE)
    yield Commit()
    return bool(done)


def wait_job(session: Session, job_id: str, timeout: float | None) -> Command[bool]:
    """Wait until a job this node holds is done with: acknowledged (here, or
    on another holder, whose ACK reaches this copy), deleted, expired or
    dead-lettered. True when it is (also when it was before the call, as
    far as this node's history reaches back: ``history_keep``), False after
    ``timeout`` seconds; raises NoJobError when this node holds no copy and
    knows of none (ask a node that does)."""
    deadline = None if timeout is None else session.clock() + timeout
    polls = 0
    first = True
    while True:
        row = yield Query(sql.SHOW, {"id": job_id}, Result.ROW)
        if row is None:
            # A job done with before the first look (a fast worker acked it
            # between ADDJOB and WAITJOB, goware/disque's pattern) answered
            # NoJobError, and an expired one not swept yet too: the answer
            # to add-then-wait depended on timing (found by a review).
            if first and not (yield from _done_before(job_id)):
                raise NoJobError(f"job {job_id} is not held on this node: wait on a node "
                                 "that holds a copy (SHOW there lists its nodes)")
            return True
        first = False
        if not (yield from _pause(session, deadline, polls)):
            return False
        polls += 1


# -------------------------------------------------------------- results

def store_result(session: Session, job_id: str, value: bytes | None, error: str | None,
                 keep: float) -> Command[None]:
    """Keep a job's result (or the error that ended it) for ``keep`` seconds."""
    yield Query(sql.STORE_RESULT, {"id": job_id, "value": value, "error": error, "keep": keep},
                Result.ROW)


def wait_result(session: Session, job_id: str, timeout: float | None,
                ) -> Command[tuple[bytes | None, str | None] | None]:
    """A job's stored result ``(value, error)``, waiting up to ``timeout``
    seconds (``None``: forever) for a worker to store it; None on timeout.
    A job gone to the dead letters with no result kept: ``(None, its dead
    letter's reason)``. Raises NoJobError once the job is gone from this
    node otherwise: none will come here (a wait with no timeout waited for
    ever). Polls (50 ms doubling to the poll interval): results are rare
    reads."""
    deadline = None if timeout is None else session.clock() + timeout
    polls = 0
    while True:
        value, error, kept, held, dead = yield Query(sql.READ_RESULT, {"id": job_id}, Result.ROW)
        if kept:
            return (bytes(value) if value is not None else None, error)
        if not held and dead is not None:
            return (None, dead)
        if not held:
            raise NoJobError(
                f"job {job_id} is not on this node and no result is kept for it: it ended "
                "without one (its worker keeps none: Worker(keep_results=...)), its result "
                "expired, it was deleted or expired, it ran on another node (results stay "
                "on the node whose worker ran the job: ask that one), or it is not "
                "committed yet")
        if not (yield from _pause(session, deadline, polls)):
            return None
        polls += 1
