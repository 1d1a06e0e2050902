"""The nemesis: a seeded schedule of faults (pure) and the code that applies them.

A schedule is a list of :class:`Fault`, fully determined by its seed and
its arguments: the same seed replays the same faults on the same nodes for
the same durations (the processes' own timing is real, not replayed). The
first faults cover every kind once, on one node each; then one kill of
every node at once (when kills are enabled); then random faults, one node
most of the time, sometimes a minority of the nodes.

Kinds and what they do to their targets:

* ``kill-node``: SIGKILL the node process; healed by starting it again.
* ``kill-postgres``: SIGKILL the node's postmaster; healed by starting it
  again, as its supervisor would (the node process stays up meanwhile).
* ``kill-both``: both; healed by starting the node (it starts its server).
* ``pause``: SIGSTOP the node process; SIGCONT.
* ``partition``: drop every packet between the targets and the other
  nodes (clients still reach every node); flushed.
* ``clock``: move the wall clock of the node process by ``skew`` seconds
  (monotonic time is untouched); set back to 0. The node's PostgreSQL keeps
  the real clock: the embedded launcher starts it with a clean environment.

Every fault is confirmed before it counts (:meth:`Nemesis.confirm`): the
process is gone, the postmaster is gone, the process is stopped (state
``T``), a connection from an isolated node's address to another node's bus
times out, libfaketime is loaded in the node process. A fault that did not
take effect stops the run: a chaos test whose faults do nothing proves nothing.

Invariant of the executor: one fault at a time; a fault is healed before
the next starts, and :meth:`Nemesis.heal_all` leaves every node running,
connected, unpaused and on time, whatever happened before.
"""

from __future__ import annotations

import random
import signal
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg

from pgq.localcluster import LocalCluster, LocalNode, wait_for

from .clock import Clocks
from .history import History
from .netfilter import Netfilter

__all__ = ["KINDS", "KILLS", "Fault", "schedule", "Nemesis"]

KINDS = ("kill-node", "kill-postgres", "kill-both", "pause", "partition", "clock")
KILLS = ("kill-node", "kill-postgres", "kill-both")
RESTART_TIMEOUT = 120.0  # seconds for a node to serve again after a heal
CONFIRM_TIMEOUT = 10.0  # seconds for a fault to show (a killed process to be reaped...)


@dataclass(frozen=True)
class Fault:
    kind: str
    targets: tuple[str, ...]
    duration: float  # seconds the fault lasts
    rest: float  # seconds of calm after it is healed
    skew: float = 0.0  # clock faults: seconds added to the wall clock

    def describe(self) -> dict[str, object]:
        described: dict[str, object] = {"kind": self.kind, "targets": list(self.targets),
                                         "duration": self.duration}
        if self.kind == "clock":
            described["skew"] = self.skew
        return described


