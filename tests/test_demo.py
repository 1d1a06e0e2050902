"""`make demo` runs `python -m pgq.demo`: here in a short mode, asserting lost = 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.skipif(os.environ.get("PGQ_TEST_DOCKER") == "1", reason="the demo runs its own server")
def test_demo_crashes_postgres_and_loses_nothing():
    done = subprocess.run([sys.executable, "-m", "pgq.demo", "--jobs", "3000"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = dict(line.split(None, 1) for line in done.stdout.splitlines()
                 if line.startswith("  ") and "  " in line.strip())
    assert lines["lost"].strip() == "0"
    assert lines["jobs"].split()[-1] == "3000"
    assert "crash+restart" in done.stdout
    assert "removed its files" in done.stdout
