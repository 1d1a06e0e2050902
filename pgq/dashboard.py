"""The web dashboard (``pgq dashboard``, ``pgq node start --dashboard``; module :mod:`pgq.dashboard`).

One small page (``pgq/dashboard_static/``: HTML, vanilla JS, CSS; nothing
to build) shows a node's queues (length, in/out rates, oldest job, paused),
a job (SHOW and its history), the dead letters, and the cluster's nodes, and
polls a JSON endpoint every two seconds for live updates. It is a Starlette
app on the same ASGI stack as the HTTP API (:mod:`pgq.httpapi`).

Routes:

=========================================  ==========================================
``GET /``                                  the page (views: #queues #queue/Q #job/ID
                                           #dead #nodes)
``GET /static/{app.js,style.css}``         its script and style
``GET /api/overview``                      queues with rates, this node, the nodes,
                                           the dead letter count (polled)
``GET /api/queues/{queue}``                QSTAT and the first queued jobs (QPEEK);
                                           also ``/api/queue?name=`` (the page's: "." and
                                           ".." are path segments a browser resolves)
``GET /api/jobs/{id}``                     SHOW, the job's history, its dead letter
``GET /api/dead-letters``                  a page of dead letters (``queue``,
                                           ``after``, ``count``)
``POST /api/dead-letters/requeue``         action: requeue ``ids`` (or a ``queue``'s, 1,000 at a
                                           time: ``more`` says if some are left)
``POST /api/queues/{queue}/pause``         action: ``state`` none, in, out or all (also
                                           ``/api/queue/pause?name=``)
                                           (broadcast to the cluster)
``GET /health``                            liveness (no database)
=========================================  ==========================================

Invariants:

* Read-only by default: an action answers 403 unless the app was given a
  token and the request carries it (``Authorization: Bearer <token>``, as
  the page sends it from sessionStorage). On loopback reads need no token
  (other Host names are refused: DNS rebinding). Beyond loopback the CLI
  refuses to listen without a token, and every ``/api`` read needs it too
  (``private``): job bodies and dead letters are user data, and anyone who
  could reach the port read them. The page, its assets and ``/health``
  hold none.
* Job bodies and every other value are user data: the JSON carries them as
  text (or base64, :mod:`pgq.jsonable`) and the page only ever puts them in
  text nodes, never HTML; a strict Content-Security-Policy (scripts from
  this server only, no inline script, no framing) backs that up.
* Errors are typed as in the HTTP API: bad input 400, an unknown job or
  queue 404, no database 503, ``{"error": kind, "message": ...}``.
* Every action is one :class:`pgq.AsyncClient` call (its semantics: a
  pause is broadcast, a requeue makes new jobs with their copies); the
  views no client command returns are short read-only SQL on the public
  views (``pgq.queue_stats``, ``pgq.cluster_nodes``, ``pgq.job_history``,
  ``pgq.dead_letter_jobs``) with a 5 s statement timeout.
* Rates are per second over the last ~10 s of the queues' ``jobs_in`` and
  ``jobs_out`` counters, sampled by the server at most once a second
  whatever the number of viewers (``null`` until two samples exist).
* The app owns its client: its lifespan closes the client and the read pool.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import html
import string
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import resources
from typing import Any

import anyio
import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from . import errors
from .aio import AsyncClient
from .contracts import meta
from .dsn import connection_settings
from .httpjson import (
    BadRequest,
    bearer_matches,
    error_response,
    exception_handlers,
    hosts_for,
    json_body,
    middleware,
    status_of,
)
from .ids import millis_from_id
from .jsonable import jsonable

__all__ = ["create_app", "PAUSE_STATES", "hosts_for"]

PAUSE_STATES = ("none", "in", "out", "all")
RATE_WINDOW = 10.0  # seconds of counters a rate is measured over
SAMPLE_EVERY = 1.0  # the server keeps at most one counter sample a second
MAX_QUEUES = 200  # the longest queues shown
DEAD_COUNT_CAP = 10_000  # the dead letter count is exact up to here ("10000+" beyond)
REQUEUE_BATCH = 1000  # dead letters requeued by one action (one transaction)
PEEK = 20  # queued jobs shown on a queue's view
PREVIEW = 200  # characters of a body shown in lists
STATEMENT_TIMEOUT_MS = 5000
_STATIC = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self'; base-uri 'none'; "
                               "form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

# ------------------------------------------------------------------ SQL

QUEUES = """
SELECT queue, length, active, waiting_repl, jobs_in, jobs_out, oldest_age_seconds, paused, blocked
FROM pgq.queue_stats ORDER BY length DESC, queue LIMIT %s
"""
THIS_NODE = f"""
SELECT node_id, coalesce({meta('node_name')}, ''), active, leaving, reachable_nodes
FROM pgq.cluster_state
"""
NODES = """
SELECT name, id, host || ':' || port, status, leaving, myself,
       extract(epoch FROM statement_timestamp() - updated_at)::double precision
