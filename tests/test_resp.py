"""Disque's client protocol (pgq serve --resp) through a raw RESP client
against a real server process: replies and error prefixes as Disque's,
pipelining, AUTH; and the parser and encoder alone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import psycopg
import pytest

from pgq.resp import NULL_ARRAY, Error, Parser, ProtocolError, Status, encode

from .cluster.conftest import free_port
from .conftest import wait_until

SECRET = "resp-secret"


class Resp:
    """A raw RESP2 client: commands as arrays of bulk strings, replies parsed."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def send(self, *args: bytes | str | int) -> None:
        parts = [a if isinstance(a, bytes) else str(a).encode() for a in args]
        self.sock.sendall(b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p)
                                                             for p in parts))

    def call(self, *args: bytes | str | int):
        self.send(*args)
        return self.reply()

    def _line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            chunk = self.sock.recv(65536)
            assert chunk, "connection closed"
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\r\n", 1)
        return line

    def reply(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return Status(rest.decode())
        if kind == b"-":
            return Error(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return None
            while len(self.buffer) < size + 2:
                self.buffer += self.sock.recv(65536)
            data, self.buffer = self.buffer[:size], self.buffer[size + 2:]
            return data
        if kind == b"*":
            count = int(rest)
            return NULL_ARRAY if count < 0 else [self.reply() for _ in range(count)]
        raise AssertionError(f"not RESP: {line!r}")


def start_server(dsn, tmp_path, secret: str | None, env=None, files: int | None = None,
                 extra: tuple[str, ...] = ()):
    """`pgq serve --resp` (``files``: its open-files limit, soft and hard)."""
    port = free_port("127.0.0.1")
    command = [sys.executable, "-m", "pgq", "serve", "--resp", f"127.0.0.1:{port}", "--dsn", dsn,
               *extra]
    if secret:
        (tmp_path / "secret").write_text(secret)
        command += ["--token-file", str(tmp_path / "secret")]

    def limited() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))

    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env=None if env is None else {**os.environ, **env},
                               preexec_fn=limited if files else None)

    def up():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            assert process.poll() is None, process.stdout.read().decode()
            return False

    try:
        wait_until(up, 30, message="the RESP port to accept")
    except BaseException:
        process.kill()
        process.wait(20)
        raise
    return process, port


@pytest.fixture
def resp(dsn, tmp_path):
    process, port = start_server(dsn, tmp_path, SECRET)

    clients = []

    def connect(auth: bool = True) -> Resp:
        client = Resp(port)
        clients.append(client)
        if auth:
            assert client.call("AUTH", SECRET) == Status("OK")
        return client

    try:
        yield connect
    finally:
        for client in clients:
            client.close()
        process.terminate()
        process.wait(20)


def test_connections_past_maxclients_are_refused_as_disque_refuses_them(dsn, tmp_path):
    """Each connection may buffer a request of up to a GiB: without a cap,
    a client could open connections until the server's memory ran out."""
    process, port = start_server(dsn, tmp_path, None, env={"PGQ_RESP_MAX_CLIENTS": "2"})
    clients = []
    try:
        # (the probe of start_server may still count for a moment: wait until two serve)
        def two_served() -> bool:
            for client in clients:
                client.close()
            clients[:] = [Resp(port), Resp(port)]
            return all(c.call("PING") == Status("PONG") for c in clients)

        wait_until(two_served, 30, message="two connections to be served")
        third = Resp(port)
        assert third.reply() == Error("ERR max number of clients reached")
        assert third.sock.recv(1) == b""  # closed by the server
        third.close()
        assert clients[0].call("CONFIG", "GET", "maxclients") == [b"maxclients", b"2"]
        clients.pop().close()  # room again, once the server saw it go

        def served() -> bool:
            other = Resp(port)
            try:
                return other.call("PING") == Status("PONG")
            except AssertionError:  # refused: the close not seen yet
                return False
            finally:
                other.close()

        wait_until(served, 30, message="a connection to be served after one closed")
    finally:
        for client in clients:
            client.close()
        process.terminate()
        process.wait(20)


