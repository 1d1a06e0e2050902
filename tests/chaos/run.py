"""One chaos run, end to end: cluster, workload and nemesis, heal, drain, check.

Phases, each marked in the history: ``faults`` (the workload runs while the
nemesis applies its schedule), ``heal`` (every fault undone, every node
serving; producers stop), ``drain`` (consumers take what is left until no
node holds a job of the queue, or ``drain_timeout``), then the check.
Whatever happens, the cluster's processes are stopped, the nftables table
removed and the clocks' files deleted with the cluster's directory.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psycopg

from pgq.localcluster import LocalCluster

from . import clock, netfilter
from .checker import Verdict, check
from .history import History
from .nemesis import KINDS, Nemesis, schedule
from .workload import QUEUE, Workload

__all__ = ["Options", "Outcome", "run", "available_kinds"]

FIRST_HOST = 31  # nodes on 127.0.0.31, .32, ... (the cluster tests use .2 to .6)


@dataclass
class Options:
    seed: int = 1
    nodes: int = 3
    seconds: float = 60.0  # of faults
    kinds: tuple[str, ...] = KINDS
    producers: int = 3
    consumers: int = 3
    rate: float = 40.0  # adds per second per producer
    durations: tuple[float, float] = (3.0, 8.0)
    rests: tuple[float, float] = (3.0, 6.0)
    drain_timeout: float = 120.0
    out: Path | None = None  # history.jsonl, summary.json, summary.md


@dataclass
class Outcome:
    verdict: Verdict
    faults: list[dict[str, object]]  # applied, in order
    skipped: dict[str, str]  # kind -> why it could not run here
    held_after_drain: int  # jobs of the queue still on some node
    seconds: float
    options: dict[str, object] = field(default_factory=dict)

    def line(self) -> str:
        return (f"seed={self.options.get('seed')} nodes={self.options.get('nodes')} "
                f"faults={len(self.faults)} {self.verdict.line()} "
                f"held_after_drain={self.held_after_drain}")


def available_kinds(kinds: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, str]]:
    """The kinds this machine can run, and why the others cannot."""
    skipped = {}
    reasons = {"partition": netfilter.unavailable(), "clock": clock.unavailable()}
    for kind in kinds:
        if reasons.get(kind):
            skipped[kind] = reasons[kind]  # type: ignore[assignment]
    return tuple(k for k in kinds if k not in skipped), skipped


def run(options: Options, log: Callable[[str], None] = print) -> Outcome:
    kinds, skipped = available_kinds(options.kinds)
    for kind, why in skipped.items():
        log(f"chaos: no {kind} faults: {why}")
    hosts = [f"127.0.0.{FIRST_HOST + i}" for i in range(options.nodes)]
    cluster = LocalCluster(options.nodes, prefix="pgq-chaos-", hosts=hosts)
    clocks = clock.Clocks(cluster.root) if "clock" in kinds else None
    for node in cluster.nodes:
        if clocks is not None:
            node.env.update(clocks.env(node.name))
            node.launcher = clocks.launcher
    net = netfilter.Netfilter() if "partition" in kinds else None
    stop = threading.Event()
    workload: Workload | None = None
    started = time.monotonic()
    pool_log = logging.getLogger("psycopg.pool")
    pool_level = pool_log.level
    pool_log.setLevel(logging.ERROR)  # one line per failed connect of every pool: noise here
    try:
        log(f"chaos: seed {options.seed}, {options.nodes} nodes, {options.seconds:g} s of "
            f"faults ({', '.join(kinds)}), cluster under {cluster.root}")
        cluster.start(timeout=180)
        history = History()
        faults = schedule(options.seed, [n.name for n in cluster.nodes], kinds,
                          count=1000, durations=options.durations, rests=options.rests)
        nemesis = Nemesis(cluster, history, net, clocks)
        workload = Workload(lambda: [n.dsn for n in cluster.nodes], history,
                            options.producers, options.consumers, options.rate).start()
        history.record("nemesis", "info", "phase", "faults")
        applied = nemesis.run(faults, options.seconds, stop)
        history.record("nemesis", "info", "phase", "heal")
        workload.stop_adding()
        nemesis.heal_all()
        history.record("nemesis", "info", "phase", "drain")
        held = _drain(cluster, options.drain_timeout)
        workload.stop()
        history.record("nemesis", "info", "phase", "done")
        outcome = Outcome(check(history.ops), [f.describe() for f in faults[:applied]], skipped,
                          held, round(time.monotonic() - started, 1),
                          {**asdict(options), "out": str(options.out) if options.out else None,
                           "kinds": list(kinds)})
        if options.out is not None:
            _write(options.out, history, outcome)
        log("chaos: " + outcome.line())
        return outcome
    finally:
        pool_log.setLevel(pool_level)
        stop.set()
        if workload is not None:
            workload.stop()
        if net is not None:
            net.close()
        cluster.close()


def _held(cluster: LocalCluster) -> int:
    """Jobs of the queue that some node still holds, in any state."""
    total = 0
    for node in cluster.nodes:
        with psycopg.connect(node.dsn, connect_timeout=5) as conn:
            row = conn.execute("SELECT coalesce(sum(length + active + waiting_repl), 0) "
                               "FROM pgq.queue_stats WHERE queue = %s", (QUEUE,)).fetchone()
        total += int(row[0]) if row else 0
    return total


def _drain(cluster: LocalCluster, timeout: float) -> int:
    """Wait until no node holds a job of the queue (twice in a row, a second
    apart: a job may be in flight between nodes); the jobs still held."""
    deadline = time.monotonic() + timeout
    empty_since: float | None = None
    held = -1
    while time.monotonic() < deadline:
        try:
            held = _held(cluster)
        except psycopg.Error:
            held = -1
        now = time.monotonic()
        if held == 0:
            empty_since = empty_since or now
            if now - empty_since >= 1.0:
                return 0
        else:
            empty_since = None
        time.sleep(0.25)
    return held


def _write(out: Path, history: History, outcome: Outcome) -> None:
    out.mkdir(parents=True, exist_ok=True)
    history.write(out / "history.jsonl")
    verdict = outcome.verdict
    summary = {"line": outcome.line(), "valid": verdict.valid, **asdict(verdict),
               "availability": verdict.availability,
               "availability_one_node": verdict.availability_one_node,
               "lost": verdict.lost[:100], "unexpected": verdict.unexpected[:100],
               "faults": outcome.faults, "skipped": outcome.skipped,
               "held_after_drain": outcome.held_after_drain, "seconds": outcome.seconds,
               "options": outcome.options}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    rows = "\n".join(f"| {i + 1} | {f['kind']} | {', '.join(f['targets'])} | {f['duration']} |"  # type: ignore[arg-type]
                     + (f" {f['skew']:+} s |" if "skew" in f else " |")
                     for i, f in enumerate(outcome.faults))
    (out / "summary.md").write_text(
        f"# Chaos run, seed {outcome.options.get('seed')}\n\n`{outcome.line()}`\n\n"
        f"Add errors by type: {json.dumps(verdict.errors)}\n\n"
        f"Skipped fault kinds: {json.dumps(outcome.skipped) or 'none'}\n\n"
        "| # | fault | targets | seconds | skew |\n|---:|---|---|---:|---|\n" + rows + "\n")
