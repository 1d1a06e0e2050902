"""A raw HTTP/1.1 client for the bench's HTTP rows: pgq's HTTP API (``pgq
serve --http``) driven like the RESP rows, by the closed loop of
:mod:`.resp_client` (one asyncio loop, keep-alive connections, one request
in flight each), with an HTTP reply parser in place of RESP's.

Requests are written by hand and replies read by Content-Length: an HTTP
library in the client would cost more CPU per request than the server's
reply, and the rows measure the server. No pgq import.
"""

from __future__ import annotations

import json
import socket
import urllib.parse
from collections.abc import Callable
from typing import Any

from . import resp_client
from .resp_client import HOST, Operation


class HttpError(Exception):
    """A reply that is not 2xx."""


def request(method: str, path: str, body: Any = None) -> bytes:
    """One keep-alive request with a JSON body."""
    data = b"" if body is None else json.dumps(body).encode()
    return (f"{method} {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def parse(buffer: bytes | bytearray, pos: int = 0) -> tuple[Any, int] | None:
    """The JSON of the reply starting at ``pos`` and the position after it
    (None until all of it arrived); a non-2xx reply as HttpError."""
    head_end = buffer.find(b"\r\n\r\n", pos)
    if head_end < 0:
        return None
    head = bytes(buffer[pos:head_end]).decode("latin-1").split("\r\n")
    status = int(head[0].split(" ", 2)[1])
    length = next((int(line.split(":", 1)[1]) for line in head[1:]
                   if line.lower().startswith("content-length:")), 0)
    end = head_end + 4 + length
    if len(buffer) < end:
        return None
    payload = bytes(buffer[head_end + 4:end])
    if not 200 <= status < 300:
        return HttpError(f"{status}: {payload[:200]!r}"), end
    return (json.loads(payload) if payload else None), end


def _reply_or_raise(reply: Any) -> Any:
    if isinstance(reply, HttpError):
        raise reply
    return reply


def add(queue: str, body: bytes) -> Callable[[], Operation]:
    """POST /v1/queues/{queue}/jobs: a durable add (201 after the commit)."""
    sent = request("POST", f"/v1/queues/{urllib.parse.quote(queue, safe='')}/jobs",
                   {"body": body.decode()})

    def operation() -> Operation:
        _reply_or_raise((yield sent))

    return operation


def get_ack(queue: str) -> Callable[[], Operation]:
    """POST /v1/lease (no wait), then POST /v1/jobs/{id}/ack of the job."""
    lease = request("POST", "/v1/lease", {"queues": [queue], "count": 1})

    def operation() -> Operation:
        got = _reply_or_raise((yield lease))
        if not got["jobs"]:
            raise RuntimeError("the queue ran dry: prefill more")
        job_id = urllib.parse.quote(got["jobs"][0]["id"], safe="")
        _reply_or_raise((yield request("POST", f"/v1/jobs/{job_id}/ack")))

    return operation


def answers_health(port: int) -> bool:
    """Does ``HOST:port`` answer GET /health with a 2xx?"""
    try:
        with socket.create_connection((HOST, port), timeout=5) as sock:
            sock.sendall(request("GET", "/health"))
            reply = bytearray()
            while (parsed := parse(reply)) is None:
                chunk = sock.recv(4096)
                if not chunk:
                    return False
                reply += chunk
            return not isinstance(parsed[0], HttpError)
    except OSError:
        return False


def served(dsn: str, connections: int, seconds: float,
           operation: Callable[[], Operation]) -> dict[str, Any]:
    """The closed loop against ``pgq serve --http`` on ``dsn`` (see
    :func:`.resp_client.served`)."""
    return resp_client.served(dsn, connections, seconds, operation, front="http",
                              parse_reply=parse, answers=answers_health)