def test_maxclients_fits_the_open_files_limit_and_a_shortage_is_waited_out(dsn, tmp_path):
    """With the common limit of 1,024 open files and maxclients 10,000, the
    1,025th descriptor made accept() fail, and that ended the server. The cap
    now fits the limit, as Redis's does, and a shortage of descriptors (here
    taken by the HTTP API's connections in the same process) is waited out."""
    http = free_port("127.0.0.1")
    process, port = start_server(dsn, tmp_path, None, files=100,
                                 extra=("--http", f"127.0.0.1:{http}"))
    held: list[socket.socket] = []
    try:
        first = Resp(port)
        assert first.call("CONFIG", "GET", "maxclients") == [b"maxclients", b"36"]  # 100 - 64
        # HTTP connections, each answered (so accepted), until one is not:
        # the process has no descriptor left.
        for _ in range(100):
            held.append(socket.create_connection(("127.0.0.1", http), timeout=5))
            held[-1].sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            try:
                # 2 s: an answer on this machine takes milliseconds
                held[-1].settimeout(2)
                assert held[-1].recv(12) == b"HTTP/1.1 200"
            except (TimeoutError, ConnectionResetError):  # not accepted, or closed at once
                break
        else:
            raise AssertionError("100 connections were all served: no shortage to wait out")
        waiting = Resp(port)  # in the listen backlog: accept() fails with EMFILE meanwhile
        waiting.sock.sendall(b"PING\r\n")
        for sock in held:
            sock.close()
        assert waiting.reply() == Status("PONG")  # accepted once descriptors were free
        assert first.call("PING") == Status("PONG") and process.poll() is None
    finally:
        for sock in held:
            sock.close()
        process.terminate()
        out = process.communicate(timeout=20)[0].decode()
    assert "at most 36 clients, not 10000" in out and "Traceback" not in out, out


def test_the_job_commands_reply_as_disque(resp):
    r = resp()
    assert r.call("PING") == Status("PONG")
    added = r.call("ADDJOB", "emails", "hello", 0, "RETRY", 30)
    assert isinstance(added, Status) and added.text.startswith("D-") and len(added.text) == 40
    job = added.text
    assert r.call("QLEN", "emails") == 1
    assert r.call("QPEEK", "emails", 1) == [[b"emails", job.encode(), b"hello"]]
    got = r.call("GETJOB", "COUNT", 5, "WITHCOUNTERS", "FROM", "nothing", "emails")
    assert got == [[b"emails", job.encode(), b"hello", b"nacks", 0, b"additional-deliveries", 0]]
    assert r.call("GETJOB", "NOHANG", "FROM", "emails") is NULL_ARRAY
    assert r.call("WORKING", job) == 30
    show = r.call("SHOW", job)
    fields = dict(zip(show[::2], show[1::2], strict=True))
    assert len(show) == 30 and fields[b"state"] == b"active" and fields[b"body"] == b"hello"
    assert r.call("NACK", job) == 1 and r.call("QLEN", "emails") == 1
    assert r.call("DEQUEUE", job) == 1 and r.call("ENQUEUE", job) == 1
    assert r.call("ACKJOB", job) == 1 and r.call("ACKJOB", job) == 0
    assert r.call("ACKJOB") == 0  # arity -1: no ID is fine
    # Acknowledged on a lone node: Disque frees the job at once, and its
    # clients read a null SHOW as "done" (pgq keeps a tombstone for a while).
    assert r.call("SHOW", job) is None
    other = r.call("ADDJOB", "emails", "bye", 0).text
    assert r.call("FASTACK", other) == 1 and r.call("DELJOB", other) == 0
    assert r.call("PAUSE", "emails", "in") == Status("in")
    assert r.call("ADDJOB", "emails", "x", 0).text.startswith("PAUSED ")
    assert r.call("PAUSE", "emails", "none") == Status("none")
    stat = r.call("QSTAT", "emails")
    assert stat[0::2][:3] == [b"name", b"len", b"age"] and stat[1] == b"emails"
    assert r.call("QSTAT", "never-seen") is NULL_ARRAY
    hello = r.call("HELLO")
    assert hello[0] == 1 and len(hello) >= 3


