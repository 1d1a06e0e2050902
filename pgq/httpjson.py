"""The JSON-over-HTTP conventions pgq's two ASGI apps share (the HTTP API,
:mod:`pgq.httpapi`, and the dashboard, :mod:`pgq.dashboard`), so an error
looks the same from both.

* An error is ``{"error": kind, "message": ...}``: bad input 400 (the
  client's message), an unknown job 404, a paused or full queue and the
  other refusals 409, no replicas, no database or no schema yet 503,
  anything else 500.
* A request body is empty (``{}``) or one JSON object; anything else is a
  :class:`BadRequest` saying which.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
from typing import Any

import anyio
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from . import errors

__all__ = ["hosts_for", "BadRequest", "RequestTooLarge", "RequestTimeout", "MAX_REQUEST_BYTES",
           "SMALL_BODY", "error_response", "status_of",
           "json_body", "BodyBudget", "OnlyHosts", "middleware", "bearer_matches",
           "exception_handlers"]

STATUS: list[tuple[type[errors.PgqError], int]] = [
    (errors.NoJobError, 404),
    (errors.PausedError, 409),
    (errors.MaxLenError, 409),
    (errors.TooLateError, 409),
    (errors.LeavingError, 409),
    (errors.NoReplError, 503),
    (errors.DatabaseUnavailableError, 503),
    (errors.SchemaNotReadyError, 503),  # a node still migrating: try again
    (errors.InvalidArgumentError, 400),
    (errors.InvalidTypeError, 400),
    (errors.BadIdError, 400),
]


class BadRequest(Exception):
    """Input the app itself refuses (a body that is not JSON, a missing field): 400."""

    status, kind = 400, "bad_request"


class ClientGone(BadRequest):
    """The client left before its request body arrived: nobody reads the answer."""

    status, kind = 499, "client_gone"


class RequestTooLarge(BadRequest):
    """A request body over MAX_REQUEST_BYTES: 413, refused while it arrives."""

    status, kind = 413, "too_large"


class RequestTimeout(BadRequest):
    """A request body that did not arrive within BODY_TIMEOUT: 408."""

    status, kind = 408, "timeout"


class Busy(BadRequest):
    """Other large request bodies are being read or parsed: 503, try again."""

    status, kind = 503, "busy"
    retry_after = 1  # seconds, sent as Retry-After


# The largest request body read: it is refused as it arrives, never held
# whole (it was read whole, then parsed, then its jobs checked against the
# client's body limit, so a client could make the server hold gigabytes).
# A batch of jobs over this goes in several requests.
MAX_REQUEST_BYTES = 64 * 1024 * 1024
# What the bodies being read and parsed at once may add up to. Parsing JSON
# takes 17-22 times a body's size in memory (a 64 MiB batch of jobs about
# 1.3 GiB, measured): unbounded, a few large requests at once could take
# the server's memory and the node with it. A body that would go past it is
# refused as it arrives (503 and Retry-After: its client sends it again);
# one body alone always fits, and the first SMALL_BODY bytes of each are
# not counted (the usual requests never wait on a large one).
MAX_BODIES_IN_FLIGHT = MAX_REQUEST_BYTES
SMALL_BODY = 1024 * 1024
# How long a whole request body may take to arrive (64 MiB at about half a
# megabyte a second; PGQ_HTTP_BODY_TIMEOUT, seconds). Without a bound, a
# client that declared a large body and stopped sending held its bytes of
# the budget above for as long as it kept the connection, and every other
# large request got 503 (found by a read-only review).
DEFAULT_BODY_TIMEOUT = 120.0


def _body_timeout(text: str | None) -> float:
    if text is None:
        return DEFAULT_BODY_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 3600:
        logging.getLogger("pgq").warning(
            "PGQ_HTTP_BODY_TIMEOUT=%r is not a number of seconds from 0 to 3600: using %g",
            text, DEFAULT_BODY_TIMEOUT)
        return DEFAULT_BODY_TIMEOUT
    return value


BODY_TIMEOUT = _body_timeout(os.environ.get("PGQ_HTTP_BODY_TIMEOUT"))
_in_flight = 0  # bytes of the bodies being read or parsed (one event loop per front)
_HELD = "pgq.body_bytes"  # a request's counted bytes, in its scope, while BodyBudget holds them


class BodyBudget:
    """ASGI middleware: the bytes a request's body counted in the budget
    (MAX_BODIES_IN_FLIGHT) stay counted until its answer starts, not only
    while the body is read and parsed. The parsed body lives on while
    its jobs are checked and added (17-22 times its size): released after
    parsing, a second 64 MiB request went in beside the first one's 1.3 GiB,
    and a third, and so on."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held = scope[_HELD] = [0]

        async def sending(message: Any) -> None:
            # Released as the answer starts: a client that does not read a
            # large answer (the IDs of 100,000 jobs) holds no budget meanwhile.
            if message["type"] == "http.response.start":
                _release(held)
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            _release(held)


