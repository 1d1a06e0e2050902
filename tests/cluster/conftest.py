"""Multi-node fixtures: real node processes, each with its own PostgreSQL.

The session starts five embedded PostgreSQL servers, one per loopback
address 127.0.0.2 .. 127.0.0.6, and migrates a template database on each.
Every test gets fresh node databases cloned from those templates and real
``pgq node start`` processes whose bus listens on the same address as their
database. Everything a test starts is stopped at its end (SIGTERM, then
SIGKILL), and the servers at the end of the session.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest

import pgq
from pgq import embedded, ports

from ..conftest import wait_until

HOSTS = [f"127.0.0.{i}" for i in range(2, 7)]
TEMPLATE = "pgq_node_template"
_numbers = itertools.count()

pytestmark = pytest.mark.skipif(os.environ.get("PGQ_TEST_DOCKER") == "1",
                                reason="cluster tests run one embedded server per node")


def free_port(host: str) -> int:
    return ports.free_port(host)


@dataclass
class Server:
    host: str
    home: Path
    instance: embedded.Instance

    def dsn(self, database: str) -> str:
        return self.instance.dsn_for(database)

    def admin(self) -> psycopg.Connection:
        return psycopg.connect(self.instance.admin_dsn_for("postgres"), autocommit=True)


@pytest.fixture(scope="session")
def sim_databases(server):
    """Five node databases for the simulation, on the suite's server (reset
    before every run)."""
    from pgq.cluster.simulation import SimDatabases

    databases = SimDatabases(embedded.ensure_running(server.home), 5, prefix="pgqsim_suite")
    yield databases
    databases.close()


@pytest.fixture(scope="session")
def servers() -> Iterator[list[Server]]:
    root = Path(tempfile.mkdtemp(prefix="pgq-cluster-"))
    os.chmod(root, 0o711)  # the server user must traverse it
    started: list[Server] = []
    try:
        for host in HOSTS:
            home = root / host
            instance = embedded.ensure_running(home, host=host)
            started.append(Server(host, home, instance))
        for server in started:
            with server.admin() as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {TEMPLATE}")
            embedded.create_database(server.instance, TEMPLATE)
            pgq.migrate(server.dsn(TEMPLATE))
        yield started
    finally:
        for server in started:
            try:
                # immediate: their data goes with the directory, so no
                # shutdown checkpoint (a CI run's teardown of these took 16 s)
                embedded.stop(server.home, "immediate")
            except Exception:  # pragma: no cover - best effort cleanup
                pass
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Node:
    name: str
    server: Server
    database: str
    bus_port: int
    secret_file: Path
    log: Path
    joins: list[str] = field(default_factory=list)
    process: subprocess.Popen | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def dsn(self) -> str:
        return self.server.dsn(self.database)

    @property
    def bus(self) -> str:
        return f"{self.server.host}:{self.bus_port}"

    def start(self) -> None:
        args = [sys.executable, "-m", "pgq.cli", "node", "start", "--name", self.name,
                "--dsn", self.dsn, "--bus", self.bus, "--secret-file", str(self.secret_file)]
        for join in self.joins:
            args += ["--join", join]
        args += self.extra_args
        log = open(self.log, "a")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **self.env})
        log.close()
        wait_until(self.serving, 30, message=f"{self.name} to serve")

    def serving(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise AssertionError(f"{self.name} exited:\n{self.log.read_text()[-3000:]}")
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute("SELECT active, bus_port FROM pgq.cluster_state").fetchone()
        return bool(row and row[0] and row[1] == self.bus_port)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def id(self) -> str:
        with psycopg.connect(self.dsn) as conn:
            return conn.execute("SELECT pgq.meta_value('node_id')").fetchone()[0]

    def view(self) -> dict[str, str]:
        """node id -> status, as this node's database shows it."""
        with psycopg.connect(self.dsn) as conn:
            rows = conn.execute("SELECT id, status FROM pgq.cluster_nodes WHERE NOT myself").fetchall()
        return dict(rows)

    def sql(self, statement: str, params: object = None) -> list[tuple]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            cursor = conn.execute(statement, params)
            return cursor.fetchall() if cursor.description else []

    def client(self, **options: object) -> pgq.Client:
        return pgq.Client(self.dsn, **options)