def schedule(seed: int, nodes: Sequence[str], kinds: Sequence[str], count: int,
             durations: tuple[float, float] = (3.0, 8.0),
             rests: tuple[float, float] = (3.0, 6.0)) -> list[Fault]:
    rng = random.Random(seed)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown fault kinds: {sorted(unknown)}")
    names = list(nodes)
    minority = max(1, (len(names) - 1) // 2)

    def fault(kind: str, targets: Sequence[str]) -> Fault:
        skew = rng.choice((-1, 1)) * round(rng.uniform(5, 60), 1) if kind == "clock" else 0.0
        return Fault(kind, tuple(sorted(targets)), round(rng.uniform(*durations), 1),
                     round(rng.uniform(*rests), 1), skew)

    faults = []
    first = list(kinds)
    rng.shuffle(first)
    faults += [fault(kind, [rng.choice(names)]) for kind in first]
    if any(kind in KILLS for kind in kinds):
        faults.append(fault(rng.choice([k for k in kinds if k in KILLS]), names))
    while len(faults) < count:
        kind = rng.choice(list(kinds))
        size = minority if rng.random() < 0.2 else 1
        faults.append(fault(kind, rng.sample(names, size)))
    return faults


class Nemesis:
    def __init__(self, cluster: LocalCluster, history: History, net: Netfilter | None = None,
                 clocks: Clocks | None = None) -> None:
        self.cluster = cluster
        self.history = history
        self.net = net
        self.clocks = clocks
        self.nodes = {node.name: node for node in cluster.nodes}

    def run(self, faults: Sequence[Fault], seconds: float, stop: threading.Event) -> int:
        """Apply ``faults`` in order until ``seconds`` of the run have passed;
        returns how many were applied."""
        applied = 0
        for fault in faults:
            if stop.is_set() or self.history.now() + fault.duration > seconds:
                break
            self.history.record("nemesis", "invoke", "fault", fault.describe())
            self.apply(fault)
            self.confirm(fault)
            stop.wait(fault.duration)  # the fault lasts this long (the schedule's, not a proof)
            self.heal(fault)
            self.history.record("nemesis", "ok", "fault", fault.describe())
            applied += 1
            stop.wait(fault.rest)
        return applied

    def apply(self, fault: Fault) -> None:
        targets = [self.nodes[name] for name in fault.targets]
        if fault.kind in ("kill-node", "kill-both"):
            for node in targets:
                node.kill(signal.SIGKILL)
        if fault.kind in ("kill-postgres", "kill-both"):
            for node in targets:
                node.kill_postgres(signal.SIGKILL)
        if fault.kind == "pause":
            for node in targets:
                if node.process is not None:
                    node.process.send_signal(signal.SIGSTOP)
        if fault.kind == "partition":
            assert self.net is not None, "partitions need nftables"
            inside = {node.host for node in targets}
            self.net.isolate(inside, {n.host for n in self.cluster.nodes} - inside)
        if fault.kind == "clock":
            assert self.clocks is not None, "clock faults need libfaketime"
            for node in targets:
                self.clocks.skew(node.name, fault.skew)

    def confirm(self, fault: Fault) -> None:
        """Wait until the fault shows; raise if it does not within seconds."""
        targets = [self.nodes[name] for name in fault.targets]
        others = [n for n in self.cluster.nodes if n.name not in fault.targets]
        checks = {
            "kill-node": lambda: all(not n.alive() for n in targets),
            "kill-postgres": lambda: all(not n.postgres_running() for n in targets),
            "kill-both": lambda: all(not n.alive() and not n.postgres_running() for n in targets),
            "pause": lambda: all(_state(n) == "T" for n in targets),
            "partition": lambda: all(not _reaches(a, b) for a in targets for b in others),
            "clock": lambda: all(self._skewed(n, fault.skew) for n in targets),
        }
        wait_for(checks[fault.kind], CONFIRM_TIMEOUT, f"{fault.kind} of {fault.targets} to show")

    def _skewed(self, node: LocalNode, skew: float) -> bool:
        assert self.clocks is not None and node.process is not None
        maps = Path(f"/proc/{node.process.pid}/maps").read_text()
        return "libfaketime" in maps and float(self.clocks.file(node.name).read_text()) == skew

    def heal(self, fault: Fault) -> None:
        targets = [self.nodes[name] for name in fault.targets]
        if fault.kind == "pause":
            for node in targets:
                if node.process is not None:
                    node.process.send_signal(signal.SIGCONT)
        if fault.kind == "partition" and self.net is not None:
            self.net.heal()
        if fault.kind == "clock" and self.clocks is not None:
            for node in targets:
                self.clocks.skew(node.name, 0.0)
        self.revive(targets)

    def heal_all(self) -> None:
        """Every node running, connected, unpaused and on time."""
        for node in self.cluster.nodes:
            if node.process is not None and node.process.poll() is None:
                node.process.send_signal(signal.SIGCONT)
        if self.net is not None:
            self.net.heal()
        if self.clocks is not None:
            for node in self.cluster.nodes:
                self.clocks.skew(node.name, 0.0)
        self.revive(self.cluster.nodes)

    def revive(self, nodes: Sequence[LocalNode]) -> None:
        """Start what is not running (a server whose node process lives, or
        the node process, which starts its own server), then wait until each
        node serves and its database answers."""
        restarted = set()
        for node in nodes:
            if node.alive() and not node.postgres_running():
                node.start_postgres()
            elif not node.alive():
                node.start()
                restarted.add(node.name)
        for node in nodes:
            answers = lambda node=node: _answers(node)  # noqa: E731
            if node.name in restarted:
                node.serve_or_restart(2 * RESTART_TIMEOUT, also=answers)
            else:
                node.wait_serving(RESTART_TIMEOUT, also=answers)


def _state(node: LocalNode) -> str | None:
    """The kernel's state letter of the node process (T: stopped)."""
    if node.process is None:
        return None
    try:
        return Path(f"/proc/{node.process.pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return None


def _reaches(source: LocalNode, target: LocalNode) -> bool:
    """Can a connection from ``source``'s address reach ``target``'s bus?"""
    with socket.socket() as sock:
        sock.settimeout(1.0)
        sock.bind((source.host, 0))
        try:
            sock.connect((target.host, target.bus_port))
        except OSError:
            return False
        return True


def _answers(node: LocalNode) -> bool:
    with psycopg.connect(node.dsn, connect_timeout=3) as conn:
        row = conn.execute("SELECT active FROM pgq.cluster_state").fetchone()
    return bool(row and row[0])
