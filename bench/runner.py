"""Runs every workload for every contender, in interleaved rounds.

Invariants: all contenders share one PostgreSQL server started here (fsync
on, synchronous_commit on; "turbo" rows set synchronous_commit off on their
database); every single run gets a fresh database; within each round the
contenders take turns (A B C A B C ...), and the median over the rounds is
what the report shows. A contender that fails a run is recorded with its
error: it never silently disappears from the table.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

import pgq
from pgq import embedded

from . import peers

# The directory holding the `bench` package: contenders run as
# `python -m bench.contenders.<name>` from there, in a checkout as well as
# in an installed wheel (where this package is pgq/bench).
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Contender:
    name: str
    module: str
    peer: bool = False  # runs in the peers' virtualenv


CONTENDERS = [
    Contender("pgq", "bench.contenders.pgq_client"),
    Contender("pgqueuer", "bench.contenders.pgqueuer_peer", peer=True),
    Contender("procrastinate", "bench.contenders.procrastinate_peer", peer=True),
    Contender("raw SQL floor", "bench.contenders.raw_sql"),
    Contender("plain COPY", "bench.contenders.plain_copy"),
    Contender("indexed COPY", "bench.contenders.indexed_copy"),
    Contender("Spark JDBC floor", "bench.contenders.spark_jdbc"),
]


@dataclass(frozen=True)
class Workload:
    key: str  # row of the report
    call: str  # contender function
    params: dict[str, Any]
    contenders: tuple[str, ...]
    turbo: bool = False
    unit: str = "jobs/s"


def workloads(smoke: bool) -> list[Workload]:
    n = 400 if smoke else 100_000
    seconds = 1.5 if smoke else 15.0
    peers_and_floor = ("pgq", "pgqueuer", "procrastinate", "raw SQL floor")
    return [
        Workload("burn-down batched (COUNT 100)", "burn",
                 {"n": n, "batch": 100, "consumers": 2, "max_seconds": 20 if smoke else 120},
                 peers_and_floor),
        Workload("burn-down per job (COUNT 1)", "burn",
                 {"n": n // 4 if not smoke else n, "batch": 1, "consumers": 2,
                  "max_seconds": 20 if smoke else 60}, peers_and_floor),
        Workload("burn-down batched, turbo (sync commit off)", "burn",
                 {"n": n, "batch": 100, "consumers": 2, "max_seconds": 20 if smoke else 120},
                 peers_and_floor, turbo=True),
        Workload("burn-down batched, pgq.Worker", "burn_worker",
                 {"n": n, "batch": 100, "consumers": 2, "max_seconds": 20 if smoke else 120},
                 ("pgq",)),
        Workload("steady state (4 producers, 4 consumers)", "steady",
                 {"producers": 4, "consumers": 4, "seconds": seconds, "batch": 10}, peers_and_floor),
        Workload("single add", "enqueue_single", {"n": 30 if smoke else 2000},
                 peers_and_floor, unit="adds/s"),
        Workload("bulk add", "enqueue_bulk", {"n": 2000 if smoke else 1_000_000},
                 ("pgq", "pgqueuer", "procrastinate", "raw SQL floor", "plain COPY", "indexed COPY")),
        Workload("Spark ingest (W=1)", "spark_ingest", {"n": 20_000 if smoke else 1_000_000},
                 ("pgq", "plain COPY", "indexed COPY", "Spark JDBC floor")),
        *closed_loop_workloads(smoke),
        *resp_workloads(smoke),
        *repeated_burn_workloads(smoke),
    ]


CLIENTS = (1, 10, 50)  # closed-loop client threads


def closed_loop_key(what: str, clients: int, shared: bool) -> str:
    who = "one shared Client" if shared else "a Client per thread"
    return f"{what}, {clients} client{'s' if clients > 1 else ''} ({who})"


def closed_loop_workloads(smoke: bool) -> list[Workload]:
    """One request in flight per client thread, durable (issue "Speed that
    scales"): pgq with one shared Client and with a Client per thread, and
    the raw psycopg floor (a connection per thread) beside the shared row."""
    seconds = 0.5 if smoke else 5.0
    clients = (1, 4) if smoke else CLIENTS
    rows = []
    for what, call, extra in (("add", "closed_add", {}),
                              ("get+ack", "closed_get_ack",
                               {"prefill": 5_000 if smoke else 150_000})):
        for n in clients:
            for shared in (True, False):
                rows.append(Workload(closed_loop_key(what, n, shared), call,
                                     {"clients": n, "seconds": seconds, "shared": shared, **extra},
                                     ("pgq", "raw SQL floor") if shared else ("pgq",),
                                     unit="adds/s" if what == "add" else "jobs/s"))
    return rows


RESP_CONNECTIONS = (10, 50)  # the connections of issue "Any language"'s RESP goals


def resp_key(what: str, connections: int, front: str = "RESP") -> str:
    return f"{what}, {connections} connection{'s' if connections > 1 else ''} ({front})"


def http_key(what: str, connections: int) -> str:
    return resp_key(what, connections, "HTTP")


def resp_workloads(smoke: bool) -> list[Workload]:
    """The closed loop through pgq's RESP port and its HTTP API (issue "Any
    language"): each connection a plain socket speaking Disque's protocol
    (or HTTP/1.1, keep-alive), one request in flight; `pgq serve --resp`
    (or `--http`) on the run's database, in its own process."""
    seconds = 0.5 if smoke else 5.0
    rows = []
    for front, key in (("resp", resp_key), ("http", http_key)):
        for what, call, extra in (("add", f"{front}_add", {}),
                                  ("get+ack", f"{front}_get_ack",
                                   {"prefill": 5_000 if smoke else 150_000})):
            for n in (4,) if smoke else RESP_CONNECTIONS:
                rows.append(Workload(key(what, n), call,
                                     {"connections": n, "seconds": seconds, **extra},
                                     ("pgq",), unit="adds/s" if what == "add" else "jobs/s"))
    return rows


REPEATS = 10


def repeated_burn_workloads(smoke: bool) -> list[Workload]:
    """Burn-downs of one queue in a row on one database, 10 consumers, COUNT
    100: does the claim slow down as dead rows pile up (with and without a
    session holding the xmin horizon)?"""
    params = {"n": 2_000 if smoke else 100_000, "batch": 100, "consumers": 10,
              "repeats": 3 if smoke else REPEATS}
    return [Workload(f"burn-down x{params['repeats']} on one database" + (", horizon held" if hold else ""),
                     "burn_repeated", {**params, "hold": hold}, ("pgq", "raw SQL floor"))
            for hold in (False, True)]


@dataclass
class Results:
    runs: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    cluster: dict[str, Any] = field(default_factory=dict)

    def add(self, workload: str, contender: str, result: dict[str, Any]) -> None:
        self.runs.setdefault(workload, {}).setdefault(contender, []).append(result)

    def median(self, workload: str, contender: str, key: str = "rate") -> float | None:
        values = [r[key] for r in self.runs.get(workload, {}).get(contender, [])
                  if r.get(key) is not None]
        return statistics.median(values) if values else None


class Server:
    """The PostgreSQL server every contender uses, started for this run."""

    def __init__(self) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="pgq-bench-"))
        os.chmod(self.home, 0o711)
        self.instance = embedded.ensure_running(self.home)
        self.counter = 0
        try:
            embedded.create_database(self.instance, "pgq_bench_template")
            pgq.migrate(self.instance.dsn_for("pgq_bench_template"))
            with self.admin() as conn:
                self.version = conn.execute("SHOW server_version").fetchone()[0]
                self.settings = dict(conn.execute(
                    "SELECT name, setting FROM pg_settings WHERE name IN "
                    "('fsync', 'synchronous_commit', 'shared_buffers', 'max_wal_size', "
                    "'full_page_writes')").fetchall())
        except BaseException:
            self.stop()  # a server started for nothing must not outlive the run
            raise

    def admin(self) -> psycopg.Connection:
        return psycopg.connect(self.instance.admin_dsn_for("postgres"), autocommit=True)

    def fresh(self, pgq_schema: bool, turbo: bool) -> str:
        self.counter += 1
        name = f"bench_{self.counter}"
        with self.admin() as conn:
            template = "TEMPLATE pgq_bench_template" if pgq_schema else ""
            # Owned by the role every contender uses: the peers create their
            # own tables (in schema public) when they start.
            conn.execute(f"CREATE DATABASE {name} OWNER {self.instance.role} {template}")
            if turbo:
                conn.execute(f"ALTER DATABASE {name} SET synchronous_commit = off")
        return name

    def drop(self, name: str) -> None:
        with self.admin() as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def stop(self) -> None:
        embedded.stop(self.home)
        shutil.rmtree(self.home, ignore_errors=True)


