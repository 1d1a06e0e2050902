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


def test_any_language_examples_run_verbatim(dsn, tmp_path):
    """The "Any language" section: its `pgq serve` line started as written
    (on the suite's database through $PGQ_DSN), then its curl and pydisque
    blocks in order. Only the ports change, and only if another program
    holds them on this machine."""
    import socket

    from .cluster.conftest import free_port
    from .conftest import wait_until

    title = "Any language: Disque's protocol and an HTTP API"
    serve = section_code(title, "")[0].split("#")[0].split()
    assert serve[:2] == ["pgq", "serve"], serve
    ports = {}
    for wanted in ("7711", "8080"):
        with socket.socket() as probe:
            busy = probe.connect_ex(("127.0.0.1", int(wanted))) == 0
        ports[wanted] = str(free_port("127.0.0.1")) if busy else wanted

    def local(text: str) -> str:
        for wanted, port in ports.items():
            text = text.replace(f"127.0.0.1:{wanted}", f"127.0.0.1:{port}")
            text = text.replace(f"localhost:{wanted}", f"localhost:{port}")
        return text

    env = {**os.environ, "PGQ_DSN": dsn}
    command = [sys.executable, "-m", "pgq", *local(" ".join(serve[1:])).split()]
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def listening(port: str) -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", int(port))) == 0

    def up() -> bool:
        assert server.poll() is None, server.stdout.read().decode()
        return all(listening(port) for port in ports.values())

    try:
        wait_until(up, 60, message="pgq serve to listen")
        text = README.read_text()
        start = text.index(f"\n## {title}\n")
        section = text[start:text.find("\n## ", start + 1)]
        blocks = re.findall(r"```(bash|python)\n(.*?)```", section, re.S)
        assert [kind for kind, _ in blocks] == ["bash", "python", "bash"], blocks
        outputs = []
        for kind, code in blocks:
            run = ["bash", "-euo", "pipefail", "-c"] if kind == "bash" else [sys.executable, "-c"]
            done = subprocess.run([*run, local(code)], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, (code, done.stdout, done.stderr)
            outputs.append(done.stdout)
        assert '"acked":1' in outputs[0].replace(" ", "")  # the curl lease then ack
        assert "hello from pydisque" in outputs[1]  # pydisque got and acked its job
        invoices = re.findall(r'"ids":\["([^"]+)"\]', outputs[2])
        assert len(invoices) == 2 and invoices[0] == invoices[1]  # the key: one job, one ID
        with pgq.Client(dsn) as client:
            assert client.qlen("emails") == 0 and client.qlen("invoices") == 1
    finally:
        server.terminate()
        server.wait(20)
