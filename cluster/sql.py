"""Every SQL statement the node process runs on its own database, by name.

Conventions as in :mod:`pgq.statements`. Node ids in per-job lists travel as
comma-joined text (they are 40-hex, so the join is unambiguous) because
PostgreSQL arrays of arrays must be rectangular.

Durability: statements that store something a peer will be told about
(REPLJOB copies before GOTJOB, SETACK tombstones before GOTACK, imported
jobs) commit synchronously; bookkeeping that can be recomputed after a crash
(replication progress, timers postponed) may commit asynchronously.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from pgq import contracts
from pgq.contracts import JOBS_CHANNEL, REPLICATION_CHANNEL_PREFIX

from .requeue import PARKED_RETRIES

# ------------------------------------------------------------------- identity

IDENTITY = f"""
SELECT {contracts.meta('node_id')}, coalesce({contracts.meta('incarnation')}::bigint, 0),
       coalesce({contracts.meta('leaving')}::boolean, false)
"""

SET_META = """
INSERT INTO pgq.meta (key, value)
SELECT * FROM unnest(%(keys)s::text[], %(values)s::text[])
ON CONFLICT (key) DO UPDATE SET value = excluded.value
"""

HEARTBEAT = """
INSERT INTO pgq.meta (key, value) VALUES ('heartbeat_at', pgq.now()::text)
ON CONFLICT (key) DO UPDATE SET value = excluded.value
"""

# Does some session hold the node lock? (The node's own connection does,
# until PostgreSQL restarts under the node process: see process.NodeLock.)
NODE_LOCK_HELD = f"SELECT {contracts.NODE_LOCK_HELD}"

LOAD_MEMBERS = """
SELECT id, name, host, port, status, incarnation, leaving, dsn, resp FROM pgq.nodes
"""

SAVE_MEMBERS = """
WITH saved AS (
    INSERT INTO pgq.nodes AS n (id, name, host, port, status, incarnation, leaving, dsn,
                                resp, updated_at)
    SELECT *, pgq.now()
    FROM unnest(%(ids)s::text[], %(names)s::text[], %(hosts)s::text[], %(ports)s::int[],
                %(statuses)s::text[], %(incarnations)s::bigint[], %(leavings)s::boolean[],
                %(dsns)s::text[], %(resps)s::text[])
    ON CONFLICT (id) DO UPDATE SET
        name = excluded.name, host = excluded.host, port = excluded.port,
        status = excluded.status, incarnation = excluded.incarnation,
        leaving = excluded.leaving, dsn = excluded.dsn, resp = excluded.resp,
        updated_at = pgq.now()
    RETURNING 1
), removed AS (
    DELETE FROM pgq.nodes WHERE id = ANY (%(forgotten)s::text[]) RETURNING 1
)
SELECT (SELECT count(*) FROM saved), (SELECT count(*) FROM removed)
"""

# A forgotten node is no holder any more (FORGET completes the ACK
# collections waiting for it, in memory): tombstones that named it made a
# restarted process wait for it until the jobs' TTL. A scan of pgq.acks,
# run only when nodes were forgotten (rare, by hand).
UNHOLD_FORGOTTEN = """
UPDATE pgq.acks a
SET nodes = ARRAY(SELECT n FROM unnest(a.nodes) AS n WHERE n <> ALL (%(forgotten)s::text[]))
WHERE a.nodes && %(forgotten)s::text[]
"""

# -------------------------------------------------------------------- outbox

# Drain the outbox and read, in the same round trip, every job it asks us to
# replicate (the hot path of a replicated add). Written so that the plan is
# right whatever the planner believes of the tables' sizes (the node runs
# generic plans, often made while the tables were empty): the DELETE touches
# the rows locked by the subquery by ctid, and each 'replicate' event reads
# its job with one primary-key probe (LIMIT 1 keeps the LATERAL subquery from
# being flattened into a hash join that scans all of pgq.jobs per drain).
DRAIN_OUTBOX_WITH_JOBS = """
WITH relaxed AS MATERIALIZED (  -- replaying an event after a crash is harmless
    SELECT set_config('synchronous_commit', 'off', true)
), drained AS (
    DELETE FROM pgq.outbox
    WHERE ctid = ANY (ARRAY(SELECT ctid FROM pgq.outbox ORDER BY seq LIMIT %(limit)s
                            FOR UPDATE SKIP LOCKED))
    RETURNING seq, kind, job_id, queue, arg
)
SELECT d.seq, d.kind, d.job_id, d.queue, d.arg, j.*
FROM drained d
LEFT JOIN LATERAL (
    SELECT j.id, j.queue, j.body, j.ctime, j.repl, j.retry, j.delay,
           extract(epoch FROM j.expires_at)::float8, j.nacks, j.additional_deliveries,
           coalesce(j.nodes_delivered, '{}'::text[]), j.priority, j.key, j.state, j.repl_waiter,
           greatest(0, extract(epoch FROM j.expires_at - pgq.now()))::float8,
           coalesce(j.nodes_confirmed, '{}'::text[]), j.repl_min
    FROM pgq.jobs j WHERE d.kind = 'replicate' AND j.id = d.job_id
    LIMIT 1
) j ON true
WHERE (SELECT count(*) FROM relaxed) = 1
ORDER BY d.seq
"""

_COPY_COLUMNS = """
    id, queue, body, ctime, repl, retry, delay, extract(epoch FROM expires_at)::float8,
    nacks, additional_deliveries, coalesce(nodes_delivered, '{}'::text[]), priority, key
