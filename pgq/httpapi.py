"""pgq over HTTP: any program adds and consumes jobs with JSON (``pgq serve --http``; module :mod:`pgq.httpapi`).

Routes (JSON in and out; bodies as ``"body"`` text, or ``"body_base64"``):

==========================================  ==========================================
``POST /v1/queues/{queue}/jobs``            add one (``body``) or many (``jobs``: [...]),
                                            with ``priority`` and an idempotency ``key``
``POST /v1/lease``                          get jobs (``queues``, ``count``, ``timeout``)
``POST /v1/jobs/{id}/ack``                  acknowledge
``POST /v1/jobs/{id}/nack``                 back in its queue (``delay`` seconds)
``POST /v1/jobs/{id}/working``              extend the lease (WORKING)
``GET /v1/jobs/{id}``                       status (SHOW)
``POST /v1/jobs/{id}/wait``                 wait until done with (``timeout``)
``GET /v1/queues/{queue}``                  queue statistics (QSTAT)
``GET /health``, ``GET /metrics``           liveness (no auth), Prometheus text
``GET /openapi.json``                       this API, as OpenAPI 3.1
==========================================  ==========================================

Why it is shaped so:

* Every route is one :class:`pgq.AsyncClient` call: the HTTP front has the
  client's semantics and its group commit (concurrent requests share
  statements and commits) and adds none of its own.
* Errors are typed, never a traceback: bad JSON or arguments are 400 with
  the client's message, an unknown job's status 404, a paused or full queue
  409, no replicas, no database or no schema yet 503; the body is
  ``{"error": kind, "message"}``. An ack or nack of an unknown job answers
  its count, 0, as Disque's ACKJOB and NACK do; a working of one is a 404
  (NoJobError), as Disque's WORKING answers -NOJOB.
* ``GET /openapi.json`` describes every answer, errors and successes
  alike (the tests check each answer they get against it).
  A NOREPL also lists the jobs of the call that stayed added (``ids``: a
  client that tries again must leave them out) and those withdrawn.
* A bearer token (``--token-file``) guards every route but ``/health`` and
  ``/openapi.json`` (the API's static description);
  the CLI refuses to listen beyond loopback without one.
"""

from __future__ import annotations

import base64
import binascii
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from . import errors
from .aio import AsyncClient
from .arguments import MAX_COUNT, MAX_IDS, MAX_PRIORITY, MAX_REPLICATE, seconds
from .arguments import count as job_count
from .httpjson import (
    SMALL_BODY,
    BadRequest,
    Busy,
    bearer_matches,
    error_response,
    exception_handlers,
    json_body,
    middleware,
    status_of,
)
from .job import Job
from .jsonable import body_fields, jsonable

__all__ = ["create_app", "OPENAPI"]

_ADD_OPTIONS = ("replicate", "delay", "retry", "ttl", "maxlen", "timeout", "priority")
# The fields each body may hold: any other is refused (a typo such as
# "prority" would otherwise be dropped without a word).
_ITEM_FIELDS = frozenset({"body", "body_base64", "key", "priority"})
_ADD_FIELDS = _ITEM_FIELDS | {"jobs", "async", *_ADD_OPTIONS}
_LEASE_FIELDS = frozenset({"queues", "count", "timeout", "withcounters"})
# The longest a request may wait (a blocking lease, a wait): an HTTP
# request is not a subscription, and each waiting request holds resources.
MAX_WAIT = 300.0
MAX_LEASE_QUEUES = 10_000
# The job bodies one lease answers at most (bytes, before JSON): past it the
# claimed jobs left over go back to their queue (GETJOB's COUNT is "at
# most"). A count of 100 jobs of 16 MiB each was one answer of 1.6 GiB of
# bodies, six times that as JSON text for control characters, built whole
# in memory (found by a read-only review). A lease always answers at least
# one job it claimed.
MAX_LEASE_BYTES = 16 * 1024 * 1024
# A lease claims at most LEASE_CHUNK jobs first, then more (without
# waiting) while its bodies stay under the budget: each claim at most twice
# the one before, at most LEASE_CLAIM_MAX, and no more than the budget left
# holds at the bodies' weight so far. It claimed its whole COUNT at once,
# up to 100,000 bodies loaded in memory before the trim above (2,000 jobs
# of 16 MiB were 32 GiB; found by a read-only review). So a lease loads at
# most its budget plus one claim's bodies (light jobs, then heavy ones: at
# most LEASE_CLAIM_MAX of the heavy), and light jobs come in a few claims.
LEASE_CHUNK = 16
LEASE_CLAIM_MAX = 256
# add_job's defaults, for checking an item before any is added
_CALL_DEFAULTS: dict[str, Any] = {"replicate": None, "delay": 0, "retry": None, "ttl": None,
                                  "maxlen": None, "asynchronous": False, "timeout": None}