FROM pgq.cluster_nodes ORDER BY NOT myself, name, id
"""
DEAD_COUNT = "SELECT count(*) FROM (SELECT 1 FROM pgq.dead_letters LIMIT %s) AS d"
# A job's history rows: from its creation (the time its ID encodes, or
# now if that is ahead, less an hour of clock skew) on, through the BRIN index on finished_at; history
# has no index on id (every ack would pay for one), and the view asked for
# every row of it, up to a day or 10 million, every 2 s while a job was
# shown (found by a read-only review).
HISTORY = """
SELECT seq, outcome, created_at, delivered_at, finished_at, lifetime_seconds,
       deliveries, nacks, additional_deliveries, retry, repl, body_size
FROM pgq.job_history
WHERE finished_at >= least(to_timestamp(%s), statement_timestamp()) - interval '1 hour' AND id = %s
ORDER BY seq DESC LIMIT 20
"""
DEAD_LETTER = """
SELECT seq, queue, reason, created_at, died_at, deliveries, nacks, additional_deliveries,
       retry, repl, body_size, body
FROM pgq.dead_letter_jobs WHERE id = %s ORDER BY seq DESC LIMIT 1
"""
# Lists show a preview of each body: only its first bytes are read (and
# its size). The views read whole bodies (QPEEK, the dead letters' page) to
# show 200 characters, every 2 s while a page was open: 100 dead letters of
# 16 MiB were 1.6 GiB out of PostgreSQL and seconds of the fronts' event
# loop each time (found by a read-only review). PREVIEW_BYTES: enough for
# PREVIEW characters of UTF-8, and one more to tell a longer body.
PREVIEW_BYTES = PREVIEW * 4 + 1
PEEK_PREVIEW = """
SELECT id, substring(body FOR %s), octet_length(body) FROM (
    (SELECT id, body, priority, ctime FROM pgq.jobs
     WHERE queue = %s AND state = 'queued' AND priority > 0 AND expires_at > pgq.now()
     ORDER BY priority DESC, ctime LIMIT %s)
    UNION ALL
    (SELECT id, body, priority, ctime FROM pgq.jobs
     WHERE queue = %s AND state = 'queued' AND priority = 0 AND expires_at > pgq.now()
     ORDER BY ctime LIMIT %s)
) AS peek
ORDER BY priority DESC, ctime LIMIT %s
"""
_DEAD_PAGE = """
SELECT seq, id, queue, reason, nacks, additional_deliveries, deliveries, died_at,
       substring(body FOR %s), octet_length(body)
FROM pgq.dead_letters WHERE {where} ORDER BY seq LIMIT %s
"""
DEAD_PAGE = _DEAD_PAGE.format(where="seq > %s")
DEAD_PAGE_OF_QUEUE = _DEAD_PAGE.format(where="queue = %s AND seq > %s")
_DEAD_PAGE_KEYS = ("seq", "id", "queue", "reason", "nacks", "additional_deliveries", "deliveries",
                   "died_at")
_QUEUE_KEYS = ("name", "length", "active", "waiting_repl", "jobs_in", "jobs_out",
               "oldest_age", "paused", "blocked")
_NODE_KEYS = ("name", "id", "bus", "status", "leaving", "myself", "seen_ago")
_HISTORY_KEYS = ("seq", "outcome", "created_at", "delivered_at", "finished_at", "lifetime",
                 "deliveries", "nacks", "additional_deliveries", "retry", "repl", "body_size")
_DEAD_KEYS = ("seq", "queue", "reason", "created_at", "died_at", "deliveries", "nacks",
              "additional_deliveries", "retry", "repl", "body_size", "body")




# ------------------------------------------------------------ reading


class _Reader:
    """Read-only SQL for what no client command returns: one small pool on
    the client's database, opened on first use."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._pool: AsyncConnectionPool | None = None
        self._opening = anyio.Lock()

    async def _open(self) -> AsyncConnectionPool:
        async with self._opening:
            if self._pool is None:
                await self._client.open()
                self._pool = AsyncConnectionPool(
                    self._client.dsn, min_size=1, max_size=2, open=False, timeout=5.0,
                    # prepare_threshold None: every statement planned with
                    # its values (a page polls every 2 s; generic plans
                    # made on an empty table are what pgq's own statements
                    # are written against, and these are not).
                    kwargs={"autocommit": True, "prepare_threshold": None,
                            **connection_settings(self._client.dsn,
                                                  f"-c statement_timeout={STATEMENT_TIMEOUT_MS}",
                                                  "pgq-dashboard", default_name="pgq-dashboard")},
                    name="pgq-dashboard")
                await self._pool.open(wait=False)
            return self._pool

    async def many(self, *statements: tuple[str, Sequence[Any] | None]) -> list[list[tuple[Any, ...]]]:
        """The rows of each statement, run in turn on one connection."""
        pool = await self._open()
        try:
            async with pool.connection() as conn:
                results = []
                for statement, params in statements:
                    cursor = await conn.execute(statement, params)
                    results.append(await cursor.fetchall())
                return results
        except (psycopg.OperationalError, PoolTimeout) as exc:
            raise errors.DatabaseUnavailableError(f"the dashboard cannot read the database: {exc}") from exc

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()


