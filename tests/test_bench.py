"""The benchmark suite runs in smoke mode on every `make test`, so it cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(os.environ.get("PGQ_TEST_DOCKER") == "1", reason="the bench runs its own servers")
# Not serial: the smoke run's figures are never compared with anything (it
# proves every row still runs and reports), and alone it took 2 of the
# suite's 17 minutes. Beside the other tests it runs slower, not wrong.
def test_bench_smoke_run_reports_every_contender(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    failures = {(w, c): r["error"] for w, by in data["runs"].items() for c, runs in by.items()
                for r in runs if "error" in r}
    assert failures == {}
    burn = data["runs"]["burn-down batched (COUNT 100)"]
    assert set(burn) == {"pgq", "pgqueuer", "procrastinate", "raw SQL floor"}
    assert all(r["rate"] > 0 for runs in burn.values() for r in runs)
    assert set(data["runs"]["bulk add"]) >= {"pgq", "plain COPY", "indexed COPY"}
    assert set(data["runs"]["Spark ingest (W=1)"]) == {"pgq", "plain COPY", "indexed COPY",
                                                        "Spark JDBC floor"}
    assert {"W=1 sync", "W=2 sync", "W=3 sync", "W=3 async", "get+ack across nodes"} <= set(data["cluster"])
    assert len(data["goals"]) == 45 and all("met" in g for g in data["goals"])
    # each p99 goal names its row: the shared Client's and the per-thread one
    p99_goals = [g["goal"] for g in data["goals"] if "p99 ≤ 10 ms" in g["goal"]]
    assert len(p99_goals) == 4 and sum("a Client per thread" in g for g in p99_goals) == 2
    closed = data["runs"]["add, 4 clients (one shared Client)"]
    assert set(closed) == {"pgq", "raw SQL floor"} and all(r["p99"] > 0 for r in closed["pgq"])
    assert set(data["runs"]["get+ack, 1 client (a Client per thread)"]) == {"pgq"}
    for key in ("add, 4 connections (RESP)", "get+ack, 4 connections (RESP)",  # issue "Any language"
                "add, 4 connections (HTTP)", "get+ack, 4 connections (HTTP)"):
        resp = data["runs"][key]
        assert set(resp) == {"pgq"} and all(r["rate"] > 0 and r["p99"] > 0 for r in resp["pgq"])
    assert data["cluster"]["add, replicate 3, 4 connections (RESP)"]["rate"] > 0
    for key in ("add, replicate 3, 4 clients (one shared Client)",  # issue "Speed that scales"
                "get+ack of 3-copy jobs, 4 clients (one shared Client)"):
        assert data["cluster"][key]["rate"] > 0 and data["cluster"][key]["p99_ms"] > 0
    resp_goals = [g["goal"] for g in data["goals"] if "(RESP)" in g["goal"]]
    assert len(resp_goals) == 6 and all("≥ durable Disque" in g for g in resp_goals)
    repeated = data["runs"]["burn-down x3 on one database, horizon held"]
    assert all(len(r["rates"]) == 3 for runs in repeated.values() for r in runs)
    markdown = (tmp_path / "results.md").read_text()
    assert "| burn-down batched (COUNT 100) |" in markdown and "## Goals" in markdown
    assert "| add, 4 connections (RESP) | " in markdown and "| pgq, RESP port |" in markdown
    assert "| add, 4 connections (HTTP) | " in markdown and "| pgq, HTTP API |" in markdown
    assert (tmp_path / "throughput.png").stat().st_size > 1000
    assert (tmp_path / "cluster_latency.png").stat().st_size > 1000


def test_bench_refuses_bad_options_before_it_runs_anything(tmp_path):
    """Found by a read-only review: `--rounds -1` or an `--only` that
    matched nothing ran nothing and wrote an empty report over the committed
    one, and `--out` naming a file failed only at the end of the whole run."""
    report = ROOT / "bench" / "results" / "results.md"
    before = report.read_bytes() if report.exists() else None
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for args, said in [(["--rounds", "-1"], "--rounds must be at least 1"),
                       (["--only", "no such row", "--no-cluster"], "matches no workload"),
                       (["--out", str(a_file)], "is a file: name a directory")]:
        done = subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and said in done.stderr, (args, done.stderr[-500:])
    assert (report.read_bytes() if report.exists() else None) == before


def test_ctrl_c_stops_the_bench_and_its_servers_with_status_130(tmp_path):
    """`pgq bench` said click's "Aborted!" and exited 1 (every other command:
    130); `python -m bench` printed a traceback. The servers it started must
    not outlive it either way."""
    import shutil
    import signal
    import tempfile
    import time

    # Its servers' directories go here, to look for them alone (xdist); not
    # under tmp_path, which the postgres user may not enter.
    home = Path(tempfile.mkdtemp(prefix="pgq-bench-interrupt-"))
    home.chmod(0o711)
    process = subprocess.Popen([sys.executable, "-m", "pgq", "bench", "--smoke", "--only",
                                "single add", "--no-cluster", "--out", str(tmp_path / "out")],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "TMPDIR": str(home)})
    try:
        assert process.stdout is not None
        # Interrupted once a run has reported (its server is up by then).
        deadline = time.monotonic() + 300  # the peers' virtualenv may be made first
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line or line.startswith("[1/"):
                break
        assert line.startswith("[1/"), process.stderr.read()[-2000:]
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
        assert process.returncode == 130 and "Traceback" not in err, err[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
    leftover = subprocess.run(["pgrep", "-f", str(home)], capture_output=True, text=True)
    shutil.rmtree(home, ignore_errors=True)
    assert leftover.stdout == "", "a bench server outlived the interrupted run"