def _known(data: dict[str, Any], fields: frozenset[str], what: str) -> None:
    unknown = sorted(set(data) - fields)
    if unknown:
        raise BadRequest(f"{what} has unknown fields {unknown}; it takes {sorted(fields)}")


def _body_of(item: dict[str, Any]) -> bytes:
    if "body_base64" in item:
        if "body" in item:
            raise BadRequest('give a job "body" or "body_base64", not both')
        encoded = item["body_base64"]
        if not isinstance(encoded, str):
            raise BadRequest("body_base64 must be a string of base64")
        try:
            return base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest("body_base64 is not valid base64") from None
    body = item.get("body")
    if not isinstance(body, str):
        raise BadRequest('a job needs "body" (text) or "body_base64"')
    try:
        return body.encode()
    except UnicodeEncodeError:  # a lone surrogate, as JSON's "\ud800" allows
        raise BadRequest('"body" is not valid Unicode text: send the bytes as "body_base64"') from None


def _wait(data: dict[str, Any], default: float) -> float:
    """A request's ``timeout``: seconds to wait, 0 to MAX_WAIT."""
    return seconds("timeout", data.get("timeout", default), maximum=MAX_WAIT)


def _within(jobs: list[Job], limit: int) -> list[Job]:
    """The first jobs whose bodies add up to at most ``limit`` bytes (the
    first job whatever its size)."""
    total = 0
    for n, job in enumerate(jobs):
        total += len(job.body)
        if n and total > limit:
            return jobs[:n]
    return jobs


def _job_json(job: Job) -> dict[str, Any]:
    out: dict[str, Any] = {"id": job.id, "queue": job.queue, **body_fields(job.body)}
    if job.nacks is not None:
        out["nacks"] = job.nacks
        out["additional_deliveries"] = job.additional_deliveries
    return out




Handler = Callable[[Request], Awaitable[Response]]
Handler0 = Callable[[], Awaitable[Response]]


