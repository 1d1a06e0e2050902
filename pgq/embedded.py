"""The embedded PostgreSQL server: pgq's zero-configuration default.

``pgq.Client()`` with no DSN (and no ``PGQ_DSN``) calls :func:`ensure_running`,
which starts - or finds already running - one PostgreSQL instance that lives
under ``PGQ_HOME``:

``PGQ_HOME/`` (default: the user's data dir, e.g. ``~/.local/share/pgq``;
``/var/lib/pgq`` for root)
    ``lock``           advisory lock serialising start/stop across processes
    ``instance.json``  port, role, password (mode 0600)
    ``data/``          the PostgreSQL cluster (owned by the server user)
    ``log/postgres.log``

Lifecycle: the first process that needs the server initialises and starts it;
the server then outlives that process so later processes (and other programs
such as Spark, through ``client.dsn``) reuse it. It stops only when asked:
``pgq.stop_embedded()`` or ``pgq embedded stop``.

Invariants:

* Start and stop happen under an exclusive ``flock`` on ``PGQ_HOME/lock``, so
  concurrent processes never initialise or start the same data dir twice.
* The server listens on 127.0.0.1 only (TCP, because Spark's JDBC driver needs
  it), on a port chosen free at start; no unix socket is created.
* Authentication is SCRAM with a random password kept in ``instance.json``
  (mode 0600): other local users cannot connect.
* Durability is PostgreSQL's default (``fsync=on``, ``synchronous_commit=on``).
* For containers (docker/compose.yaml) four variables open the server to
  other hosts on purpose: ``PGQ_EMBEDDED_LISTEN`` (listen address, e.g.
  ``*``), ``PGQ_EMBEDDED_PORT`` (a fixed port), ``PGQ_EMBEDDED_PASSWORD`` (a
  known password instead of a random one) and ``PGQ_EMBEDDED_HBA`` (an
  extra ``pg_hba.conf`` source, e.g. ``samenet``; SCRAM is still required).
* PostgreSQL refuses to run as root: when the caller is root, ``initdb`` and
  ``pg_ctl`` run as an unprivileged user (``PGQ_SERVER_USER``, default
  ``postgres``), who owns ``data/`` and ``log/``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import secrets
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import psycopg

from .errors import EmbeddedServerError
from .pgbinaries import find_server_binaries

__all__ = ["Instance", "home_directory", "ensure_running", "stop", "status"]

ROLE = "pgq"
DATABASE = "pgq"
START_TIMEOUT = 60

SERVER_SETTINGS = """
# --- written by pgq (embedded server) ---
listen_addresses = '127.0.0.1'
unix_socket_directories = ''
max_connections = 200
fsync = on
synchronous_commit = on
full_page_writes = on
timezone = 'UTC'
log_timezone = 'UTC'
log_line_prefix = '%m [%p] '
log_min_messages = warning
"""


@dataclass(frozen=True)
class Instance:
    """What a client needs to reach the embedded server."""

    port: int
    password: str
    role: str = ROLE
    database: str = DATABASE
    host: str = "127.0.0.1"

    @property
    def dsn(self) -> str:
        return f"postgresql://{self.role}:{self.password}@{self.host}:{self.port}/{self.database}"

    def dsn_for(self, database: str) -> str:
        return f"postgresql://{self.role}:{self.password}@{self.host}:{self.port}/{database}"


def home_directory(home: str | os.PathLike[str] | None = None) -> Path:
    """The embedded server's directory: ``home``, else ``$PGQ_HOME``, else the default."""
    if home is not None:
        return Path(home).expanduser().absolute()
    env = os.environ.get("PGQ_HOME")
    if env:
        return Path(env).expanduser().absolute()
    if os.geteuid() == 0:
        # root's data dir (/root/...) is not reachable by the unprivileged
        # server user, so root gets the system-wide location.
        return Path("/var/lib/pgq")
    import platformdirs

    return Path(platformdirs.user_data_dir("pgq", appauthor=False))


# ---------------------------------------------------------------- processes


