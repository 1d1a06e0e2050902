"""The HTTP API (pgq serve --http) through a real HTTP client against a real
server process: every route, bodies as text and base64, typed 4xx errors,
bearer-token auth, and the refusal to listen beyond loopback without one."""

from __future__ import annotations

import base64
import contextlib
import json
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

import jsonschema
import psycopg
import pytest

from pgq.httpapi import OPENAPI

from .cluster.conftest import free_port
from .conftest import wait_until

TOKEN = "s3cret-token"


def q(job_id: str) -> str:
    """A job ID in a URL path: its '/' and '+' percent-encoded."""
    return urllib.parse.quote(job_id, safe="")


def call(base, method, path, body=None, token=TOKEN, raw=None, headers=None):
    """One request; its answer is checked against the OpenAPI document."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(base + path, data=data, method=method, headers=headers or {})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
            kind = response.headers.get("content-type", "")
            status = response.status
    except urllib.error.HTTPError as exc:
        text = exc.read().decode()
        kind = exc.headers.get("content-type", "")
        status = exc.code
    reply = json.loads(text) if "json" in kind else text
    conforms(method, path, status, kind, reply)
    return status, reply


def _closed(schema):
    """``schema`` with every object that lists its properties closed to
    others: an answer holding a field the document does not describe fails
    (a client generated from the document would not see it)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _closed(value) for key, value in schema.items()}
    if "properties" in schema:
        out.setdefault("additionalProperties", False)
    return out


def _operation(method: str, path: str):
    path = path.partition("?")[0]
    for template, operations in OPENAPI["paths"].items():
        if re.fullmatch(re.sub(r"\\{\w+\\}", "[^/]+", re.escape(template)), path):
            return operations.get(method.lower())
    return None  # not a route: Starlette's 404


def test_every_schema_of_the_openapi_document_is_valid_json_schema():
    schemas = []
    for operations in OPENAPI["paths"].values():
        for operation in operations.values():
            body = operation.get("requestBody", {}).get("content", {})
            schemas += [m["schema"] for m in body.values()]
            for response in operation["responses"].values():
                schemas += [m["schema"] for m in response.get("content", {}).values()]
    assert len(schemas) > 20
    for schema in schemas:
        jsonschema.Draft202012Validator.check_schema(schema)


def conforms(method: str, path: str, status: int, kind: str, reply) -> None:
    """The answer is one the OpenAPI document describes: its status listed
    for the operation, its body valid against that status's schema."""
    operation = _operation(method, path)
    if operation is None or status == 405:
        return
    documented = operation["responses"].get(str(status))
    assert documented is not None, f"{method} {path} answered {status}: not in the OpenAPI document"
    content = documented.get("content")
    assert content, f"{method} {path}: the document does not describe the body of its {status}"
    [media] = [m for m in content if m in kind] or [None]
    assert media is not None, f"{method} {path} {status}: {kind} is not among {list(content)}"
    jsonschema.validate(reply, _closed(content[media]["schema"]),
                        cls=jsonschema.Draft202012Validator)


class Served:
    """A `pgq serve --http` process: its base URL, and (once stopped) what it printed."""

    def __init__(self, dsn: str, token_file=None, env=None) -> None:
        port = free_port("127.0.0.1")
        secret = ["--token-file", str(token_file)] if token_file else []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pgq", "serve", "--http", f"127.0.0.1:{port}", *secret,
             "--dsn", dsn], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        self.base = f"http://127.0.0.1:{port}"
        self.output = ""

    def up(self) -> bool:
        try:
            return call(self.base, "GET", "/health", token=None)[0] == 200
        except OSError:
            assert self.process.poll() is None, self.process.stdout.read().decode()
            return False

    def stop(self) -> str:
        if self.process.poll() is None:
            self.process.terminate()
        self.output = self.process.communicate(timeout=20)[0].decode(errors="replace")
        return self.output


@pytest.fixture
def serve(dsn):
    """Start servers on this test's database (stopped at the end)."""
    started: list[Served] = []

    def start(token_file=None, env=None) -> Served:
        served = Served(dsn, token_file, env)
        started.append(served)
        wait_until(served.up, 30, message="the HTTP API to answer")
        return served

    try:
        yield start
    finally:
        for served in started:
            served.stop()


@pytest.fixture
def api(serve, tmp_path):
    (tmp_path / "token").write_text(TOKEN + "\n")
    return serve(tmp_path / "token").base


def test_add_lease_ack_nack_working_status_and_stats(api):
    status, added = call(api, "POST", "/v1/queues/emails/jobs", {"body": "hello", "retry": 30})
    assert status == 201 and len(added["ids"]) == 1
    job = added["ids"][0]
    status, many = call(api, "POST", "/v1/queues/emails/jobs", {"jobs": [
        {"body": "two"}, {"body_base64": base64.b64encode(b"\xff\x00").decode()}], "retry": 30})
    assert status == 201 and len(many["ids"]) == 2
    status, leased = call(api, "POST", "/v1/lease", {"queues": ["emails"], "count": 3})
    assert status == 200
    bodies = {j["id"]: j.get("body", j.get("body_base64")) for j in leased["jobs"]}
    assert bodies == {job: "hello", many["ids"][0]: "two", many["ids"][1]: "/wA="}
    assert leased["jobs"][0]["nacks"] == 0
    assert call(api, "POST", f"/v1/jobs/{q(job)}/working") == (200, {"retry": 30})
    unknown = q("D-00000000-++++++++++++++++++++++++-0001")
    status, error = call(api, "POST", f"/v1/jobs/{unknown}/working")  # Disque: -NOJOB
    assert (status, error["error"]) == (404, "NoJobError")
    assert call(api, "POST", f"/v1/jobs/{q(many['ids'][0])}/nack", {"delay": 60}) == (200, {"nacked": 1})
    status, shown = call(api, "GET", f"/v1/jobs/{q(job)}")
    assert status == 200 and shown["state"] == "active" and shown["body"] == "hello"
    assert call(api, "POST", f"/v1/jobs/{q(job)}/ack") == (200, {"acked": 1})
    assert call(api, "POST", f"/v1/jobs/{q(many['ids'][1])}/ack") == (200, {"acked": 1})
    status, stats = call(api, "GET", "/v1/queues/emails")
    assert status == 200 and stats["name"] == "emails"
    status, text = call(api, "GET", "/metrics")
    assert status == 200 and 'pgq_queue_active{queue="emails"}' in text
    status, spec = call(api, "GET", "/openapi.json", token=None)
    assert status == 200 and "/v1/lease" in spec["paths"]