def create_app(client: AsyncClient, token: str | None = None, *,
               allowed_hosts: list[str] | None = None,
               stopping: anyio.Event | None = None) -> Starlette:
    """The HTTP API over ``client`` (see the module doc); with
    ``allowed_hosts`` (:func:`pgq.httpjson.hosts_for`) other Host headers are
    refused (400). Once ``stopping`` is set (a graceful stop), blocked
    leases and waits answer at once, as at the end of their timeout."""

    def authorized(request: Request) -> bool:
        return bearer_matches(request, token)

    def guarded(handler: Handler, public: bool = False) -> Handler:
        async def run(request: Request) -> Response:
            if not public and not _same_origin(request):
                # A web page's request to this API (a form or fetch() to
                # localhost): browsers name the page in Origin; programs
                # send none. Without a token that page could add or ack jobs.
                return error_response("forbidden", "requests from web pages of another origin "
                                      "are refused (no Origin header, or this server's)", 403)
            if token and not public and not authorized(request):
                response = error_response("unauthorized", "send Authorization: Bearer <token>", 401)
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
            try:
                _utf8_path(request)
                return await handler(request)
            except BadRequest as exc:
                response = error_response(exc.kind, str(exc), exc.status)
                if isinstance(exc, Busy):
                    response.headers["Retry-After"] = str(exc.retry_after)
                return response
            except errors.NoReplError as exc:
                # Some jobs of the call may have their copies and stay: say
                # which, or a client that tries again adds them twice.
                return error_response(type(exc).__name__, str(exc), status_of(exc),
                                      ids=list(exc.added), withdrawn=list(exc.removed))
            except errors.PgqError as exc:
                return error_response(type(exc).__name__, str(exc), status_of(exc))
        return run

    async def add(request: Request) -> Response:
        data = await json_body(request)
        _known(data, _ADD_FIELDS, "an add")
        queue = request.path_params["queue"]
        options = {k: data[k] for k in _ADD_OPTIONS if k in data}
        if "timeout" in options:
            # Bounded as every wait here; 0 ("until replicated or the TTL",
            # a day by default) held the request and a connection that long.
            options["timeout"] = seconds("timeout", options["timeout"], maximum=MAX_WAIT,
                                         allow_minimum=False)
        if "async" in data:
            options["asynchronous"] = data["async"]
        if "jobs" in data:
            items = data["jobs"]
            if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
                raise BadRequest('"jobs" must be a list of objects')
            if len(items) > MAX_IDS:
                raise BadRequest(f'"jobs" holds at most {MAX_IDS:,} jobs: add more in several '
                                 'requests')
            for item in items:
                _known(item, _ITEM_FIELDS, "an item of \"jobs\" (options go beside \"jobs\")")
            if "key" in data:
                raise BadRequest('"key" names one job: give each item of "jobs" its own "key"')
            if "body" in data or "body_base64" in data:
                # one job's body beside a list: that job was dropped
                raise BadRequest('"body" and "body_base64" name one job: with "jobs", put each '
                                 'body in its item')
            if any("key" in i or "priority" in i for i in items):
                # per-job keys or priorities: one add each (they still share
                # commits with concurrent requests through the client). Every
                # item is checked first, so bad input adds nothing; a refusal
                # while adding (PAUSED, MAXLEN) leaves the items before it.
                each = [(_body_of(i), {**options, **{k: i[k] for k in ("key", "priority") if k in i}})
                        for i in items]
                for n, (body, item_options) in enumerate(each):
                    client.add_call(queue, [body], **{**_CALL_DEFAULTS, **item_options})
                    if n % 1000 == 999:  # ~20 us an item: others' requests go on meanwhile
                        await anyio.lowlevel.checkpoint()
                ids = []
                try:
                    for body, item_options in each:
                        ids.append(await client.add_job(queue, body, **item_options))
                except errors.PgqError as exc:
                    if not ids:
                        raise
                    # The items before it are in: say which, or a client
                    # that tries again adds them twice.
                    more = ({"withdrawn": list(exc.removed)}
                            if isinstance(exc, errors.NoReplError) else {})
                    return error_response(
                        type(exc).__name__, f"{exc} (items 1-{len(ids)} of {len(each)} were "
                        "added before it: their IDs are in \"ids\")", status_of(exc), ids=ids, **more)
            else:
                ids = await client.add_jobs(queue, [_body_of(i) for i in items], **options)
        else:
            if "key" in data:
                options["key"] = data["key"]
            ids = [await client.add_job(queue, _body_of(data), **options)]
        return JSONResponse({"ids": ids}, status_code=201)

    async def lease(request: Request) -> Response:
        data = await json_body(request, limit=SMALL_BODY)
        _known(data, _LEASE_FIELDS, "a lease")
        queues = data.get("queues")
        if isinstance(queues, str):
            queues = [queues]
        if not isinstance(queues, list) or not queues or not all(isinstance(q, str) for q in queues):
            raise BadRequest('"queues" must name at least one queue')
        if len(queues) > MAX_LEASE_QUEUES:
            # checked on the event loop: 2 million names (one 64 MiB body)
            # held every request about 1.6 s
            raise BadRequest(f'"queues" names at most {MAX_LEASE_QUEUES:,} queues')
        timeout = _wait(data, 0)
        withcounters = data.get("withcounters", True)
        if not isinstance(withcounters, bool):
            raise BadRequest('"withcounters" must be true or false')
        gone = anyio.Event()  # set by _while_connected when the client leaves

        count = job_count(data.get("count", 1))  # a typed 400, as get_job's own check

        async def claim() -> list[Job]:
            step = min(count, LEASE_CHUNK)
            jobs = await client.get_job(*queues, count=step, timeout=timeout or None,
                                        nohang=not timeout, withcounters=withcounters)
            try:
                total = sum(len(j.body) for j in jobs)
                full = len(jobs) == step
                while full and len(jobs) < count and total < MAX_LEASE_BYTES and not gone.is_set():
                    # twice the last claim, no more than LEASE_CLAIM_MAX, nor
                    # than the budget left holds at the bodies' weight so far
                    room = (MAX_LEASE_BYTES - total) * len(jobs) // max(total, 1) + 1
                    step = min(count - len(jobs), step * 2, LEASE_CLAIM_MAX, room)
                    more = await client.get_job(*queues, count=step, nohang=True,
                                                withcounters=withcounters)
                    jobs += more
                    total += sum(len(j.body) for j in more)
                    full = len(more) == step  # else the queues ran dry
            except BaseException:
                # Cancelled between claims (the client left, the server
                # stops): the jobs of the claims before go back to their
                # queue, as a cancelled GET's do (left leased, they waited
                # out their retry, and a retry-0 job was lost).
                with anyio.CancelScope(shield=True):
                    await client._give_back(jobs)
                raise
            return jobs

        async def leased() -> Response:
            jobs = await claim()
            if jobs and gone.is_set():
                # The client left while the claim ran (the claim is never
                # stopped half-way: its jobs come back): nobody reads them.
                # Left leased, they waited out their retry, and a retry-0
                # job was lost. Back in their queue, as for a cancelled GET.
                with anyio.CancelScope(shield=True):
                    await client._give_back(jobs)
                return Response(status_code=499)
            answered = _within(jobs, MAX_LEASE_BYTES)
            if len(answered) < len(jobs):
                with anyio.CancelScope(shield=True):
                    await client._give_back(jobs[len(answered):])
                    if gone.is_set():  # the client left during that: nobody reads the rest
                        await client._give_back(answered)
                        return Response(status_code=499)
            return JSONResponse({"jobs": [_job_json(j) for j in answered]})

        return await _while_connected(request, leased, gone, stopping,
                                      lambda: JSONResponse({"jobs": []})) \
            if timeout else await leased()

    async def ack(request: Request) -> Response:
        return JSONResponse({"acked": await client.ack_job(request.path_params["id"])})

    async def nack(request: Request) -> Response:
        data = await json_body(request, limit=SMALL_BODY)
        _known(data, frozenset({"delay"}), "a nack")
        return JSONResponse({"nacked": await client.nack_job(request.path_params["id"],
                                                             delay=data.get("delay", 0))})

    async def working(request: Request) -> Response:
        return JSONResponse({"retry": await client.working(request.path_params["id"])})

    async def status(request: Request) -> Response:
        info = await client.show(request.path_params["id"])
        if info is None:
            raise errors.NoJobError(f"job {request.path_params['id']} is not known on this node")
        return JSONResponse(jsonable(info))

    async def wait(request: Request) -> Response:
        data = await json_body(request, limit=SMALL_BODY)
        _known(data, frozenset({"timeout"}), "a wait")
        timeout = _wait(data, 30)

        async def waited() -> Response:
            return JSONResponse({"done": await client.wait_job(request.path_params["id"],
                                                               timeout=timeout)})

        return await _while_connected(request, waited, None, stopping,
                                      lambda: JSONResponse({"done": False}))

    async def stats(request: Request) -> Response:
        info = await client.qstat(request.path_params["queue"])
        if info is None:
            raise errors.NoJobError(f"queue {request.path_params['queue']} is not known here")
        return JSONResponse(jsonable(info))

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "node": client.node_id})

    async def metrics(request: Request) -> Response:
        import anyio.to_thread
        from prometheus_client import CollectorRegistry, generate_latest

        from .metrics import _NodeCollector

        registry = CollectorRegistry()
        registry.register(_NodeCollector(client.dsn, None))
        text = await anyio.to_thread.run_sync(generate_latest, registry)
        return PlainTextResponse(text.decode(), media_type="text/plain; version=0.0.4")

    async def openapi(request: Request) -> Response:
        return JSONResponse(OPENAPI)

    routes = [
        Route("/v1/queues/{queue:path}/jobs", guarded(add), methods=["POST"]),
        Route("/v1/lease", guarded(lease), methods=["POST"]),
        Route("/v1/jobs/{id:path}/ack", guarded(ack), methods=["POST"]),
        Route("/v1/jobs/{id:path}/nack", guarded(nack), methods=["POST"]),
        Route("/v1/jobs/{id:path}/working", guarded(working), methods=["POST"]),
        Route("/v1/jobs/{id:path}/wait", guarded(wait), methods=["POST"]),
        Route("/v1/jobs/{id:path}", guarded(status), methods=["GET"]),
        Route("/v1/queues/{queue:path}", guarded(stats), methods=["GET"]),
        Route("/health", guarded(health, public=True), methods=["GET"]),
        Route("/metrics", guarded(metrics), methods=["GET"]),
        Route("/openapi.json", guarded(openapi, public=True), methods=["GET"]),
    ]
    # On loopback only loopback Host names: a page that rebinds its own name
    # to 127.0.0.1 passes the Origin check (its Origin is its Host).
    return Starlette(routes=routes, middleware=middleware(allowed_hosts),
                     exception_handlers=exception_handlers("GET /openapi.json lists the routes"))


