"""Test fixtures: real PostgreSQL servers, one fresh database per test.

The default backend is pgq's own embedded launcher: the suite starts one
PostgreSQL instance under a temporary ``PGQ_HOME`` (as the ``postgres`` user
when the suite runs as root), migrates a template database once, and gives
every test its own database cloned from it (about 20 ms). The server is
stopped and its directory removed at the end of the session.

``PGQ_TEST_DOCKER=1`` (with a Docker engine) uses a testcontainers PostgreSQL
instead; tests that need to stop and restart the server itself are skipped
there.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

import pgq
from pgq import embedded

TEMPLATE = "pgq_template"
_numbers = itertools.count()


@dataclass
class Server:
    """A PostgreSQL server the tests may use (and, if embedded, restart)."""

    admin_dsn: str  # superuser DSN on database 'postgres'
    url_for: object  # callable: database name -> DSN
    home: Path | None  # embedded server directory, None for docker

    def dsn(self, database: str) -> str:
        return self.url_for(database)  # type: ignore[operator,no-any-return]

    @property
    def restartable(self) -> bool:
        return self.home is not None

    def create_database(self, name: str, template: str | None = None) -> None:
        """A new database pgq's role can migrate and use (dropped first if it exists)."""
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            if self.home is None:
                conn.execute(f"CREATE DATABASE {name}" + (f" TEMPLATE {template}" if template else ""))
                return
        embedded.create_database(embedded.ensure_running(self.home), name, template)

    def stop(self, mode: str = "fast") -> None:
        assert self.home is not None
        embedded.stop(self.home, mode)

    def start(self) -> None:
        assert self.home is not None
        embedded.ensure_running(self.home)


def _docker_server() -> Iterator[Server]:
    from testcontainers.postgres import PostgresContainer

    with PostgresContainer("postgres:16", driver=None) as container:
        base = container.get_connection_url()

        def url_for(database: str) -> str:
            return base.rsplit("/", 1)[0] + "/" + database

        yield Server(url_for("postgres"), url_for, None)


def _embedded_server() -> Iterator[Server]:
    # immediate stop at the end: the data goes with the directory
    with embedded.temporary_server("pgq-test-", "immediate") as (instance, home):
        yield Server(instance.admin_dsn_for("postgres"), instance.dsn_for, home)


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    """One real PostgreSQL server for the whole session, with a migrated template."""
    use_docker = os.environ.get("PGQ_TEST_DOCKER") == "1"
    servers = _docker_server() if use_docker else _embedded_server()
    srv = next(servers)
    try:
        srv.create_database(TEMPLATE)  # pgq's role owns the pgq schemas there, nothing more
        pgq.migrate(srv.dsn(TEMPLATE))
        yield srv
    finally:
        servers.close()


@pytest.fixture
def dsn(server: Server) -> Iterator[str]:
    """A fresh, migrated database for this test only."""
    name = f"pgq_test_{os.getpid()}_{next(_numbers)}"
    with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
    try:
        yield server.dsn(name)
    finally:
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def client(dsn: str) -> Iterator[pgq.Client]:
    with pgq.Client(dsn) as c:
        yield c


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection]:
    """An autocommit connection to the test database, for assertions in SQL."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn


def counters_match_jobs(conn: psycopg.Connection) -> bool:
    """The trigger-maintained counters equal a full count of the jobs table."""
    kept = conn.execute("""
        SELECT queue, sum(queued), sum(active), sum(waiting) FROM pgq.queue_counters
        GROUP BY queue HAVING sum(queued) <> 0 OR sum(active) <> 0 OR sum(waiting) <> 0
        ORDER BY queue""").fetchall()
    counted = conn.execute("""
        SELECT queue, count(*) FILTER (WHERE state = 'queued'),
               count(*) FILTER (WHERE state = 'active'), count(*) FILTER (WHERE state = 'wait-repl')
        FROM pgq.jobs GROUP BY queue ORDER BY queue""").fetchall()
    return [tuple(int(x) if not isinstance(x, str) else x for x in r) for r in kept] == \
           [tuple(int(x) if not isinstance(x, str) else x for x in r) for r in counted]


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One local SparkSession (2 cores, quiet, no UI) for every Spark test."""
    from pgq.spark import spark_session

    scratch = tmp_path_factory.mktemp("spark")
    session = spark_session("local[2]", app_name="pgq-tests", config={
        "spark.local.dir": str(scratch / "local"),
        "spark.sql.warehouse.dir": str(scratch / "warehouse"),
        "spark.driver.memory": "1g",
    })
    try:
        yield session
    finally:
        session.stop()


def wait_until(predicate: Callable[[], object], timeout: float = 20.0, every: float = 0.1,
               message: str = "condition") -> object:
    """Poll ``predicate`` until it returns something true (returned), or
    fail after ``timeout`` seconds: how tests wait for a condition."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {message}")
        time.sleep(every)




class TableLock:
    """Another session holding ``LOCK TABLE <table> IN ACCESS EXCLUSIVE MODE``
    (as a migration or VACUUM FULL does), from a thread, for at most 20 s:
    a regression fails, it does not hang. :meth:`take` returns once the lock
    is held; :meth:`release` lets it go and waits for the thread."""

    def __init__(self, dsn: str, table: str) -> None:
        import threading

        self.dsn, self.table = dsn, table
        self.locked, self.released = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._hold, daemon=True)

    def _hold(self) -> None:
        with psycopg.connect(self.dsn) as admin:
            admin.execute(f"LOCK TABLE {self.table} IN ACCESS EXCLUSIVE MODE")
            self.locked.set()
            self.released.wait(20)

    def take(self) -> None:
        self.thread.start()
        assert self.locked.wait(10), f"{self.table} locked"

    def release(self) -> None:
        self.released.set()
        if self.thread.is_alive():
            self.thread.join(30)


async def async_wait_until(predicate: Callable[[], Awaitable[object]], timeout: float = 20.0,
                           every: float = 0.05) -> object:
    """:func:`wait_until` for async tests: polls an awaitable predicate (a
    database's state has no event to wait on); TimeoutError after ``timeout``."""
    import anyio

    with anyio.fail_after(timeout):
        while not (value := await predicate()):  # noqa: ASYNC110 - polling a database
            await anyio.sleep(every)
    return value