@dataclass(frozen=True)
class _Runner:
    """Runs PostgreSQL binaries, as the unprivileged server user when we are root."""

    bindir: Path
    user: str | None  # None: run as ourselves

    def run(self, *args: str, timeout: float = START_TIMEOUT) -> subprocess.CompletedProcess[str]:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "LANG": "C"}
        kwargs: dict[str, object] = {}
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            kwargs = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
            env["HOME"] = entry.pw_dir
        try:
            return subprocess.run(
                [str(self.bindir / args[0]), *args[1:]],
                capture_output=True, text=True, timeout=timeout, env=env, cwd="/",
                check=False, **kwargs,  # type: ignore[arg-type]
            )
        except subprocess.TimeoutExpired as exc:
            raise EmbeddedServerError(f"{args[0]} did not finish within {timeout:g} s") from exc

    def chown(self, path: Path) -> None:
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def can_enter(self, directory: Path) -> bool:
        if self.user is None:
            return os.access(directory, os.X_OK)
        entry = pwd.getpwnam(self.user)
        probe = subprocess.run(
            ["/bin/sh", "-c", 'cd "$1"', "sh", str(directory)],
            user=entry.pw_uid, group=entry.pw_gid, extra_groups=[],
            capture_output=True, check=False, cwd="/",
        )
        return probe.returncode == 0


def _server_user() -> str | None:
    if os.geteuid() != 0:
        return None
    name = os.environ.get("PGQ_SERVER_USER", "postgres")
    try:
        pwd.getpwnam(name)
    except KeyError:
        raise EmbeddedServerError(
            f"running as root, but the unprivileged user {name!r} that should run "
            "PostgreSQL does not exist: create it (e.g. `useradd --system postgres`), "
            "set PGQ_SERVER_USER to another user, or run as a normal user"
        ) from None
    return name


# ---------------------------------------------------------------- files


@contextlib.contextmanager
def _locked(home: Path) -> Iterator[None]:
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read_instance(home: Path) -> Instance | None:
    try:
        raw = json.loads((home / "instance.json").read_text())
        return Instance(**raw)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as exc:
        raise EmbeddedServerError(
            f"{home / 'instance.json'} is corrupt ({exc}); stop the server and remove "
            f"{home} to start afresh"
        ) from exc