async def _while_connected(request: Request, waiting: Handler0,
                           gone: anyio.Event | None = None, stopping: anyio.Event | None = None,
                           stopped: Callable[[], Response] | None = None) -> Response:
    """Run a request that may wait (a blocking lease, a wait), cancelled
    when its client goes away: the server does not cancel it, so a lease
    whose client had left went on waiting, holding its place among the
    blocked GETs, and took the next job for nobody (it then waited out its
    RETRY). The cancellation lands between pgq's statements, in practice in
    the wait; a claim already made stays made. Cancelled as well when the
    server stops (``stopping``), answering ``stopped()`` (nothing came):
    the stop waited for it, then cancelled it without an answer."""
    response: Response = Response(status_code=499)  # nobody is there to read it
    failure: Exception | None = None
    ended_by_stop = False

    async with anyio.create_task_group() as tasks:
        async def watch() -> None:
            # The body is read: the next message is the client leaving.
            while (await request.receive())["type"] != "http.disconnect":
                pass
            if gone is not None:
                gone.set()
            tasks.cancel_scope.cancel()

        async def stop() -> None:
            nonlocal ended_by_stop
            assert stopping is not None
            await stopping.wait()
            ended_by_stop = True
            tasks.cancel_scope.cancel()

        tasks.start_soon(watch)
        if stopping is not None and stopped is not None:
            tasks.start_soon(stop)
        try:
            response = await waiting()
        except Exception as exc:  # raised as itself, not in a task group's ExceptionGroup
            failure = exc
        tasks.cancel_scope.cancel()
    if failure is not None:
        raise failure
    if ended_by_stop and response.status_code == 499 and stopped is not None \
            and not (gone is not None and gone.is_set()):
        return stopped()
    return response