# -------------------------------------------------------------- rates


@dataclass
class _Rates:
    """Per-second rates of the queues' counters over the last ~RATE_WINDOW s."""

    clock: Callable[[], float] = time.monotonic
    samples: deque[tuple[float, dict[str, tuple[int, int]]]] = field(default_factory=deque)

    def update(self, counters: dict[str, tuple[int, int]]) -> dict[str, tuple[float | None, float | None]]:
        now = self.clock()
        if not self.samples or now - self.samples[-1][0] >= SAMPLE_EVERY:
            self.samples.append((now, counters))
        while len(self.samples) > 1 and now - self.samples[1][0] >= RATE_WINDOW:
            self.samples.popleft()  # keep the newest sample at least a window old
        while len(self.samples) > 1 and now - self.samples[0][0] > 2 * RATE_WINDOW:
            # After a quiet spell (no viewer for an hour) the oldest sample is
            # an hour old: the "live" rate was the hour's average.
            self.samples.popleft()
        then, before = self.samples[0]
        elapsed = now - then
        return {queue: _rate_pair(before.get(queue), now_counts, elapsed)
                for queue, now_counts in counters.items()}


def _rate_pair(before: tuple[int, int] | None, now: tuple[int, int],
               elapsed: float) -> tuple[float | None, float | None]:
    if before is None or elapsed < SAMPLE_EVERY / 2:
        return None, None
    return _rate(before[0], now[0], elapsed), _rate(before[1], now[1], elapsed)


def _rate(then: int, now: int, elapsed: float) -> float | None:
    """Per second; None when the counter went back (its queue was removed and made again)."""
    return round((now - then) / elapsed, 2) if now >= then else None


# ------------------------------------------------------------- shaping


def _queue_json(row: tuple[Any, ...], rates: tuple[float | None, float | None]) -> dict[str, Any]:
    out: dict[str, Any] = jsonable(dict(zip(_QUEUE_KEYS, row, strict=True)))
    out["in_rate"], out["out_rate"] = rates
    return out


def _this_node(rows: list[tuple[Any, ...]]) -> dict[str, Any]:
    node_id, name, active, leaving, reachable = rows[0] if rows else ("", "", False, False, 1)
    return {"id": node_id, "name": name, "active": bool(active), "leaving": bool(leaving),
            "reachable": int(reachable)}


