"""The embedded PostgreSQL server: pgq's zero-configuration default.

``pgq.Client()`` with no DSN (and no ``PGQ_DSN``) calls :func:`ensure_running`,
which starts - or finds already running - one PostgreSQL instance that lives
under ``PGQ_HOME``:

``PGQ_HOME/`` (default: the user's data dir, e.g. ``~/.local/share/pgq``;
``/var/lib/pgq`` for root)
    ``lock``           advisory lock serialising start/stop across processes
    ``instance.json``  port, roles, passwords (mode 0600)
    ``data/``          the PostgreSQL cluster (owned by the server user)
    ``data.partial-*`` a first initdb at work (renamed to ``data/`` when whole)
    ``log/postgres.log``

Lifecycle: the first process that needs the server initialises and starts it;
the server then outlives that process so later processes (and other programs
such as Spark, through ``client.dsn``) reuse it. It stops only when asked:
``pgq.stop_embedded()`` or ``pgq embedded stop``.

Invariants:

* Start and stop happen under an exclusive ``flock`` on ``PGQ_HOME/lock``, so
  concurrent processes never initialise or start the same data dir twice.
* **A server is used only once it is proven to be this directory's own.**
  Nothing recorded earlier is trusted: after a crash the recorded port may
  belong to another process (another node's new server, anything), the
  ``postmaster.pid`` left behind may name a dead process (a zombie, when
  nobody reaps it) or a recycled pid, and a restarted server may still be in
  crash recovery. The launcher reads ``data/postmaster.pid``, checks that its
  process is alive and runs in this data directory (``/proc``), waits while
  it reports ``starting`` (crash recovery) or ``stopping``, removes the file
  when it names anything else, and starts its own server otherwise. It then
  connects to the port the live postmaster wrote and checks that the server
  answering there started when that postmaster did.
* **The password never goes to a server not proven to be ours**: every DSN
  of an instance carries ``require_auth=scram-sha-256`` (libpq 16+), so
  libpq refuses a server that asks for the password in clear; SCRAM proves
  knowledge of the password without revealing it, and a server that does not
  hold our verifier cannot complete it.
* Two roles: ``pgq_admin`` (the bootstrap superuser: initdb, creating
  databases, tests) and ``pgq``, what clients use: it can log in and owns
  schemas ``pgq`` and ``pgq_staging`` of database ``pgq``, nothing more (no
  superuser, no CREATEDB, no CREATEROLE). An instance made before this split
  has one superuser role ``pgq`` and keeps working.
* The server listens on 127.0.0.1 (TCP, because Spark's JDBC driver needs
  it), or on a cluster node's bus address, on a port chosen free at start;
  no unix socket is created. On an address beyond loopback, this machine's
  own addresses may log in too (``samehost``); other machines only through
  ``PGQ_EMBEDDED_HBA``. The port
  and listen address are written to ``data/pgq_runtime.conf`` (quoted), never
  passed through a shell.
* Authentication is SCRAM with random passwords kept in ``instance.json``
  (created 0600, replaced atomically): other local users cannot connect.
* Durability is PostgreSQL's default (``fsync=on``, ``synchronous_commit=on``).
* For containers (docker/compose.yaml) four variables open the server to
  other hosts on purpose: ``PGQ_EMBEDDED_LISTEN`` (listen address, e.g.
  ``*``), ``PGQ_EMBEDDED_PORT`` (a fixed port), ``PGQ_EMBEDDED_PASSWORD`` (a
  known password for role ``pgq`` instead of a random one) and
  ``PGQ_EMBEDDED_HBA`` (an extra ``pg_hba.conf`` source, e.g. ``samenet``;
  SCRAM is still required). Each is validated before use. A changed
  ``PGQ_EMBEDDED_PASSWORD`` takes effect at the next start: role ``pgq``'s
  password follows ``instance.json``.
* PostgreSQL refuses to run as root: when the caller is root, ``initdb`` and
  ``pg_ctl`` run as an unprivileged user (``PGQ_SERVER_USER``, default
  ``postgres``), who owns ``data/`` and ``log/``.
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import functools
import json
import logging
import os
import pwd
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ParamSpec, TypeVar
from urllib.parse import quote

import psycopg
from psycopg import sql

from . import ports
from .errors import EmbeddedServerError
from .pgbinaries import find_server_binaries

P = ParamSpec("P")
R = TypeVar("R")
logger = logging.getLogger("pgq")

__all__ = ["Instance", "home_directory", "ensure_running", "stop", "status",
           "create_database", "read_postmaster", "Postmaster", "write_private",
           "temporary_server"]

ROLE = "pgq"
ADMIN_ROLE = "pgq_admin"
DATABASE = "pgq"
SCHEMAS = ("pgq", "pgq_staging")
START_TIMEOUT = 60
RUNTIME_CONF = "pgq_runtime.conf"
# initdb works in PGQ_HOME/data.partial-XXXX, renamed to data/ once whole.
PARTIAL_PREFIX = "data.partial-"

SERVER_SETTINGS = f"""
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
password_encryption = 'scram-sha-256'
# port and listen address of this start (pgq rewrites it before each start)
include_if_exists = '{RUNTIME_CONF}'
"""

# libpq learned require_auth in 16: with it, a server that asks for the
# password in clear (or md5) is refused before the password leaves.
_REQUIRE_SCRAM = psycopg.pq.version() >= 160000


@dataclass(frozen=True)
class Instance:
    """What a client needs to reach the embedded server.

    ``admin_role``/``admin_password`` are the superuser's (``None`` on an
    instance made before the role split, whose one role is a superuser).
    """

    port: int
    password: str
    role: str = ROLE
    database: str = DATABASE
    host: str = "127.0.0.1"
    admin_role: str | None = None
    admin_password: str | None = None

    @property
    def dsn(self) -> str:
        return self.dsn_for(self.database)

    def dsn_for(self, database: str) -> str:
        """A DSN of role ``pgq`` (owner of the pgq schemas) on ``database``."""
        return _url(self.role, self.password, self.host, self.port, database)

    def admin_dsn_for(self, database: str = "postgres") -> str:
        """A superuser DSN, for creating databases and roles (never for clients)."""
        if self.admin_role is None or self.admin_password is None:
            return self.dsn_for(database)  # an instance from before the role split
        return _url(self.admin_role, self.admin_password, self.host, self.port, database)


def _url(role: str, password: str, host: str, port: int, database: str) -> str:
    auth = f"{quote(role, safe='')}:{quote(password, safe='')}"
    where = f"[{host}]" if ":" in host else host  # an IPv6 address: libpq could not parse it bare
    url = f"postgresql://{auth}@{where}:{port}/{quote(database, safe='')}"
    return url + ("?require_auth=scram-sha-256" if _REQUIRE_SCRAM else "")


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


# Characters pg_ctl's /bin/sh command line would expand in the data and log
# paths (it quotes them with ""): a backtick ran a command as the server
# user, and '$x' or '"' made the start fail after initdb had succeeded, on
# every later start too (found by a read-only review).
_SHELL_SPECIAL = frozenset('"$`\\\n\r')


def _check_home_path(home: Path) -> None:
    """Refuse, before anything is created, a home the server cannot use by
    its name: one pg_ctl's shell would rewrite, or one that is not UTF-8
    (initdb echoes it, and decoding its output raised a traceback)."""
    text = str(home)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise EmbeddedServerError(
            f"the embedded server's directory {text.encode('utf-8', 'replace').decode()!r} is not "
            "valid UTF-8: choose another PGQ_HOME (or --home / --data)") from None
    found = sorted(_SHELL_SPECIAL.intersection(text))
    if found:
        raise EmbeddedServerError(
            f"the embedded server's directory {text!r} holds {' '.join(map(repr, found))}, which "
            "PostgreSQL's pg_ctl passes through a shell: choose another PGQ_HOME (or --home / --data)")


# ---------------------------------------------------------------- processes


@dataclass(frozen=True)
class _Runner:
    """Runs PostgreSQL binaries, as the unprivileged server user when we are root."""

    bindir: Path
    user: str | None  # None: run as ourselves

    def run(self, *args: str, timeout: float = START_TIMEOUT) -> subprocess.CompletedProcess[str]:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "LANG": "C"}
        kwargs: dict[str, Any] = {}
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            kwargs = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
            env["HOME"] = entry.pw_dir
        try:
            return subprocess.run(
                [str(self.bindir / args[0]), *args[1:]],
                capture_output=True, text=True, timeout=timeout, env=env, cwd="/",
                check=False, **kwargs,
            )
        except subprocess.TimeoutExpired as exc:
            raise EmbeddedServerError(f"{args[0]} did not finish within {timeout:g} s") from exc

    def chown(self, path: Path) -> None:
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def entry_refused(self, directory: Path) -> str | None:
        """Why the server user cannot enter ``directory`` (None: it can),
        as the probe said it: a chaos run once saw a start refused here for
        no reason its message could tell, so the reason is kept. A probe
        killed by a signal is tried once more (it says nothing of the
        directory)."""
        if self.user is None:
            return None if os.access(directory, os.X_OK) else "no search permission"
        entry = pwd.getpwnam(self.user)
        for _attempt in range(2):
            probe = subprocess.run(
                ["/bin/sh", "-c", 'cd "$1"', "sh", str(directory)],
                user=entry.pw_uid, group=entry.pw_gid, extra_groups=[],
                capture_output=True, check=False, cwd="/",
                # Not our environment: an LD_PRELOAD of ours (libfaketime in
                # the chaos test) failed as the server user and was read as
                # "not reachable" (the chaos run's restart was refused so).
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"},
            )
            if probe.returncode >= 0:
                break
        if probe.returncode == 0:
            return None
        said = probe.stderr.decode(errors="replace").strip().splitlines()
        return said[-1] if said else f"the probe exited with status {probe.returncode}"


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


# ---------------------------------------------------------------- the postmaster


@dataclass(frozen=True)
class Postmaster:
    """What ``data/postmaster.pid`` says (PostgreSQL writes it at start and
    updates its status line; see miscadmin.h, LOCK_FILE_LINE_*)."""

    pid: int
    data_dir: str
    started: int  # unix time the postmaster started
    port: int
    status: str  # 'starting' (incl. crash recovery), 'ready', 'stopping', 'standby', ''


def read_postmaster(data: Path) -> Postmaster | None:
    """The postmaster.pid of ``data``, or None if missing or unreadable."""
    try:
        lines = (data / "postmaster.pid").read_text().splitlines()
        return Postmaster(int(lines[0]), lines[1], int(lines[2]), int(lines[3]),
                          lines[7].strip() if len(lines) > 7 else "")
    except (OSError, ValueError, IndexError):
        return None


_HAS_PROC = Path("/proc/self/stat").exists()


def _process_state(pid: int) -> str | None:
    """The kernel's state letter of ``pid`` (``Z``: a zombie), '' if /proc
    cannot tell, None if there is no such process."""
    if not _HAS_PROC:
        return ""  # macOS, BSD: a missing /proc/PID says nothing (every pid read as gone)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[0]


def _owns(postmaster: Postmaster, data: Path) -> bool | None:
    """Is the process of ``postmaster`` a live postmaster of ``data``?

    True or False where ``/proc`` can tell (Linux); None where it cannot, in
    which case only ``kill(pid, 0)`` is known (PostgreSQL's own test).
    """
    state = _process_state(postmaster.pid)
    if state is None or state in ("Z", "X", "x"):
        return False  # gone, or a zombie nobody reaped: not serving anything
    if state == "":
        try:
            os.kill(postmaster.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return None
    try:
        cwd = os.readlink(f"/proc/{postmaster.pid}/cwd")
    except OSError:
        cwd = None  # another user's process and we are not root
    if cwd is not None:
        # The postmaster changes into its data directory at start.
        return os.path.realpath(cwd) == os.path.realpath(data)
    try:
        cmdline = Path(f"/proc/{postmaster.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return bool(cmdline) and cmdline[0].endswith(b"postgres") and \
        os.fsencode(str(data)) in cmdline


# How long a postmaster.pid that cannot be read is given to become readable
# before it is taken for a crash's leftover (a postmaster writes its first
# lines in one write, right after creating the file).
UNREADABLE_PID_GRACE = 0.5


def _left_by_a_crash(data: Path) -> bool:
    """Whether ``data``'s postmaster.pid, there but unreadable (empty, or
    cut short: a crash while the postmaster wrote it), belongs to no live
    process. pg_ctl refuses to start while such a file is there ("the PID
    file ... is empty"), and every start failed the same way until someone
    deleted it by hand (found by a read-only review). Called under the
    home's lock, so no other pgq is starting a server there meanwhile."""
    path = data / "postmaster.pid"
    for attempt in range(2):
        try:
            first = path.read_text(errors="replace").split("\n", 1)[0].strip()
        except FileNotFoundError:
            return False  # gone meanwhile: nothing left to remove
        except OSError:
            return False
        if read_postmaster(data) is not None:
            return False  # readable now: the loop looks at it as any other
        if first.isdigit():  # a pid: stale unless that process serves data
            return _owns(Postmaster(int(first), str(data), 0, 0, ""), data) is False
        if attempt == 0:
            time.sleep(UNREADABLE_PID_GRACE)
    return True


def _serving(data: Path) -> bool:
    """Whether a live postmaster (or one /proc cannot rule out) holds ``data``."""
    postmaster = read_postmaster(data)
    return postmaster is not None and _owns(postmaster, data) is not False


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


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable by its owner only from
    the first byte (no window in which another user could read it)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")  # mode 0600
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            # On disk before the rename names it, and the rename on disk
            # before we go on: a power cut must not leave an empty
            # instance.json (its passwords lost, the server unusable).
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    write_private(home / "instance.json", json.dumps(asdict(instance)))


def _free_port(preferred: int | None, host: str = "127.0.0.1") -> int:
    # PostgreSQL binds with SO_REUSEADDR, so must the probe: a port with
    # connections in TIME_WAIT after a stop is free for it.
    if preferred and ports.bindable(host, preferred, reuse_address=True) is not None:
        return preferred
    try:  # not one an outgoing connection may take before the postmaster binds it
        return ports.free_port(host, reuse_address=True, servers=True)
    except OSError:
        raise EmbeddedServerError(f"no free TCP port on {host}") from None


# ---------------------------------------------------------------- settings

_LISTEN = re.compile(r"\*|[A-Za-z0-9.:_-]{1,253}(,[A-Za-z0-9.:_-]{1,253})*\Z")
_HBA_SOURCE = re.compile(r"(all|samehost|samenet|[0-9A-Fa-f.:]{2,45}(/[0-9]{1,3})?)\Z")


# A private server (temporary_server's, for tests and simulations) takes
# none of the PGQ_EMBEDDED_* variables, which are meant for the user's own
# server (a fixed port that server already holds failed every test session
# started beside it; a known password, an open listen address and pg_hba
# source are not what a throwaway server wants). Marked in its home, so
# that every later start of it (a test's restart) is private too; set
# while ensure_running works on such a home.
PRIVATE_MARK = "private"
_PRIVATE: contextvars.ContextVar[bool] = contextvars.ContextVar("pgq_embedded_private",
                                                               default=False)


def _setting(name: str) -> str | None:
    """A PGQ_EMBEDDED_* variable, unless this server is private."""
    return None if _PRIVATE.get() else os.environ.get(name)


def _listen_addresses(host: str) -> str:
    chosen = _setting("PGQ_EMBEDDED_LISTEN")
    listen = chosen or host
    if not _LISTEN.match(listen):
        # Name what was given: without the variable the address is the
        # caller's host (a node's bus host), and naming the variable sent
        # the user looking for a setting they never made.
        what = f"PGQ_EMBEDDED_LISTEN={listen!r}" if chosen else f"the server's host {listen!r}"
        raise EmbeddedServerError(
            f"{what} is not a listen address: give '*', an IP address or host name, or a "
            "comma-separated list of them")
    return listen


def _fixed_port() -> int | None:
    fixed = _setting("PGQ_EMBEDDED_PORT")
    if not fixed:
        return None
    if not fixed.isdigit() or not 0 < int(fixed) < 65536:
        raise EmbeddedServerError(f"PGQ_EMBEDDED_PORT={fixed!r} is not a TCP port (1-65535)")
    return int(fixed)


def _hba_source() -> str | None:
    source = _setting("PGQ_EMBEDDED_HBA")
    if source and not _HBA_SOURCE.match(source):
        raise EmbeddedServerError(
            f"PGQ_EMBEDDED_HBA={source!r} is not a pg_hba.conf address: give samenet, "
            "samehost, all, or an address with an optional /mask")
    return source or None


_SAMEHOST_RULE = "host all all samehost scram-sha-256"


def _allow_samehost(data: Path, address: str) -> bool:
    """A server on an address beyond loopback (a node's bus address): let
    this machine's own addresses log in (SCRAM still). initdb allows
    loopback only, and a connection to the machine's own 10.0.0.5 comes
    from 10.0.0.5: a node on such an address could not log in to its own
    server. Other machines still need PGQ_EMBEDDED_HBA. True if the rule
    was added now."""
    if ports.is_loopback(address):
        return False
    hba = data / "pg_hba.conf"
    if _SAMEHOST_RULE in hba.read_text():
        return False
    with open(hba, "a") as rules:  # appending keeps the owner and mode
        rules.write(f"\n# added by pgq (a listen address beyond loopback)\n{_SAMEHOST_RULE}\n")
    return True


def _include_runtime_conf(data: Path) -> None:
    """Servers made by older pgq versions took port and address from pg_ctl
    -o; they now read them from RUNTIME_CONF, which their conf must include."""
    conf = data / "postgresql.conf"
    if f"include_if_exists = '{RUNTIME_CONF}'" not in conf.read_text():
        with open(conf, "a") as handle:  # appending keeps the owner and mode
            handle.write(f"\ninclude_if_exists = '{RUNTIME_CONF}'\n")


def _write_runtime_conf(data: Path, runner: _Runner, port: int, listen: str) -> None:
    # Values are quoted for postgresql.conf (a quote doubled) and never
    # reach a shell: pg_ctl is started without -o.
    conf = (f"port = {int(port)}\n"
            f"listen_addresses = '{listen.replace(chr(39), chr(39) * 2)}'\n")
    path = data / RUNTIME_CONF
    write_private(path, conf)
    runner.chown(path)


# ---------------------------------------------------------------- lifecycle


def _prepare_directories(home: Path, runner: _Runner, created: bool) -> tuple[Path, Path]:
    """data/ and log/ under ``home`` (``created``: by this start, before its
    lock file: made 0711 then, or only given the search bits it lacks)."""
    home.mkdir(parents=True, exist_ok=True)
    if runner.user is not None:
        # The server user may traverse, not list. A directory the user
        # had (PGQ_HOME=/tmp, --home .) only gains the search bits: it was
        # set to 0711, and /tmp lost its sticky bit and everyone's write
        # access (found by a read-only review).
        mode = home.stat().st_mode & 0o7777
        wanted = 0o711 if created else mode | 0o011
        if wanted != mode:
            os.chmod(home, wanted)
        refused = runner.entry_refused(home)
        if refused is not None:
            raise EmbeddedServerError(
                f"PGQ_HOME={home} is not reachable by the server user {runner.user!r} "
                f"({refused}; a parent directory may be private, e.g. under /root); choose "
                "a directory such as /var/lib/pgq or /tmp/pgq"
            )
    data, log = home / "data", home / "log"
    server_uid = pwd.getpwnam(runner.user).pw_uid if runner.user is not None else os.getuid()
    if (data / "PG_VERSION").exists() and data.stat().st_uid != server_uid:
        # Another user's server (sudo -E with that user's PGQ_HOME): taken
        # over, its data/ changed hands and its own server lost access to it.
        owner = _user_name(data.stat().st_uid)
        raise EmbeddedServerError(
            f"the server in {home} belongs to user {owner}: run pgq as that user, or choose "
            "another PGQ_HOME (root runs the server as "
            f"{runner.user or 'itself'}, and leaves another user's server alone)")
    for directory in (data, log):
        # Handed to the server user only if pgq made it (now, or empty from
        # a start cut short): a data/ or log/ of the user's own stays theirs.
        if not directory.exists() or not any(directory.iterdir()):
            directory.mkdir(mode=0o700, exist_ok=True)
            runner.chown(directory)
    return data, log


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _initdb(home: Path, data: Path, runner: _Runner) -> Instance:
    """Make the cluster in a directory of its own and rename it to ``data/``
    once it is whole, its settings written and its passwords in
    instance.json: a first start killed at any point (kill -9, a container
    stopped while it initialises) leaves ``data/`` empty, and the next start
    begins again. initdb into ``data/`` itself left a PG_VERSION without
    instance.json, which no later start could use."""
    _remove_partial_clusters(home)
    admin_password = secrets.token_urlsafe(32)
    password = _setting("PGQ_EMBEDDED_PASSWORD") or secrets.token_urlsafe(32)
    hba = _hba_source()
    partial = Path(tempfile.mkdtemp(dir=home, prefix=PARTIAL_PREFIX))  # mode 0700
    runner.chown(partial)
    pwfile = home / ".pwfile"
    write_private(pwfile, admin_password + "\n")
    runner.chown(pwfile)
    try:
        done = runner.run(
            "initdb", "-D", str(partial), "-U", ADMIN_ROLE, f"--pwfile={pwfile}",
            "--auth-host=scram-sha-256", "--auth-local=scram-sha-256",
            "--encoding=UTF8", "--locale=C", "--no-instructions",
        )
    finally:
        pwfile.unlink(missing_ok=True)
    if done.returncode != 0:
        _remove_partial_clusters(home)
        raise EmbeddedServerError(f"initdb failed in {home}:\n{done.stderr.strip()}")
    with open(partial / "postgresql.conf", "a") as conf:
        conf.write(SERVER_SETTINGS)
    if hba:
        with open(partial / "pg_hba.conf", "a") as rules:
            rules.write(f"\n# added by pgq (PGQ_EMBEDDED_HBA)\nhost all all {hba} scram-sha-256\n")
    instance = Instance(port=0, password=password, admin_role=ADMIN_ROLE,
                        admin_password=admin_password)
    _write_instance(home, instance)
    try:
        partial.rename(data)  # replaces the empty directory: one step on disk
    except OSError as exc:
        raise EmbeddedServerError(
            f"{data} is not empty but holds no PostgreSQL cluster (no PG_VERSION): "
            f"remove it to start afresh ({exc.strerror})") from exc
    _fsync_directory(home)
    return instance


def _remove_partial_clusters(home: Path) -> None:
    """What a first start killed during initdb left (an initdb it started
    may even go on writing there: each attempt has a directory of its own)."""
    for leftover in home.glob(f"{PARTIAL_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)


_TRANSIENT_START = ("could not bind", "Address already in use", "shared memory block",
                    "lock file", "is another postmaster")


def _start(data: Path, log: Path, runner: _Runner, preferred_port: int | None,
           listen: str, deadline: float) -> None:
    """Start our server (pg_ctl -w); retry while the failure is one that
    passes (a port taken meanwhile, old backends still detaching)."""
    fixed = _fixed_port()
    last_error = ""
    while True:
        probe = "0.0.0.0" if listen == "*" else listen.split(",")[0]
        port = fixed or _free_port(preferred_port, probe)
        _write_runtime_conf(data, runner, port, listen)
        wait = max(int(deadline - time.monotonic()), 5)
        done = runner.run(
            "pg_ctl", "start", "-D", str(data), "-l", str(log / "postgres.log"), "-w", "-t", str(wait),
            timeout=wait + 10,  # pg_ctl's own wait ends first (START_TIMEOUT cut a longer one)
        )
        if done.returncode == 0:
            return
        last_error = (done.stdout + done.stderr).strip() + "\n" + _log_tail(log / "postgres.log")
        if time.monotonic() >= deadline or not any(t in last_error for t in _TRANSIENT_START):
            break
        preferred_port = None  # the port was taken in between: pick another one
        time.sleep(0.2)
    raise EmbeddedServerError(f"PostgreSQL did not start in {data}:\n{last_error}")


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _our_postmaster(data: Path, log: Path, runner: _Runner, instance: Instance,
                    listen: str, deadline: float) -> Postmaster:
    """The ready postmaster of ``data``: found (proven ours) or started."""
    started = False
    while True:
        postmaster = read_postmaster(data)
        if postmaster is None and (data / "postmaster.pid").exists() and not started:
            if not _left_by_a_crash(data):
                if time.monotonic() >= deadline:
                    raise EmbeddedServerError(
                        f"{data / 'postmaster.pid'} cannot be read, and its process is alive: "
                        "is another PostgreSQL starting there?")
                time.sleep(0.1)  # a live postmaster is still writing it
                continue
            (data / "postmaster.pid").unlink(missing_ok=True)
        if postmaster is not None:
            owned = _owns(postmaster, data)
            if owned is False:
                # Not a server of this directory (dead, a zombie, a recycled
                # pid): PostgreSQL would refuse to start while it is there.
                (data / "postmaster.pid").unlink(missing_ok=True)
                postmaster = None
            elif postmaster.status == "ready":
                return postmaster
            elif postmaster.status == "standby":
                raise EmbeddedServerError(f"the server in {data} runs as a standby")
        if postmaster is None and not started:
            _start(data, log, runner, instance.port or None, listen, deadline)
            started = True
            continue
        if postmaster is None and started:
            raise EmbeddedServerError(
                f"PostgreSQL in {data} exited right after its start; see {log / 'postgres.log'}:\n"
                + _log_tail(log / "postgres.log"))
        # 'starting' (crash recovery can take a while) or 'stopping': wait.
        if time.monotonic() >= deadline:
            raise EmbeddedServerError(
                f"PostgreSQL in {data} is still {(postmaster and postmaster.status) or 'starting'} (crash "
                f"recovery?) after waiting for it; see {log / 'postgres.log'}")
        time.sleep(0.1)


def _connect(dsn: str, timeout: int = 10) -> psycopg.Connection:
    return psycopg.connect(dsn, autocommit=True, connect_timeout=timeout)


_IDENTITY = ("SELECT extract(epoch FROM pg_postmaster_start_time())::float8, "
             "inet_server_port()")


def _check_identity(row: tuple[float, int] | None, postmaster: Postmaster, data: Path) -> None:
    assert row is not None
    if abs(float(row[0]) - postmaster.started) > 2 or int(row[1]) != postmaster.port:
        raise EmbeddedServerError(
            f"the server on port {postmaster.port} is not the one running in {data} "
            "(it started at another time): refusing to use it")


def _verify_and_provision(instance: Instance, postmaster: Postmaster, data: Path,
                          log: Path, follow_password: bool = False) -> None:
    """Check that the server answering on the port is ``postmaster`` (the
    one running in our data directory) and that role ``pgq`` can use its
    database. One connection when all is in place (the common case); the
    admin role provisions what is missing."""
    try:
        with _connect(instance.dsn) as conn:
            _check_identity(conn.execute(_IDENTITY).fetchone(), postmaster, data)
            return
    except psycopg.OperationalError as exc:
        if instance.admin_role is None:
            raise EmbeddedServerError(
                f"PostgreSQL of {data} runs on port {postmaster.port} but pgq cannot log in "
                f"({str(exc).strip()}); see {log / 'postgres.log'}") from exc
    try:
        with _connect(instance.admin_dsn_for("postgres")) as conn:
            _check_identity(conn.execute(_IDENTITY).fetchone(), postmaster, data)
            if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s",
                                (instance.role,)).fetchone():
                conn.execute(sql.SQL(
                    "CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD {}"
                ).format(sql.Identifier(instance.role), sql.Literal(instance.password)))
            elif follow_password:  # PGQ_EMBEDDED_PASSWORD at a start: the role follows it
                conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                    sql.Identifier(instance.role), sql.Literal(instance.password)))
    except psycopg.Error as exc:
        raise EmbeddedServerError(
            f"PostgreSQL of {data} runs on port {postmaster.port} but pgq cannot log in "
            f"({str(exc).strip()}); see {log / 'postgres.log'}") from exc
    create_database(instance, instance.database)