class Cluster:
    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = nodes

    def __getitem__(self, index: int) -> Node:
        return self.nodes[index]

    def __iter__(self):
        return iter(self.nodes)

    def ids(self) -> dict[str, str]:
        return {n.name: n.id() for n in self.nodes}

    def wait_mesh(self, nodes: list[Node] | None = None, timeout: float = 30.0) -> None:
        members = nodes or [n for n in self.nodes if n.alive]
        ids = {n.id() for n in members}

        def meshed() -> bool:
            for node in members:
                view = node.view()
                if any(view.get(other) != "alive" for other in ids - {node.id()}):
                    return False
            return True

        wait_until(meshed, timeout, 0.2, "a full mesh")

    def holders(self, job_id: str) -> dict[str, str]:
        """node name -> state of its copy of the job ('acked' for a tombstone)."""
        found = {}
        for node in self.nodes:
            rows = node.sql("SELECT state FROM pgq.jobs WHERE id = %s UNION ALL "
                            "SELECT 'acked' FROM pgq.acks WHERE id = %s", (job_id, job_id))
            if rows:
                found[node.name] = rows[0][0]
        return found

    def copies(self, job_id: str) -> int:
        return sum(1 for state in self.holders(job_id).values() if state != "acked")


# Lines of each node's log a failed test shows (pytest_runtest_makereport).
LOG_TAIL_LINES = 40


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test shows the tail of each of its nodes' logs: a node that
    went wrong (a front that could not bind, a start that stalled) says so
    there, and the log is gone with the test's temporary directory."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    for node in getattr(item, "pgq_nodes", []):
        try:
            lines = node.log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        except OSError:
            continue
        report.sections.append((f"{node.name}'s log ({report.when})", "\n".join(lines)))


@pytest.fixture
def make_cluster(servers: list[Server], tmp_path: Path,
                 request: pytest.FixtureRequest) -> Iterator[Callable[..., Cluster]]:
    made: list[Node] = []
    request.node.pgq_nodes = made  # their logs, if the test fails
    secret = tmp_path / "cluster.secret"
    secret.write_text("test-cluster-secret-" + os.urandom(8).hex())

    def make(count: int = 3, mesh: bool = True, extra_args: list[str] | None = None,
             env: dict[str, str] | None = None,
             node_args: dict[int, list[str]] | None = None) -> Cluster:
        nodes = []
        for i in range(count):
            server = servers[i]
            database = f"pgq_node_{os.getpid()}_{next(_numbers)}"
            with server.admin() as conn:
                conn.execute(f"CREATE DATABASE {database} TEMPLATE {TEMPLATE}")
            # every database starts from the same template: give each node its own id
            with psycopg.connect(server.dsn(database), autocommit=True) as conn:
                conn.execute("UPDATE pgq.meta SET value = encode(sha256(random()::text::bytea), 'hex')::char(40) "
                             "WHERE key = 'node_id'")
            node = Node(f"n{i + 1}", server, database, free_port(server.host), secret,
                        tmp_path / f"n{i + 1}.log")
            if i > 0:
                node.joins = [nodes[0].bus]
            node.extra_args = [a.replace("{host}", server.host)
                               for a in (extra_args or []) + (node_args or {}).get(i, [])]
            node.env = env or {}
            nodes.append(node)
            made.append(node)
        for node in nodes:
            node.start()
        cluster = Cluster(nodes)
        if mesh:
            cluster.wait_mesh()
        return cluster

    yield make
    for node in made:
        node.kill(signal.SIGTERM)
    for node in made:
        try:
            with node.server.admin() as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {node.database} WITH (FORCE)")
        except psycopg.Error:
            pass