def test_scans_and_cluster_introspection(resp):
    r = resp()
    ids = [r.call("ADDJOB", q, "x", 0).text for q in ("sa", "sb", "sb")]
    cursor, queues = r.call("QSCAN", "COUNT", 10)
    assert cursor == b"0" and sorted(queues) == [b"sa", b"sb"]
    assert r.call("QSCAN", "MINLEN", 2)[1] == [b"sb"]
    cursor, jobs = r.call("JSCAN", "0", "QUEUE", "sb", "STATE", "queued")
    assert cursor == b"0" and sorted(j.text for j in jobs) == sorted(ids[1:])
    # case-blind, as Disque's strcasecmp (STATE QUEUED was refused)
    assert sorted(j.text for j in r.call("JSCAN", "QUEUE", "sb", "STATE", "QUEUED")[1]) == sorted(ids[1:])
    _, full = r.call("JSCAN", "REPLY", "all", "QUEUE", "sa")
    assert full[0][:2] == [b"id", ids[0].encode()] and len(full[0]) == 30
    assert r.call("JSCAN", "REPLY", "nope") == Error("ERR Invalid REPLY type, try ID or ALL")
    myid = r.call("CLUSTER", "MYID")  # a bulk string, as Disque's
    assert isinstance(myid, bytes) and len(myid) == 40 and myid in r.call("CLUSTER", "NODES")
    assert r.call("CLUSTER", "LEAVING") == Status("no")
    assert r.call("QSCAN", "1", "2") == Error("ERR syntax error")  # a second bare number
    # BUSYLOOP: every page in one reply (it was accepted and ignored: one page
    # of COUNT 1); MAXLEN -1 is no bound (it left out every queue).
    assert r.call("QSCAN", "COUNT", 1, "BUSYLOOP") == [b"0", [b"sa", b"sb"]]
    assert sorted(r.call("QSCAN", "COUNT", 10, "MAXLEN", -1)[1]) == [b"sa", b"sb"]
    assert r.call("QPEEK", "sa", 0) == []  # Disque: nothing to peek
    # A cursor past the first page encodes a job ID (hundreds of bits): read
    # as a 64-bit number, it was refused and no client could page on.
    cursor, seen = b"", []
    while cursor != b"0":
        cursor, page = r.call("JSCAN", *([cursor] if cursor else []), "COUNT", 1, "QUEUE", "sb")
        assert len(page) <= 1
        seen += [j.text for j in page]
    assert sorted(seen) == sorted(ids[1:])
    # JSCAN BUSYLOOP: every page in one reply (it gave one page of COUNT).
    assert r.call("JSCAN", "COUNT", 1, "BUSYLOOP", "QUEUE", "sb")[0] == b"0"
    assert sorted(j.text for j in r.call("JSCAN", "COUNT", 1, "BUSYLOOP", "QUEUE", "sb")[1]) \
        == sorted(ids[1:])
    # A dummy ACK (an unknown at-least-once ID acknowledged) is no job: JSCAN skips it.
    dummy = "D-00000000-++++++++++++++++++++++++-0001"
    assert r.call("ACKJOB", dummy) == 0
    assert dummy.encode() not in [j.text.encode() for j in r.call("JSCAN", "STATE", "acked")[1]]


def test_errors_have_disques_prefixes(resp):
    r = resp()
    assert r.call("SHOW", "not-an-id") == Error("BADID Invalid Job ID format.")
    assert r.call("ACKJOB", "D-00000000-++++++++++++++++++++++++-0001", "bad") \
        == Error("BADID Invalid Job ID format.")
    assert r.call("WORKING", "D-00000000-++++++++++++++++++++++++-0001") \
        == Error("NOJOB Job not known in the context of this node.")
    # An ID that is not even UTF-8 is a bad ID too (it was a syntax error).
    for command in ("SHOW", "ACKJOB", "FASTACK", "NACK", "WORKING", "DELJOB", "WAITJOB"):
        assert r.call(command, b"D-\xff\xfe") == Error("BADID Invalid Job ID format."), command
    assert r.call("ADDJOB", "q", "x", -1) == Error("ERR timeout is negative")
    # Integers beyond 64 bits: an error reply, not an OverflowError inside.
    assert r.call("ADDJOB", "q", "x", "9" * 400) == Error("ERR timeout is not an integer or out of range")
    assert r.call("GETJOB", "TIMEOUT", "9" * 400, "FROM", "q") \
        == Error("ERR TIMEOUT is not an integer or out of range")
    assert r.call("QSCAN", "9" * 5000) == Error("ERR cursor is not an integer or out of range")
    assert r.call("ADDJOB", "q", "x", 0, "BOGUS", 1) == Error("ERR syntax error")
    assert r.call("GETJOB", "emails") == Error("ERR syntax error")
    for command in ("GETJOB", "CLUSTER", "CONFIG", "DEBUG"):  # Disque's arity -2
        assert r.call(command) == Error(f"ERR wrong number of arguments for '{command.lower()}' command")
    assert b"registered_queues:" in r.call("INFO")
    assert r.call("GETJOB", "COUNT", 0, "FROM", "q") == Error("ERR COUNT must be a number greater than zero")
    assert r.call("NOSUCH").text.startswith("ERR unknown command")
    # At most 128 characters of an unknown name come back, as from Redis
    # (a 64 MiB name echoed whole held the event loop for seconds).
    assert r.call("X" * 10_000) == Error(f"ERR unknown command '{'x' * 128}'")
    # A message of several lines is one reply line (each CR and LF a
    # space): a lone LF ended the line early for redigo, goware/disque's
    # RESP library, which then dropped the connection.
    assert r.call("DEBUG", "ERROR", "ERR a\nb\rc") == Error("ERR a b c")
    assert r.call("ADDJOB", "q", "x", 0, "MAXLEN", 0) == Error("ERR MAXLEN must be a positive number")
    # ADDJOB's and GETJOB's checks in Disque's words (src/job.c, queue.c)
    for options, error in [
        (("REPLICATE", 0), "ERR REPLICATE must be between 1 and 65535"),
        (("DELAY", -1), "ERR DELAY time must be a non negative number"),
        (("RETRY", -1), "ERR RETRY time must be a non negative number"),
        (("TTL", 0), "ERR TTL must be a number > 0"),
        (("TTL", 10, "DELAY", 20), "ERR The specified DELAY is greater than TTL. Job refused "
                                   "since would never be delivered"),
        (("RETRY", 0, "REPLICATE", 2),
         "ERR With RETRY set to 0 please explicitly set  REPLICATE to 1 (at-most-once delivery)"),
    ]:
        assert r.call("ADDJOB", "q", "x", 0, *options) == Error(error), options
    assert r.call("GETJOB", "COUNT", "abc", "FROM", "q") \
        == Error("ERR COUNT must be a number greater than zero")
    assert r.call("GETJOB", "TIMEOUT", -1, "FROM", "q") == Error("ERR timeout is negative")
    assert r.call("JSCAN", "STATE", "done") == Error("ERR Invalid job state name")
    assert r.call("PAUSE", "q", "sideways") == Error("ERR syntax error")
    assert r.call("QLEN", "q") == 0  # none of them added anything