def create_database(instance: Instance, name: str, template: str | None = None) -> None:
    """Create database ``name`` (from ``template``) if missing, with schemas
    ``pgq`` and ``pgq_staging`` owned by the instance's role (so it can
    migrate and use it without any other privilege)."""
    ident = sql.Identifier
    created = False
    with _connect(instance.admin_dsn_for("postgres")) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            statement = sql.SQL("CREATE DATABASE {}").format(ident(name))
            if template:
                statement += sql.SQL(" TEMPLATE {}").format(ident(template))
            with contextlib.suppress(psycopg.errors.DuplicateDatabase):
                conn.execute(statement)
                created = True
    if instance.admin_role is None:
        return
    with _connect(instance.admin_dsn_for(name)) as conn:
        for schema in SCHEMAS:
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {} AUTHORIZATION {}").format(
                ident(schema), ident(instance.role)))
        # The application's own tables go to public, not to pgq's schema:
        # the role is named pgq, so the default search_path ("$user",
        # public) put an unqualified CREATE TABLE orders (the README's quick
        # start) in schema pgq, where `CREATE TABLE IF NOT EXISTS jobs`
        # silently found pgq's own table, and dropping pgq's schema took
        # the application's tables with it (found by a read-only review).
        # pgq's own SQL names its schema everywhere. Only for a database
        # made here and now: one made before may hold an application's
        # tables in schema pgq, which its sessions must go on finding.
        if created:
            conn.execute(sql.SQL("GRANT USAGE, CREATE ON SCHEMA public TO {}").format(
                ident(instance.role)))
            conn.execute(sql.SQL("ALTER ROLE {} IN DATABASE {} SET search_path = public").format(
                ident(instance.role), ident(name)))


