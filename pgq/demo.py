"""``python -m pgq.demo``: the README's main job - a local 3-node cluster.

Sets up three nodes (each a node process with its own embedded PostgreSQL)
under a temporary directory, runs producers adding replicated jobs (W=2) and
consumers on every node, kills one node process with SIGKILL halfway,
restarts it, and ends with a verdict: jobs added, delivered, duplicates,
lost (must be 0), throughput, and the time the cluster took to detect the
failure. Everything it started is stopped and removed at the end.

Exit status 0 only if no job was lost.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

from . import Client, Job, Worker, embedded
from .errors import NoReplError, PgqError

QUEUE = "demo"


@dataclass
class DemoNode:
    name: str
    data: Path
    bus_port: int
    secret: Path
    join: str | None
    process: subprocess.Popen | None = None
    dsn: str = ""

    @property
    def bus(self) -> str:
        return f"127.0.0.1:{self.bus_port}"

    def start(self) -> None:
        args = [sys.executable, "-m", "pgq.cli", "node", "start", "--name", self.name,
                "--data", str(self.data), "--bus", self.bus, "--secret-file", str(self.secret)]
        if self.join:
            args += ["--join", self.join]
        log = open(self.data.parent / f"{self.name}.log", "a")  # noqa: SIM115
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def kill(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def cluster_view(self) -> dict[str, str]:
        with psycopg.connect(self.dsn, connect_timeout=5) as conn:
            rows = conn.execute("SELECT name, status FROM pgq.cluster_nodes WHERE NOT myself").fetchall()
        return dict(rows)

    def serving(self) -> bool:
        state_file = self.data / "node.json"
        if not state_file.exists():
            return False
        import json

        state = json.loads(state_file.read_text())
        if state.get("state") != "running" or not state.get("dsn"):
            return False
        self.dsn = state["dsn"]
        return True


class _Progress:
    """Live bars on a terminal; plain milestone lines otherwise (logs, tests)."""

    def __init__(self, total: int) -> None:
        self.live = sys.stdout.isatty()
        self.total = total
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.progress = Progress(TextColumn("  {task.description:<10}"), BarColumn(),
                                     MofNCompleteColumn())
            self.added = self.progress.add_task("added", total=total)
            self.delivered = self.progress.add_task("delivered", total=total)

    def __enter__(self) -> _Progress:
        if self.live:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self.progress.stop()

    def update(self, added: int, delivered: int) -> None:
        if self.live:
            self.progress.update(self.added, completed=added)
            self.progress.update(self.delivered, completed=delivered)

    def say(self, message: str) -> None:
        if self.live:
            self.progress.console.print(f"  {message}")
        else:
            print(f"  {message}", flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (psycopg.Error, OSError, ValueError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"demo: timed out waiting for {what}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pgq.demo",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=6000, help="jobs to add (default 6000)")
    parser.add_argument("--no-kill", action="store_true", help="do not kill a node halfway")
    opts = parser.parse_args(argv)
    logging.getLogger("psycopg.pool").setLevel(logging.CRITICAL)
    logging.getLogger("pgq").setLevel(logging.ERROR)

    root = Path(tempfile.mkdtemp(prefix="pgq-demo-"))
    os.chmod(root, 0o711)
    secret = root / "cluster.secret"
    secret.write_text(secrets.token_urlsafe(32))
    nodes: list[DemoNode] = []
    print(f"starting a 3-node cluster under {root} ...", flush=True)
    try:
        first = None
        for i in range(3):
            node = DemoNode(f"n{i + 1}", root / f"n{i + 1}", _free_port(), secret, first)
            first = first or node.bus
            nodes.append(node)
            node.start()
        for node in nodes:
            _wait(node.serving, 90, f"{node.name} to start")
        _wait(lambda: all(set(n.cluster_view().values()) == {"alive"} and len(n.cluster_view()) == 2
                          for n in nodes), 60, "the nodes to see each other")
        print("cluster up: " + ", ".join(f"{n.name} bus {n.bus}" for n in nodes), flush=True)
        return run(nodes, opts)
    finally:
        for node in nodes:
            node.kill(signal.SIGTERM)
        for node in nodes:
            if (node.data / "postgres").exists():
                embedded.stop(node.data / "postgres")
        shutil.rmtree(root, ignore_errors=True)
        print("stopped the demo cluster and removed its files", flush=True)


def run(nodes: list[DemoNode], opts: argparse.Namespace) -> int:
    added: list[str] = []
    withdrawn: set[str] = set()  # NOREPL: removed, copies deleted best effort
    delivered: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    errors: list[str] = []

    def produce(node: DemoNode, share: int) -> None:
        client = Client([node.dsn, *(n.dsn for n in nodes if n is not node)], reconnect_timeout=60)
        try:
            sent = 0
            while sent < share:
                batch = [b"job %d" % i for i in range(sent, min(share, sent + 50))]
                try:
                    ids = client.add_jobs(QUEUE, batch, replicate=2, retry=2, timeout=3)
                except NoReplError as exc:  # our node process is down: those did not count
                    ids = list(exc.added)
                    with lock:
                        withdrawn.update(exc.removed)
                    time.sleep(0.2)
                    if not ids:
                        continue
                with lock:
                    added.extend(ids)
                sent += len(batch) if len(ids) == len(batch) else len(ids)
        except PgqError as exc:
            errors.append(f"{node.name} producer: {exc}")

    def record(job: Job) -> None:
        with lock:
            delivered[job.id] += 1

    # One pgq.Worker per node: consumers connected to every node's database.
    workers = [Worker(node.dsn, queues=[QUEUE], handler=record, concurrency=4, poll_timeout=0.5)
               for node in nodes]

    started = time.monotonic()
    share = opts.jobs // 3
    producers = [threading.Thread(target=produce, args=(n, share)) for n in nodes]
    consumers = [threading.Thread(target=w.run, kwargs={"install_signal_handlers": False})
                 for w in workers]
    for thread in producers + consumers:
        thread.start()
    victim, killed_at, detected_in = nodes[2], None, None
    restarted = opts.no_kill
    with _Progress(opts.jobs) as progress:
        while True:
            time.sleep(0.25)
            with lock:
                done, total = len(delivered), len(added)
            progress.update(total, done)
            if killed_at is None and not opts.no_kill and done >= opts.jobs // 2:
                progress.say(f"kill -9 {victim.name}'s node process")
                victim.kill(signal.SIGKILL)
                killed_at = time.monotonic()
            if killed_at is not None and detected_in is None:
                if nodes[0].cluster_view().get(victim.name) == "dead":
                    detected_in = time.monotonic() - killed_at
                    progress.say(f"{victim.name} declared dead after {detected_in:.1f} s; restarting it")
                    victim.start()
                    restarted = True
            producers_done = not any(t.is_alive() for t in producers)
            if producers_done and restarted and done >= total and set(delivered) >= set(added):
                break
            if time.monotonic() - started > 110:
                progress.say("time is up (110 s)")
                break
    for worker in workers:
        worker.stop()
    for thread in producers + consumers:
        thread.join(30)
    elapsed = time.monotonic() - started
    lost = set(added) - set(delivered)
    duplicates = sum(n - 1 for i, n in delivered.items() if i not in withdrawn)
    stray = len(withdrawn & set(delivered))
    print("verdict")
    print(f"  jobs added      {len(added)} (replicate=2, retry=2 s)")
    print(f"  delivered       {len(set(added) & set(delivered))} distinct")
    if withdrawn:
        print(f"  NOREPL          {len(withdrawn)} adds withdrawn while a node process was down"
              f" ({stray} delivered anyway: removing partial copies is best effort)")
    print(f"  duplicates      {duplicates} (at-least-once: re-deliveries around the kill)")
    print(f"  lost            {len(lost)}")
    print(f"  throughput      {len(delivered) / elapsed:,.0f} jobs/s end to end ({elapsed:.1f} s)")
    if detected_in is not None:
        print(f"  detection       {detected_in:.1f} s to declare the killed node dead")
    for error in errors:
        print(f"  error           {error}")
    return 0 if not lost and len(added) >= opts.jobs - 3 else 1


if __name__ == "__main__":
    sys.exit(main())
