"""Test helpers for projects that use pgq: a pytest plugin and a worker runner.

Installed with pgq (a ``pytest11`` entry point), the plugin gives tests:

* ``pgq_dsn``: a fresh, migrated database for this test only. The session
  starts one PostgreSQL server (pgq's embedded launcher, in a temporary
  directory removed at the end) or uses the server of ``PGQ_TEST_ADMIN_DSN``
  (a role that may create databases), migrates a template database once, and
  clones it for every test (``CREATE DATABASE ... TEMPLATE``: milliseconds).
  The database is dropped after the test.
* ``pgq_client``: a :class:`pgq.Client` on that database.

and :func:`run_jobs`, which runs the jobs queued for a :class:`pgq.Worker`
synchronously, in the test, until none is ready::

    def test_welcome_mail_is_sent(pgq_client):
        signup(pgq_client, "ada@example.com")          # adds a job
        stats = run_jobs(worker_of_my_app(pgq_client))
        assert stats.succeeded == 1

Fixtures are named ``pgq_*`` so that they never shadow a project's own.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

__all__ = ["TestServer", "run_jobs", "pgq_server", "pgq_dsn", "pgq_client"]

# The session's template database is this, then its own suffix: sessions
# sharing a server (pytest-xdist's workers, two CI jobs, a run after a
# killed one) each had "pgq_testing_template", and the second failed on
# it, or dropped it under the first's feet (found by a read-only review).
TEMPLATE = "pgq_testing_template"
_numbers = itertools.count()
_SESSION = f"{os.getpid()}_{uuid.uuid4().hex[:8]}"


@dataclass
class TestServer:
    """A PostgreSQL server whose databases the tests may create and drop."""

    __test__ = False  # not a test class, whatever pytest's name rules say

    admin_dsn: str  # a role that may create databases, on database 'postgres'
    home: Path | None = None  # embedded server directory (None: PGQ_TEST_ADMIN_DSN)
    template: str = TEMPLATE  # this session's migrated template database

    def dsn_for(self, database: str) -> str:
        """A URL, as the embedded server's (a key=value DSN here broke a
        project's `pgq_dsn.replace("postgresql://", ...)` in CI only)."""
        from psycopg.conninfo import conninfo_to_dict, make_conninfo

        from .dsn import libpq_url

        return libpq_url(make_conninfo("", **{**conninfo_to_dict(self.admin_dsn), "dbname": database}))

    def create(self, name: str, template: str | None = None) -> str:
        """A new database (from ``template``); its DSN."""
        if self.home is not None:
            from . import embedded

            instance = embedded.ensure_running(self.home)
            embedded.create_database(instance, name, template)
            return instance.dsn_for(name)
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
        return self.dsn_for(name)

    def drop(self, name: str) -> None:
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _start_server() -> Iterator[TestServer]:
    admin = os.environ.get("PGQ_TEST_ADMIN_DSN")
    if admin:
        yield TestServer(admin)
        return
    from . import embedded

    with embedded.temporary_server("pgq-testing-") as (instance, home):
        yield TestServer(instance.admin_dsn_for("postgres"), home)


@pytest.fixture(scope="session")
def pgq_server() -> Iterator[TestServer]:
    """The session's PostgreSQL server, with a migrated template database."""
    from .migrate import migrate

    for server in _start_server():
        server.template = f"{TEMPLATE}_{_SESSION}"
        try:
            migrate(server.create(server.template))
            yield server
        finally:
            server.drop(server.template)


@pytest.fixture
def pgq_dsn(pgq_server: TestServer) -> Iterator[str]:
    """A fresh, migrated database for this test only (dropped after it)."""
    name = f"pgq_testing_{_SESSION}_{next(_numbers)}"  # (a pid repeats across containers)
    dsn = pgq_server.create(name, pgq_server.template)
    try:
        yield dsn
    finally:
        pgq_server.drop(name)


@pytest.fixture
def pgq_client(pgq_dsn: str) -> Iterator[Any]:
    """A :class:`pgq.Client` on this test's database."""
    from .client import Client

    with Client(pgq_dsn) as client:
        yield client


def run_jobs(worker: Any) -> Any:
    """Run ``worker`` (a :class:`pgq.Worker`) in this thread until none of
    its queues has a job ready and none is running; the
    :class:`~pgq.worker.WorkerStats` of this run. Jobs not ready yet
    (delayed, or NACKed with a back-off after a failure) stay queued."""
    return worker.run(install_signal_handlers=False, until_empty=True)