def _typed_os_errors(func: Callable[P, R]) -> Callable[P, R]:
    """A path the server cannot use (PGQ_HOME not writable, a file where a
    directory should be, a home of another user) is an EmbeddedServerError
    saying which and what to do, not an OSError from deep inside."""
    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except OSError as exc:
            where = f" {exc.filename}" if exc.filename else ""
            raise EmbeddedServerError(
                f"the embedded server cannot use{where}: {exc.strerror or exc} (set PGQ_HOME, "
                "or --home / --data, to a directory this user may write, or give a DSN)"
            ) from exc
    return wrapper


@_typed_os_errors
def ensure_running(home: str | os.PathLike[str] | None = None,
                   host: str | None = None, timeout: float = START_TIMEOUT) -> Instance:
    """Start the embedded server under ``home`` if needed; return how to reach it.

    ``host`` is the loopback address to listen on (default 127.0.0.1, or the
    one the instance used before); a cluster node uses its bus address.
    Safe to call from many processes at once, and after any crash: see the
    module's invariants; ``timeout`` bounds the wait for a server to start
    or to finish its crash recovery. Does not apply migrations: the client
    does that (see :func:`pgq.migrate`).
    """
    directory = home_directory(home)
    _check_home_path(directory)
    private = _PRIVATE.set((directory / PRIVATE_MARK).exists())
    try:
        return _ensure_running(directory, host, timeout)
    finally:
        _PRIVATE.reset(private)