def run_once(server: Server, contender: Contender, workload: Workload, peer_python: Path,
             timeout: float) -> dict[str, Any]:
    # The indexed COPY floor copies the job table's definition (LIKE pgq.jobs).
    database = server.fresh(pgq_schema=contender.name in ("pgq", "indexed COPY"),
                            turbo=workload.turbo)
    params = {"workload": workload.call, "dsn": server.instance.dsn_for(database), **workload.params}
    python = str(peer_python) if contender.peer else sys.executable
    try:
        done = subprocess.run([python, "-m", contender.module, json.dumps(params)], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:300]}
        result = json.loads(done.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    except (ValueError, IndexError) as exc:
        return {"error": f"unreadable result: {exc}"}
    finally:
        server.drop(database)
    if "error" not in result and result.get("seconds"):
        result["rate"] = result["jobs"] / result["seconds"]
    return result


def row_names(smoke: bool, with_cluster: bool = True) -> list[str]:
    """Every row a run may measure (what ``--only`` picks from)."""
    names = [w.key for w in workloads(smoke)]
    if with_cluster:
        from .cluster import PYTHON_ROWS, closed_rows, resp_rows

        names += [*PYTHON_ROWS, *closed_rows(smoke), *resp_rows(smoke)]
    return names


def run(smoke: bool, rounds: int, only: list[str] | None, log: Callable[[str], None],
        with_cluster: bool = True) -> Results:
    results = Results()
    peer_python = peers.ensure(log)
    server = Server()
    chosen = [w for w in workloads(smoke) if not only or any(o in w.key for o in only)]
    results.meta = machine(server, smoke, rounds)
    if only:  # a partial run: its report says which rows and leaves the others "not run"
        results.meta["mode"] = "partial" if not smoke else "smoke"
        results.meta["only"] = list(only)
    total = rounds * sum(len(w.contenders) for w in chosen)
    step = 0
    try:
        for round_no in range(rounds):
            for workload in chosen:
                order = [c for c in CONTENDERS if c.name in workload.contenders]
                order = order[round_no % len(order):] + order[:round_no % len(order)]  # rotate
                for contender in order:
                    step += 1
                    started = time.monotonic()
                    result = run_once(server, contender, workload, peer_python,
                                      timeout=120 if smoke else 900)
                    results.add(workload.key, contender.name, result)
                    shown = (f"{result['rate']:,.0f} {workload.unit}" if "rate" in result
                             else result.get("error", "?"))
                    log(f"[{step}/{total}] round {round_no + 1} {workload.key} {contender.name}: "
                        f"{shown} ({time.monotonic() - started:.1f} s)")
    finally:
        server.stop()
    if with_cluster:
        from .cluster import run_cluster

        results.cluster = run_cluster(smoke, rounds, log, only)
    return results


def machine(server: Server, smoke: bool, rounds: int) -> dict[str, Any]:
    versions = peers.installed()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "mode": "smoke" if smoke else "full",
        "rounds": rounds,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "postgresql": server.version,
        "postgresql_settings": server.settings,
        "versions": {"pgq": pgq.__version__, **{k: versions.get(k) for k in peers.PEERS},
                     "psycopg": psycopg.__version__},
    }