"""



class CopyRow(NamedTuple):
    """``_COPY_COLUMNS`` by name (``EXPORT_JOBS``)."""

    id: str
    queue: str
    body: bytes
    ctime: int
    repl: int
    retry: float
    delay: float
    expires_at: float  # unix time
    nacks: int
    additional_deliveries: int
    nodes: list[str]  # nodes_delivered
    priority: int
    key: str | None


class ReplicationRow(NamedTuple):
    """A job to replicate: its copy (``_COPY_COLUMNS``), then what its
    replication needs (a drained 'replicate' event's job, ``UNREPLICATED``)."""

    copy: CopyRow
    state: str
    repl_waiter: int | None
    ttl_left: float
    confirmed: list[str]  # nodes_confirmed
    repl_min: int | None

    @classmethod
    def of(cls, row: Sequence[Any]) -> ReplicationRow:
        """From a row of the columns above, the copy's first."""
        width = len(CopyRow._fields)
        return cls(CopyRow(*row[:width]), *row[width:])


class OutboxEvent(NamedTuple):
    """The first columns of ``DRAIN_OUTBOX_WITH_JOBS``; a 'replicate' event's
    job follows (:func:`outbox_rows`)."""

    seq: int
    kind: str
    job_id: str | None
    queue: str | None
    arg: str | None


def outbox_rows(rows: list[Any]) -> list[tuple[OutboxEvent, ReplicationRow | None]]:
    """Drained events by name, each with its job (None: not a 'replicate'
    event, or the job is gone: withdrawn or acknowledged meanwhile)."""
    width = len(OutboxEvent._fields)
    return [(OutboxEvent(*row[:width]),
             ReplicationRow.of(row[width:]) if row[width] is not None else None) for row in rows]


def _made_here(job_id: str) -> str:
    """A job whose ID this node made (a client added it here): the ID's node prefix."""
    return f"left(split_part({job_id}, '-', 2), 8) = left(%(myself)s, 8)"


# After a restart: every job created here that still lacks copies.
UNREPLICATED = f"""
SELECT {_COPY_COLUMNS}, state, repl_waiter,
       greatest(0, extract(epoch FROM expires_at - pgq.now()))::float8,
       coalesce(nodes_confirmed, '{{}}'::text[]), repl_min
FROM pgq.jobs
WHERE repl > 1 AND {_made_here('id')}
  AND repl > coalesce(cardinality(nodes_confirmed), 1)
  AND expires_at > pgq.now()
"""

# ---------------------------------------------------------------- replication

# REPLJOB: store copies durably, then the caller answers GOTJOB for `stored`
# and SETACK for `acked`. The statement is a contract (pgq.contracts): a
# client writing the copies of its own add straight into this database runs
# the same one.
STORE_COPIES = contracts.STORE_COPIES

# The re-queue watch of a queued copy of a job with other holders (schema
# 0009): TIMERS arms copies queued without one; the statements that queue
# a copy as its holders become known arm it themselves, in the same UPDATE,
# so that no second statement locks the fresh rows while claims walk past
# them (SKIP LOCKED: a batch armed later looked like an empty queue).
_ARMED = "pgq.now() + (j.retry + random() * 0.5) * interval '1 second'"

# A delayed copy here (active, never delivered, its delay still running)
# that has holders elsewhere: its timer is its delay's end, a timer that
# counts nothing (requeue_counts false), so that TIMERS queues it then, as a
# real queued copy: announced (the other holders stand aside), exportable
# by federation, watched. Without it the copy stayed 'active' past its
# delay, served only by a GET on this node (found by a read-only review).
# (Its delay may have ended already when its holders are recorded: an
# asynchronous add replicated late, after a restart of the node process.
# Then the timer is now.)
def _delay_timer(holders: str) -> str:
    return (f"(j.state = 'active' AND j.enqueues = 0 AND j.requeue_at IS NOT NULL "
            f"AND j.retry > 0 AND cardinality({holders}) > 1)")


_DELAY_END = "greatest(j.requeue_at, pgq.now())"

# Synchronous replication achieved: queue the job (or keep it active until
# its delay), record its holders, wake the client waiting for it. A durable
# commit: the client is told at once, and a crash of PostgreSQL alone
# (the node process goes on) put a relaxed one back to 'wait-repl', which
# only a restart of the node process replicates again: the job stayed
# invisible here, and one with retry 0 was never delivered.
REPLICATION_ACHIEVED = f"""
WITH done AS (
    UPDATE pgq.jobs j SET
        state = CASE WHEN j.requeue_at > pgq.now() THEN 'active' ELSE 'queued' END,
        queued_at = CASE WHEN j.requeue_at > pgq.now() THEN NULL
                         ELSE pgq.now() END,
        requeue_at = CASE WHEN j.requeue_at > pgq.now() THEN j.requeue_at END,
        enqueues = CASE WHEN j.requeue_at > pgq.now() THEN 0 ELSE 1 END,
        nodes_delivered = string_to_array(u.delivered, ','),
        nodes_confirmed = string_to_array(u.confirmed, ','),
        cluster_requeue_at = CASE WHEN NOT coalesce(j.requeue_at > pgq.now(), false)
                                       AND j.retry > 0
                                       AND cardinality(string_to_array(u.delivered, ',')) > 1
                                  THEN {_ARMED}
                                  WHEN j.requeue_at > pgq.now() AND j.retry > 0
                                       AND cardinality(string_to_array(u.delivered, ',')) > 1
                                  THEN j.requeue_at  -- its delay's end (see _delay_timer)
                                  ELSE j.cluster_requeue_at END,
        requeue_counts = NOT coalesce(j.requeue_at > pgq.now() AND j.retry > 0
                                      AND cardinality(string_to_array(u.delivered, ',')) > 1,
                                      false)
    FROM unnest(%(ids)s::text[], %(delivered)s::text[], %(confirmed)s::text[])
        AS u(id, delivered, confirmed)
    WHERE j.id = u.id AND j.state = 'wait-repl'
    RETURNING j.id, j.queue, j.state, j.repl_waiter
), woken AS (
    SELECT pg_notify('{REPLICATION_CHANNEL_PREFIX}' || repl_waiter, id) FROM done WHERE repl_waiter IS NOT NULL
), consumers AS (
    SELECT pg_notify('{JOBS_CHANNEL}', q.queue)
    FROM (SELECT DISTINCT queue FROM done WHERE state = 'queued') AS q
    WHERE EXISTS (SELECT 1 FROM pgq.waiters w WHERE w.queue = q.queue)
)
SELECT (SELECT count(*) FROM done), (SELECT count(*) FROM woken), (SELECT count(*) FROM consumers)
"""

# The holders of u.delivered added to a copy's (they only widen), and the
# copy's watch armed as its holders become known: a queued one at one retry
# (_ARMED), a delayed one at its delay's end, counting nothing
# (_delay_timer). One text for REPLICATION_PROGRESS and RECORD_HOLDERS.
_NEW_HOLDERS = "string_to_array(u.delivered, ',')"
_HOLDERS_WIDENED_AND_ARMED = f"""
    nodes_delivered = ARRAY(SELECT DISTINCT n FROM unnest(coalesce(j.nodes_delivered, '{{}}')
                                                         || {_NEW_HOLDERS}) AS n
                            ORDER BY n),
    cluster_requeue_at = CASE WHEN j.state = 'queued' AND j.cluster_requeue_at IS NULL
                                   AND j.retry > 0 AND cardinality({_NEW_HOLDERS}) > 1
                              THEN {_ARMED}
                              WHEN j.cluster_requeue_at IS NULL AND {_delay_timer(_NEW_HOLDERS)}
                              THEN {_DELAY_END}
                              ELSE j.cluster_requeue_at END,
    requeue_counts = j.requeue_counts AND NOT coalesce(
        j.cluster_requeue_at IS NULL AND {_delay_timer(_NEW_HOLDERS)}, false)"""

# Progress of asynchronous / transactional replication: the holders, and
# the watch of a copy queued here that now has holders elsewhere. The
# holders only widen, as in RECORD_HOLDERS: such a job is queued while it
# replicates, and a node that imported it meanwhile (NEEDJOBS: EXPORT_JOBS
# lists the importer) was dropped from the list, so our ACK never reached
# its copy and it served the job again (found by a read-only review).
REPLICATION_PROGRESS = f"""
UPDATE pgq.jobs j SET {_HOLDERS_WIDENED_AND_ARMED},
    nodes_confirmed = string_to_array(u.confirmed, ',')
FROM unnest(%(ids)s::text[], %(delivered)s::text[], %(confirmed)s::text[])
    AS u(id, delivered, confirmed)
WHERE j.id = u.id
"""

# REPLJOBs are about to go to new targets: they are holders from now on
# (Disque adds a target to nodes_delivered as it sends). Recorded before the
# sends, so that an ACK, NACK or WORKING made here meanwhile reaches every
# node that may hold a copy; until then an ACK of an asynchronous job
# deleted it without a SETACK, and a copy's re-queue timer delivered it
# again. Only widens the holders (a late send never forgets one). The jobs
# returned still exist: a job acked or deleted meanwhile gets no REPLJOB.
RECORD_HOLDERS = f"""
WITH relaxed AS MATERIALIZED (  -- lost in a crash, it costs a duplicate, never a job
    SELECT set_config('synchronous_commit', 'off', true)
)
UPDATE pgq.jobs j SET {_HOLDERS_WIDENED_AND_ARMED}
FROM unnest(%(ids)s::text[], %(delivered)s::text[]) AS u(id, delivered), relaxed
WHERE j.id = u.id
RETURNING j.id
"""

# A leaving node handed a new job over (external replication): it keeps no
# copy it would serve. The row stays as a receipt for the waiting client
# (never claimable: active, no timers) until the maintenance sweep drops it.
HANDED_OVER = f"""
WITH done AS (
    UPDATE pgq.jobs j SET state = 'active', requeue_at = NULL, cluster_requeue_at = NULL,
        nodes_delivered = string_to_array(u.delivered, ','),
        nodes_confirmed = string_to_array(u.confirmed, ',')
    FROM unnest(%(ids)s::text[], %(delivered)s::text[], %(confirmed)s::text[])
        AS u(id, delivered, confirmed)
    WHERE j.id = u.id
    RETURNING j.id, j.repl_waiter
)
SELECT count(*), count(pg_notify('{REPLICATION_CHANNEL_PREFIX}' || repl_waiter, id)) FROM done
WHERE repl_waiter IS NOT NULL
"""

DROP_HANDED_OVER = """
DELETE FROM pgq.jobs
WHERE state = 'active' AND requeue_at IS NULL AND cluster_requeue_at IS NULL
  AND nodes_delivered IS NOT NULL AND NOT (%(myself)s = ANY (nodes_delivered))
"""

# ----------------------------------------------------------------------- acks

# SETACK: the job is acknowledged elsewhere. Delete our copy (it is not our
# client's outcome, so it is not logged in history), keep a tombstone so a
# late copy cannot resurrect it. `known` tells the sender whether we held it;
# `nodes` are the holders we knew, so the node layer can tell whether we
# know holders the sender does not.
# The tombstone keeps the holders only this node knew of (the copy's
# holders beyond those the senders named, the senders and this node) with
# the named ones, as TRACK_ACK_GC writes them for the GC this node drives
# (pgq.cluster.acks.take_over): written by TRACK_ACK_GC alone, they were
# lost to a crash between the two statements (the copy, which named them,
# deleted here), and the SETACK sent again found a tombstone naming none.
# Those holders never heard of the ACK, and their timers delivered the job
# again (found by a read-only review).
APPLY_SETACK = """
WITH incoming AS (
    SELECT u.id, u.nodes, string_to_array(u.nodes, ',') || string_to_array(u.askers, ',')
                          || %(myself)s::text AS known
    FROM unnest(%(ids)s::text[], %(nodes)s::text[], %(askers)s::text[]) AS u(id, nodes, askers)
), existing AS (  -- a dummy tombstone knows no holder: it answers 'unknown'
    SELECT id, nodes FROM pgq.acks WHERE id = ANY (%(ids)s::text[]) AND NOT dummy
), gone AS (
    DELETE FROM pgq.jobs WHERE id = ANY (%(ids)s::text[])
    RETURNING id, queue, expires_at, nodes_delivered
), tombstones AS (
    INSERT INTO pgq.acks AS a (id, queue, expires_at, dummy, nodes)
    SELECT g.id, g.queue, g.expires_at, false,
           CASE WHEN EXISTS (SELECT 1 FROM unnest(g.nodes_delivered) AS n WHERE n <> ALL (i.known))
                THEN ARRAY(SELECT DISTINCT n FROM unnest(
                    g.nodes_delivered || array_remove(string_to_array(i.nodes, ','), '')) AS n
                    ORDER BY n) END
    FROM gone g JOIN incoming i ON i.id = g.id
    ON CONFLICT (id) DO NOTHING
)
SELECT i.id, (g.id IS NOT NULL OR e.id IS NOT NULL) AS known,
       coalesce(g.nodes_delivered, e.nodes, '{}'::text[]) AS local_nodes
FROM incoming i
LEFT JOIN gone g ON g.id = i.id
LEFT JOIN existing e ON e.id = i.id
"""

# This node drives the GC of these tombstones (it knows holders to reach).
TRACK_ACK_GC = """
UPDATE pgq.acks a SET nodes = string_to_array(u.nodes, ',')
FROM unnest(%(ids)s::text[], %(nodes)s::text[]) AS u(id, nodes)
WHERE a.id = u.id
"""

# At start: copies whose re-queue came due while this node was down are
# announced first (a WILLQUEUE once they are within the announce window):
# fired at once, they queued here a job acked meanwhile elsewhere, before
# the acker's SETACK (or the other holders' answer) could reach this node.
# A delayed copy never delivered whose delay ended while this node was
# down is no longer served here at once either (its delay's timer counted
# nothing: another holder may have queued the job meanwhile, and a
# consumer may hold it): it waits for the WILLQUEUE round like any copy,
# and a re-queue then counts (found by a read-only review).
POSTPONE_OVERDUE_TIMERS = """
UPDATE pgq.jobs SET cluster_requeue_at = pgq.now() + %(after)s * interval '1 second',
    requeue_counts = requeue_counts OR (enqueues = 0 AND requeue_at IS NOT NULL),
    requeue_at = CASE WHEN enqueues = 0 THEN NULL ELSE requeue_at END
WHERE cluster_requeue_at <= pgq.now() AND state = 'active' AND cardinality(nodes_delivered) > 1
"""

PENDING_ACK_GC = """
SELECT id, nodes, dummy FROM pgq.acks
WHERE (nodes IS NOT NULL OR dummy) AND expires_at > pgq.now()
"""

# DELJOB (GC done elsewhere, or a FASTACK): forget the job and its tombstone.
# Except at the node that made its ID (a client added it here): there a
# tombstone stays for RETRY_WINDOW (expire_acks drops it). A client that runs
# the add again after a lost connection must find the job done with
# (pgq.commands._kept_before), and one done with on another node left no
# history row here (SETACK deletes a copy unlogged; a FASTACK's DELJOB too).
# Without it, such a retry stored the job again: delivered after its ACK.
RETRY_WINDOW = "interval '60 seconds'"
APPLY_DELJOB = f"""
WITH made_here AS (
    SELECT u.id FROM unnest(%(ids)s::text[]) AS u(id)
    WHERE {_made_here('u.id')}
), jobs AS (
    DELETE FROM pgq.jobs WHERE id = ANY (%(ids)s::text[]) RETURNING id, queue, expires_at
), acks AS (
    DELETE FROM pgq.acks
    WHERE id = ANY (%(ids)s::text[]) AND id NOT IN (SELECT id FROM made_here)
    RETURNING 1
), kept AS (  -- as a holder's after SETACK: no holders left to collect from
    UPDATE pgq.acks
    SET expires_at = least(expires_at, pgq.now() + {RETRY_WINDOW}), nodes = NULL
    WHERE id IN (SELECT id FROM made_here)
    RETURNING 1
), short AS (
    INSERT INTO pgq.acks (id, queue, expires_at)
    SELECT j.id, j.queue, least(j.expires_at, pgq.now() + {RETRY_WINDOW}) FROM jobs j
    WHERE j.id IN (SELECT id FROM made_here)
    ON CONFLICT (id) DO NOTHING
    RETURNING 1
)
SELECT (SELECT count(*) FROM jobs), (SELECT count(*) FROM acks),
       (SELECT count(*) FROM kept) + (SELECT count(*) FROM short) AS kept
"""

# ------------------------------------------------------------ one queued copy

# A holder we hear from about a job holds a copy, and so do the holders it
# names: remember them all, so that our own announcements (WILLQUEUE,
# QUEUED, the watch) and ACK reach them. Holder lists diverge (the origin
# widens replication after the first copies went out; a restarted origin
# resumes): holders that never heard of each other could each keep the job
# queued (found by the simulation: seeds 4 and 25).
_LEARN_HOLDER = """
    nodes_delivered = CASE WHEN nodes_delivered @> ARRAY[%(sender)s::text] THEN nodes_delivered
                           ELSE coalesce(nodes_delivered, ARRAY[%(myself)s::text]) || %(sender)s::text
                      END"""

# `given`: per job, the holders the message names (comma-joined).
_GIVEN_HOLDERS = """
given AS (
    SELECT g.id, array_remove(string_to_array(g.holders, ','), '') || %(sender)s::text AS named
    FROM unnest(%(ids)s::text[], %(holders)s::text[]) AS g(id, holders)
)"""

# Our holders plus those named (and the sender), as a sorted set.
_MERGED_HOLDERS = """
    (SELECT array_agg(DISTINCT n ORDER BY n)
     FROM unnest(coalesce(j.nodes_delivered, ARRAY[%(myself)s::text]) || g.named) AS n)"""

# WILLQUEUE from `sender`: it will queue these within `ahead` seconds.
# Learn the holders it names; answer with our state (the node replies
# QUEUED for a copy queued here, SETACK for an acknowledged one). And an
# active copy whose own timer would race the sender's stands aside: its
# timer is postponed by retry when the sender comes first (our timer is
# due after the sender's window) or wins the tie (both due within the
# window: the lower node id queues). Disque relies on the sender's QUEUED
# alone to postpone the others, which arrives too late when two timers
# come due closer together than a message takes: both queued the job and
# counted the re-queue twice (a real-process test under a loaded CI run).
# The announcement goes out `ahead` seconds early, so this holds for any
# delay shorter than that; past it the QUEUED tie-break still decides.
# A copy this node serves: queued, or a delayed one whose delay ended
# (active, never delivered: a claim takes it as it takes a queued one, until
# its timer queues it, see _delay_timer). Reported and tie-broken as
# queued: a delayed job stayed 'active' here after its delay, so the other
# holders' timers queued it too, and two nodes served it with no fault at
# all (found by a read-only review, in the simulation). A lease that ran out
# is not: that job is re-queued by some holder, counting a delivery.
_QUEUED_HERE = ("(j.state = 'queued' OR (j.state = 'active' AND j.enqueues = 0 "
                "AND j.requeue_at <= pgq.now()))")

# A NACK's back-off still running here (its timer, requeue_counts false:
# never shortened): answered as queued, so that a holder whose parked
# timer came first (_PARKED, ten retries at most) stands aside. It read
# 'active', and that holder queued the job long before the back-off
# ended, counting a delivery (found by a read-only review).
_BACKING_OFF = ("(j.state = 'active' AND NOT j.requeue_counts AND j.retry > 0 "
                "AND j.cluster_requeue_at > pgq.now())")

_STANDS_ASIDE = """(
    j.state = 'active' AND j.retry > 0
    AND j.cluster_requeue_at < pgq.now() + j.retry * interval '1 second'
    AND (%(sender)s < %(myself)s
         OR j.cluster_requeue_at > pgq.now() + %(ahead)s * interval '1 second'))"""

WILLQUEUE_STATE = f"""
WITH {_GIVEN_HOLDERS}, learned AS (
    UPDATE pgq.jobs j SET nodes_delivered = {_MERGED_HOLDERS},
        cluster_requeue_at = CASE WHEN {_STANDS_ASIDE}
            THEN pgq.now() + (j.retry + random() * 0.5) * interval '1 second'
            ELSE j.cluster_requeue_at END
    FROM given g
    WHERE j.id = g.id AND (NOT coalesce(j.nodes_delivered @> g.named, false) OR {_STANDS_ASIDE})
    RETURNING j.id, j.nodes_delivered
)
SELECT j.id, CASE WHEN {_QUEUED_HERE} OR {_BACKING_OFF} THEN 'queued' ELSE j.state END,
       coalesce(l.nodes_delivered, j.nodes_delivered)
FROM pgq.jobs j LEFT JOIN learned l ON l.id = j.id
WHERE j.id = ANY (%(ids)s::text[])
UNION ALL
SELECT a.id, 'acked', a.nodes FROM pgq.acks a WHERE a.id = ANY (%(ids)s::text[])
"""

# QUEUED from `sender`: another holder queued these. Count the (re-)queue,
# and if we have it queued too keep it only if we win the tie-break (the
# lower node id keeps it, as in Disque). A copy we keep is returned: the
# node answers QUEUED at once, so that the sender (the loser) yields, and
# the copy keeps watch (see TIMERS) in case that answer is lost. Without it
# the winner stayed silent and both kept the job queued for good (found by
# the simulation, seed 13).
#
# A copy that ends active here is parked on the sender (schema 0019,
# pgq.cluster.requeue): its timer goes _PARKED seconds out (Disque postpones
# it by one retry), and the sender's next QUEUEDs (its watch sends one every
# retry) leave the row alone until less than half of that is left
# (_STILL_PARKED: nothing to count, no holder to learn). The node brings a
# parked copy back to one retry when the sender turns suspect, dead or gone
# (UNPARK). A parked copy re-queues as a timer does (requeue_counts): a
# NACK's back-off it replaced is moot, its job queued at the sender.
_YIELDS = f"(NOT {_QUEUED_HERE} OR %(sender)s < %(myself)s)"
# PARKED_RETRIES retries, but never past half the TTL left (nor below one
# retry): the default retry is a tenth of the TTL, and a timer past the
# expiry never fires, so a copy whose sender stopped holding the job queued
# unseen (its database down, a local DELJOB there) must fire before.
_PARKED = (f"least({PARKED_RETRIES} * j.retry, greatest(j.retry, "
           "extract(epoch FROM j.expires_at - pgq.now()) / 2))")
_STILL_PARKED = f"""coalesce(
    j.state = 'active' AND j.parked_on = %(sender)s AND %(counter)s = ''
    AND j.cluster_requeue_at > pgq.now() + {_PARKED} / 2 * interval '1 second'
    AND j.nodes_delivered @> g.named, false)"""

APPLY_QUEUED = f"""
WITH {_GIVEN_HOLDERS}
UPDATE pgq.jobs j SET nodes_delivered = {_MERGED_HOLDERS},
    nacks = j.nacks + (%(counter)s = 'nacks')::integer,
    additional_deliveries = j.additional_deliveries
                            + (%(counter)s = 'additional_deliveries')::integer,
    state = CASE WHEN j.state = 'queued' AND %(sender)s < %(myself)s THEN 'active' ELSE j.state END,
    -- A copy that yields serves nothing here: not at the end of a delay
    -- still running (the sender queued the job already), nor of a lease.
    requeue_at = CASE WHEN {_YIELDS} AND (j.retry > 0 OR {_QUEUED_HERE}) THEN NULL
                      ELSE j.requeue_at END,
    cluster_requeue_at = CASE
        WHEN j.retry = 0 THEN j.cluster_requeue_at
        WHEN {_YIELDS} THEN pgq.now() + ({_PARKED} + random() * 0.5) * interval '1 second'
        ELSE pgq.now() + (j.retry + random() * 0.5) * interval '1 second' END,
    parked_on = CASE WHEN j.retry > 0 AND {_YIELDS} THEN %(sender)s END,
    requeue_counts = j.requeue_counts OR (j.retry > 0 AND {_YIELDS})
FROM given g
WHERE j.id = g.id AND j.state <> 'wait-repl' AND NOT {_STILL_PARKED}
RETURNING j.id, NOT {_YIELDS} AS kept, j.nodes_delivered
"""

# Copies parked on holders that turned suspect, dead or gone: back to one
# retry (or sooner, as it was), so that one of them queues the job if nobody
# else has it queued (WILLQUEUE first, as any timer). Not a NACK's back-off
# (requeue_counts false: that timer is the NACK's delay, never shortened).
# At most `limit` rows a statement: the node runs it until one comes back
# short. A row another transaction holds is skipped (its own timer still
# bounds the wait: _PARKED).
def _unpark(parked: str) -> str:
    return f"""
UPDATE pgq.jobs j SET parked_on = NULL,
    cluster_requeue_at = CASE WHEN j.state = 'active' AND j.requeue_counts AND j.retry > 0
                                   AND j.cluster_requeue_at IS NOT NULL
        THEN least(j.cluster_requeue_at,
                   pgq.now() + (j.retry + random() * 0.5) * interval '1 second')
        ELSE j.cluster_requeue_at END
WHERE j.ctid = ANY (ARRAY(
    SELECT ctid FROM pgq.jobs
    WHERE parked_on IS NOT NULL AND {parked}
    LIMIT %(limit)s FOR UPDATE SKIP LOCKED))
RETURNING 1
"""


UNPARK = _unpark("parked_on = ANY (%(holders)s::text[])")
# At start: every copy parked on a node this one does not know alive (it
# may have died, or left, while this node was down).
UNPARK_UNLESS_ALIVE = _unpark("NOT (parked_on = ANY (%(alive)s::text[]))")

# QUEUED or WORKING named jobs acknowledged here: the sender still has a
# copy (it missed our SETACK, which backs off up to minutes): it is told now.
ACKED_HERE = """
SELECT id, coalesce(nodes, '{}'::text[]) FROM pgq.acks WHERE id = ANY (%(ids)s::text[])
"""

# WORKING from another holder: out of our queue, re-queue postponed by retry.
APPLY_WORKING = f"""
UPDATE pgq.jobs SET{_LEARN_HOLDER},
    state = 'active', requeue_at = NULL,
    cluster_requeue_at = pgq.now() + (retry + random() * 0.5) * interval '1 second'
WHERE id = ANY (%(ids)s::text[]) AND retry > 0 AND state IN ('queued', 'active')
"""

# ENQUEUE from a leaving node: the job is ours to queue now. Never an
# at-most-once job delivered here, as REQUEUE refuses one (a stray or
# crafted ENQUEUE delivered it twice).
#
# A job never queued whose DELAY has not run out (an add with a delay on a
# leaving node) stays active until then, as its origin would have kept it:
# requeue_at at its delay's end, and, with holders elsewhere, the timer
# _delay_timer gives an origin's delayed copy (cluster_requeue_at = its
# delay's end, counting nothing), so that TIMERS queues it then, announced
# and exportable. It was queued at once, its delay ignored (found by a
# review of docs/cluster-protocol.md); the first version of this left it
# active with no timer, served only by a GET on this node (found by the
# review of that).
APPLY_ENQUEUE = f"""
WITH target AS (
    SELECT id, enqueues = 0 AND delay > 0
               AND to_timestamp(ctime / 1e9) + delay * interval '1 second' > pgq.now() AS waits,
           to_timestamp(ctime / 1e9) + delay * interval '1 second' AS due
    FROM pgq.jobs
    WHERE id = ANY (%(ids)s::text[]) AND state = 'active' AND NOT (retry = 0 AND deliveries > 0)
    FOR UPDATE
), done AS (
    UPDATE pgq.jobs j SET
        state = CASE WHEN t.waits THEN 'active' ELSE 'queued' END,
        queued_at = CASE WHEN t.waits THEN j.queued_at ELSE pgq.now() END,
        requeue_at = CASE WHEN t.waits THEN t.due END,
        cluster_requeue_at = CASE WHEN t.waits AND j.retry > 0 AND cardinality(j.nodes_delivered) > 1
                                  THEN t.due END,
        requeue_counts = CASE WHEN t.waits AND j.retry > 0 AND cardinality(j.nodes_delivered) > 1
                              THEN false ELSE j.requeue_counts END,
        enqueues = j.enqueues + (NOT t.waits)::integer
    FROM target t WHERE j.id = t.id
    RETURNING j.queue, t.waits
)
SELECT count(pg_notify('{JOBS_CHANNEL}', q.queue))
FROM (SELECT DISTINCT queue FROM done WHERE NOT waits) AS q
"""

# Re-queue timers run by the node, in one statement (the node runs it ten
# times a second): the timers that fired ('fired' rows), and those due within
# `ahead` seconds ('soon' rows), which get a WILLQUEUE to the other holders
# first.
#
# The timer fired and nobody objected: queue it here, announce QUEUED. A
# node-run timer only fires after the job was queued somewhere (the origin
# queues it once replicated, or after its delay) and nobody acknowledged it
# within retry, so it counts an additional delivery - on every copy - unless
# it ends a NACK's back-off (requeue_counts false: the NACK counted already).
#
# Every queued copy of a replicated job keeps watch (schema 0009): its timer
# stays armed (copies queued another way - replication achieved, NACK,
# ENQUEUE, an import - are armed by the `armed` part), and when it comes due
# on the still-queued copy the node announces QUEUED again (no count) and
# re-arms it. Another holder may have queued the job too while the
# announcements between them were lost; the repeated QUEUED makes the one
# with the higher node id yield. A claim replaces the watch with its lease;
# a copy that yields has its timer postponed like any active copy.
TIMERS = f"""
WITH armed AS (  -- queued copies without their watch yet (schema 0009): armed, no announcement
    UPDATE pgq.jobs j SET
        cluster_requeue_at = {_ARMED}
    WHERE j.ctid = ANY (ARRAY(
        SELECT ctid FROM pgq.jobs
        WHERE state = 'queued' AND cluster_requeue_at IS NULL AND cardinality(nodes_delivered) > 1
          AND retry > 0
        LIMIT 2000 FOR UPDATE SKIP LOCKED))
    RETURNING 1
), due AS (
    SELECT ctid, state, requeue_counts FROM pgq.jobs
    WHERE cluster_requeue_at <= pgq.now() AND state IN ('active', 'queued')
      AND expires_at > pgq.now()
    LIMIT 2000 FOR UPDATE SKIP LOCKED
), fired AS (
    UPDATE pgq.jobs j SET
        state = 'queued',
        queued_at = CASE WHEN d.state = 'active' THEN pgq.now() ELSE j.queued_at END,
        cluster_requeue_at = CASE WHEN j.retry > 0 AND cardinality(j.nodes_delivered) > 1
                                  THEN pgq.now() + (j.retry + random() * 0.5) * interval '1 second'
                             END,
        requeue_at = NULL,
        enqueues = j.enqueues + (d.state = 'active')::integer,
        additional_deliveries = j.additional_deliveries
                                + (d.state = 'active' AND d.requeue_counts)::integer,
        requeue_counts = true
    FROM due d WHERE j.ctid = d.ctid
    RETURNING j.id, j.queue, coalesce(j.nodes_delivered, '{{}}'::text[]) AS nodes_delivered,
              d.state = 'active' AND d.requeue_counts AS counted, d.state = 'active' AS fresh
), woken AS (
    SELECT pg_notify('{JOBS_CHANNEL}', q.queue) FROM (SELECT DISTINCT queue FROM fired WHERE fresh) AS q
    WHERE EXISTS (SELECT 1 FROM pgq.waiters w WHERE w.queue = q.queue)
)
SELECT 'fired' AS kind, f.id, f.nodes_delivered, f.counted, NULL::float8 AS due
FROM fired f
WHERE (SELECT count(*) FROM armed) >= 0 AND (SELECT count(*) FROM woken) >= 0
UNION ALL
-- Due within `ahead` seconds: a WILLQUEUE to the other holders first. (Read
-- with the statement's snapshot: a copy fired above is not among them.)
SELECT 'soon', s.id, s.nodes, NULL, s.due
FROM (SELECT j.id, coalesce(j.nodes_delivered, '{{}}'::text[]) AS nodes,
             extract(epoch FROM j.cluster_requeue_at)::float8 AS due
      FROM pgq.jobs j
      WHERE j.cluster_requeue_at > pgq.now()
        AND j.cluster_requeue_at <= pgq.now() + %(ahead)s * interval '1 second'
        AND j.state = 'active' AND j.expires_at > pgq.now()
      ORDER BY j.cluster_requeue_at LIMIT 2000) AS s
"""

# --------------------------------------------------------------- federation

WAITED_QUEUES = """
SELECT w.queue, coalesce((SELECT sum(c.queued) FROM pgq.queue_counters c
                          WHERE c.queue = w.queue), 0)::bigint
FROM (SELECT DISTINCT queue FROM pgq.waiters x
      WHERE EXISTS (SELECT 1 FROM pg_stat_get_activity(x.pid))) AS w
WHERE NOT EXISTS (SELECT 1 FROM pgq.queues p WHERE p.name = w.queue AND p.paused IN ('out', 'all'))
"""

QUEUE_READY = """
SELECT coalesce((SELECT sum(queued) FROM pgq.queue_counters WHERE queue = %(queue)s), 0)::bigint,
       EXISTS (SELECT 1 FROM pgq.queues WHERE name = %(queue)s AND paused IN ('out', 'all'))
"""

# NEEDJOBS: hand over up to `count` queued jobs, in the order a claim here
# would take them: higher priority first, then oldest (the two arms of the
# claim, pgq.statements._CLAIM_BODY: jobs_priority_idx, then
# jobs_queued_idx; a job of priority > 0 may come from both). At-least-once
# jobs stay here as active copies with a re-queue timer (if the importer
# never acks them, they come back); at-most-once jobs are moved: deleted here.
# Except a keyed at-most-once job: it stays here as an active copy with no
# timer (never queued again here), which the importer's ACK removes (it
# lists this node as a holder). Deleted, its key was free here at once: a
# producer's retried add queued the work twice, and a WAITJOB here said
# 'done' while the job was being worked on elsewhere.
EXPORT_JOBS = f"""
WITH ranked AS (
    SELECT ctid, priority, ctime FROM pgq.jobs
    WHERE queue = %(queue)s AND state = 'queued' AND priority > 0 AND expires_at > pgq.now()
    ORDER BY priority DESC, ctime LIMIT %(count)s
), ready AS (
    SELECT ctid, priority, ctime FROM pgq.jobs
    WHERE queue = %(queue)s AND state = 'queued' AND expires_at > pgq.now()
    ORDER BY ctime LIMIT %(count)s
), picked AS MATERIALIZED (
    -- Only the rows picked are locked: a ready job locked and left made a
    -- concurrent claim skip it and move its floor past it, with no epoch
    -- move to bring it back (a claim that does that moves the epoch). A
    -- row a claim holds is skipped here: the export comes up short.
    -- `IS TRUE`: no partial index's predicate matches it, so the rows are
    -- found by their ctid (as `state = 'queued'`, the generic plan made on
    -- a fresh node walked the whole of jobs_queued_idx, every queued job).
    SELECT j.ctid FROM pgq.jobs j
    WHERE j.ctid = ANY (ARRAY(
        SELECT ctid FROM (SELECT * FROM ranked UNION ALL SELECT * FROM ready) AS c
        GROUP BY ctid, priority, ctime
        ORDER BY priority DESC, ctime LIMIT %(count)s))
      AND (j.state = 'queued') IS TRUE
    FOR UPDATE SKIP LOCKED
), moved AS (
    DELETE FROM pgq.jobs j
    WHERE j.ctid = ANY (ARRAY(SELECT ctid FROM picked)) AND j.retry = 0 AND j.key IS NULL
    RETURNING {_COPY_COLUMNS}
), kept AS (
    UPDATE pgq.jobs j SET
        state = 'active', requeue_at = NULL,
        cluster_requeue_at = CASE WHEN j.retry > 0 THEN pgq.now()
            + (j.retry + random() * 0.5) * interval '1 second' END,
        nodes_delivered = ARRAY(SELECT DISTINCT n FROM unnest(
            coalesce(j.nodes_delivered, '{{}}'::text[]) || ARRAY[%(myself)s, %(requester)s]) AS n
            ORDER BY n)
    WHERE j.ctid = ANY (ARRAY(SELECT ctid FROM picked)) AND (j.retry > 0 OR j.key IS NOT NULL)
    RETURNING {_COPY_COLUMNS}
)
SELECT * FROM moved UNION ALL SELECT * FROM kept
"""

# YOURJOBS: queue the imported jobs here (an active copy we hold is queued),
# unless acknowledged already. Imports do not count as deliveries.
IMPORT_JOBS = f"""
WITH incoming AS (
{contracts.COPY_ROWS}    WHERE NOT EXISTS (SELECT 1 FROM pgq.acks a WHERE a.id = u.id)
      AND to_timestamp(u.expires) > pgq.now()
), imported AS (
    INSERT INTO pgq.jobs AS j (id, queue, state, ctime, body, repl, retry, delay, expires_at,
                               queued_at, enqueues, nacks, additional_deliveries,
                               nodes_delivered, nodes_confirmed, priority, key)
    SELECT id, queue, 'queued', ctime, body, repl, retry, delay, to_timestamp(expires),
           pgq.now(), 1, nacks, adds,
           CASE WHEN retry > 0 OR key IS NOT NULL THEN ARRAY(SELECT DISTINCT n FROM unnest(
               string_to_array(nodes, ',') || ARRAY[%(myself)s, %(sender)s]) AS n ORDER BY n) END,
           CASE WHEN retry > 0 OR key IS NOT NULL THEN ARRAY[%(myself)s]::text[] END, priority, key
    FROM incoming
    ON CONFLICT (id) DO UPDATE SET
        state = 'queued', queued_at = pgq.now(), requeue_at = NULL,
        cluster_requeue_at = NULL, enqueues = j.enqueues + 1
    WHERE j.state = 'active'
    RETURNING j.id, j.queue
), woken AS (
    SELECT pg_notify('{JOBS_CHANNEL}', q.queue) FROM (SELECT DISTINCT queue FROM imported) AS q
)
SELECT queue, count(*), (SELECT count(*) FROM woken) FROM imported GROUP BY queue
"""

SAVE_IMPORT_STATS = """
WITH saved AS (
    INSERT INTO pgq.queue_imports AS q (queue, import_from, import_rate, updated_at)
    SELECT u.queue, string_to_array(u.nodes, ','), u.rate, pgq.now()
    FROM unnest(%(queues)s::text[], %(nodes)s::text[], %(rates)s::int[]) AS u(queue, nodes, rate)
    ON CONFLICT (queue) DO UPDATE SET import_from = excluded.import_from,
        import_rate = excluded.import_rate, updated_at = pgq.now()
    RETURNING 1
)
DELETE FROM pgq.queue_imports WHERE NOT (queue = ANY (%(queues)s::text[]))
"""

# -------------------------------------------------------------------- pause

APPLY_PAUSE = f"""
WITH cleared AS (
    DELETE FROM pgq.queues WHERE name = %(queue)s AND %(state)s = 'none' RETURNING 1
), stored AS (
    INSERT INTO pgq.queues AS p (name, paused) SELECT %(queue)s, %(state)s WHERE %(state)s <> 'none'
    ON CONFLICT (name) DO UPDATE SET paused = excluded.paused, updated_at = pgq.now()
    RETURNING 1
)
SELECT pg_notify('{JOBS_CHANNEL}', %(queue)s)
"""