def _ensure_running(directory: Path, host: str | None, timeout: float) -> Instance:
    created = not directory.exists()  # before _locked makes it for its lock file
    with _locked(directory):
        instance = _read_instance(directory)
        if instance is not None and host is not None and host != instance.host \
                and _serving(directory / "data"):
            # Stopped, it starts on the new address (instance.json said the
            # old one for ever, and this refusal outlived `pgq embedded stop`).
            raise EmbeddedServerError(
                f"the server in {directory} listens on {instance.host}, not {host}: "
                "stop it first to move it")
        runner = _Runner(find_server_binaries(), _server_user())
        data, log = _prepare_directories(directory, runner, created)
        if not (data / "PG_VERSION").exists():
            instance = _initdb(directory, data, runner)
        elif instance is None:
            raise EmbeddedServerError(
                f"{data} exists but {directory / 'instance.json'} (its password) is "
                f"missing; stop any server using it and remove {directory} to start afresh"
            )
        _include_runtime_conf(data)
        address = host or instance.host
        if _allow_samehost(data, address) and _serving(data):
            runner.run("pg_ctl", "reload", "-D", str(data), "-s")  # the rule, for this server too
        deadline = time.monotonic() + timeout
        starting = not _serving(data)  # (under the lock: nobody else starts it meanwhile)
        postmaster = _our_postmaster(data, log, runner, instance, _listen_addresses(address),
                                     deadline)
        current = replace(instance, port=postmaster.port, host=address)
        # PGQ_EMBEDDED_PASSWORD changed since initdb (a new .env on an old
        # volume): it was ignored, and a client given the new one was
        # locked out. Taken at a start only: a process that merely attaches
        # to the running server (a Client without a DSN, `pgq migrate`) in a
        # shell with another value changed the live server's password under
        # the processes using it. instance.json first; the role follows it.
        wanted = _setting("PGQ_EMBEDDED_PASSWORD")
        follow = bool(wanted) and starting and current.admin_role is not None
        if follow and wanted != current.password:
            current = replace(current, password=wanted)  # type: ignore[arg-type]
        elif wanted and wanted != current.password:
            logger.warning("PGQ_EMBEDDED_PASSWORD differs from the running server's password; it "
                           "takes effect at the server's next start (`pgq embedded stop`)")
        if current != instance:
            _write_instance(directory, current)
        _verify_and_provision(current, postmaster, data, log, follow_password=follow)
        return current