def _utf8_path(request: Request) -> None:
    """The path names queues and jobs: bytes that are not UTF-8 are refused.
    The server decodes them with replacement, so "caf%E9" and "caf%E8" both
    named the queue "caf\ufffd"."""
    raw = request.scope.get("raw_path")
    if raw is None:
        return
    try:
        urllib.parse.unquote_to_bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("the path is not UTF-8 once its %-escapes are decoded: encode queue "
                         "names and job IDs as UTF-8") from None


def _same_origin(request: Request) -> bool:
    origin = request.headers.get("origin")
    return origin is None or origin == f"{request.url.scheme}://{request.headers.get('host', '')}"


_ERROR = {"description": "refused", "content": {"application/json": {"schema": {
    "type": "object", "required": ["error", "message"],
    "properties": {"error": {"type": "string", "description": "the kind, e.g. bad_request, "
                                                                "NoJobError, PausedError"},
                   "message": {"type": "string"},
                   "ids": {"type": "array", "items": {"type": "string"},
                           "description": "an add of items with keys or priorities refused "
                                          "part-way: the IDs of the items added before"},
                   "withdrawn": {"type": "array", "items": {"type": "string"},
                                 "description": "NoReplError: the IDs whose partial copies "
                                                "were withdrawn"}}}}}}
_PARAMETERS = {name: [{"name": name, "in": "path", "required": True, "schema": {"type": "string"},
                       "description": what}]
               for name, what in (("queue", "a queue name, percent-encoded"),
                                  ("id", "a job ID, percent-encoded ('/' and '+' included)"))}