def test_goware_disque_calls_work_unchanged(resp):
    """The Go client goware/disque's calls, as it sends them and with the
    reply shapes it checks (it cannot run here: no Go toolchain): Add with
    Replicate, Delay, RetryAfter, TTL, MaxLen and Timeout (a status ID);
    Get over several queues left to right (TIMEOUT ms WITHCOUNTERS FROM ...,
    7 fields); Fetch (SHOW: 30 elements, integers where it reads int64);
    Nack; Ack; Wait (SHOW polled until null); Len; ActiveLen (JSCAN)."""
    r = resp()
    add = ["1000", "REPLICATE", 1, "RETRY", 1, "TTL", 60, "MAXLEN", 100]
    low = r.call("ADDJOB", "go-low", "low", *add)
    high = r.call("ADDJOB", "go-high", "high", *add)
    later = r.call("ADDJOB", "go-high", "later", *add[:1], "DELAY", 1, *add[1:])
    assert all(isinstance(reply, Status) for reply in (low, high, later))  # redigo: a string
    got = r.call("GETJOB", "TIMEOUT", 1000, "WITHCOUNTERS", "FROM", "go-high", "go-low")
    assert len(got) == 1 and len(got[0]) == 7
    queue, job_id, data, _n, nacks, _a, additional = got[0]
    assert (queue, job_id, data) == (b"go-high", high.text.encode(), b"high")
    assert isinstance(nacks, int) and isinstance(additional, int)
    fetched = r.call("SHOW", job_id)
    assert len(fetched) == 30 and fetched[1] == job_id and fetched[3] == b"go-high"
    assert fetched[5] == b"active" and fetched[29] == b"high"
    for index in (7, 9, 11, 13, 15, 17, 19):  # repl, ttl, ctime, delay, retry, nacks, add.-deliveries
        assert isinstance(fetched[index], int), (fetched[index - 1], fetched[index])
    assert r.call("NACK", job_id) == 1
    again = r.call("GETJOB", "TIMEOUT", 1000, "WITHCOUNTERS", "FROM", "go-high", "go-low")
    assert again[0][1] == job_id and again[0][4] == 1  # nacks
    assert r.call("JSCAN", "QUEUE", "go-high", "STATE", "active")[1] != []  # ActiveLen
    assert r.call("ACKJOB", job_id) == 1
    assert r.call("SHOW", job_id) is None  # Wait returns
    assert r.call("QLEN", "go-low") == 1  # Len


def test_pgq_extensions_priority_key_and_waitjob(resp):
    r, other = resp(), resp()
    plain = r.call("ADDJOB", "px", "plain", 0).text
    urgent = r.call("ADDJOB", "px", "urgent", 0, "PRIORITY", 5, "KEY", "order-9").text
    assert r.call("ADDJOB", "px", "again", 0, "KEY", "order-9").text == urgent  # idempotent
    assert r.call("QLEN", "px") == 2
    assert r.call("ADDJOB", "px", "x", 0, "PRIORITY", -1).text.startswith("ERR priority")
    assert r.call("ADDJOB", "px", "x", 0, "PRIORITY", "high") \
        == Error("ERR PRIORITY is not an integer or out of range")
    got = r.call("GETJOB", "COUNT", 2, "FROM", "px")
    assert [job[1] for job in got] == [urgent.encode(), plain.encode()]
    assert r.call("WAITJOB", urgent, "TIMEOUT", 50) == 0  # still being worked on
    other.send("WAITJOB", urgent)  # blocks until done with, on its own connection
    assert r.call("ACKJOB", urgent) == 1
    assert other.reply() == 1
    assert r.call("WAITJOB", "D-00000000-++++++++++++++++++++++++-0001") \
        == Error("NOJOB Job not known in the context of this node.")
    assert r.call("WAITJOB", plain, "FOREVER").text.startswith("ERR syntax error")
    # a fractional RETRY (pgq's) reads as whole seconds rounded up: 0 is at most once
    half = r.call("ADDJOB", "px-half", "x", 0, "RETRY", 0.5).text
    assert r.call("WORKING", half) == 1
    shown = r.call("SHOW", half)
    assert dict(zip(shown[::2], shown[1::2], strict=True))[b"retry"] == 1


