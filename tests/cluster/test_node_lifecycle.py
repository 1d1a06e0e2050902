"""A node's lifecycle from the command line, against real node processes:
one node per directory, stop that stops, a clean failed start, waiting for
a node, and SIGTERM that is quick even when the database is gone."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from pgq.cluster.nodedir import NodeDirectory

from pgq import embedded

from .conftest import free_port, wait_until

CLI = [sys.executable, "-m", "pgq.cli"]


def pgq_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def node_dir():
    root = Path(tempfile.mkdtemp(prefix="pgq-lifecycle-"))
    os.chmod(root, 0o711)
    secret = root / "secret"
    secret.write_text(pgq_cli("cluster", "secret").stdout)
    yield root, secret
    for child in root.iterdir():
        pid = NodeDirectory(child).running_pid() if child.is_dir() else None
        if pid and pid > 0:
            os.kill(pid, signal.SIGKILL)
        if (child / "postgres").exists():
            embedded.stop(child / "postgres")
    shutil.rmtree(root, ignore_errors=True)


def test_one_node_per_directory_and_a_stop_that_stops(node_dir):
    root, secret = node_dir
    data = root / "n1"
    bus = f"127.0.0.1:{free_port('127.0.0.1')}"
    started = pgq_cli("node", "start", "--name", "n1", "--data", str(data), "--bus", bus,
                      "--secret-file", str(secret), "--detach")
    assert started.returncode == 0, started.stderr
    assert "n1 serves" in started.stdout
    state = json.loads((data / "node.json").read_text())
    pid = NodeDirectory(data).running_pid()
    assert pid and pid == state["pid"] and state["state"] == "running"

    # A second start of the same node says who runs it and changes nothing.
    other_bus = f"127.0.0.1:{free_port('127.0.0.1')}"
    again = pgq_cli("node", "start", "--name", "n1", "--data", str(data), "--bus", other_bus,
                    "--secret-file", str(secret))
    assert again.returncode == 1
    assert f"n1 is already running in {data} (pid {pid})" in again.stderr
    assert json.loads((data / "node.json").read_text()) == state
    assert pgq_cli("node", "wait", "--data", str(data), "--timeout", "5").returncode == 0
    # Detached, the same: it said "n1 serves" with the pid of the child that exited.
    detached = pgq_cli("node", "start", "--name", "n1", "--data", str(data), "--bus", other_bus,
                       "--secret-file", str(secret), "--detach")
    assert detached.returncode == 1 and "serves" not in detached.stdout
    assert "exited" in detached.stderr and "already running" in detached.stderr

    # The node's status hides the password unless asked.
    status = json.loads(pgq_cli("node", "status", "--data", str(data), "--json").stdout)
    assert ":***@" in status["dsn"] and status["state"] == "running"

    stopped = pgq_cli("node", "stop", "--data", str(data))
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.strip() == f"stopped n1: node process (pid {pid}) and its PostgreSQL"
    assert NodeDirectory(data).running_pid() is None
    assert embedded.status(data / "postgres")["running"] is False
    with pytest.raises(ProcessLookupError):
        for _ in range(100):  # the process may linger as a zombie for a moment
            os.kill(pid, 0)
            if Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z":
                raise ProcessLookupError
            time.sleep(0.05)

    # Nothing runs any more: say so (exit 3); a directory that is no node: exit 1.
    twice = pgq_cli("node", "stop", "--data", str(data))
    assert twice.returncode == 3 and "n1 is not running" in twice.stderr
    nowhere = pgq_cli("node", "stop", "--data", str(root / "no-such-dir"))
    assert nowhere.returncode == 1 and "not a node directory" in nowhere.stderr


def test_a_status_probe_does_not_make_a_start_fail(tmp_path):
    """A probe ("is a node running here?") holds a shared lock on node.lock
    for an instant; a start that tried its exclusive lock in that instant
    said "already running (pid ?)" and exited (a harness polling for
    "serving" while the node started could make it fail). A process of
    its own probes without pause while this one takes and drops the
    directory 300 times."""
    data = tmp_path / "n1"
    directory = NodeDirectory(data)
    directory.acquire("n1")
    directory.release()
    prober = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from pgq.cluster.nodedir import NodeDirectory\n"
        "d = NodeDirectory(Path(sys.argv[1]))\n"
        "print('probing', flush=True)\n"
        "while True: d.running_pid()\n"), str(data)], stdout=subprocess.PIPE, text=True)
    try:
        assert prober.stdout is not None and prober.stdout.readline() == "probing\n"
        for _ in range(300):
            directory.acquire("n1")  # raised NodeRunningError within a few dozen
            directory.release()
    finally:
        prober.kill()
        prober.wait(10)


def test_sigterm_while_a_node_starts_runs_its_clean_up(node_dir):
    """SIGTERM's default action killed a starting node (its embedded
    server's first start takes seconds) without clean-up: the PostgreSQL
    it launched ran on, and node.json said "starting" for ever."""
    root, secret = node_dir
    data = root / "n3"
    process = subprocess.Popen([*CLI, "node", "start", "--name", "n3", "--data", str(data),
                                "--bus", f"127.0.0.1:{free_port('127.0.0.1')}",
                                "--secret-file", str(secret)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # Its embedded server's initdb is at work (a second or more here, and
        # the server's start and the migration follow): the signal lands
        # seconds before the node could serve, whatever the machine's load.
        def initdb_at_work() -> bool:
            home = data / "postgres"
            return (NodeDirectory(data).read() or {}).get("state") == "starting" and \
                home.is_dir() and any(p.name.startswith(embedded.PARTIAL_PREFIX) for p in home.iterdir())

        wait_until(initdb_at_work, 60, every=0.02, message="n3's initdb")
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    assert process.returncode == 128 + signal.SIGTERM, out
    assert "Traceback" not in out, out
    assert NodeDirectory(data).read()["state"] == "stopped"
    assert NodeDirectory(data).running_pid() is None
    assert not embedded.status(data / "postgres")["running"]  # the server it launched is stopped


def test_a_start_that_fails_leaves_nothing_behind(node_dir):
    root, secret = node_dir
    data = root / "n2"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        failed = pgq_cli("node", "start", "--name", "n2", "--data", str(data),
                         "--bus", f"127.0.0.1:{port}", "--secret-file", str(secret))
    assert failed.returncode == 1
    lines = [line for line in failed.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"127.0.0.1:{port}" in lines[0]
    assert not (data / "postgres" / "data" / "postmaster.pid").exists()  # no PostgreSQL left
    assert NodeDirectory(data).running_pid() is None

    # A front's or the metrics' port in use: one line too, before PostgreSQL
    # starts. The node served without any front (a traceback in its log, its
    # RESP address advertised all the same), or failed with PostgreSQL left up.
    for option in ("--http", "--metrics"):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            failed = pgq_cli("node", "start", "--name", "n2", "--data", str(data),
                             "--bus", f"127.0.0.1:{free_port('127.0.0.1')}",
                             "--secret-file", str(secret), option, f"127.0.0.1:{port}",
                             timeout=60)
        lines = [line for line in failed.stderr.splitlines() if line.strip()]
        assert failed.returncode == 1 and len(lines) == 1, (option, failed.stderr)
        assert f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0], (option, lines)
        assert not (data / "postgres" / "data" / "postmaster.pid").exists(), option
    # Two fronts given one port: refused before PostgreSQL starts too (each
    # passed a probe that bound and closed; the node then served no front).
    port = free_port("127.0.0.1")
    failed = pgq_cli("node", "start", "--name", "n2", "--data", str(data),
                     "--bus", f"127.0.0.1:{free_port('127.0.0.1')}", "--secret-file", str(secret),
                     "--http", f"127.0.0.1:{port}", "--resp", f"127.0.0.1:{port}", timeout=60)
    lines = [line for line in failed.stderr.splitlines() if line.strip()]
    assert failed.returncode == 1 and len(lines) == 1, failed.stderr
    assert f"127.0.0.1:{port} for the RESP port" in lines[0] and "in use" in lines[0], lines
    assert not (data / "postgres" / "data" / "postmaster.pid").exists()

    weak = root / "weak"
    weak.write_text("a long shared cluster secret")
    refused = pgq_cli("node", "start", "--name", "n2", "--data", str(data),
                      "--bus", f"127.0.0.1:{free_port('127.0.0.1')}", "--secret-file", str(weak))
    assert refused.returncode == 1 and "pgq cluster secret" in refused.stderr

    for unspecified in ("0.0.0.0:7711", "[::]:7711"):  # peers would send their replies there
        nowhere = pgq_cli("node", "start", "--name", "n2", "--data", str(data),
                          "--bus", unspecified, "--secret-file", str(secret))
        assert nowhere.returncode == 1 and "--bus $(hostname):7711" in nowhere.stderr, nowhere.stderr


def test_sigterm_stops_a_node_quickly_even_without_its_database(node_dir):
    root, secret = node_dir
    data = root / "n3"
    bus = f"127.0.0.1:{free_port('127.0.0.1')}"
    process = subprocess.Popen([*CLI, "node", "start", "--name", "n3", "--data", str(data),
                                "--bus", bus, "--secret-file", str(secret)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        waited = pgq_cli("node", "wait", "--data", str(data), "--timeout", "90")
        assert waited.returncode == 0, waited.stderr
        listed = pgq_cli("cluster", "nodes", "--data", str(data), "--json")  # right after wait
        assert listed.returncode == 0 and json.loads(listed.stdout)[0]["name"] == "n3"
        embedded.stop(data / "postgres")  # the database goes away first
        began = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=15)
        # A couple of seconds: the last state write is bounded at 1.5 s and
        # the pool closes with a 1 s limit; 5 s leaves room for a loaded box.
        assert time.monotonic() - began < 5
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_two_node_processes_never_serve_one_database(make_cluster):
    cluster = make_cluster(1, mesh=False)
    node = cluster[0]
    second = pgq_cli("node", "start", "--name", "twin", "--dsn", node.dsn,
                     "--bus", f"{node.server.host}:{free_port(node.server.host)}",
                     "--secret-file", str(node.secret_file))
    assert second.returncode == 1
    assert "already serves this database" in second.stderr
    wait_until(node.serving, 10, message="the first node to keep serving")