@_typed_os_errors
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
        postmaster = read_postmaster(data)
        if postmaster is None:
            return False
        if _owns(postmaster, data) is False:
            (data / "postmaster.pid").unlink(missing_ok=True)  # a stale file: nothing runs
            return False
        runner = _Runner(find_server_binaries(), _server_user())
        done = runner.run("pg_ctl", "stop", "-D", str(data), "-m", mode, "-w",
                          "-t", str(START_TIMEOUT))
        if done.returncode != 0:
            if _owns(postmaster, data) is False:  # died meanwhile (and nobody reaped it)
                (data / "postmaster.pid").unlink(missing_ok=True)
                return True
            raise EmbeddedServerError(f"pg_ctl stop failed:\n{(done.stdout + done.stderr).strip()}")
        return True


@contextlib.contextmanager
def temporary_server(prefix: str = "pgq-", mode: str = "fast") -> Iterator[tuple[Instance, Path]]:
    """A private server in a new temporary directory, for tests and
    simulations: ``(instance, home)``; stopped (pg_ctl ``mode``) and the
    directory removed on exit, whatever happened inside. It ignores the
    ``PGQ_EMBEDDED_*`` variables (loopback, a free port, random passwords)."""
    home = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        # none of the user's PGQ_EMBEDDED_* settings, at this start or any later one
        (home / PRIVATE_MARK).write_text("a private server: PGQ_EMBEDDED_* do not apply\n")
        yield ensure_running(home), home
    finally:
        try:
            stop(home, mode)
        finally:
            shutil.rmtree(home, ignore_errors=True)


@_typed_os_errors
def status(home: str | os.PathLike[str] | None = None) -> dict[str, object]:
    """Describe the embedded server under ``home`` (never starts it). The DSN
    shown has its password masked (``Instance.dsn`` has it)."""
    from .dsn import redact

    directory = home_directory(home)
    data = directory / "data"
    postmaster = read_postmaster(data)
    running = postmaster is not None and _owns(postmaster, data) is not False
    instance = _read_instance(directory) if running else None
    return {
        "dsn": redact(replace(instance, port=postmaster.port).dsn)
        if instance is not None and postmaster is not None else None,
        "home": str(directory),
        "initialized": (data / "PG_VERSION").exists(),
        "running": running,
        "state": (postmaster.status or "starting") if running and postmaster else "stopped",
        "port": postmaster.port if running and postmaster else None,
        "log": str(directory / "log" / "postgres.log"),
    }