def _op(summary: str, body: dict[str, Any] | None = None, ok: str = "200",
        path: str | None = None, reply: dict[str, Any] | None = None) -> dict[str, Any]:
    done: dict[str, Any] = {"description": "done"}
    if reply is not None:
        done["content"] = {"application/json": {"schema": reply}}
    op: dict[str, Any] = {"summary": summary,
                          "responses": {ok: done,
                                        "400": {**_ERROR, "description": "bad input"},
                                        "401": {**_ERROR, "description": "token missing or wrong"},
                                        "403": {**_ERROR, "description": "from a web page of "
                                                "another origin"},
                                        "404": {**_ERROR, "description": "no such job or queue"},
                                        "409": {**_ERROR, "description": "refused: queue paused "
                                                "or full, too late, node leaving"},
                                        "408": {**_ERROR, "description": "the request body "
                                                "did not arrive in time (PGQ_HTTP_BODY_TIMEOUT, 120 s)"},
                                        "413": {**_ERROR, "description": "a request body over "
                                                "64 MiB (1 MiB for a lease, a nack, a wait): "
                                                "send it in several requests"},
                                        "503": {**_ERROR, "description": "no replicas or no "
                                                "database; or busy reading other large bodies "
                                                "(Retry-After: send it again)"}}}
    if path is not None:
        op["parameters"] = _PARAMETERS[path]
    if body is not None:
        op["requestBody"] = {"content": {"application/json": {"schema": body}}}
    return op


def _reply(required: list[str], **properties: Any) -> dict[str, Any]:
    """A JSON object answered on success (every property listed: a client
    generated from this document reads them all)."""
    return {"type": "object", "required": required, "properties": properties}


_SECONDS: dict[str, Any] = {"type": "number", "minimum": 0}
_JOB_PROPERTIES: dict[str, Any] = {
    "body": {"type": "string"}, "body_base64": {"type": "string"},
    "key": {"type": "string", "description": "idempotency key: the live job holding it is "
            "answered instead of adding"},
    "priority": {"type": "integer", "minimum": 0, "maximum": MAX_PRIORITY,
                 "description": "higher first"}}
_JOB_IN: dict[str, Any] = {"type": "object", "properties": _JOB_PROPERTIES,
                           "additionalProperties": False}
_INT: dict[str, Any] = {"type": "integer", "minimum": 0}
_IDS: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
_OR_NULL = {"integer": {"type": ["integer", "null"]}, "number": {"type": ["number", "null"]},
            "string": {"type": ["string", "null"]}}
# A body comes back as text when it is UTF-8, else as base64 (pgq.jsonable).
_BODY_OUT: dict[str, Any] = {
    "body": {"type": "string", "description": "the body, when it is UTF-8 text"},
    "body_base64": {"type": "string", "description": "the body's bytes, when they are not text"}}
_LEASED = _reply(["id", "queue"], id={"type": "string"}, queue={"type": "string"}, **_BODY_OUT,
                 nacks={**_INT, "description": "with withcounters (the default)"},
                 additional_deliveries={**_INT, "description": "with withcounters (the default)"})
_SHOWN = _reply(
    ["id", "queue", "state"], id={"type": "string"}, queue={"type": "string"},
    state={"type": "string", "description": "queued, active, wait-repl; acked for the "
           "tombstone of a job acknowledged here whose other holders are still being told"},
    repl=_OR_NULL["integer"], ttl={**_OR_NULL["number"], "description": "seconds left"},
    ctime={**_OR_NULL["integer"], "description": "creation, nanoseconds since the epoch"},
    delay=_OR_NULL["number"], retry=_OR_NULL["number"], nacks=_OR_NULL["integer"],
    additional_deliveries=_OR_NULL["integer"], deliveries=_OR_NULL["integer"],
    next_requeue_within={**_OR_NULL["number"], "description": "seconds"},
    next_awake_within={**_OR_NULL["number"], "description": "seconds"},
    **{**_BODY_OUT, "body": {"type": ["string", "null"], "description": "the body, when it "
                             "is UTF-8 text (null for a tombstone)"}},
    nodes_delivered=_IDS, nodes_confirmed=_IDS, priority=_OR_NULL["integer"],
    key=_OR_NULL["string"])
_QUEUE_STATS = _reply(
    ["name", "len"], name={"type": "string"}, len=_INT,
    age={**_SECONDS, "description": "seconds since the queue was made"},
    idle={**_SECONDS, "description": "seconds since its last activity"}, blocked=_INT,
    import_from=_IDS, import_rate=_INT, jobs_in=_INT, jobs_out=_INT,
    pause={"type": "string", "enum": ["none", "in", "out", "all"]})
OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "pgq", "version": "1", "description": "Disque's job queue on PostgreSQL"},
    "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    "security": [{"bearer": []}],
    "paths": {
        "/v1/queues/{queue}/jobs": {"post": _op("Add one job, or many (jobs)", {
            "type": "object", "additionalProperties": False, "properties": {
                **_JOB_PROPERTIES,
                "jobs": {"type": "array", "items": _JOB_IN, "maxItems": MAX_IDS},
                "replicate": {"type": "integer", "minimum": 1, "maximum": MAX_REPLICATE},
                "maxlen": {"type": "integer", "minimum": 1},
                **{k: _SECONDS for k in ("delay", "retry")},
                "ttl": {"type": "number", "exclusiveMinimum": 0},
                "timeout": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_WAIT,
                            "description": "seconds to wait for the copies"},
                "async": {"type": "boolean"}}},
            ok="201", path="queue", reply=_reply(["ids"], ids={**_IDS, "description":
                                                               "the new jobs' IDs, in order"}))},
        "/v1/lease": {"post": _op("Get jobs from queues, left to right", {
            "type": "object", "required": ["queues"], "additionalProperties": False,
            "properties": {
                "queues": {"oneOf": [{"type": "array", "items": {"type": "string"}, "minItems": 1,
                                      "maxItems": MAX_LEASE_QUEUES},
                                     {"type": "string"}]},
                "count": {"type": "integer", "minimum": 1, "maximum": MAX_COUNT,
                          "description": "at most this many jobs: fewer when their bodies "
                                         f"pass {MAX_LEASE_BYTES // 2**20} MiB (the others "
                                         "stay queued)"},
                "timeout": {**_SECONDS, "maximum": MAX_WAIT,
                            "description": "seconds to wait for a job (0: answer at once)"},
                "withcounters": {"type": "boolean"}}},
            reply=_reply(["jobs"], jobs={"type": "array", "items": _LEASED}))},
        "/v1/jobs/{id}/ack": {"post": _op("Acknowledge a job", path="id", reply=_reply(
            ["acked"], acked={**_INT, "description": "1, or 0 for a job not known here"}))},
        "/v1/jobs/{id}/nack": {"post": _op("Put a job back in its queue", {
            "type": "object", "additionalProperties": False,
            "properties": {"delay": _SECONDS}}, path="id", reply=_reply(
                ["nacked"], nacked={**_INT, "description": "1, or 0 for a job not known here"}))},
        "/v1/jobs/{id}/working": {"post": _op("Extend a job's lease", path="id", reply=_reply(
            ["retry"], retry={**_SECONDS, "description": "seconds until it is queued again "
                              "(its RETRY)"}))},
        "/v1/jobs/{id}/wait": {"post": _op("Wait until a job is done with", {
            "type": "object", "additionalProperties": False,
            "properties": {"timeout": {**_SECONDS, "maximum": MAX_WAIT, "default": 30}}},
            path="id", reply=_reply(["done"], done={"type": "boolean", "description":
                                                     "done with: acknowledged (its ACK reached this node), "
                                                     "deleted, expired or dead-lettered"}))},
        "/v1/jobs/{id}": {"get": _op("A job's status", path="id", reply=_SHOWN)},
        "/v1/queues/{queue}": {"get": _op("A queue's statistics", path="queue",
                                          reply=_QUEUE_STATS)},
        "/health": {"get": {"summary": "Liveness", "security": [],
                            "responses": {"200": {"description": "up", "content": {
                                "application/json": {"schema": _reply(
                                    ["status", "node"], status={"const": "ok"},
                                    node={"type": "string", "description": "this node's ID"})}}}}}},
        "/metrics": {"get": {**_op("Prometheus metrics"), "responses": {
            "200": {"description": "metrics", "content": {"text/plain": {"schema": {
                "type": "string"}}}},
            "401": {**_ERROR, "description": "token missing or wrong"},
            "403": {**_ERROR, "description": "from a web page of another origin"}}}},
        "/openapi.json": {"get": {"summary": "This document", "security": [],
                                  "responses": {"200": {"description": "OpenAPI 3.1", "content": {
                                      "application/json": {"schema": {"type": "object"}}}}}}},
    },
}
