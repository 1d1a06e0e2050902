"""pgq.testing, as a user's project meets it: the example of docs/testing.md
runs under pytest in a fresh process (the plugin loads from the installed
entry point), and run_jobs stops by itself once no job is ready."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pgq
from pgq.testing import run_jobs

DOC = Path(__file__).parents[1] / "docs" / "testing.md"


def _run_the_documented_example(tmp_path, env=None):
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    (tmp_path / "test_example.py").write_text(code)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tmp_path / "test_example.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env)


def test_the_documented_example_passes_as_written(tmp_path):
    done = _run_the_documented_example(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout


def test_sessions_sharing_an_admin_server_do_not_share_a_template(tmp_path, server):
    """With PGQ_TEST_ADMIN_DSN every session made "pgq_testing_template":
    a second session at once (pytest-xdist, two CI jobs), or any after one
    that was killed before its teardown, failed on it, or dropped it while
    another cloned it (found by a read-only review). A template left by a
    killed session stands in for the other session here."""
    import os

    import psycopg

    with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS pgq_testing_template WITH (FORCE)")
        conn.execute("CREATE DATABASE pgq_testing_template")
    try:
        done = _run_the_documented_example(tmp_path, {**os.environ, "PGQ_TEST_ADMIN_DSN": server.admin_dsn})
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
        assert "2 passed" in done.stdout
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:  # its own is gone
            left = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'pgq_testing%'").fetchall()
        assert left == [("pgq_testing_template",)]
    finally:
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            conn.execute("DROP DATABASE IF EXISTS pgq_testing_template WITH (FORCE)")


def test_run_jobs_runs_what_is_ready_and_leaves_the_rest(client):
    client.add_jobs("rj", [b"ok", b"ok", b"fail"], retry=60)
    later = client.add_job("rj", b"later", delay=60)
    seen = []
    worker = pgq.Worker(client, concurrency=2)

    @worker.task("rj", backoff=30)
    def handle(job):
        seen.append(job.body)
        if job.body == b"fail":
            raise RuntimeError("planned")

    stats = run_jobs(worker)
    assert sorted(seen) == [b"fail", b"ok", b"ok"]
    assert (stats.succeeded, stats.failed) == (2, 1)
    # the failed one waits for its back-off, the delayed one for its delay
    assert client.qlen("rj") == 0 and client.show(later)["state"] == "active"
