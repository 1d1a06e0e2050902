"""The README's quick start runs verbatim: its Python blocks, in order, in a
fresh process with no DSN (so on the embedded server, in a home of its own)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg

import pgq
from pgq import embedded

README = Path(__file__).resolve().parent.parent / "README.md"


def section_code(title: str, language: str = "python") -> list[str]:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(rf"```{language}\n(.*?)```", text[start:end if end > 0 else None], re.S)


def test_quick_start_runs_verbatim(tmp_path):
    # the embedded server runs as the postgres user when we are root: its home
    # must be reachable by it (pytest's tmp_path is private)
    home = Path(tempfile.mkdtemp(prefix="pgq-readme-"))
    home.chmod(0o755)
    blocks = section_code("Quick start")
    assert len(blocks) == 3, "the quick start has its three examples"
    script = "\n".join(blocks) + "\nprint('DSN', client.dsn)\n"
    env = {k: v for k, v in os.environ.items() if k != "PGQ_DSN"}
    env["PGQ_HOME"] = str(home)
    try:
        done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        dsn = next(line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("DSN "))
        assert 'b\'{"to": "ada@example.com"}\'' in done.stdout  # the first block printed its job
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT status FROM orders WHERE id = 42").fetchone() == ("shipped",)
        with pgq.Client(dsn) as client:
            assert client.qlen("ship") == 0 and client.qlen("emails") == 0
    finally:
        embedded.stop(home)
        shutil.rmtree(home, ignore_errors=True)