def test_config_and_debug_subset(resp):
    r = resp()
    assert r.call("CONFIG", "GET", "appendfsync") == [b"appendfsync", b"always"]
    pairs = r.call("CONFIG", "GET", "append*")
    assert dict(zip(pairs[::2], pairs[1::2], strict=True)) \
        == {b"appendonly": b"yes", b"appendfsync": b"always"}
    assert r.call("CONFIG", "GET", "nothing-like-it") == []
    assert r.call("CONFIG", "SET", "appendfsync", "no").text.startswith("ERR CONFIG SET")
    assert r.call("CONFIG", "RESETSTAT") == Status("OK")
    assert r.call("DEBUG", "SLEEP", 0) == Status("OK")
    assert r.call("DEBUG", "ERROR", "boom") == Error("boom")
    assert r.call("DEBUG", "SEGFAULT").text.startswith("ERR DEBUG subcommands here")
    # fnmatch compiles a pattern on the event loop: 1 MB took 3 s
    assert "at most 256 bytes" in r.call("CONFIG", "GET", "*" * 1_000_000).text
    # one database served by pgq serve is no cluster node: nothing to meet with
    assert "not a cluster node" in r.call("CLUSTER", "MEET", "127.0.0.1", 7711).text


def test_pipelined_commands_are_answered_in_order(resp):
    r = resp()
    for i in range(50):
        r.send("ADDJOB", "pipe", f"job {i}", 0)
    ids = [r.reply().text for _ in range(50)]
    assert len(set(ids)) == 50
    for _ in range(50):
        r.send("GETJOB", "NOHANG", "FROM", "pipe")
    bodies = [r.reply()[0][2] for _ in range(50)]
    assert bodies == [f"job {i}".encode() for i in range(50)]  # oldest first


def test_auth_is_required_and_checked(resp):
    r = resp(auth=False)
    assert r.call("PING") == Status("PONG")
    assert r.call("QLEN", "q") == Error("NOAUTH Authentication required.")
    assert r.call("AUTH", "wrong") == Error("ERR invalid password")
    assert r.call("AUTH", SECRET) == Status("OK") and r.call("QLEN", "q") == 0


def test_before_auth_a_request_is_small_and_after_it_as_large_as_disques(resp):
    # Before AUTH, as Redis: at most 10 arguments of 16 KiB. Any client could
    # make the server hold 512 MiB per connection before authenticating.
    stranger = resp(auth=False)
    stranger.sock.sendall(b"*2\r\n$4\r\nPING\r\n$%d\r\n" % (16 * 1024 + 1))
    assert stranger.reply() == Error("ERR Protocol error: invalid bulk length")
    assert stranger.sock.recv(1) == b""  # and the connection is closed
    crowd = resp(auth=False)
    crowd.send(*["PING"] * 11)
    assert crowd.reply() == Error("ERR Protocol error: invalid multibulk length")
    # AUTH and a large ADDJOB in one packet: the limits lift right after AUTH.
    member = resp(auth=False)
    big = b"x" * (256 * 1024)
    member.sock.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(SECRET), SECRET.encode())
                        + b"*4\r\n$6\r\nADDJOB\r\n$3\r\nbig\r\n$%d\r\n%s\r\n$1\r\n0\r\n"
                        % (len(big), big))
    assert member.reply() == Status("OK") and member.reply().text.startswith("D-")
    assert member.call("QLEN", "big") == 1


def test_the_parser_takes_pieces_inline_commands_and_refuses_garbage():
    parser = Parser()
    assert parser.feed(b"*2\r\n$4\r\nQLEN\r\n$") == []
    assert parser.feed(b"1\r\nq\r\nPING\r\n") == [[b"QLEN", b"q"], [b"PING"]]
    with pytest.raises(ProtocolError):
        Parser().feed(b"*1\r\n+oops\r\n")
    with pytest.raises(ProtocolError):
        Parser().feed(b"*1\r\n$99999999999\r\n")
    # A negative size moved the parser back: feed() looped for ever on it.
    for request in (b"*1\r\n$-100\r\n", b"*1\r\n$-5\r\nabc\r\n"):
        with pytest.raises(ProtocolError, match="invalid bulk length"):
            Parser().feed(request)
    # Byte by byte: the array is read on from where the last piece ended.
    request = b"*3\r\n$6\r\nACKJOB\r\n$2\r\nab\r\n$0\r\n\r\n*1\r\n$4\r\nPING\r\n"
    pieces = Parser()
    assert [c for byte in request for c in pieces.feed(bytes([byte]))] == \
        [[b"ACKJOB", b"ab", b""], [b"PING"]]
    # An inline command ends at LF, with or without CR (as Redis reads it).
    assert Parser().feed(b"PING\nQLEN  q\r\n") == [[b"PING"], [b"QLEN", b"q"]]
    assert encode([Status("OK"), Error("ERR x"), 3, b"b", None, NULL_ARRAY]) == \
        b"*6\r\n+OK\r\n-ERR x\r\n:3\r\n$1\r\nb\r\n$-1\r\n*-1\r\n"


