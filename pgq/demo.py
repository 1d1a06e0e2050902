"""``python -m pgq.demo``: the README's main job, on one node.

Sets up a throwaway embedded PostgreSQL (its own temporary PGQ_HOME, so the
user's data is never touched), runs producers and consumers concurrently,
crashes PostgreSQL (``pg_ctl -m immediate``) halfway through, restarts it, and
ends with a verdict: jobs added, delivered, duplicates, lost (must be 0),
throughput. Everything it started is stopped and removed at the end.

Exit status 0 only if no job was lost.
"""

from __future__ import annotations

import argparse
import collections
import logging
import shutil
import sys
import tempfile
import threading
import time

from . import Client, embedded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pgq.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000, help="jobs to produce (default 20000)")
    parser.add_argument("--consumers", type=int, default=4, help="consumer threads (default 4)")
    parser.add_argument("--no-crash", action="store_true", help="do not crash PostgreSQL halfway")
    opts = parser.parse_args(argv)
    # The crash makes the connection pool log each failed reconnection; the
    # demo reports the outcome itself.
    logging.getLogger("psycopg.pool").setLevel(logging.CRITICAL)

    home = tempfile.mkdtemp(prefix="pgq-demo-")
    print(f"setting up an embedded PostgreSQL under {home} ...", flush=True)
    try:
        dsn = embedded.ensure_running(home).dsn
        with Client(dsn, migrate=True):
            pass
        return run(dsn, home, opts)
    finally:
        embedded.stop(home)
        shutil.rmtree(home, ignore_errors=True)
        print("stopped the demo server and removed its files")


def run(dsn: str, home: str, opts: argparse.Namespace) -> int:
    added: list[str] = []
    delivered: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    done_producing = threading.Event()
    crash_seconds = 0.0

    def produce(share: int) -> None:
        with Client(dsn, reconnect_timeout=60) as client:
            for start in range(0, share, 500):
                ids = client.add_jobs("demo", [b"job %d" % i for i in range(start, min(share, start + 500))],
                                      retry=2)
                with lock:
                    added.extend(ids)

    def consume() -> None:
        with Client(dsn, reconnect_timeout=60) as client:
            while True:
                jobs = client.get_job("demo", count=50, timeout=0.5)
                if not jobs:
                    with lock:
                        finished = done_producing.is_set() and len(delivered) >= len(added)
                    if finished:
                        return
                    continue
                with lock:
                    delivered.update(j.id for j in jobs)
                client.ack_job(*(j.id for j in jobs))

    started = time.monotonic()
    producers = [threading.Thread(target=produce, args=(opts.jobs // 2,)) for _ in range(2)]
    consumers = [threading.Thread(target=consume) for _ in range(opts.consumers)]
    for thread in producers + consumers:
        thread.start()
    crashed = opts.no_crash
    while any(t.is_alive() for t in producers + consumers):
        time.sleep(0.25)
        with lock:
            progress = len(delivered)
        print(f"\r  added {len(added):>7}  delivered {progress:>7}", end="", flush=True)
        if not crashed and progress >= opts.jobs // 2:
            crashed = True
            print("\n  crashing PostgreSQL (immediate stop) and restarting it ...", flush=True)
            t0 = time.monotonic()
            embedded.stop(home, mode="immediate")
            embedded.ensure_running(home)
            crash_seconds = time.monotonic() - t0
        if not any(t.is_alive() for t in producers):
            done_producing.set()
    elapsed = time.monotonic() - started
    lost = set(added) - set(delivered)
    duplicates = sum(n - 1 for n in delivered.values())
    print()
    print("verdict")
    print(f"  jobs added      {len(added)}")
    print(f"  delivered       {len(delivered)} distinct")
    print(f"  duplicates      {duplicates} (at-least-once: re-deliveries after the crash)")
    print(f"  lost            {len(lost)}")
    print(f"  throughput      {len(delivered) / elapsed:,.0f} jobs/s end to end ({elapsed:.1f} s)")
    if crash_seconds:
        print(f"  crash+restart   {crash_seconds:.1f} s")
    return 0 if not lost else 1


if __name__ == "__main__":
    sys.exit(main())
