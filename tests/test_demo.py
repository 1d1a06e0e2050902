"""`make demo` runs `python -m pgq.demo` (a 3-node cluster with a node killed
halfway): here in a short mode, asserting lost = 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


@pytest.mark.skipif(os.environ.get("PGQ_TEST_DOCKER") == "1", reason="the demo runs its own servers")
def test_demo_kills_a_node_and_loses_nothing():
    done = subprocess.run([sys.executable, "-m", "pgq.demo", "--jobs", "1500"],
                          capture_output=True, text=True, timeout=180)
    out = done.stdout.replace("\r", "\n")
    assert done.returncode == 0, out + done.stderr
    assert re.search(r"^  lost +0$", out, re.M), out
    assert re.search(r"^  jobs added +1500 ", out, re.M), out
    assert re.search(r"^  detection +\d+\.\d s", out, re.M), out
    assert re.search(r"^  throughput +[\d,]+ jobs/s end to end \(every job delivered ", out, re.M), out
    assert "kill -9 n3's node process" in out
    assert "removed its files" in out