def test_inline_commands_read_quotes_as_redis_does():
    # Split on blanks only, `ADDJOB q "hello world" 0` from redis-cli or
    # telnet added the body '"hello' with the timeout 'world"'.
    assert Parser().feed(b'ADDJOB q "hello world" 0\r\n') == [[b"ADDJOB", b"q", b"hello world", b"0"]]
    assert Parser().feed(b"ADDJOB q 'it\\'s' 0\n") == [[b"ADDJOB", b"q", b"it's", b"0"]]
    assert Parser().feed(b'X "\\x41\\n\\t\\"\\\\" "" \'\\n\'\n') == [[b"X", b'A\n\t"\\', b"", b"\\n"]]
    for unbalanced in (b'ADDJOB q "open\n', b"ADDJOB q 'open\n", b'ADDJOB q "a"b 0\n'):
        with pytest.raises(ProtocolError, match="unbalanced quotes in request"):
            Parser().feed(unbalanced)
    # Blanks are skipped between arguments, but only space, tab, CR, LF
    # (and NUL) end a word, as in Redis; with or without quotes on the line.
    assert Parser().feed(b"\vQLEN a\vb \f c\n") == [[b"QLEN", b"a\vb", b"c"]]
    assert Parser().feed(b'\vQLEN a\vb \f "c"\n') == [[b"QLEN", b"a\vb", b"c"]]


def test_an_inline_line_longer_than_64_kib_is_refused_even_whole():
    # Only a line still waiting for its end was measured: a line of 1 MiB
    # pipelined behind a blocked GETJOB was split on the shared event loop.
    with pytest.raises(ProtocolError, match="too big inline request"):
        Parser().feed(b"PING " + b"x" * (64 * 1024) + b"\r\n")
    assert Parser().feed(b"PING " + b"x" * 60_000 + b"\r\n") == [[b"PING", b"x" * 60_000]]


def test_a_request_larger_than_the_limit_is_refused_as_it_arrives(monkeypatch):
    import pgq.resp

    monkeypatch.setattr(pgq.resp, "MAX_REQUEST", 10)  # Redis's 1 GiB, scaled down
    parser = Parser()
    assert parser.feed(b"*3\r\n$6\r\nADDJOB\r\n$4\r\nq") == []
    with pytest.raises(ProtocolError, match="request too large"):
        parser.feed(b"abc\r\n$1\r\n")


def test_pydisque_works_unchanged(dsn, tmp_path):
    """pydisque on redis-py >= 8, which opens with HELLO 3 (real Disque
    refuses it): pgq answers the handshake and speaks RESP3 from then on."""
    pydisque = pytest.importorskip("pydisque.client")
    process, port = start_server(dsn, tmp_path, None)
    try:
        client = pydisque.Client([f"127.0.0.1:{port}"])
        client.connect()
        job = client.add_job("pyd", "hello", retry=30, replicate=1)
        assert client.qlen("pyd") == 1
        got = client.get_job(["pyd"], timeout=1000, withcounters=True)
        assert got == [(b"pyd", job, b"hello", 0, 0)]
        client.ack_job(job)
        assert client.get_job(["pyd"], nohang=True) == [] and client.qlen("pyd") == 0
    finally:
        process.terminate()
        process.wait(20)


def test_cluster_nodes_flags_follow_the_membership():
    # Disque's flags: myself, leaving, fail? (suspected), fail; the link
    # connected while the node is believed alive (it printed "noflags ...
    # connected" for every node whatever its state).
    from types import SimpleNamespace

    from pgq.resp import Session

    me, peer = "a" * 40, "b" * 40
    session = Session(SimpleNamespace(node_id=me))  # only its node_id is read
    assert session._node_flags({"id": me, "status": "alive"}) == "myself 0 0 connected"
    assert session._node_flags({"id": peer, "status": "alive"}) == "noflags 0 0 connected"
    assert session._node_flags({"id": peer, "status": "suspect"}) == "fail? 0 0 connected"
    assert session._node_flags({"id": peer, "status": "dead"}) == "fail 0 0 disconnected"
    assert session._node_flags({"id": me, "status": "alive", "leaving": True}) \
        == "myself,leaving 0 0 connected"