def _preview(prefix: bytes, size: int) -> dict[str, Any]:
    """A body for a list, from its first bytes and its size: at most
    PREVIEW characters of its text, or of its base64 when those bytes are
    not UTF-8 (a character cut at the end of the prefix is dropped)."""
    raw = bytes(prefix)
    for cut in range(4 if len(raw) < size else 1):
        try:
            text = raw[:len(raw) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        return {"body": text[:PREVIEW], "truncated": len(text) > PREVIEW or len(raw) < size}
    shown = base64.b64encode(raw[:PREVIEW * 3 // 4]).decode()
    return {"body_base64": shown, "truncated": size > PREVIEW * 3 // 4}


def _created_at(ctime: Any) -> str | None:
    if not isinstance(ctime, int):
        return None
    return datetime.fromtimestamp(ctime / 1e9, UTC).isoformat()


def _queue_name(request: Request) -> str:
    """The queue of /api/queues/{queue}, or of /api/queue?name=. The page
    uses the second: a browser resolves a path segment "." or ".." (and
    "%2e") before sending it, so queues of those names could not be opened
    from it, nor paused."""
    if "queue" in request.path_params:
        return str(request.path_params["queue"])
    name = request.query_params.get("name")
    if name is None:
        raise BadRequest('say which queue: "name"')
    return name


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    text = request.query_params.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise errors.InvalidArgumentError(f"{name} must be an integer, not {text!r}") from None
    if not low <= value <= high:
        raise errors.InvalidArgumentError(f"{name} must be between {low} and {high}")
    return value




# ---------------------------------------------------------------- page


@functools.cache
def _asset(name: str) -> str:
    return (resources.files("pgq") / "dashboard_static" / name).read_text(encoding="utf-8")


def _page(actions: bool, private: bool = False) -> str:
    return string.Template(_asset("index.html")).substitute(
        actions=html.escape("true" if actions else "false", quote=True),
        private=html.escape("true" if private else "false", quote=True))


# ----------------------------------------------------------------- app

Handler = Callable[[Request], Awaitable[Response]]






def _carries(token: str | None, request: Request) -> bool:
    """Whether the request carries the dashboard token (as the HTTP API
    reads it: the same bytes, scheme in any case; compared in constant time)."""
    return bearer_matches(request, token)


def _refusal(token: str | None, request: Request) -> JSONResponse | None:
    """403 unless actions are enabled and the request carries the token."""
    if not token:
        return error_response("read_only", "this dashboard is read-only: start it with --token-file "
                                   "to allow actions", 403)
    if not _carries(token, request):
        return error_response("forbidden", "this action needs the dashboard token "
                                   "(Authorization: Bearer <token>)", 403)
    return None


def _unauthorized(token: str | None, request: Request) -> JSONResponse | None:
    """401 unless the request carries the token (a private dashboard's reads)."""
    if _carries(token, request):
        return None
    return error_response("unauthorized", "this dashboard listens beyond loopback: its data "
                          "needs the dashboard token (Authorization: Bearer <token>)", 401)


def create_app(client: AsyncClient, token: str | None = None, *,
               clock: Callable[[], float] = time.monotonic,
               allowed_hosts: list[str] | None = None, private: bool = False) -> Starlette:
    """The dashboard over ``client`` (see the module doc); actions need
    ``token``; with ``allowed_hosts`` other Host headers are refused (400);
    ``private``: the ``/api`` reads need ``token`` too (beyond loopback)."""
    reader = _Reader(client)
    rates = _Rates(clock)

    def handle(handler: Handler, action: bool = False, data: bool = True) -> Handler:
        async def run(request: Request) -> Response:
            try:
                if action:
                    refused = _refusal(token, request)
                elif private and data:
                    refused = _unauthorized(token, request)
                else:
                    refused = None
                response = refused or await handler(request)
            except BadRequest as exc:
                response = error_response(exc.kind, str(exc), exc.status)
            except errors.PgqError as exc:
                response = error_response(type(exc).__name__, str(exc), status_of(exc))
            response.headers.update(_HEADERS)
            return response
        return run

    async def page(request: Request) -> Response:
        return HTMLResponse(_page(bool(token), private))

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in _STATIC:
            return error_response("not_found", f"no such file: {name}", 404)
        return Response(_asset(name), media_type=_STATIC[name])

    async def overview(request: Request) -> Response:
        queues, node, nodes, dead = await reader.many(
            (QUEUES, (MAX_QUEUES,)), (THIS_NODE, None), (NODES, None), (DEAD_COUNT, (DEAD_COUNT_CAP + 1,)))
        measured = rates.update({r[0]: (int(r[4]), int(r[5])) for r in queues})
        this = _this_node(node)
        listed = [jsonable(dict(zip(_NODE_KEYS, r, strict=True))) for r in nodes]
        for entry in listed:
            if entry["myself"] and not this["active"]:
                entry["status"] = "no node process"
        return JSONResponse({
            "queues": [_queue_json(r, measured[r[0]]) for r in queues],
            "node": this, "nodes": listed, "clustered": len(listed) > 1,
            "dead_letters": min(int(dead[0][0]), DEAD_COUNT_CAP),
            "dead_letters_more": int(dead[0][0]) > DEAD_COUNT_CAP,
            "actions": bool(token), "time": datetime.now(UTC).isoformat(),
        })

    async def queue(request: Request) -> Response:
        name = _queue_name(request)
        stats = await client.qstat(name)
        if stats is None:
            raise errors.NoJobError(f"queue {name!r} is not known on this node")
        [jobs] = await reader.many((PEEK_PREVIEW, (PREVIEW_BYTES, name, PEEK, name, PEEK, PEEK)))
        return JSONResponse({"queue": jsonable(stats),
                             "jobs": [{"id": job_id, **_preview(prefix, size)}
                                      for job_id, prefix, size in jobs]})

    async def job(request: Request) -> Response:
        job_id = request.path_params["id"]
        info = await client.show(job_id)  # a malformed ID: BadIdError (400)
        made = millis_from_id(job_id) / 1000.0
        history, dead = await reader.many((HISTORY, (made, job_id)), (DEAD_LETTER, (job_id,)))
        if info is None and not history and not dead:
            raise errors.NoJobError(f"job {job_id} is not known on this node")
        shown = None if info is None else {**jsonable(info), "created_at": _created_at(info.get("ctime"))}
        return JSONResponse({
            "id": job_id, "job": shown,
            "history": [jsonable(dict(zip(_HISTORY_KEYS, r, strict=True))) for r in history],
            "dead_letter": jsonable(dict(zip(_DEAD_KEYS, dead[0], strict=True))) if dead else None,
        })

    async def dead_letters(request: Request) -> Response:
        queue_name = request.query_params.get("queue") or None
        after = _int_param(request, "after", 0, 0, 2**63 - 1)
        count = _int_param(request, "count", 50, 1, 500)
        [rows] = await reader.many(
            (DEAD_PAGE_OF_QUEUE, (PREVIEW_BYTES, queue_name, after, count)) if queue_name
            else (DEAD_PAGE, (PREVIEW_BYTES, after, count)))
        items = [{**jsonable(dict(zip(_DEAD_PAGE_KEYS, r[:-2], strict=True))), **_preview(r[-2], r[-1])}
                 for r in rows]
        return JSONResponse({"dead_letters": items,
                             "next": items[-1]["seq"] if len(items) == count else 0})

    async def requeue(request: Request) -> Response:
        data = await json_body(request)
        ids, queue_name = data.get("ids"), data.get("queue")
        if ids is not None and (not isinstance(ids, list) or not ids
                                or not all(isinstance(i, str) for i in ids)):
            raise BadRequest('"ids" must be a non-empty list of job IDs')
        if queue_name is not None and not isinstance(queue_name, str):
            raise BadRequest('"queue" must be a queue name')
        if ids is None and queue_name is None:
            raise BadRequest('say what to requeue: "ids" and/or "queue"')
        # One transaction of at most REQUEUE_BATCH: a queue's dead letters
        # beyond it stay, and "more" says so (the cap was silent: a click on
        # a queue of 5,000 requeued 1,000 and said nothing of the rest).
        if ids is not None and len(ids) > REQUEUE_BATCH:
            raise BadRequest(f'at most {REQUEUE_BATCH} "ids" at a time')
        new_ids = await client.requeue_dead_letters(queue_name, ids=ids, count=REQUEUE_BATCH)
        # "more": some are left, or another call is requeueing them (locked
        # rows are skipped): the page says so, a script may call again.
        more = ids is None and bool((await reader.many(
            (DEAD_PAGE_OF_QUEUE, (1, queue_name, 0, 1)) if queue_name else (DEAD_PAGE, (1, 0, 1))))[0])
        return JSONResponse({"requeued": new_ids, "more": more})

    async def pause(request: Request) -> Response:
        data = await json_body(request)
        state = data.get("state")
        if state not in PAUSE_STATES:
            raise BadRequest(f'"state" must be one of {", ".join(PAUSE_STATES)}')
        name = _queue_name(request)
        return JSONResponse({"queue": name, "paused": await client.pause(name, state, "bcast")})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await reader.close()
                await client.close()

    routes = [
        Route("/", handle(page, data=False), methods=["GET"]),
        Route("/static/{name}", handle(static, data=False), methods=["GET"]),
        Route("/api/overview", handle(overview), methods=["GET"]),
        Route("/api/dead-letters", handle(dead_letters), methods=["GET"]),
        Route("/api/dead-letters/requeue", handle(requeue, action=True), methods=["POST"]),
        Route("/api/queues/{queue:path}/pause", handle(pause, action=True), methods=["POST"]),
        Route("/api/queues/{queue:path}", handle(queue), methods=["GET"]),
        Route("/api/queue/pause", handle(pause, action=True), methods=["POST"]),  # ?name=
        Route("/api/queue", handle(queue), methods=["GET"]),  # ?name=: what the page uses
        Route("/api/jobs/{id:path}", handle(job), methods=["GET"]),
        Route("/health", handle(health, data=False), methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan, middleware=middleware(allowed_hosts),
                     exception_handlers=exception_handlers("the page at / uses them", _HEADERS))


# ----------------------------------------------------- in another thread
