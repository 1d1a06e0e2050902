"""A raw RESP2 client for the bench's RESP rows: many connections, each a
closed loop with one request in flight (no pipelining), driven from one
process; plus starting ``pgq serve --resp`` and waiting until it answers.

One asyncio event loop drives every connection, with ``asyncio.Protocol``
callbacks (no coroutine, no thread per request): a reply costs the client a
few microseconds in one thread. Threads with blocking sockets (as
``common.closed_loop`` does for the Python client) would hand the GIL over
and wake a thread (a futex and a context switch) on every reply; with 50
connections on a 2-core machine shared with the server and PostgreSQL, the
client itself would then become the bottleneck. Each result says how much
of one core the client used (``client_cpu``), to show it was not.

No pgq import: the server runs in its own process (``python -m pgq.cli``).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pgq import ports

from .common import percentiles

HOST = "127.0.0.1"

# One operation of a closed loop: a generator that yields a command (bytes)
# and receives its reply, until it returns (the operation is done).
Operation = Generator[bytes, Any, None]


class ReplyError(Exception):
    """The server answered ``-ERR ...`` (or another error prefix)."""


def command(*args: bytes | str | int) -> bytes:
    """One command as a RESP array of bulk strings."""
    parts = [a if isinstance(a, bytes) else str(a).encode() for a in args]
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def parse(buffer: bytes | bytearray, pos: int = 0) -> tuple[Any, int] | None:
    """The reply starting at ``pos`` and the position after it, or None if
    ``buffer`` does not hold all of it yet. Status replies come as str,
    errors as ReplyError, null bulks and null arrays as None."""
    end = buffer.find(b"\r\n", pos)
    if end < 0:
        return None
    kind, line, after = buffer[pos:pos + 1], bytes(buffer[pos + 1:end]), end + 2
    if kind == b"+":
        return line.decode(), after
    if kind == b"-":
        return ReplyError(line.decode(errors="replace")), after
    if kind == b":":
        return int(line), after
    if kind == b"$":
        return _bulk(buffer, int(line), after)
    if kind == b"*":
        return _array(buffer, int(line), after)
    raise ValueError(f"not a RESP reply: {bytes(buffer[pos:end])!r}")


def _bulk(buffer: bytes | bytearray, size: int, pos: int) -> tuple[Any, int] | None:
    if size < 0:
        return None, pos
    if len(buffer) < pos + size + 2:
        return None
    return bytes(buffer[pos:pos + size]), pos + size + 2


def _array(buffer: bytes | bytearray, count: int, pos: int) -> tuple[Any, int] | None:
    if count < 0:
        return None, pos
    items = []
    for _ in range(count):
        parsed = parse(buffer, pos)
        if parsed is None:
            return None
        item, pos = parsed
        items.append(item)
    return items, pos


# ------------------------------------------------------------ operations

def add(queue: str, body: bytes, replicate: int | None = None) -> Callable[[], Operation]:
    """ADDJOB queue body 0 [REPLICATE n]: a durable add (its reply comes
    after the commit, on every copy's database for REPLICATE n)."""
    extra: tuple[bytes | str | int, ...] = ("REPLICATE", replicate) if replicate else ()
    request = command("ADDJOB", queue, body, 0, *extra)

    def operation() -> Operation:
        yield request

    return operation


def get_ack(queue: str) -> Callable[[], Operation]:
    """GETJOB NOHANG FROM queue, then ACKJOB of the job it got: two round
    trips, one after the other."""
    request = command("GETJOB", "NOHANG", "FROM", queue)

    def operation() -> Operation:
        jobs = yield request
        if not jobs:
            raise RuntimeError("the queue ran dry: prefill more")
        yield command("ACKJOB", jobs[0][1])

    return operation


# ------------------------------------------------------------ closed loop

# A reply parser: (reply, bytes used) once the buffer holds a whole reply.
Parse = Callable[[bytearray], "tuple[Any, int] | None"]


class _Connection(asyncio.Protocol):
    """One connection's closed loop: an operation at a time until ``stop``."""

    def __init__(self, operation: Callable[[], Operation], done: asyncio.Future[None],
                 parse_reply: Parse) -> None:
        self.operation, self.done, self.parse_reply = operation, done, parse_reply
        self.latencies: list[float] = []
        self.buffer = bytearray()
        self.stop = 0.0
        self.began = 0.0
        self.current: Operation | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def begin(self, stop: float) -> None:
        self.stop = stop
        self._next()

    def _next(self) -> None:
        self.began = time.perf_counter()
        if self.began >= self.stop:
            self._finish(None)
            return
        self.current = self.operation()
        self._send(next(self.current))

    def _send(self, request: bytes) -> None:
        assert self.transport is not None
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        parsed = self.parse_reply(self.buffer)
        if parsed is None:
            return
        reply, used = parsed
        if used != len(self.buffer):  # one request in flight: one reply at a time
            self._finish(RuntimeError(f"unexpected bytes after a reply: {bytes(self.buffer[used:])!r}"))
            return
        self.buffer.clear()
        self._reply(reply)

    def _reply(self, reply: Any) -> None:
        if isinstance(reply, ReplyError):
            self._finish(reply)
            return
        assert self.current is not None
        try:
            self._send(self.current.send(reply))
        except StopIteration:
            self.latencies.append(time.perf_counter() - self.began)
            self._next()
        except Exception as exc:  # the operation refused the reply
            self._finish(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(exc or ConnectionError("the server closed the connection"))

    def _finish(self, exc: BaseException | None) -> None:
        if self.done.done():
            return
        if exc is None:
            self.done.set_result(None)
        else:
            self.done.set_exception(exc)


async def _drive(port: int, connections: int, seconds: float,
                 operation: Callable[[], Operation], parse_reply: Parse) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    made: list[_Connection] = []
    try:
        for _ in range(connections):  # all connected before the clock starts
            done: asyncio.Future[None] = loop.create_future()
            _, protocol = await loop.create_connection(
                lambda d=done: _Connection(operation, d, parse_reply), HOST, port)
            made.append(protocol)
        cpu, began = time.process_time(), time.perf_counter()
        for protocol in made:
            protocol.begin(began + seconds)
        await asyncio.gather(*(p.done for p in made))
        elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu
    finally:
        for protocol in made:
            if protocol.transport is not None:
                protocol.transport.close()
    flat = [x for p in made for x in p.latencies]
    return {"jobs": len(flat), "seconds": elapsed, "client_cpu": cpu / elapsed, **percentiles(flat)}


def closed_loop(port: int, connections: int, seconds: float,
                operation: Callable[[], Operation], parse_reply: Parse = parse) -> dict[str, Any]:
    """``connections`` connections to ``HOST:port``, each running
    ``operation`` again and again, one request in flight, for ``seconds``:
    the count, the time, the client's CPU share and the latency of one
    operation (p50/p99). Replies are RESP unless ``parse_reply`` says
    otherwise (:mod:`.http_client`)."""
    return asyncio.run(_drive(port, connections, seconds, operation, parse_reply))


# ------------------------------------------------------------ the server

def free_port() -> int:
    return ports.free_port(HOST)


def answers_ping(port: int) -> bool:
    """Does ``HOST:port`` answer PING with PONG?"""
    try:
        with socket.create_connection((HOST, port), timeout=5) as sock:
            sock.sendall(command("PING"))
            reply = b""
            while not reply.endswith(b"\r\n"):
                chunk = sock.recv(64)
                if not chunk:
                    return False
                reply += chunk
            return reply == b"+PONG\r\n"
    except OSError:
        return False


def wait_answering(port: int, ended: Callable[[float], bool], timeout: float = 90,
                   answers: Callable[[int], bool] = answers_ping) -> None:
    """Wait until the server on ``port`` answers (PING, or ``answers``).
    ``ended(t)`` waits up to ``t`` seconds for the server's process to end
    and says whether it did (then this raises at once, instead of waiting
    out ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not answers(port):
        if ended(0.05):
            raise RuntimeError(f"the server on port {port} exited before it answered")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server on port {port} did not answer in {timeout:g} s")


def exited(process: subprocess.Popen[bytes]) -> Callable[[float], bool]:
    """For wait_answering: waits up to t seconds for ``process`` to end; did it?"""
    def wait(seconds: float) -> bool:
        try:
            process.wait(seconds)
            return True
        except subprocess.TimeoutExpired:
            return False

    return wait


def served(dsn: str, connections: int, seconds: float, operation: Callable[[], Operation],
           front: str = "resp", parse_reply: Parse = parse,
           answers: Callable[[int], bool] = answers_ping) -> dict[str, Any]:
    """:func:`closed_loop` against ``pgq serve --resp`` (or ``--http``:
    ``front``) on ``dsn``, with the share of one core the server process
    used meanwhile (``server_cpu``; None where /proc is not there)."""
    with serving(dsn, front, answers) as (port, pid):
        cpu, began = cpu_seconds(pid), time.perf_counter()
        result = closed_loop(port, connections, seconds, operation, parse_reply)
        used, elapsed = cpu_seconds(pid), time.perf_counter() - began
    share = None if cpu is None or used is None else (used - cpu) / elapsed
    return {**result, "server_cpu": share}


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) of process ``pid`` so far, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def serving(dsn: str, front: str = "resp",
            answers: Callable[[int], bool] = answers_ping) -> Iterator[tuple[int, int]]:
    """``pgq serve --resp`` (or ``--http``) on ``dsn`` in its own process,
    answering on the port this yields (with the process id); terminated
    (and waited for) on the way out."""
    port = free_port()
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen([sys.executable, "-m", "pgq.cli", "serve", "--dsn", dsn,
                                    f"--{front}", f"{HOST}:{port}"], stdout=log,
                                   stderr=subprocess.STDOUT)
        try:
            try:
                wait_answering(port, exited(process), answers=answers)
            except (RuntimeError, TimeoutError) as exc:
                log.seek(0)
                raise RuntimeError(f"{exc}: {log.read()[-300:].decode(errors='replace')}") from None
            yield port, process.pid
        finally:
            stop(process)


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not ended within 10 s; reaped either way."""
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