def _release(held: list[int]) -> None:
    global _in_flight
    _in_flight -= held[0]
    held[0] = 0


def error_response(kind: str, message: str, status: int, **more: Any) -> JSONResponse:
    """An error as JSON: its kind, a message that says what to do, and
    ``more`` (the IDs of the jobs a failed request added, say)."""
    return JSONResponse({"error": kind, "message": message, **more}, status_code=status)


def status_of(exc: errors.PgqError) -> int:
    return next((status for kind, status in STATUS if isinstance(exc, kind)), 500)


async def json_body(request: Request, limit: int = MAX_REQUEST_BYTES) -> dict[str, Any]:
    """The request's body as a JSON object, read within the size limits
    (its bytes stay counted until the request is answered, under
    :class:`BodyBudget`; without it, until it is parsed). A route that
    takes a few small fields passes ``limit=SMALL_BODY``: such a body is
    never counted, so it cannot hold the budget for a long wait (a lease
    of 300 s sent with 63 MiB of blanks did)."""
    held = request.scope.get(_HELD)
    counted = held if held is not None else [0]  # this body's bytes counted in _in_flight
    try:
        raw = await _read_body(request, counted, limit)
        if len(raw) <= SMALL_BODY:
            return _parse(raw)
        # A large body parses in a thread: a 64 MiB one took the event loop,
        # and every other request with it, for about a second.
        return await anyio.to_thread.run_sync(_parse, raw)
    finally:
        if held is None:
            _release(counted)


async def _read_body(request: Request, counted: list[int], limit: int) -> bytes:
    global _in_flight
    too_large = RequestTooLarge(
        f"the request body is over {limit // 2**20} MiB: "
        + ("add the jobs in several requests" if limit >= MAX_REQUEST_BYTES
           else "this request takes a few small fields"))
    # Leading zeros are legal and unbounded (httptools passes them on), and
    # int() of more than 4,300 digits raises: a 500 before this check.
    declared = request.headers.get("content-length", "").lstrip("0")
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise too_large
    chunks, size = [], 0
    try:
        with anyio.fail_after(BODY_TIMEOUT):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
                more = max(0, size - SMALL_BODY) - counted[0]  # a body's first MiB is free
                if more:
                    if _in_flight + more > MAX_BODIES_IN_FLIGHT:
                        raise Busy("the server is reading other large requests: send this one "
                                   "again in a moment, or in smaller requests")
                    _in_flight += more
                    counted[0] += more
    except ClientDisconnect:
        # gone before its body arrived: nobody reads an answer (not a 500)
        raise ClientGone() from None
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {BODY_TIMEOUT:g} s: "
                             "send it again, or in smaller requests") from None
    return b"".join(chunks)


def _parse(raw: bytes) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        data = json.loads(raw, object_pairs_hook=_no_repeated_keys, parse_float=_number)
    except _RepeatedKey as exc:
        raise BadRequest(f"the request body names {str(exc)!r} twice in one object: "
                         "send each field once") from None
    except json.JSONDecodeError:
        raise BadRequest("the request body is not JSON") from None
    except UnicodeDecodeError:
        raise BadRequest("the request body is not JSON in UTF-8") from None
    except ValueError:  # an integer of more than 4,300 digits (int()'s limit)
        raise BadRequest("a number in the request body has too many digits") from None
    except RecursionError:  # arrays or objects nested about a thousand deep
        raise BadRequest("the request body nests too deeply") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    return data


class _RepeatedKey(ValueError):
    pass