def test_a_blocking_lease_and_a_wait(api):
    assert call(api, "POST", "/v1/lease", {"queues": "none-yet", "timeout": 0.3}) == (200, {"jobs": []})
    job = call(api, "POST", "/v1/queues/w/jobs", {"body": "x", "retry": 30})[1]["ids"][0]
    assert call(api, "POST", f"/v1/jobs/{q(job)}/wait", {"timeout": 0.2}) == (200, {"done": False})
    call(api, "POST", f"/v1/jobs/{q(job)}/ack")
    # acked before the wait: done (this node's history says so)
    assert call(api, "POST", f"/v1/jobs/{q(job)}/wait", {"timeout": 1}) == (200, {"done": True})
    unknown = "D-00000000-++++++++++++++++++++++++-0001"
    assert call(api, "POST", f"/v1/jobs/{q(unknown)}/wait", {"timeout": 1})[0] == 404


def test_priority_and_idempotency_keys(api):
    plain = call(api, "POST", "/v1/queues/pk/jobs", {"body": "plain"})[1]["ids"][0]
    status, added = call(api, "POST", "/v1/queues/pk/jobs",
                         {"body": "urgent", "priority": 9, "key": "invoice-7"})
    urgent = added["ids"][0]
    assert status == 201
    assert call(api, "POST", "/v1/queues/pk/jobs", {"body": "again", "key": "invoice-7"}) \
        == (201, {"ids": [urgent]})
    status, many = call(api, "POST", "/v1/queues/pk/jobs", {"jobs": [
        {"body": "k1", "key": "a"}, {"body": "top", "priority": 20}, {"body": "k1 again", "key": "a"}]})
    assert status == 201 and many["ids"][0] == many["ids"][2] != many["ids"][1]
    leased = call(api, "POST", "/v1/lease", {"queues": ["pk"], "count": 10})[1]["jobs"]
    assert [j["id"] for j in leased] == [many["ids"][1], urgent, plain, many["ids"][0]]
    status, shown = call(api, "GET", f"/v1/jobs/{q(urgent)}")
    assert shown["priority"] == 9 and shown["key"] == "invoice-7"


@pytest.mark.parametrize("method,path,body,raw,status,kind", [
    ("POST", "/v1/queues/q/jobs", {"body": "x", "priority": -1}, None, 400, "InvalidArgumentError"),
    ("POST", "/v1/queues/q/jobs", {"body": "x", "key": 5}, None, 400, "InvalidTypeError"),
    ("POST", "/v1/queues/q/jobs", {"jobs": [{"body": "x"}], "key": "k"}, None, 400, "bad_request"),
    ("POST", "/v1/queues/q/jobs", {"jobs": [{"body": "x", "key": "ok"}, {"body": "y", "key": ""}]},
     None, 400, "InvalidArgumentError"),
    ("POST", "/v1/queues/q/jobs", None, b"{not json", 400, "bad_request"),
    ("POST", "/v1/queues/q/jobs", {"bodyy": "x"}, None, 400, "bad_request"),
    ("POST", "/v1/queues/q/jobs", {"body_base64": "%%%"}, None, 400, "bad_request"),
    ("POST", "/v1/queues/q/jobs", {"body": "x", "retry": -1}, None, 400, "InvalidArgumentError"),
    # an add waits at most 300 s, as every request (0 meant until the TTL)
    ("POST", "/v1/queues/q/jobs", {"body": "x", "timeout": 0}, None, 400, "InvalidArgumentError"),
    ("POST", "/v1/queues/q/jobs", {"body": "x", "timeout": 301}, None, 400, "InvalidArgumentError"),
    ("POST", "/v1/lease", {"queues": []}, None, 400, "bad_request"),
    ("GET", "/v1/jobs/not-an-id", None, None, 400, "BadIdError"),
    ("GET", "/v1/jobs/D-00000000-++++++++++++++++++++++++-0001", None, None, 404, "NoJobError"),
    ("GET", "/v1/queues/nothing-here", None, None, 404, "NoJobError"),
])
def test_bad_input_gets_a_typed_4xx(api, method, path, body, raw, status, kind):
    got_status, error = call(api, method, path, body, raw=raw)
    assert (got_status, error["error"]) == (status, kind) and error["message"]
    assert call(api, "GET", "/v1/queues/q")[0] == 404  # nothing was added (every item checked first)