def _write_instance(home: Path, instance: Instance) -> None:
    path = home / "instance.json"
    fd, tmp = tempfile.mkstemp(dir=home, prefix=".instance-")
    with os.fdopen(fd, "w") as handle:
        json.dump(asdict(instance), handle)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _free_port(preferred: int | None, host: str = "127.0.0.1") -> int:
    for port in ([preferred] if preferred else []) + [0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            # PostgreSQL binds with SO_REUSEADDR, so must the probe: a port
            # with connections in TIME_WAIT after a stop is free for it.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise EmbeddedServerError(f"no free TCP port on {host}")


def _answers(instance: Instance, database: str = "postgres") -> bool:
    try:
        with psycopg.connect(instance.dsn_for(database), connect_timeout=3) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


# ---------------------------------------------------------------- lifecycle


def _prepare_directories(home: Path, runner: _Runner) -> tuple[Path, Path]:
    home.mkdir(parents=True, exist_ok=True)
    if runner.user is not None:
        os.chmod(home, 0o711)  # the server user may traverse, not list
        if not runner.can_enter(home):
            raise EmbeddedServerError(
                f"PGQ_HOME={home} is not reachable by the server user {runner.user!r} "
                "(a parent directory is private, e.g. under /root); choose a directory "
                "such as /var/lib/pgq or /tmp/pgq"
            )
    data, log = home / "data", home / "log"
    for directory in (data, log):
        directory.mkdir(mode=0o700, exist_ok=True)
        runner.chown(directory)
    return data, log


def _initdb(home: Path, data: Path, runner: _Runner) -> str:
    password = os.environ.get("PGQ_EMBEDDED_PASSWORD") or secrets.token_urlsafe(24)
    pwfile = home / ".pwfile"
    pwfile.write_text(password + "\n")
    os.chmod(pwfile, 0o600)
    runner.chown(pwfile)
    try:
        done = runner.run(
            "initdb", "-D", str(data), "-U", ROLE, f"--pwfile={pwfile}",
            "--auth-host=scram-sha-256", "--auth-local=scram-sha-256",
            "--encoding=UTF8", "--locale=C", "--no-instructions",
        )
    finally:
        pwfile.unlink(missing_ok=True)
    if done.returncode != 0:
        raise EmbeddedServerError(f"initdb failed in {data}:\n{done.stderr.strip()}")
    with open(data / "postgresql.conf", "a") as conf:
        conf.write(SERVER_SETTINGS)
    source = os.environ.get("PGQ_EMBEDDED_HBA")
    if source:
        with open(data / "pg_hba.conf", "a") as hba:
            hba.write(f"\n# added by pgq (PGQ_EMBEDDED_HBA)\nhost all all {source} scram-sha-256\n")
    return password


def _start(data: Path, log: Path, runner: _Runner, preferred_port: int | None,
           host: str) -> int:
    last_error = ""
    listen = os.environ.get("PGQ_EMBEDDED_LISTEN") or host
    fixed = os.environ.get("PGQ_EMBEDDED_PORT")
    for _attempt in range(3):
        port = int(fixed) if fixed else _free_port(preferred_port, host)
        done = runner.run(
            "pg_ctl", "start", "-D", str(data), "-l", str(log / "postgres.log"),
            "-w", "-t", str(START_TIMEOUT), "-o", f"-p {port} -c listen_addresses='{listen}'",
        )
        if done.returncode == 0:
            return port
        last_error = (done.stdout + done.stderr).strip()
        preferred_port = None  # the port was taken in between: pick another one
    tail = _log_tail(log / "postgres.log")
    raise EmbeddedServerError(f"PostgreSQL did not start in {data}:\n{last_error}\n{tail}")


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _running_port(data: Path) -> int | None:
    """The port from postmaster.pid if a postmaster claims the data dir."""
    try:
        fields = (data / "postmaster.pid").read_text().splitlines()
        pid, port = int(fields[0]), int(fields[3])
    except (OSError, ValueError, IndexError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, owned by the server user
    return port


def _ensure_database(instance: Instance) -> None:
    with psycopg.connect(instance.dsn_for("postgres"), autocommit=True, connect_timeout=10) as conn:
        exists = conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (instance.database,)
        ).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{instance.database}"')


def ensure_running(home: str | os.PathLike[str] | None = None,
                   host: str | None = None) -> Instance:
    """Start the embedded server under ``home`` if needed; return how to reach it.

    ``host`` is the loopback address to listen on (default 127.0.0.1, or the
    one the instance used before); a cluster node uses its bus address.
    Safe to call from many processes at once. Does not apply migrations: the
    client does that (see :func:`pgq.migrate`).
    """
    directory = home_directory(home)
    with _locked(directory):
        instance = _read_instance(directory)
        if instance is not None and host is not None and host != instance.host:
            raise EmbeddedServerError(
                f"the server in {directory} listens on {instance.host}, not {host}: "
                "stop it first to move it")
        if instance is not None and _answers(instance):
            _ensure_database(instance)
            return instance
        runner = _Runner(find_server_binaries(), _server_user())
        data, log = _prepare_directories(directory, runner)
        if not (data / "PG_VERSION").exists():
            password = _initdb(directory, data, runner)
        elif instance is None:
            raise EmbeddedServerError(
                f"{data} exists but {directory / 'instance.json'} (its password) is "
                f"missing; stop any server using it and remove {directory} to start afresh"
            )
        else:
            password = instance.password
        address = host or (instance.host if instance else "127.0.0.1")
        port = _running_port(data)
        if port is None:
            port = _start(data, log, runner, instance.port if instance else None, address)
        instance = Instance(port=port, password=password, host=address)
        _write_instance(directory, instance)
        if not _answers(instance):
            raise EmbeddedServerError(
                f"PostgreSQL in {data} runs on port {port} but refuses pgq's credentials; "
                f"see {log / 'postgres.log'}"
            )
        _ensure_database(instance)
        return instance


def stop(home: str | os.PathLike[str] | None = None, mode: str = "fast") -> bool:
    """Stop the embedded server under ``home``. Returns False if it was not running.

    ``mode`` is pg_ctl's shutdown mode: ``fast`` (default: disconnect clients,
    checkpoint), ``smart`` (wait for clients) or ``immediate`` (like a crash:
    the next start runs crash recovery).
    """
    if mode not in ("smart", "fast", "immediate"):
        raise ValueError(f"mode must be smart, fast or immediate, not {mode!r}")
    directory = home_directory(home)
    data = directory / "data"
    if not (data / "PG_VERSION").exists():
        return False
    with _locked(directory):
        if _running_port(data) is None:
            return False
        runner = _Runner(find_server_binaries(), _server_user())
        done = runner.run("pg_ctl", "stop", "-D", str(data), "-m", mode, "-w",
                          "-t", str(START_TIMEOUT))
        if done.returncode != 0:
            raise EmbeddedServerError(f"pg_ctl stop failed:\n{(done.stdout + done.stderr).strip()}")
        return True


def status(home: str | os.PathLike[str] | None = None) -> dict[str, object]:
    """Describe the embedded server under ``home`` (never starts it)."""
    directory = home_directory(home)
    data = directory / "data"
    instance = _read_instance(directory) if directory.exists() else None
    port = _running_port(data)
    return {
        "home": str(directory),
        "initialized": (data / "PG_VERSION").exists(),
        "running": port is not None,
        "port": port,
        "dsn": instance.dsn if instance is not None and port is not None else None,
        "log": str(directory / "log" / "postgres.log"),
    }