def test_a_resp3_handshake_and_its_replies():
    import asyncio

    from pgq.resp import Session

    class Client:
        node_id = "n" * 40

    session = Session(Client(), password="pw")  # type: ignore[arg-type]
    refused = asyncio.run(session.run([b"HELLO", b"3"]))
    assert refused.text.startswith("NOAUTH")
    assert asyncio.run(session.run([b"HELLO", b"4"])).text.startswith("NOPROTO")
    reply = asyncio.run(session.run([b"HELLO", b"3", b"AUTH", b"default", b"pw"]))
    assert session.resp3 and reply["proto"] == 3 and encode(reply, True).startswith(b"%7\r\n")
    assert encode([None, NULL_ARRAY], True) == b"*2\r\n_\r\n_\r\n"


def test_an_unexpected_error_is_one_err_reply_and_the_server_goes_on(dsn):
    """A bug in one command (here a client whose QLEN raises RuntimeError, a
    fault injected into a real client on a real database) must not take the
    server down: the bench once crashed `pgq serve` with one bad statement."""
    import anyio

    import pgq
    from pgq import resp

    class Faulty(pgq.AsyncClient):
        async def qlen(self, queue):  # type: ignore[override]
            raise RuntimeError("injected")

    async def call(stream, *args: bytes) -> bytes:
        await stream.send(b"*%d\r\n" % len(args)
                          + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args))
        return await stream.receive(65536)

    async def main():
        port = free_port("127.0.0.1")
        async with Faulty(dsn) as client, anyio.create_task_group() as group:
            ready = anyio.Event()
            group.start_soon(resp.serve, client, "127.0.0.1", port, None, ready.set)
            await ready.wait()
            async with await anyio.connect_tcp("127.0.0.1", port) as one:
                reply = await call(one, b"QLEN", b"q")
                assert reply.startswith(b"-ERR internal error in QLEN (RuntimeError)"), reply
                assert await call(one, b"PING") == b"+PONG\r\n"  # the connection lives on
            async with await anyio.connect_tcp("127.0.0.1", port) as two:
                added = await call(two, b"ADDJOB", b"q", b"x", b"0")
                assert added.startswith(b"+D-"), added  # the new job's ID
            group.cancel_scope.cancel()

    anyio.run(main)


def test_blocked_getjobs_wait_on_the_shared_listener_and_each_gets_one_job(resp, dsn):
    """The RESP front's blocked GETJOBs wait on its client's shared LISTEN
    connection (pgq.listener): registered for the queue while they block,
    and each job added goes to exactly one of them."""
    blocked = [resp(), resp()]
    for r in blocked:
        r.send("GETJOB", "TIMEOUT", 20_000, "FROM", "shared-resp")  # 20 s: well past the waits below

    def registered():
        with psycopg.connect(dsn, autocommit=True) as conn:
            return conn.execute("SELECT queue FROM pgq.waiters").fetchall()

    assert wait_until(registered, 10, message="the blocked GETJOBs to register") == [("shared-resp",)]
    producer = resp()
    ids = {producer.call("ADDJOB", "shared-resp", body, 0).text for body in ("a", "b")}
    got = [r.reply() for r in blocked]
    assert all(len(jobs) == 1 for jobs in got)
    assert {jobs[0][1].decode() for jobs in got} == ids


def test_a_client_gone_while_blocked_takes_no_job_and_holds_nothing(resp, dsn):
    """A consumer that closes its connection during a blocking GETJOB is
    unblocked, as Disque frees it: it kept blocking for nobody and took the
    next job for its closed socket (the job then waited out its RETRY).
    And twelve blocked GETJOBs (the front's pool holds ten connections)
    leave ADDJOB working: each blocked GET held a connection."""
    observer = resp()
    blocked = [resp() for _ in range(12)]
    for r in blocked:
        r.send("GETJOB", "TIMEOUT", 60_000, "FROM", "gone-resp")  # far past the waits below

    def blocked_count() -> int:
        stat = observer.call("QSTAT", "gone-resp")
        return 0 if stat is NULL_ARRAY else dict(zip(stat[::2], stat[1::2], strict=True))[b"blocked"]

    wait_until(lambda: blocked_count() == 12, 20, message="twelve blocked GETJOBs")
    added = observer.call("ADDJOB", "other-resp", "x", 0)  # the pool is not held by the twelve
    assert isinstance(added, Status) and added.text.startswith("D-")
    for r in blocked:
        r.close()
    wait_until(lambda: blocked_count() == 0, 20, message="the closed GETJOBs to end")
    job = observer.call("ADDJOB", "gone-resp", "for a live consumer", 0).text
    consumer = resp()
    got = consumer.call("GETJOB", "NOHANG", "FROM", "gone-resp")
    assert got == [[b"gone-resp", job.encode(), b"for a live consumer"]]