def test_odd_input_gets_a_json_4xx_never_a_500(api):
    # One server for all of them (a server per case costs a second each).
    cases = [
        # (method, path, body, raw, status, kind)
        ("POST", "/v1/queues/q/jobs", {"body": "x", "delay": 10**400}, None, 400, "InvalidArgumentError"),
        ("POST", "/v1/queues/q/jobs", None, b"[" * 5000, 400, "bad_request"),  # nested too deep
        ("POST", "/v1/queues/q/jobs", None, b'{"body": "\\ud800"}', 400, "bad_request"),  # lone surrogate
        ("POST", "/v1/queues/q/jobs", {"body_base64": None}, None, 400, "bad_request"),
        ("POST", "/v1/queues/q/jobs", {"body": "x", "body_base64": "eA=="}, None, 400, "bad_request"),
        ("POST", "/v1/queues/q/jobs", {"body": "x", "prority": 5}, None, 400, "bad_request"),
        ("POST", "/v1/queues/q/jobs", {"jobs": [{"body": "x", "ttl": 5}]}, None, 400, "bad_request"),
        # one job's body beside a list of them: that job was dropped
        ("POST", "/v1/queues/q/jobs", {"body": "x", "jobs": [{"body": "y"}]}, None, 400, "bad_request"),
        ("POST", "/v1/queues/q/jobs", {"body_base64": "eA==", "jobs": [{"body": "y"}]}, None,
         400, "bad_request"),
        ("POST", "/v1/lease", {"queues": ["q"], "timeout": ""}, None, 400, "InvalidTypeError"),
        ("POST", "/v1/lease", {"queues": ["q"], "timeout": 301}, None, 400, "InvalidArgumentError"),
        ("POST", "/v1/lease", {"queues": ["q"], "withcounters": "false"}, None, 400, "bad_request"),
        ("POST", "/v1/lease", {"queues": [f"q{i}" for i in range(10_001)]}, None, 400, "bad_request"),
        ("POST", "/v1/jobs/D-00000000-++++++++++++++++++++++++-0001/wait", {"timeout": None}, None,
         400, "InvalidTypeError"),
        ("GET", "/v1/nothing", None, None, 404, "not_found"),
        ("DELETE", "/v1/lease", None, None, 405, "method_not_allowed"),
        # a field given twice: json.loads kept the last, and A was dropped with a 201
        ("POST", "/v1/queues/q/jobs", None, b'{"jobs": [{"body": "A"}], "jobs": [{"body": "B"}]}',
         400, "bad_request"),
        ("POST", "/v1/queues/q/jobs", None, b'{"body": "a", "body": "b"}', 400, "bad_request"),
        # a path that is not UTF-8: "caf%E9" and "caf%E8" both named "caf\ufffd"
        ("POST", "/v1/queues/caf%E9/jobs", {"body": "x"}, None, 400, "bad_request"),
        ("GET", "/v1/queues/%FF", None, None, 400, "bad_request"),
        ("POST", "/v1/queues/q/jobs", {"jobs": [{}] * 100_001}, None, 400, "bad_request"),
    ]
    for method, path, body, raw, status, kind in cases:
        got_status, error = call(api, method, path, body, raw=raw)
        assert (got_status, error["error"]) == (status, kind) and error["message"], (path, body, raw)
    assert call(api, "GET", "/v1/queues/q")[0] == 404  # none of them added anything


def test_whole_numbers_written_with_a_fraction_are_integers(api):
    # JSON Schema's "integer" is any number without a fractional part: a
    # client's encoder may write a count or a priority as 2.0 (Python's does
    # for a float) or 3e1; they were refused as "must be an int".
    status, added = call(api, "POST", "/v1/queues/f/jobs", raw=b'{"body": "x", "priority": 2.0, '
                         b'"retry": 3e1, "replicate": 1.0}')
    assert status == 201
    status, leased = call(api, "POST", "/v1/lease", raw=b'{"queues": ["f"], "count": 1.0}')
    assert status == 200 and [j["id"] for j in leased["jobs"]] == added["ids"]
    shown = call(api, "GET", f"/v1/jobs/{q(added['ids'][0])}")[1]
    assert (shown["priority"], shown["retry"]) == (2, 30)
    status, error = call(api, "POST", "/v1/lease", raw=b'{"queues": ["f"], "count": 1.5}')
    assert (status, error["error"]) == (400, "InvalidTypeError")
    # past 2**53 a float is not an exact integer: 2**62 + 1 written with a
    # fraction would have been taken as 2**62
    status, error = call(api, "POST", "/v1/queues/f/jobs",
                         raw=b'{"body": "x", "maxlen": 4611686018427387905.0}')
    assert (status, error["error"]) == (400, "InvalidTypeError")


def _post_unread(base: str, path: str, payload: dict, timeout: float = 60):
    """POST ``payload`` as JSON over a raw socket, returned unread: its
    request stays in flight while the test acts (read it with _reply_of)."""
    import socket

    body = json.dumps(payload).encode()
    sock = socket.create_connection(("127.0.0.1", urllib.parse.urlsplit(base).port),
                                    timeout=timeout)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
                 + b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    return sock


def _reply_of(sock) -> bytes:
    """One HTTP response read from a raw socket (its head, and its body by
    Content-Length), or what came before the server closed."""
    reply = b""
    while b"\r\n\r\n" not in reply or len(reply.partition(b"\r\n\r\n")[2]) < int(
            reply.lower().partition(b"content-length: ")[2].partition(b"\r\n")[0] or 0):
        data = sock.recv(65536)
        if not data:
            break
        reply += data
    return reply


