"""The requests a command makes of a driver: pgq's sans-I/O boundary.

Every pgq command (ADDJOB, GETJOB, ...) is written once, in
:mod:`pgq.commands`, as a generator that *yields* the requests below and
receives their results. Two small drivers (:mod:`pgq.driver`) execute them:
one with a blocking psycopg connection, one with an async one. The command
logic therefore has no I/O of its own, is shared by :class:`pgq.Client` and
:class:`pgq.AsyncClient`, and can be driven by a fake in tests.

Invariants a driver guarantees:

* Requests run on one connection, in the order they are yielded.
* :class:`Begin`/:class:`Commit` bracket an atomic group on connections pgq
  owns or that are in autocommit mode; inside a caller's open transaction they
  do nothing, because the caller's transaction is the atomic unit.
* After :class:`Listen`, the driver un-registers the waiter and stops
  listening before the connection is used for anything else, even when the
  command fails or is cancelled.
* :class:`PeerWrite` is the one request that leaves the connection: it runs
  on other nodes' databases (the copies a client writes itself), each write
  its own durable transaction, all at once; the connection's own open
  transaction, if any, stays open meanwhile. A peer that fails or does not
  answer within the request's timeout is reported, never raised.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

from .ids import entropy

if TYPE_CHECKING:
    from .floors import Floors

__all__ = [
    "Result",
    "Query",
    "Begin",
    "Commit",
    "Rollback",
    "Copy",
    "PeerWrite",
    "PeerUnreached",
    "Listen",
    "ListenReplication",
    "Wait",
    "ClusterView",
    "Housekeeping",
    "Request",
    "Command",
    "Session",
]

T = TypeVar("T")


class Result(Enum):
    """What a :class:`Query` returns to the command."""

    ROWS = "rows"  # list of tuples
    ROW = "row"  # first tuple or None
    VALUE = "value"  # first column of the first row, or None
    ROWCOUNT = "rowcount"  # number of rows affected
    NONE = "none"


@dataclass(frozen=True, slots=True)
class Query:
    """Execute one statement (named ``%(name)s`` parameters)."""

    sql: str
    params: Mapping[str, Any] | None = None
    result: Result = Result.ROWS
    # Its rows are jobs handed to the caller (a claim): once it returned, a
    # driver lets the command run to its end or its next Wait before it
    # takes a cancellation, which would hand them to nobody.
    delivers: bool = False


@dataclass(frozen=True, slots=True)
class Begin:
    """Start an atomic group (see the module invariants)."""


@dataclass(frozen=True, slots=True)
class Commit:
    """End the atomic group started by :class:`Begin`."""


@dataclass(frozen=True, slots=True)
class Rollback:
    """Undo the atomic group started by :class:`Begin` (pgq's own
    connections only: a command never rolls back a caller's transaction)."""


@dataclass(frozen=True, slots=True)
class PeerWrite:
    """Run ``sql`` on other nodes' databases, at once: ``writes`` holds, per
    peer, ``(node id, DSN, params)``. Each write is its own transaction,
    committed durably (unless the client is in turbo mode) before its result
    counts. Returns ``{node id: rows}`` for the peers that answered within
    ``timeout`` seconds and ``{node id: the exception}`` for the others
    (:class:`PeerUnreached` for those nothing was sent to)."""

    sql: str
    writes: tuple[tuple[str, str, Mapping[str, Any]], ...]
    timeout: float


class PeerUnreached(Exception):
    """A :class:`PeerWrite`'s outcome for a peer that nothing was sent to
    (no connection within the timeout, none at all, or no time left to
    send): there is nothing to undo on it."""


@dataclass(frozen=True, slots=True)
class Copy:
    """``COPY ... FROM STDIN (FORMAT BINARY)`` of ready-made binary ``data``
    (signature and trailer included: see :mod:`pgq.copydata`)."""

    sql: str
    data: Iterable[bytes]


@dataclass(frozen=True, slots=True)
class Listen:
    """Register as a blocked consumer of ``queues`` and LISTEN for new jobs.

    Replies ``False`` when no job can have been added unnoticed since the
    command's last claim (the client's shared listener was registered for
    these queues before that claim began: see :mod:`pgq.listener`), so the
    command need not claim again before it waits; otherwise ``None``."""

    queues: tuple[str, ...]
    # Seconds the GET may still wait (None: no deadline): a listener that
    # cannot register its queues that soon leaves it polling, rather than
    # hold it past its TIMEOUT.
    within: float | None = None


@dataclass(frozen=True, slots=True)
class ListenReplication:
    """LISTEN on this connection's private channel ``pgq_r<backend pid>``, where
    the node process announces that a synchronous add got its copies. Stays
    on for the life of the connection (other clients never use it)."""


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait up to ``seconds`` for a notification (or just sleep if not
    listening); returns the (channel, payload) pairs received."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Housekeeping:
    """A point where the driver may run the periodic sweep (timers, expiry)."""


Request = (Query | Begin | Commit | Rollback | Copy | PeerWrite | Listen | ListenReplication | Wait
           | Housekeeping)
Command = Generator[Request, Any, T]


@dataclass(slots=True)
class ClusterView:
    """What a client last read of its node's cluster (``pgq.cluster_state``).

    A cache shared by a client's sessions: commands refresh it when it is
    older than ``max_age`` seconds, and re-read it before failing on it.
    ``active`` means a node process serves the database (clients replicate
    through it); ``member`` that the database belongs to a cluster node (its
    process ran at least once); ``reachable`` counts nodes that may take a
    copy (HELLO's priority 1), this one included unless it is leaving;
    ``peers``, those of them that advertised a DSN, as ``(node id, DSN)``:
    where a client may write copies itself. ``failing`` (kept across
    refreshes) holds, per peer a direct write failed on, when to try it
    again.
    """

    active: bool = False
    leaving: bool = False
    reachable: int = 1
    member: bool = False
    fetched_at: float = float("-inf")
    max_age: float = 1.0
    peers: tuple[tuple[str, str], ...] = ()
    failing: dict[str, float] = field(default_factory=dict)

    def stale(self, now: float) -> bool:
        return now - self.fetched_at > self.max_age

    def direct_peers(self, now: float) -> list[tuple[str, str]]:
        """The peers a direct write may go to now (not failing lately)."""
        return [p for p in self.peers if self.failing.get(p[0], now) <= now]

    @property
    def available(self) -> int:
        """Nodes an add may put copies on: 1 (this one) without a node process."""
        return self.reachable if self.active else 1


@dataclass(frozen=True, slots=True)
class Session:
    """What a command knows about where it runs.

    ``owned`` is True on pgq's own pooled autocommit connections; False on a
    caller's connection, where pgq must not change transaction settings and
    must notify consumers unconditionally (a waiter that registers after our
    statement but before the caller commits would otherwise be missed).
    """

    owned: bool
    node_id: str
    clock: Callable[[], float]
    can_listen: bool
    poll_interval: float
    host: str = "127.0.0.1"
    port: int = 5432
    cluster: ClusterView = field(default_factory=ClusterView)
    replication_timeout: float = 5.0
    # Where new job IDs get their time and randomness (the simulation's are virtual).
    wall: Callable[[], float] = time.time
    random_bytes: Callable[[int], bytes] = entropy  # os.urandom, read 4 KiB at a time
    floors: Floors | None = None  # where claims start (None: from the front)
    # The driver runs PeerWrite: synchronous replicated adds write their
    # copies into the peers' databases themselves (pgq.commands._add_direct).
    direct: bool = False