def _number(text: str) -> int | float:
    """A JSON number written with a fraction or an exponent: an int when it
    has no fractional part, as JSON Schema's "integer" says (a client's
    encoder may write a count or a priority as 1.0 or 1e3)."""
    value = float(text)
    # Past 2**53 a float no longer holds every integer: 4611686018427387905.0
    # would come out as 2**62; such a number stays a float (and is refused
    # where an integer is wanted).
    return int(value) if value.is_integer() and abs(value) <= 2 ** 53 else value


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict, refusing a key given twice: json.loads keeps
    the last one, so {"jobs": [A], "jobs": [B]} added B alone and said 201."""
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        for key, _value in pairs:
            if key in seen:
                raise _RepeatedKey(key)
            seen.add(key)
    return data


class OnlyHosts:
    """ASGI middleware: a request whose Host header names none of
    ``allowed_hosts`` (:func:`hosts_for`) is refused, 400, as JSON like every
    other error of these apps (Starlette's TrustedHostMiddleware answered in
    plain text)."""

    def __init__(self, app: Any, allowed_hosts: list[str]) -> None:
        self.app = app
        self.allowed = {host.lower() for host in allowed_hosts}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            host = _host_name(Headers(scope=scope).get("host", ""))
            if host.lower() not in self.allowed:
                response = error_response("bad_host", "this server answers only for the Host "
                                          f"names {', '.join(sorted(self.allowed))}", 400)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def middleware(allowed_hosts: list[str] | None) -> list[Middleware]:
    """Both apps' middleware: the body budget, and the Host check when
    ``allowed_hosts`` names some (:func:`hosts_for`)."""
    stack = [Middleware(BodyBudget)]
    if allowed_hosts:
        stack.append(Middleware(OnlyHosts, allowed_hosts=allowed_hosts))
    return stack


def _host_name(header: str) -> str:
    """A Host header's name, without its port ("[::1]:8080" -> "[::1]")."""
    if header.startswith("["):
        return header[:header.find("]") + 1]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


def hosts_for(listen_host: str) -> list[str] | None:
    """The Host headers a server on ``listen_host`` answers: on loopback
    only loopback names, so a web page elsewhere cannot reach it through DNS
    rebinding (its requests carry the attacker's host name); beyond
    loopback, any (None). Loopback as the CLI judges it (pgq.ports): a name
    that merely began with "127." counted as loopback here and not there,
    so a dashboard on such a name answered its reads without the token the
    CLI had asked for (found by a read-only review)."""
    from .ports import is_loopback

    bare = listen_host[1:-1] if listen_host.startswith("[") and listen_host.endswith("]") \
        else listen_host
    if not is_loopback(bare):
        return None
    names = {"localhost", "127.0.0.1", "::1", "[::1]", bare}
    if ":" in bare:
        names.add(f"[{bare}]")  # as a Host header writes an IPv6 address
    return sorted(names)


def bearer_matches(request: Request, token: str | None) -> bool:
    """Whether the request's Authorization header is ``Bearer <token>``
    (the scheme in any case, HTTP's blanks around the token), compared in
    constant time; never without a token. Starlette decodes a header's
    bytes as latin-1: encoding them back gives the bytes the client sent (a
    UTF-8 token's, say). Only HTTP's blanks are stripped: str.strip() also
    took a UTF-8 token's last byte when it was 0x85 or 0xA0 (latin-1
    spaces)."""
    if not token:
        return False
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip(" \t").encode("latin-1"), token.encode())


def exception_handlers(routes: str, headers: dict[str, str] | None = None) -> dict[Any, Any]:
    """Starlette's own refusals (no such route 404, wrong method 405) and a
    failure nobody foresaw (500) as JSON like every other error, with
    ``headers``; ``routes`` says where the routes are listed. The 500's
    traceback goes to the log, not to the client."""

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        response = error_response(kind, f"{exc.detail}: {request.method} {request.url.path} "
                                  f"({routes})", exc.status_code)
        response.headers.update(headers or {})
        return response

    async def server_error(request: Request, exc: Exception) -> Response:
        response = error_response("internal_error", f"{type(exc).__name__} while serving "
                                  f"{request.method} {request.url.path}; see the server's log",
                                  500)
        response.headers.update(headers or {})
        return response

    return {HTTPException: http_error, Exception: server_error}
