"""Scripted stories on the simulation: a test tells the cluster what happens,
step by step, and waits for conditions in virtual time.

:class:`Scenario` runs a :class:`~.simulation.Simulation` without its random
workload and faults: the nodes start, mesh, and then only what the test
does happens (adds, gets, acks through the real client commands; crashes,
restarts, partitions, a node leaving), on the perfect in-memory network
unless the test degrades it. A condition is awaited with :meth:`Scenario.until`,
which runs events one at a time and checks it as virtual time passes: a
proof by condition, never by sleeping, and a run replays exactly.

Invariants still checked on every step, as in a seeded run: no node step
raises, and no node is declared dead while it answers (see
:mod:`.simulation`). A violation, or a condition not met in time, fails
with the trace of the last steps.

The real-process tests (``tests/cluster``) keep the wiring: sockets, the
node process, the CLI. The stories of the protocols live here.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from pgq import arguments, commands, contracts
from pgq.errors import PgqError

from .mock_transport import NetworkFaults
from .simulation import SimDatabases, SimNode, SimOptions, Simulation, _Stop

__all__ = ["Scenario", "ScenarioFailed", "Call"]

T = TypeVar("T")
MESH_WITHIN = 10.0  # virtual seconds for nodes to see each other at start


class ScenarioFailed(AssertionError):
    """A condition was not met in time, or an invariant broke."""


@dataclass
class Call:
    """A client command under way; ``done`` once it returned or raised."""

    what: str
    done: bool = False
    value: Any = None
    error: PgqError | None = None


class Scenario:
    def __init__(self, databases: SimDatabases, nodes: int = 3, seed: int = 1,
                 direct: bool = False) -> None:
        """``direct``: synchronous replicated adds write their copies into the
        peers' databases themselves (else through the node process, the
        path the older stories prove)."""
        self.sim = Simulation(databases, SimOptions(seed=seed, nodes=nodes, faults=(), adds=0),
                              direct=direct)
        for node in self.sim.nodes:
            self.sim._start(node)
        self.until(lambda: self.meshed() and self.recorded(), MESH_WITHIN, "a full mesh",
                   every=0.05)

    # ------------------------------------------------------------ time

    @property
    def now(self) -> float:
        return self.sim.now

    def _step(self) -> bool:
        if self.sim.next_at() is None:
            return False
        try:
            self.sim.step()
        except _Stop:
            raise ScenarioFailed(self.sim.violations[-1].report()) from None
        return True

    def run_for(self, seconds: float) -> None:
        """Let ``seconds`` of virtual time pass."""
        deadline = self.now + seconds
        while (at := self.sim.next_at()) is not None and at <= deadline:
            self._step()
        self.sim.now = deadline

    def until(self, condition: Callable[[], T], within: float, what: str,
              every: float = 0.01) -> T:
        """Run until ``condition()`` is true (checked every ``every`` virtual
        seconds); its value, or :class:`ScenarioFailed` after ``within``."""
        deadline = self.now + within
        checked = float("-inf")
        while True:
            if self.now - checked >= every:
                checked = self.now
                value = condition()
                if value:
                    return value
            if (at := self.sim.next_at()) is None or at > deadline:
                trace = "\n    ".join(self.sim._trace[-self.sim.options.trace_lines:])
                raise ScenarioFailed(f"{what}: not within {within:g} virtual seconds "
                                     f"(t={self.now:.3f})\n  trace:\n    {trace}")
            self._step()

    def holds(self, condition: Callable[[], Any], seconds: float, what: str,
              every: float = 0.05) -> None:
        """Run ``seconds`` of virtual time checking that ``condition()`` stays true."""
        deadline = self.now + seconds
        while self.now < deadline:
            if not condition():
                raise ScenarioFailed(f"{what}: broken at t={self.now:.3f}")
            self.run_for(min(every, deadline - self.now))

    # ------------------------------------------------------------ nodes

    def node(self, which: int | str) -> SimNode:
        if isinstance(which, int):
            return self.sim.nodes[which]
        return next(n for n in self.sim.nodes if n.name == which)

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.sim.nodes]

    def meshed(self) -> bool:
        """Every running node sees every other running node alive."""
        up = [n for n in self.sim.nodes if n.up and n.core and n.core.membership]
        for node in up:
            view = {m.id: m.status for m in node.core.membership.view()}  # type: ignore[union-attr]
            if any(view.get(other.node_id) != "alive" for other in up):
                return False
        return True

    def recorded(self) -> bool:
        """Every running node's database says what its clients read: every
        running node reachable (``pgq.cluster_state``)."""
        up = [n for n in self.sim.nodes if n.up]
        for node in up:
            row = node.client_conn.execute("SELECT reachable_nodes FROM pgq.cluster_state").fetchone()
            if row is None or row[0] != len(up):
                return False
        return True

    def sees(self, observer: int | str, target: int | str) -> str | None:
        """``target``'s status in ``observer``'s membership."""
        core = self.node(observer).core
        member = core.membership.get(self.node(target).node_id) if core and core.membership \
            else None
        return member.status if member is not None else None

    def crash(self, which: int | str) -> None:
        self.sim._crash(self.node(which))

    def restart(self, which: int | str) -> None:
        self.sim._restart(self.node(which))

    def partition(self, *side: str) -> None:
        self.sim._partition(set(side))

    def heal(self) -> None:
        self.sim._heal()

    def degrade(self, faults: NetworkFaults) -> None:
        self.sim.network.faults = faults

    def leaving(self, which: int | str, flag: bool = True) -> None:
        """What ``pgq cluster leaving yes|no`` does: the flag in the node's
        database, then a word to its process through the outbox."""
        node = self.node(which)
        conn = node.client_conn
        conn.execute(contracts.SET_LEAVING, {"leaving": flag})
        conn.execute(contracts.TELL_NODE, {"kind": contracts.OUTBOX_LEAVING, "queue": None,
                                           "arg": "yes" if flag else "no"})
        self.sim._ring(node)

    # ------------------------------------------------------------ database

    def sql(self, which: int | str, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
        cursor = self.node(which).client_conn.execute(statement, params)
        return cursor.fetchall() if cursor.description is not None else []

    def holders(self, job_id: str) -> dict[str, str]:
        """Node name -> state of its copy (``acked`` for a tombstone alone)."""
        out = {}
        for node in self.sim.nodes:
            row = node.client_conn.execute(
                "SELECT coalesce((SELECT state FROM pgq.jobs WHERE id = %(id)s), "
                "(SELECT 'acked' FROM pgq.acks WHERE id = %(id)s))", {"id": job_id}).fetchone()
            if row and row[0] is not None:
                out[node.name] = row[0]
        return out

    def queued_on(self, job_id: str) -> list[str]:
        return sorted(name for name, state in self.holders(job_id).items() if state == "queued")

    def counters(self, job_id: str) -> dict[str, tuple[int, int]]:
        """Node name -> (nacks, additional deliveries) of its copy."""
        out = {}
        for node in self.sim.nodes:
            row = node.client_conn.execute(
                "SELECT nacks, additional_deliveries FROM pgq.jobs WHERE id = %s",
                (job_id,)).fetchone()
            if row is not None:
                out[node.name] = (int(row[0]), int(row[1]))
        return out

    # ------------------------------------------------------------ clients

    def start(self, which: int | str, command: Callable[[Any], Generator[Any, Any, T]],
              what: str, listen: bool = False) -> Call:
        """Start a client command on a node's database; it runs as events."""
        node = self.node(which)
        call = Call(what)

        def done(outcome: Any) -> None:
            call.done = True
            if isinstance(outcome, PgqError):
                call.error = outcome
            else:
                call.value = outcome

        self.sim._client(node, command(self.sim._session(node, listen)), what, done)
        return call

    def do(self, which: int | str, command: Callable[[Any], Generator[Any, Any, T]],
           what: str, within: float = 30.0, listen: bool = False) -> T:
        """Run a client command to its end; its value, or the PgqError it raised."""
        call = self.start(which, command, what, listen)
        self.until(lambda: call.done, within, what)
        if call.error is not None:
            raise call.error
        return call.value  # type: ignore[no-any-return]

    def add(self, which: int | str, body: bytes, queue: str = "q", *, replicate: int | None = None,
            retry: float | None = None, ttl: float | None = 600, timeout: float | None = None,
            asynchronous: bool = False) -> str:
        params = arguments.job_params(replicate=replicate, delay=0, retry=retry, ttl=ttl,
                                      maxlen=None, asynchronous=asynchronous, timeout=timeout)
        ids = self.do(which, lambda s: commands.add_jobs(s, queue, [body], params),
                      f"add on {which}", within=(timeout or 5.0) + 30.0)
        return ids[0]

    def get(self, which: int | str, queue: str = "q", count: int = 1,
            timeout: float | None = None, withcounters: bool = False) -> list[Any]:
        """GETJOB; without ``timeout`` it does not block (NOHANG)."""
        return self.do(which, lambda s: commands.get_jobs(s, [queue], count, timeout,
                                                          timeout is None, withcounters),
                       f"get on {which}", within=(timeout or 0.0) + 30.0,
                       listen=timeout is not None)

    def ack(self, which: int | str, *ids: str) -> int:
        return self.do(which, lambda s: commands.ack_jobs(s, list(ids)), f"ack on {which}")

    def fast_ack(self, which: int | str, *ids: str) -> int:
        return self.do(which, lambda s: commands.fast_ack_jobs(s, list(ids)),
                       f"fastack on {which}")

    def nack(self, which: int | str, *ids: str) -> int:
        return self.do(which, lambda s: commands.nack_jobs(s, list(ids)), f"nack on {which}")

    def working(self, which: int | str, job_id: str) -> int | float:
        return self.do(which, lambda s: commands.working(s, job_id), f"working on {which}")