@pytest.mark.parametrize("getjob, pipelined", [
    # a command pipelined behind the blocked one, then the close: the
    # watcher read the command and stopped watching
    (("GETJOB", "TIMEOUT", 60_000, "FROM", "gone-after"), ("PING",)),
    # a queue named like the option: the GETJOB was taken for a NOHANG one
    # and not watched at all
    (("GETJOB", "TIMEOUT", 60_000, "FROM", "nohang"), None),
], ids=["pipelined-then-closed", "a-queue-named-nohang"])
def test_a_client_gone_while_blocked_is_seen_whatever_it_sent(resp, getjob, pipelined):
    queue = getjob[-1]
    observer = resp()
    leaving = resp()
    leaving.send(*getjob)

    def blocked_count() -> int:
        stat = observer.call("QSTAT", queue)
        return 0 if stat is NULL_ARRAY else dict(zip(stat[::2], stat[1::2], strict=True))[b"blocked"]

    wait_until(lambda: blocked_count() == 1, 20, message="the blocked GETJOB")
    if pipelined:
        leaving.send(*pipelined)
    leaving.close()
    wait_until(lambda: blocked_count() == 0, 20, message="the closed GETJOB to end")
    job = observer.call("ADDJOB", queue, "for a live consumer", 0).text
    assert resp().call("GETJOB", "NOHANG", "FROM", queue) == [[queue.encode(), job.encode(),
                                                               b"for a live consumer"]]


def test_an_acknowledged_job_shows_with_disques_types():
    """pgq keeps a tombstone of an acknowledged job, not the job: SHOW (in a
    cluster, while its ACK goes round to the other holders) and JSCAN REPLY
    all sent nulls where Disque sends integers, and Disque's clients failed
    to read them (goware/disque's Fetch: "unexpected reply: repl")."""
    from pgq import commands
    from pgq.resp import Session

    tombstone = commands._ack_dict(("D-00000000-AAAAAAAAAAAAAAAAAAAAAAAA-0001", "q", None, False,
                                    30.0, ["n2"]))
    reply = Session._show_reply(None, tombstone)  # type: ignore[arg-type]
    fields = dict(zip(reply[::2], reply[1::2], strict=True))
    assert fields["state"] == "acked" and fields["nodes-delivered"] == ["n2"]
    for key in ("repl", "ttl", "ctime", "delay", "retry", "nacks", "additional-deliveries",
                "next-requeue-within", "next-awake-within"):
        assert isinstance(fields[key], int), (key, fields[key])
    assert fields["body"] == b"" and fields["next-awake-within"] == 30_000
    assert encode(reply).count(b"$-1") == 0


def test_jobs_claimed_for_a_getjob_the_servers_stop_cut_off_go_back(dsn, tmp_path):
    """A GETJOB whose claim was in flight when the server stopped: the stop
    cancelled the reply's send before it wrote, and the claimed jobs went to
    nobody (a RETRY 0 job for good). They now go back to their queue. The
    claim is held in flight by a lock on the queue counters (its trigger
    waits for it) while the server is told to stop."""
    process, port = start_server(dsn, tmp_path, None)
    admin = psycopg.connect(dsn, autocommit=True)
    admin_peer = psycopg.connect(dsn, autocommit=True)  # looks while admin holds the lock
    consumer = None
    try:
        job = Resp(port).call("ADDJOB", "cut-off", "only once", 0, "RETRY", 0).text
        admin.execute("BEGIN")
        admin.execute("LOCK TABLE pgq.queue_counters IN EXCLUSIVE MODE")
        consumer = Resp(port)
        consumer.send("GETJOB", "TIMEOUT", 60_000, "FROM", "cut-off")
        wait_until(lambda: admin_peer.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database()").fetchone()[0] >= 1, 20,
            message="the claim to wait for the lock")
        process.terminate()  # a graceful stop: it waits for the claim in flight
        admin.execute("COMMIT")
        process.wait(30)
        consumer.sock.settimeout(10)
        data = b""
        while chunk := consumer.sock.recv(65536):
            data += chunk
        with psycopg.connect(dsn) as conn:
            state = conn.execute("SELECT state FROM pgq.jobs WHERE id = %s", (job,)).fetchone()
        # Delivered (the reply written before the stop took effect) or back
        # in its queue; never taken for nobody.
        assert job.encode() in data or state == ("queued",), (data, state, process.stdout.read().decode()[-3000:])
    finally:
        admin.close()
        admin_peer.close()
        if consumer is not None:
            consumer.close()
        if process.poll() is None:
            process.kill()
        process.wait(20)


@pytest.mark.parametrize("value,cap", [("2", 2), (" 7 ", 7), ("0", 10_000), ("²", 10_000),
                                       ("many", 10_000), ("9" * 5000, 10_000)])
def test_max_clients_reads_a_positive_number_or_keeps_disques_default(monkeypatch, value, cap):
    # '²' passed str.isdigit() and made int() raise as the server started
    from pgq.resp import max_clients

    monkeypatch.setenv("PGQ_RESP_MAX_CLIENTS", value)
    assert max_clients() == cap