def test_a_request_body_over_the_limit_is_refused_as_it_arrives(api):
    # It was read whole, then parsed: a client could make the server hold
    # gigabytes. Raw sockets: urllib cannot read an answer that comes while
    # it still sends.
    import socket

    from pgq.httpjson import MAX_REQUEST_BYTES

    host, port = api.removeprefix("http://").split(":")
    head = (f"POST /v1/queues/big/jobs HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n")

    def answer(request: bytes, body_chunks=()) -> bytes:
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(request)
            for chunk in body_chunks:
                sock.sendall(chunk)
            return _reply_of(sock)

    # A declared length over the limit: refused before any byte of the body.
    declared = answer((head + f"Content-Length: {MAX_REQUEST_BYTES + 1}\r\n\r\n").encode())
    assert declared.startswith(b"HTTP/1.1 413") and b"several requests" in declared
    # A chunked body: refused once past the limit (one byte past it is sent).
    megabyte = b"x" * 2**20
    chunks = [b"100000\r\n" + megabyte + b"\r\n"] * (MAX_REQUEST_BYTES // 2**20) + [b"1\r\nx\r\n"]
    chunked = answer((head + "Transfer-Encoding: chunked\r\n\r\n").encode(), chunks)
    assert chunked.startswith(b"HTTP/1.1 413")
    assert call(api, "GET", "/v1/queues/big")[0] == 404  # nothing added


def test_requests_of_a_few_fields_refuse_large_bodies_and_odd_numbers(api):
    """Found by a read-only review: a lease, a nack or a wait took a 64 MiB
    body (a lease of 300 s held 63 MiB of the bodies' budget meanwhile);
    a Content-Length with thousands of leading zeros (legal, and passed on
    by httptools) and a JSON integer of 5,000 digits were 500s."""
    import socket

    host, port = api.removeprefix("http://").split(":")

    def answer(path: str, length: str, body: bytes = b"") -> bytes:
        # Raw sockets: urllib cannot read an answer that comes while it
        # still sends (a body refused part-way broke its pipe).
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall((f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                          f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {length}\r\n\r\n").encode() + body)
            return _reply_of(sock)

    for path in ("/v1/lease", "/v1/jobs/x/nack", "/v1/jobs/x/wait"):
        reply = answer(path, str(2**20 + 1))  # refused before any byte of the body
        assert reply.startswith(b"HTTP/1.1 413") and b"a few small fields" in reply, reply[:300]
    reply = answer("/v1/lease", "0" * 5000 + "2", b"{}")
    assert reply.startswith(b"HTTP/1.1 400") and b"queues" in reply, reply[:300]
    status, error = call(api, "POST", "/v1/lease", raw=b'{"queues": ["q"], "count": 1' + b"0" * 5000
                         + b"}")
    assert (status, error["message"]) == (400, "a number in the request body has too many digits")


def test_a_body_that_stops_arriving_is_refused_in_time(serve, tmp_path):
    # A client that declared a body and stopped sending held its bytes of
    # the bodies' budget for as long as it kept the connection open.
    import os
    import socket
    import time

    (tmp_path / "token").write_text(TOKEN + "\n")
    served = serve(tmp_path / "token", env={**os.environ, "PGQ_HTTP_BODY_TIMEOUT": "1"})
    host, port = served.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall((f"POST /v1/queues/slow/jobs HTTP/1.1\r\nHost: {host}:{port}\r\n"
                      f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
                      "Content-Length: 100\r\n\r\n{\"body\": ").encode())
        started = time.monotonic()
        reply = _reply_of(sock)
    assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in reply, reply[:300]
    # (the server's deadline is 1 s; the socket's own timeout is 30)
    assert time.monotonic() - started < 20
    assert call(served.base, "GET", "/v1/queues/slow")[0] == 404  # nothing added


def test_a_lease_answers_at_most_its_bytes_of_bodies(api):
    """COUNT is "at most": a lease answers the jobs whose bodies add up to
    MAX_LEASE_BYTES (the first whatever its size), and the others go back
    to their queue (100 jobs of 16 MiB were one answer of 1.6 GiB of
    bodies, built whole in memory)."""
    from pgq.httpapi import MAX_LEASE_BYTES

    size = MAX_LEASE_BYTES * 2 // 5  # two fit, the third does not
    ids = [call(api, "POST", "/v1/queues/heavy/jobs", {"body": str(n) * size, "retry": 60})[1]["ids"][0]
           for n in range(3)]
    status, leased = call(api, "POST", "/v1/lease", {"queues": ["heavy"], "count": 3})
    assert status == 200 and [j["id"] for j in leased["jobs"]] == ids[:2]
    assert call(api, "GET", "/v1/queues/heavy")[1]["len"] == 1  # the third is queued again
    status, leased = call(api, "POST", "/v1/lease", {"queues": ["heavy"], "count": 3})
    assert [j["id"] for j in leased["jobs"]] == ids[2:]


def test_large_bodies_read_at_once_share_a_budget_and_small_ones_pass(api):
    """JSON parsing takes about twenty times a body in memory: the bodies
    read at once add up to at most MAX_BODIES_IN_FLIGHT (past it, 503 with
    Retry-After), their first MiB not counted."""
    import socket

    from pgq.httpjson import MAX_BODIES_IN_FLIGHT

    host, port = api.removeprefix("http://").split(":")

    def head(length: int) -> bytes:
        return (f"POST /v1/queues/budget/jobs HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {length}\r\n\r\n").encode()

    # One body of 3/4 of the budget, its last bytes held back: it is counted.
    body = b'{"body": "' + b"x" * (MAX_BODIES_IN_FLIGHT * 3 // 4) + b'"}'
    first = socket.create_connection((host, int(port)), timeout=60)
    try:
        first.sendall(head(len(body)) + body[:-10])

        def refused() -> bytes | None:
            other = b'{"body": "' + b"y" * (MAX_BODIES_IN_FLIGHT // 2) + b'"}'
            with socket.create_connection((host, int(port)), timeout=60) as sock:
                sock.sendall(head(len(other)) + other)
                reply = _reply_of(sock)
            return reply if reply.startswith(b"HTTP/1.1 503") else None

        # (sendall returns before the server read it all: wait for that)
        busy = wait_until(refused, 30, message="a second large body to be refused")
        assert b"retry-after: 1" in busy.lower() and b'"busy"' in busy
        # A small request goes through meanwhile.
        assert call(api, "POST", "/v1/queues/budget/jobs", {"body": "small"})[0] == 201
        first.sendall(body[-10:])
        assert not _reply_of(first).startswith(b"HTTP/1.1 503")  # read whole: answered
    finally:
        first.close()
    # The budget is free again.
    status, _ = call(api, "POST", "/v1/queues/budget/jobs",
                     {"body": "z" * (MAX_BODIES_IN_FLIGHT // 2)})
    assert status != 503


def test_a_web_page_of_another_origin_is_refused(api):
    # Browsers name the page in Origin; a form or fetch() to this API from
    # any site would otherwise add or acknowledge jobs (with no token, on
    # loopback, nothing else would stop it).
    status, error = call(api, "POST", "/v1/queues/web/jobs", {"body": "x"},
                         headers={"Origin": "http://evil.example"})
    assert (status, error["error"]) == (403, "forbidden")
    same = api  # http://127.0.0.1:port, as the Host header says
    assert call(api, "POST", "/v1/queues/web/jobs", {"body": "x"}, headers={"Origin": same})[0] == 201
    assert call(api, "GET", "/v1/queues/web")[1]["len"] == 1
    # DNS rebinding: a page whose own name now points at 127.0.0.1 sends
    # its name as Host and as Origin, which agree: loopback names only.
    port = urllib.parse.urlsplit(api).port
    rebound = {"Host": f"rebind.example:{port}", "Origin": f"http://rebind.example:{port}"}
    status, error = call(api, "POST", "/v1/queues/web/jobs", {"body": "x"}, headers=rebound)
    assert (status, error["error"]) == (400, "bad_host")  # as JSON, as every error
    assert call(api, "GET", "/v1/queues/web")[1]["len"] == 1  # nothing added
    assert call(api, "GET", "/health", token=None, headers={"Host": f"localhost:{port}"})[0] == 200


def test_the_token_is_required_and_checked(api):
    assert call(api, "GET", "/v1/queues/q", token=None)[0] == 401
    assert call(api, "GET", "/v1/queues/q", token="wrong")[0] == 401
    request = urllib.request.Request(api + "/v1/queues/q")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.headers["WWW-Authenticate"] == "Bearer"
    # The scheme's case does not matter (RFC 9110): 404, past the token check.
    assert call(api, "GET", "/v1/queues/q", token=None,
                headers={"Authorization": f"bearer {TOKEN}"})[0] == 404
    assert call(api, "GET", "/health", token=None)[0] == 200


def test_a_token_that_is_not_ascii_works_from_the_environment_too(serve):
    """The header's bytes are compared with the token's UTF-8 (Starlette
    gives headers as latin-1: a UTF-8 token never matched), and
    PGQ_HTTP_TOKEN is stripped as a token file is (a trailing space or
    newline never matched either)."""
    import http.client
    import os

    secret = "pässwort-✓"
    served = serve(env={**os.environ, "PGQ_HTTP_TOKEN": f" {secret}\n"})
    host, port = served.base.removeprefix("http://").split(":")

    def status_with(token: bytes) -> int:
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            connection.putrequest("GET", "/v1/queues/utf")
            connection.putheader("Authorization", b"Bearer " + token)
            connection.endheaders()
            return connection.getresponse().status
        finally:
            connection.close()

    assert status_with(secret.encode()) == 404  # past the token check: no such queue
    assert status_with(b"wrong") == 401
    assert status_with(secret.encode("latin-1", "replace")) == 401


@pytest.mark.parametrize("secret", ["voilà", "tokenÅ"])
def test_a_token_ending_in_a_byte_latin1_calls_a_space_works(serve, secret):
    """UTF-8 'à' ends in 0xA0 and 'Å' in 0x85: read as latin-1, str.strip()
    took them for blanks, and such a token never matched."""
    import http.client
    import os

    served = serve(env={**os.environ, "PGQ_HTTP_TOKEN": secret})
    host, port = served.base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.putrequest("GET", "/v1/queues/utf")
        connection.putheader("Authorization", b"Bearer " + secret.encode())
        connection.endheaders()
        assert connection.getresponse().status == 404  # past the token check: no such queue
    finally:
        connection.close()


def test_a_client_gone_before_its_body_arrived_is_no_server_error(serve, tmp_path):
    """A client that sends half its body and leaves: Starlette raised
    ClientDisconnect, which became a 500 and a traceback in the log."""
    import socket

    (tmp_path / "token").write_text(TOKEN)
    served = serve(tmp_path / "token")
    host, port = served.base.removeprefix("http://").split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(f"POST /v1/queues/half/jobs HTTP/1.1\r\nHost: {host}:{port}\r\n"
                         f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
                         "Content-Length: 100000\r\n\r\n{\"body\": \"".encode())
    assert call(served.base, "POST", "/v1/queues/half/jobs", {"body": "whole"})[0] == 201
    assert call(served.base, "GET", "/v1/queues/half")[1]["len"] == 1
    output = served.stop()
    assert "Traceback" not in output and "Exception in ASGI application" not in output, output


@pytest.mark.parametrize("front", ["--http", "--resp"])
def test_listening_beyond_loopback_needs_a_secret(dsn, front):
    done = subprocess.run([sys.executable, "-m", "pgq", "serve", front, "0.0.0.0:1", "--dsn", dsn],
                          capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in __import__("os").environ.items()
                               if k != "PGQ_HTTP_TOKEN"})
    assert done.returncode == 2 and "(beyond loopback) needs a secret" in done.stderr


def test_a_lease_whose_client_left_ends_and_takes_no_job(api):
    """A blocking lease whose client disconnects is cancelled: the server
    kept it waiting and it took the next job for nobody."""

    def blocked() -> int:
        status, stats = call(api, "GET", "/v1/queues/left")
        return int(stats["blocked"]) if status == 200 else 0

    # far past the waits below
    leaving = _post_unread(api, "/v1/lease", {"queues": ["left"], "timeout": 60}, timeout=30)
    wait_until(lambda: blocked() == 1, 20, message="the lease to block")
    leaving.close()
    wait_until(lambda: blocked() == 0, 20, message="the abandoned lease to end")
    status, added = call(api, "POST", "/v1/queues/left/jobs", {"body": "for someone"})
    assert status == 201
    status, leased = call(api, "POST", "/v1/lease", {"queues": ["left"]})
    assert [j["id"] for j in leased["jobs"]] == added["ids"]


def test_a_blocked_lease_does_not_hold_the_servers_stop(serve, tmp_path):
    """A graceful stop answers a blocked lease at once, as its timeout would
    ({"jobs": []}): it held `pgq serve` for its 300 s, then for the 10 s of
    fronts.HTTP_STOP_GRACE, and was cut off without an answer."""

    (tmp_path / "token").write_text(TOKEN + "\n")
    served = serve(tmp_path / "token")
    waiting = _post_unread(served.base, "/v1/lease", {"queues": ["held"], "timeout": 300})

    def blocked() -> int:
        status, stats = call(served.base, "GET", "/v1/queues/held")
        return int(stats["blocked"]) if status == 200 else 0

    wait_until(lambda: blocked() == 1, 20, message="the lease to block")
    try:
        # 25 s leaves room for a slow machine; the answer comes at once, the
        # grace (10 s) is for requests that do not wait.
        served.process.terminate()
        returncode = served.process.wait(timeout=25)
        answer = _reply_of(waiting)
    finally:
        if served.process.poll() is None:
            served.process.kill()
        waiting.close()
    output = served.stop()
    assert returncode == 0 and "Traceback" not in output, output
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"jobs":[]}'), answer


def test_a_second_ctrl_c_during_the_graceful_stop_is_an_interrupt(serve, tmp_path, dsn):
    """The first SIGINT stops `pgq serve` gracefully (status 0); a second
    one while that stop waits for a request in flight ends it as an
    interrupt, status 130 (it said 0, as if the stop had been clean, after
    a traceback per task uvicorn cut off). The request in flight: an add
    blocked on a lock of the jobs table."""
    import signal
    import socket

    from .conftest import TableLock

    (tmp_path / "token").write_text(TOKEN + "\n")
    served = serve(tmp_path / "token")
    port = urllib.parse.urlsplit(served.base).port
    lock = TableLock(dsn, "pgq.jobs")
    lock.take()
    adding = _post_unread(served.base, "/v1/queues/held/jobs", {"body": "held"})
    try:
        with psycopg.connect(dsn, autocommit=True) as watcher:
            wait_until(lambda: watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()").fetchone()[0] >= 1, 20,
                message="the add to wait on the lock")

        def refused() -> bool:  # the graceful stop closes the listening socket first
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
            except OSError:
                return True
            return False

        served.process.send_signal(signal.SIGINT)
        wait_until(refused, 20, message="the graceful stop to begin")
        assert served.process.poll() is None  # still waiting for the add (grace: 10 s)

        def interrupted() -> bool:
            # Signals within SECOND_SIGNAL_AFTER (1 s) of the first count as
            # that one (a wrapper that forwards a Ctrl-C the terminal sent
            # too): it takes one sent after that.
            served.process.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                served.process.wait(timeout=0.25)
            return served.process.poll() is not None

        wait_until(interrupted, 8, message="the second Ctrl-C to end it")
        returncode = served.process.returncode
    finally:
        lock.release()
        adding.close()
    output = served.stop()
    assert returncode == 130, output
    assert "stopped at once by a second signal" in output and "Traceback" not in output, output


def test_a_signal_right_after_the_first_is_the_same_ctrl_c():
    # A wrapper (`uv run`, say) forwards the Ctrl-C the terminal also sent
    # to the whole process group: two SIGINTs within milliseconds are one
    # Ctrl-C, and must not cut the graceful stop short.
    from pgq.fronts import SECOND_SIGNAL_AFTER, _repeated

    assert _repeated(100.0, 100.0 + SECOND_SIGNAL_AFTER / 10)
    assert not _repeated(100.0, 100.0 + SECOND_SIGNAL_AFTER)


def test_items_added_before_a_refusal_are_named(api):
    """Items with priorities are added one by one; a refusal part-way (here
    MAXLEN) says which went in, or a client that tries again adds them twice."""
    status, error = call(api, "POST", "/v1/queues/capped/jobs", {"maxlen": 2, "jobs": [
        {"body": "a", "priority": 1}, {"body": "b", "priority": 1}, {"body": "c", "priority": 1}]})
    assert (status, error["error"]) == (409, "MaxLenError") and len(error["ids"]) == 2
    assert "items 1-2 of 3" in error["message"]
    leased = call(api, "POST", "/v1/lease", {"queues": ["capped"], "count": 5})[1]["jobs"]
    assert sorted(j["id"] for j in leased) == sorted(error["ids"])


def test_a_lease_whose_client_left_while_its_claim_ran_puts_the_jobs_back(dsn):
    """The claim is never stopped half-way (its jobs come back from it), and
    the response then went to a closed connection: the jobs waited out their
    retry, and a retry-0 job was lost. In process, so that the client leaves
    exactly while the claim runs."""
    import anyio

    from pgq import AsyncClient
    from pgq.httpapi import create_app

    async def main() -> None:
        async with AsyncClient(dsn) as client:
            job_id = await client.add_job("left-mid", b"x", retry=0)
            app = create_app(client)
            leave, left = anyio.Event(), anyio.Event()
            claim = client.get_job

            async def get_job(*queues, **options):
                with anyio.CancelScope(shield=True):  # as the claim itself: nothing stops it
                    leave.set()
                    await left.wait()  # the server has seen the client leave
                    return await claim(*queues, **options)

            client.get_job = get_job  # type: ignore[method-assign]
            sent = await _lease_left(app, {"queues": ["left-mid"], "timeout": 30}, leave, left)
            assert sent[0]["status"] == 499  # nobody there to read it
            shown = await client.show(job_id)
            assert shown["state"] == "queued" and shown["deliveries"] == 1

    anyio.run(main)


def test_a_parsed_body_counts_in_the_budget_until_its_request_is_answered():
    """A 64 MiB body parses to about 1.3 GiB, alive while its jobs are
    checked and added; released when parsing ended, a second and a third
    such request went in beside it."""
    import anyio
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from pgq import httpjson

    async def handler(request):
        await httpjson.json_body(request)
        return JSONResponse({"counted": httpjson._in_flight})

    app = Starlette(routes=[Route("/", handler, methods=["POST"])],
                    middleware=[Middleware(httpjson.BodyBudget)])
    body = json.dumps({"body": "x" * (3 * httpjson.SMALL_BODY)}).encode()

    async def main() -> None:
        sent = []

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            sent.append((message, httpjson._in_flight))

        scope = {"type": "http", "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/", "raw_path": b"/", "query_string": b"", "root_path": "",
                 "headers": [], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        await app(scope, receive, send)
        counted = json.loads(sent[1][0]["body"])["counted"]
        assert counted == len(body) - httpjson.SMALL_BODY  # still held while it was handled
        # released as its answer starts: a client that does not read a large
        # answer holds none of the budget
        assert [held for _message, held in sent] == [0, 0]
        assert httpjson._in_flight == 0

    anyio.run(main)


def test_a_database_without_its_schema_yet_is_a_503_to_try_again():
    # a node still migrating is unavailable for a moment, not a server error
    from pgq import errors
    from pgq.httpjson import status_of

    assert status_of(errors.SchemaNotReadyError("schema 0019 needed")) == 503
    assert status_of(errors.PgqError("anything else")) == 500


def test_a_request_line_and_headers_past_the_bound_are_refused_before_they_are_read_whole(api):
    # uvicorn's httptools protocol copied a URL of any length on the event
    # loop the fronts share, before Host, token or body checks could run
    # (found by a read-only review). Past fronts.MAX_REQUEST_HEAD: a 400
    # and the connection closed, with far less than the 4 MiB sent.
    import socket

    from pgq.fronts import MAX_REQUEST_HEAD

    host, port = api.rsplit("/", 1)[1].rsplit(":", 1)
    sent = 0
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"GET /health?x=")
        try:
            while sent < 4 * 1024 * 1024:
                sock.sendall(b"a" * 65536)
                sent += 65536
        except OSError:  # closed by the server: what this test wants
            pass
        reply = _reply_of(sock)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:100]
    assert sent < 4 * 1024 * 1024 or MAX_REQUEST_HEAD >= 4 * 1024 * 1024
    # One header too big, never ended: httptools builds a header whole
    # before the protocol hears of it (found by a review of the bound).
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sent = 0
        try:
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\nX-Big: ".encode())
            while sent < 8 * 1024 * 1024:
                sock.sendall(b"v" * 65536)
                sent += 65536
        except OSError:
            pass
        assert _reply_of(sock).startswith(b"HTTP/1.1 400")
        assert sent < 8 * 1024 * 1024
    headers = "".join(f"X-Filler-{i}: {'v' * 100}\r\n" for i in range(2000))  # 230 KB of headers
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        try:
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n{headers}\r\n".encode())
        except OSError:
            pass
        assert _reply_of(sock).startswith(b"HTTP/1.1 400")
    assert call(api, "GET", "/health", token=None)[0] == 200  # the server goes on
    # A body sent in the same write as its head is body, not head (the
    # first version of the bound refused a POST of 100 KB sent so).
    body = json.dumps({"body": "x" * 200_000}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/queues/onewrite/jobs HTTP/1.1\r\nHost: {host}:{port}\r\n"
                     f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert _reply_of(sock).startswith(b"HTTP/1.1 201")


def _lease_scope() -> dict:
    return {"type": "http", "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/lease", "raw_path": b"/v1/lease", "query_string": b"",
            "root_path": "", "headers": [(b"host", b"127.0.0.1")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}


async def _lease_left(app, request: dict, leaves, left) -> list[dict]:
    """One lease served in process whose client leaves once ``leaves`` is
    set (the server then sees it: ``left`` is set); what the server sent."""
    import anyio

    messages = [{"type": "http.request", "body": json.dumps(request).encode(), "more_body": False}]
    sent: list[dict] = []

    async def receive():
        if messages:
            return messages.pop()
        await leaves.wait()
        left.set()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    with anyio.fail_after(30):
        await app(_lease_scope(), receive, send)
    return sent


def test_a_lease_claims_by_what_the_bodies_weigh_not_its_whole_count(dsn):
    """A lease claimed its whole COUNT at once (up to 100,000 bodies in
    memory) before trimming its answer to MAX_LEASE_BYTES (found by a
    read-only review). Now it claims LEASE_CHUNK jobs, then more, each
    claim at most twice the last and within the budget at the weight so
    far: heavy jobs, or light ones followed by heavy ones, load a bounded
    few past the budget; light ones come in a few claims."""
    import anyio

    from pgq import AsyncClient
    from pgq.httpapi import LEASE_CHUNK, MAX_LEASE_BYTES, create_app

    async def main() -> None:
        async with AsyncClient(dsn) as client:
            await client.add_jobs("weighed", [b"x" * (MAX_LEASE_BYTES // 4)] * 40, retry=60)
            await client.add_jobs("mixed", [b"y"] * LEASE_CHUNK, retry=60)
            await client.add_jobs("mixed", [b"z" * 2**20] * 64, retry=60)
            await client.add_jobs("light", [b"l"] * 300, retry=60)
            app = create_app(client)
            claims: list[tuple[int, int]] = []  # (jobs, bytes) of each claim
            claim = client.get_job

            async def get_job(*queues, **options):
                jobs = await claim(*queues, **options)
                claims.append((len(jobs), sum(len(j.body) for j in jobs)))
                return jobs

            client.get_job = get_job  # type: ignore[method-assign]

            async def lease(queue: str, count: int) -> list[dict]:
                sent = []

                async def receive():
                    body = json.dumps({"queues": [queue], "count": count}).encode()
                    return {"type": "http.request", "body": body, "more_body": False}

                async def send(message):
                    sent.append(message)

                await app(_lease_scope(), receive, send)
                return json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["jobs"]

            heavy = await lease("weighed", 40)
            assert len(heavy) == 4 and sum(n for n, _ in claims) <= LEASE_CHUNK
            assert (await client.qstat("weighed"))["len"] == 36  # given back, or never claimed
            claims.clear()
            mixed = await lease("mixed", 80)
            assert LEASE_CHUNK < len(mixed) <= LEASE_CHUNK + 16  # the light ones, then up to 16 MiB of heavy
            assert max(b for _, b in claims) <= 2 * MAX_LEASE_BYTES, claims
            assert sum(n for n, _ in claims) <= 3 * LEASE_CHUNK, claims
            claims.clear()
            light = await lease("light", 300)
            assert len(light) == 300 and len(claims) <= 5, claims

    anyio.run(main)


def test_a_blocking_lease_cancelled_between_its_claims_gives_their_jobs_back(dsn):
    """Claims in chunks (above): a lease cancelled after its first claim
    (its client left while the second ran) kept the first claim's jobs
    leased, found by a review of that change."""
    import anyio

    from pgq import AsyncClient
    from pgq.httpapi import LEASE_CHUNK, create_app

    async def main() -> None:
        async with AsyncClient(dsn) as client:
            await client.add_jobs("between", [b"x"] * (LEASE_CHUNK * 4), retry=0)
            app = create_app(client)
            first_done, left = anyio.Event(), anyio.Event()
            claim = client.get_job

            async def get_job(*queues, **options):
                if first_done.is_set():  # the second claim: the client leaves meanwhile
                    await left.wait()
                    await anyio.sleep_forever()  # cancelled here by the server
                jobs = await claim(*queues, **options)
                first_done.set()
                return jobs

            client.get_job = get_job  # type: ignore[method-assign]
            await _lease_left(app, {"queues": ["between"], "count": LEASE_CHUNK * 4, "timeout": 30},
                              first_done, left)
            assert (await client.qstat("between"))["len"] == LEASE_CHUNK * 4  # all queued again

    anyio.run(main)


def test_a_lease_whose_client_leaves_while_its_tail_goes_back_gives_all_back(dsn):
    """The answer went to nobody when the client left while the jobs past
    the budget were given back: the answered jobs stayed leased (a retry-0
    one lost; found by a review)."""
    import anyio

    from pgq import AsyncClient
    from pgq.httpapi import MAX_LEASE_BYTES, create_app

    async def main() -> None:
        async with AsyncClient(dsn) as client:
            await client.add_jobs("tail", [b"x" * (MAX_LEASE_BYTES // 2 + 1)] * 3, retry=0)
            app = create_app(client)
            trimming, left = anyio.Event(), anyio.Event()
            give_back = client._give_back

            async def giving_back(jobs):
                if not trimming.is_set():  # the trimmed tail: the client leaves meanwhile
                    trimming.set()
                    await left.wait()
                    await anyio.lowlevel.checkpoint()
                await give_back(jobs)

            client._give_back = giving_back  # type: ignore[method-assign]
            sent = await _lease_left(app, {"queues": ["tail"], "count": 3, "timeout": 30},
                                     trimming, left)
            assert sent[0]["status"] == 499
            assert (await client.qstat("tail"))["len"] == 3  # every job queued again

    anyio.run(main)
