"""Disque's client protocol (RESP2) on pgq: ``pgq serve --resp HOST:PORT``.

Programs written for Disque (its clients exist in most languages) talk to
pgq unchanged: commands, reply types and error prefixes follow Disque's
(``../shared/reference/disque-commands.md``), for the commands listed in
:data:`COMMANDS`. Every command is one :class:`pgq.AsyncClient` call, so
requests arriving on many connections at once share statements and commits
(the client's group commit), as Disque shares an fsync per event-loop turn;
a reply is written only after its commit.

The module is in three parts, each testable alone: :class:`Parser` (bytes
in, commands out, no I/O), :func:`encode` (reply values to bytes), and
:class:`Session` (one connection's commands against a client). The server
(:func:`serve`) is the thin anyio loop around them. Invariants:

* A connection's replies come in the order of its commands (pipelining).
* A malformed request closes the connection after an ``-ERR Protocol
  error`` reply, as Redis and Disque do; a bad command is one ``-ERR``.
* Whatever goes wrong in one command is that command's ``-ERR`` (logged),
  and whatever goes wrong on one connection closes that connection only:
  the server and its other connections go on.
* A port beyond loopback requires AUTH (``--token-file``): until then
  every command but AUTH, PING and QUIT gets ``-NOAUTH``.
"""

from __future__ import annotations

import fnmatch
import hmac
import logging
import math
import os
import re
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from . import commands, errors
from .accepting import accept_forever
from .aio import AsyncClient
from .arguments import DEFAULT_TTL, MAX_QUEUE_NAME_BYTES, MAX_REPLICATE
from .job import Job

__all__ = ["Parser", "ProtocolError", "Status", "Error", "NULL_ARRAY", "encode", "Session",
           "serve", "COMMANDS"]

log = logging.getLogger("pgq.resp")

MAX_BULK = 512 * 1024 * 1024  # Disque's (Redis's) limit on one argument
MAX_ARGS = 1024 * 1024
# One request's arguments together, as Redis's client-query-buffer-limit: a
# million arguments of 512 MiB each were all accepted and buffered.
MAX_REQUEST = 1024 * 1024 * 1024
# Before AUTH (when a password is set), as Redis: a client that has not
# authenticated could otherwise make the server hold 512 MiB per connection.
UNAUTHENTICATED_BULK = 16 * 1024
UNAUTHENTICATED_ARGS = 10
# Disque's maxclients (10000 by default; PGQ_RESP_MAX_CLIENTS): each
# connection may buffer a request of up to MAX_REQUEST bytes, so without a
# cap a client could open connections until the server's memory ran out
# (found by a read-only review). A connection past it gets Redis's error
# and is closed.
DEFAULT_MAX_CLIENTS = 10_000
TOO_MANY_CLIENTS = b"-ERR max number of clients reached\r\n"


class ProtocolError(Exception):
    """The bytes are not RESP: the connection is closed after one error."""


@dataclass(frozen=True)
class Status:
    text: str


@dataclass(frozen=True)
class Error:
    text: str  # with its prefix: "ERR ...", "NOREPL ..."


class _NullArray:
    pass


NULL_ARRAY = _NullArray()


class Parser:
    """RESP2 requests (arrays of bulk strings, or inline commands) from a
    byte stream fed in pieces."""

    def __init__(self, max_bulk: int = MAX_BULK, max_args: int = MAX_ARGS) -> None:
        self._buffer = bytearray()
        self.max_bulk, self.max_args = max_bulk, max_args
        # The array being read, kept between pieces: parsing it again from
        # its start at every piece made a large request (ACKJOB of 80k IDs)
        # cost seconds of the event loop, quadratic in its size.
        self._args: list[bytes] | None = None
        self._count = 0  # its length
        self._position = 0  # where its next argument starts in the buffer
        self._declared = 0  # the bytes its arguments said they hold, so far

    def feed(self, data: bytes) -> list[list[bytes]]:
        """Every complete command of the stream so far."""
        self.add(data)
        commands: list[list[bytes]] = []
        while (command := self.take()) is not None:
            commands.append(command)
        return commands

    def add(self, data: bytes) -> None:
        self._buffer += data

    def buffered(self) -> int:
        """Bytes received and not yet taken as commands."""
        return len(self._buffer)

    def take(self) -> list[bytes] | None:
        """The next complete command (None: none yet), so that a server
        can change the limits between commands (after AUTH)."""
        while True:
            command = self._one()
            if command is None or command:
                return command

    def _line(self, start: int, end_mark: bytes = b"\r\n") -> tuple[bytes, int] | None:
        end = self._buffer.find(end_mark, start)
        # Whole or not: a line of 1 MiB that arrived with its end (pipelined
        # behind a blocked GETJOB) was split on the shared event loop.
        if (end if end >= 0 else len(self._buffer)) - start > MAX_INLINE:
            raise ProtocolError("too big inline request")
        if end < 0:
            return None
        return bytes(self._buffer[start:end]), end + len(end_mark)

    def _one(self) -> list[bytes] | None:
        if not self._buffer:
            return None
        if self._buffer[0:1] != b"*":  # inline command: words on one line
            # Ended by LF, a CR before it optional, as Redis reads it
            # (`printf 'PING\n' | nc` hung here until 64 KiB piled up).
            line = self._line(0, b"\n")
            if line is None:
                return None
            text, used = line
            del self._buffer[:used]
            return split_inline(text.removesuffix(b"\r"))
        if self._args is None:
            head = self._line(0)
            if head is None:
                return None
            count = _number(head[0][1:], self.max_args, "invalid multibulk length")
            self._args, self._count, self._position, self._declared = [], max(count, 0), head[1], 0
        args = self._args
        while len(args) < self._count:
            line = self._line(self._position)
            if line is None:
                return None
            text, start = line
            if text[0:1] != b"$":
                raise ProtocolError(f"expected '$', got '{text[0:1].decode(errors='replace')}'")
            # Never negative: a size of -100 moved the position back, so the
            # buffer never shrank and feed() looped for ever on one request.
            size = _number(text[1:], self.max_bulk, "invalid bulk length", minimum=0)
            if self._declared + size > MAX_REQUEST:
                raise ProtocolError("request too large")
            if len(self._buffer) < start + size + 2:
                return None  # this argument's header is read again: one line
            args.append(bytes(self._buffer[start:start + size]))
            self._declared += size
            self._position = start + size + 2
        del self._buffer[:self._position]
        self._args = None
        return args


MAX_INLINE = 64 * 1024  # bytes of an inline command's line (Redis: PROTO_INLINE_MAX_SIZE)
_SPACE = frozenset(b" \t\n\r\v\f\0")  # skipped between arguments (isspace, and NUL)
_WORD_END = frozenset(b" \t\n\r\0")  # ends an unquoted word (\v and \f do not)
# An unquoted word: starts at no blank, ends at a _WORD_END (lines with no quote)
_UNQUOTED = re.compile(rb"[^ \t\n\r\v\f\0][^ \t\n\r\0]*")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = {ord("n"): ord("\n"), ord("r"): ord("\r"), ord("t"): ord("\t"), ord("b"): 8, ord("a"): 7}


def split_inline(line: bytes) -> list[bytes]:
    """An inline command's arguments, as Redis reads them (``sdssplitargs``):
    words between blanks; "double quotes" with escapes (\\n \\r \\t \\b
    \\a \\xHH, any other character escaped as itself) and 'single quotes'
    (only \\' escaped) make one argument each, spaces and all. A closing
    quote must end its argument; an unbalanced quote is a ProtocolError.
    Splitting on blanks only made ``ADDJOB q "hello world" 0`` (typed in
    redis-cli or telnet) add the body '"hello' with a timeout of 'world"'.

    One departure: Redis ends the line at a NUL byte; here a NUL separates
    arguments outside quotes and is kept inside them (a byte a client
    meant to send)."""
    if b'"' not in line and b"'" not in line:  # the common case, at C speed
        return _UNQUOTED.findall(line)
    args: list[bytes] = []
    i, end = 0, len(line)
    while True:
        while i < end and line[i] in _SPACE:
            i += 1
        if i == end:
            return args
        current = bytearray()
        quote = 0  # the open quote's byte, 0: none
        while True:
            c = line[i] if i < end else None
            if quote:
                if c is None:
                    raise ProtocolError("unbalanced quotes in request")
                if c == quote:  # must end its argument
                    if i + 1 < end and line[i + 1] not in _SPACE:
                        raise ProtocolError("unbalanced quotes in request")
                    i += 1
                    break
                if c != ord("\\") or i + 1 == end:
                    current.append(c)
                elif quote == ord("'"):  # only \' is an escape
                    if line[i + 1] == ord("'"):
                        i += 1
                    current.append(line[i])
                elif line[i + 1] == ord("x") and i + 3 < end and line[i + 2] in _HEX \
                        and line[i + 3] in _HEX:
                    current.append(int(line[i + 2:i + 4], 16))
                    i += 3
                else:
                    i += 1
                    current.append(_ESCAPES.get(line[i], line[i]))
            elif c is None or c in _WORD_END:
                break
            elif c in (ord('"'), ord("'")):
                quote = c
            else:
                current.append(c)
            i += 1
        args.append(bytes(current))


def _number(text: bytes, limit: int, what: str, minimum: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ProtocolError(what) from None
    if value > limit or (minimum is not None and value < minimum):
        raise ProtocolError(what)
    return value


_NO_LINE_BREAKS = str.maketrans("\r\n", "  ")


def encode(value: Any, resp3: bool = False) -> bytes:
    """A reply value as RESP2 (or RESP3): Status, Error, int, bytes/str
    (bulk), None (null bulk), NULL_ARRAY, list (array), dict (RESP3 map; a
    flat array in RESP2)."""
    if resp3 and (value is None or value is NULL_ARRAY):
        return b"_\r\n"
    if isinstance(value, dict):
        if resp3:
            return b"%%%d\r\n" % len(value) + b"".join(
                encode(k, resp3) + encode(v, resp3) for k, v in value.items())
        return encode([x for pair in value.items() for x in pair])
    if isinstance(value, Status):
        return b"+" + value.text.encode() + b"\r\n"
    if isinstance(value, Error):
        # Every CR and LF becomes a space (as Redis 6.2+): a lone LF in a
        # multi-line message (a libpq error's) ended the reply line early
        # for clients that read up to LF (redigo: "bad response line
        # terminator", and the connection dropped).
        return b"-" + value.text.translate(_NO_LINE_BREAKS).encode() + b"\r\n"
    if isinstance(value, bool):
        return b":%d\r\n" % int(value)
    if isinstance(value, int):
        return b":%d\r\n" % value
    if value is None:
        return b"$-1\r\n"
    if value is NULL_ARRAY:
        return b"*-1\r\n"
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return b"$%d\r\n%s\r\n" % (len(data), data)
    if isinstance(value, str):
        return encode(value.encode())
    if isinstance(value, float):
        return encode(f"{value:g}")
    if isinstance(value, (list, tuple)):
        return b"*%d\r\n" % len(value) + b"".join(encode(v, resp3) for v in value)
    raise TypeError(f"cannot encode {type(value).__name__}")


# Disque's error texts, by pgq error (the prefix is what clients switch on).
def _disque_error(exc: errors.PgqError) -> Error:
    if isinstance(exc, errors.BadIdError):
        return Error("BADID Invalid Job ID format.")
    if isinstance(exc, errors.NoReplError):
        return Error(f"NOREPL {exc}")
    if isinstance(exc, errors.PausedError):
        return Error("PAUSED Queue paused in input, try later")
    if isinstance(exc, errors.MaxLenError):
        return Error("MAXLEN Queue is already longer than the specified MAXLEN count")
    if isinstance(exc, errors.NoJobError):
        return Error("NOJOB Job not known in the context of this node.")
    if isinstance(exc, errors.TooLateError):
        return Error("TOOLATE Half of job TTL already elapsed, you are no longer allowed to "
                     "postpone the next delivery.")
    if isinstance(exc, errors.LeavingError):
        return Error("LEAVING This node is leaving the cluster, please connect to a different one")
    return Error(f"ERR {exc}")


class _Syntax(Exception):
    pass


def _text(arg: bytes) -> str:
    try:
        return arg.decode()
    except UnicodeDecodeError:
        raise _Syntax("ERR invalid UTF-8 in a name") from None


def _job_id(arg: bytes) -> str:
    """A job ID argument: not UTF-8 is not an ID (Disque's BADID, as for any
    malformed one), where a name gets a syntax error."""
    try:
        return arg.decode()
    except UnicodeDecodeError:
        raise _Syntax("BADID Invalid Job ID format.") from None


def _int(arg: bytes, what: str, error: str | None = None) -> int:
    """A signed 64-bit integer, as Disque's (an int of hundreds of digits
    overflowed later, in a division by 1000)."""
    error = error or f"ERR {what} is not an integer or out of range"
    try:
        value = int(arg)
    except ValueError:
        raise _Syntax(error) from None
    if not -2**63 <= value < 2**63:
        raise _Syntax(error)
    return value


# A scan cursor encodes the last key seen (a queue name or job ID, at most
# MAX_QUEUE_NAME_BYTES): it is no 64-bit number, unlike Disque's.
_CURSOR_DIGITS = len(str(2 ** (8 * MAX_QUEUE_NAME_BYTES)))


def _scan_cursor(arg: bytes) -> int:
    """A QSCAN/JSCAN cursor: 0 or one a previous reply gave (the client
    checks it decodes to a key). Read with _int, every cursor past the
    first page was refused."""
    if len(arg) > _CURSOR_DIGITS:
        raise _Syntax("ERR cursor is not an integer or out of range")
    return int(arg)


def _check_addjob(options: dict[str, Any]) -> None:
    """ADDJOB's option checks, with Disque's words (src/job.c); the client
    checks again, and answers what Disque has no word for (a fractional
    REPLICATE, a priority, a key)."""
    replicate, delay, retry = options.get("replicate"), options.get("delay"), options.get("retry")
    ttl = options.get("ttl")
    if replicate is not None and not 1 <= replicate <= MAX_REPLICATE:
        raise _Syntax(f"ERR REPLICATE must be between 1 and {MAX_REPLICATE}")
    if delay is not None and delay < 0:
        raise _Syntax("ERR DELAY time must be a non negative number")
    if retry is not None and retry < 0:
        raise _Syntax("ERR RETRY time must be a non negative number")
    if ttl is not None and ttl <= 0:
        raise _Syntax("ERR TTL must be a number > 0")
    if options.get("maxlen") is not None and options["maxlen"] <= 0:
        raise _Syntax("ERR MAXLEN must be a positive number")
    if delay is not None and delay >= (ttl if ttl is not None else DEFAULT_TTL):
        raise _Syntax("ERR The specified DELAY is greater than TTL. Job refused since would "
                      "never be delivered")
    if retry == 0 and replicate is not None and replicate > 1:  # a default W is one copy here
        raise _Syntax("ERR With RETRY set to 0 please explicitly set  REPLICATE to 1 "
                      "(at-most-once delivery)")


def _float(arg: bytes, what: str) -> float:
    try:
        return float(arg)
    except ValueError:
        raise _Syntax(f"ERR {what} is not a number") from None


def _whole_retry(retry: float) -> int:
    """A RETRY in whole seconds, as Disque's clients read it; a fraction
    (pgq's ADDJOB takes RETRY 0.5) rounds up: 0 would read as at most once."""
    return math.ceil(retry)


def _job_reply(job: Job, withcounters: bool) -> list[Any]:
    reply: list[Any] = [job.queue, job.id, bytes(job.body)]
    if withcounters:
        reply += ["nacks", job.nacks or 0, "additional-deliveries", job.additional_deliveries or 0]
    return reply


# SHOW as Disque replies it: its 15 fields in its order (pgq.commands adds
# `deliveries` and orders them its own way).
_SHOW_KEYS = ("id", "queue", "state", "repl", "ttl", "ctime", "delay", "retry", "nacks",
              "additional_deliveries", "nodes_delivered", "nodes_confirmed",
              "next_requeue_within", "next_awake_within", "body")


def _number_or_null(value: Any) -> Any:
    if value is None:
        return None
    return int(value) if float(value).is_integer() else value


class Session:
    """One connection's commands, run against an :class:`AsyncClient`."""

    def __init__(self, client: AsyncClient, password: str | None = None,
                 address: str | None = None, max_clients: int = DEFAULT_MAX_CLIENTS) -> None:
        self.client = client
        self.password = password
        self.address = address  # HOST:PORT this connection reached (HELLO's own entry)
        self.max_clients = max_clients  # the server's cap (CONFIG GET maxclients)
        self.authenticated = password is None
        self.resp3 = False  # after HELLO 3 (redis-py 8 asks for it on connect)
        # Jobs GETJOB claimed for this connection whose reply is not written
        # yet: if the connection ends first (closed, reset, the server
        # stopping), _connection puts them back in their queue.
        self.unsent: list[Job] = []

    async def run(self, args: list[bytes]) -> Any:
        name = args[0].decode(errors="replace").lower()
        handler = COMMANDS.get(name)
        if handler is None:
            # At most 128 characters of it, as Redis: a 64 MiB name echoed
            # whole took the event loop for seconds and a GiB of memory.
            return Error(f"ERR unknown command '{name[:128]}'")
        if not self.authenticated and name not in ("auth", "ping", "quit", "hello"):
            return Error("NOAUTH Authentication required.")
        if len(args) - 1 < _AT_LEAST.get(name, 0):  # Disque's arity -2: one argument at least
            return Error(f"ERR wrong number of arguments for '{name}' command")
        try:
            return await handler(self, args[1:])
        except _Syntax as exc:
            return Error(str(exc))
        except errors.PgqError as exc:
            return _disque_error(exc)
        except Exception as exc:  # a bug of ours: one -ERR, never the whole server
            log.exception("pgq resp: %s failed", name.upper())
            return Error(f"ERR internal error in {name.upper()} ({type(exc).__name__}): "
                         "see the server's log")

    # -------------------------------------------------------------- server

    async def ping(self, args: list[bytes]) -> Any:
        return args[0] if args else Status("PONG")

    async def auth(self, args: list[bytes]) -> Any:
        if len(args) == 2:  # AUTH user password (Redis 6): the user is ignored
            args = args[1:]
        if len(args) != 1:
            raise _Syntax("ERR wrong number of arguments for 'auth' command")
        if self.password is None:
            return Error("ERR Client sent AUTH, but no password is set")
        if not hmac.compare_digest(args[0], self.password.encode()):
            return Error("ERR invalid password")
        self.authenticated = True
        return Status("OK")

    async def hello(self, args: list[bytes]) -> Any:
        if args:  # Redis 6's handshake, which Disque lacks and redis-py >= 8 sends
            return self._handshake(args)
        if not self.authenticated:
            return Error("NOAUTH Authentication required.")
        info = await self.client.hello()
        nodes = [[n["id"], *self._client_address(n), str(n["priority"])] for n in info["nodes"]]
        return [1, info.get("id", self.client.node_id), *nodes]

    def _node_flags(self, node: dict[str, Any]) -> str:
        """CLUSTER NODES' flags, pings and link, as Disque: myself, leaving,
        fail? (suspected), fail (dead or left) or noflags; the link
        connected while the node is believed alive (pings: not tracked, 0)."""
        status = node.get("status", "alive")
        flags = ["myself"] if node["id"] == self.client.node_id else []
        if node.get("leaving"):
            flags.append("leaving")
        if status == "suspect":
            flags.append("fail?")
        elif status in ("dead", "left"):
            flags.append("fail")
        link = "connected" if status in ("alive", "suspect") else "disconnected"
        return f"{','.join(flags) or 'noflags'} 0 0 {link}"

    def _client_address(self, node: dict[str, Any]) -> tuple[str, str]:
        """Where a Disque client reaches ``node`` (HELLO, CLUSTER NODES):
        this front at the address the connection came to; another node at
        the RESP address it advertised over the bus; a node serving no RESP
        front at its bus address (the Python API's ``hello()`` gives these)."""
        if node["id"] == self.client.node_id and self.address:
            address = self.address
        elif node.get("resp"):
            address = str(node["resp"])
        else:
            return node.get("host") or "", str(node.get("port") or "")
        host, _, port = address.rpartition(":")
        return host, port

    def _handshake(self, args: list[bytes]) -> Any:
        """``HELLO protover [AUTH user pass] [SETNAME name]``: the RESP
        version (2 or 3) and the password; the server's map in reply.
        Disque answers an error here, so RESP3 clients (redis-py >= 8, which
        pydisque uses) could not talk to it at all; pgq answers."""
        version = _int(args[0], "protocol version")
        if version not in (2, 3):
            return Error("NOPROTO unsupported protocol version")
        rest = args[1:]
        while rest:
            word = rest[0].lower()
            if word == b"auth" and len(rest) >= 3:
                reply = self._check_password(rest[2])
                if reply is not None:
                    return reply
                rest = rest[3:]
            elif word == b"setname" and len(rest) >= 2:
                rest = rest[2:]
            else:
                raise _Syntax("ERR syntax error in HELLO option")
        if not self.authenticated:
            return Error("NOAUTH HELLO must be called with the client already authenticated, "
                         "otherwise the HELLO AUTH <user> <pass> option can be used")
        self.resp3 = version == 3
        return {"server": "pgq", "version": "1.0.0", "proto": version,
                "id": self.client.node_id, "mode": "standalone", "role": "master",
                "modules": []}

    def _check_password(self, given: bytes) -> Error | None:
        if self.password is None:
            return None
        if not hmac.compare_digest(given, self.password.encode()):
            return Error("WRONGPASS invalid username-password pair")
        self.authenticated = True
        return None

    async def info(self, args: list[bytes]) -> Any:
        info = await self.client.info()
        lines = ["# Server", "disque_version:pgq", f"node_id:{self.client.node_id}"]
        for key, value in sorted(info.items()):
            if not isinstance(value, (dict, list)):
                lines.append(f"{key}:{value}")
        lines.append(f"registered_queues:{info.get('queues', 0)}")  # Disque's name for it
        return ("\r\n".join(lines) + "\r\n").encode()

    # -------------------------------------------------------------- jobs

    async def addjob(self, args: list[bytes]) -> Any:
        if len(args) < 3:
            raise _Syntax("ERR wrong number of arguments for 'addjob' command")
        queue, body, timeout_ms = _text(args[0]), args[1], _int(args[2], "timeout")
        if timeout_ms < 0:
            raise _Syntax("ERR timeout is negative")
        # 0: wait until replicated or expired (Disque), not the client's 5 s.
        options: dict[str, Any] = {"timeout": timeout_ms / 1000}
        rest = args[3:]
        i = 0
        while i < len(rest):
            word = rest[i].lower()
            if word == b"async":
                options["asynchronous"] = True
                i += 1
                continue
            if i + 1 >= len(rest) or word not in _ADDJOB_OPTIONS:
                raise _Syntax("ERR syntax error")
            value = rest[i + 1]
            key = word.decode()
            if key == "key":  # pgq: an idempotency key
                options[key] = _text(value)
            elif key in ("replicate", "maxlen", "priority"):
                options[key] = _int(value, key.upper())
            else:
                options[key] = _float(value, key.upper())
            i += 2
        _check_addjob(options)
        return Status(await self.client.add_job(queue, body, **options))

    async def getjob(self, args: list[bytes]) -> Any:
        nohang, timeout_ms, count, withcounters = False, 0, 1, False
        i = 0
        while i < len(args) and args[i].lower() != b"from":
            word = args[i].lower()
            if word == b"nohang":
                nohang = True
            elif word == b"withcounters":
                withcounters = True
            elif word == b"count" and i + 1 < len(args):
                count = _int(args[i + 1], "COUNT", "ERR COUNT must be a number greater than zero")
                if count <= 0:
                    raise _Syntax("ERR COUNT must be a number greater than zero")
                i += 1
            elif word == b"timeout" and i + 1 < len(args):
                timeout_ms = _int(args[i + 1], "TIMEOUT")
                if timeout_ms < 0:
                    raise _Syntax("ERR timeout is negative")
                i += 1
            else:
                raise _Syntax("ERR syntax error")
            i += 1
        queues = [_text(q) for q in args[i + 1:]]
        if i >= len(args) or not queues:
            raise _Syntax("ERR syntax error")
        jobs = await self.client.get_job(*queues, count=count,
                                         timeout=timeout_ms / 1000 if timeout_ms else None,
                                         nohang=nohang, withcounters=withcounters)
        self.unsent += jobs  # at once: a cancellation may land at the next await
        if not jobs:
            return NULL_ARRAY
        return [_job_reply(job, withcounters) for job in jobs]

    async def _ids(self, args: list[bytes], call: Callable[..., Awaitable[int]]) -> Any:
        if not args:
            return 0
        return await call(*[_job_id(a) for a in args])

    async def ackjob(self, args: list[bytes]) -> Any:
        return await self._ids(args, self.client.ack_job)

    async def fastack(self, args: list[bytes]) -> Any:
        return await self._ids(args, self.client.fast_ack)

    async def nack(self, args: list[bytes]) -> Any:
        return await self._ids(args, self.client.nack_job)

    async def enqueue(self, args: list[bytes]) -> Any:
        return await self._ids(args, self.client.enqueue)

    async def dequeue(self, args: list[bytes]) -> Any:
        return await self._ids(args, self.client.dequeue)

    async def deljob(self, args: list[bytes]) -> Any:
        return await self._ids(args, self.client.del_job)

    async def working(self, args: list[bytes]) -> Any:
        if len(args) != 1:
            raise _Syntax("ERR wrong number of arguments for 'working' command")
        retry = await self.client.working(_job_id(args[0]))
        return _whole_retry(retry)

    async def show(self, args: list[bytes]) -> Any:
        if len(args) != 1:
            raise _Syntax("ERR wrong number of arguments for 'show' command")
        info = await self.client.show(_job_id(args[0]))
        if info is None or self._collected(info):
            return None
        return self._show_reply(info)

    def _collected(self, info: dict[str, Any]) -> bool:
        """An acknowledged job Disque would have freed already: no other
        holder is left for its ACK to reach (or none held it). pgq keeps the
        tombstone a while longer (late copies, the Python API's SHOW), but
        Disque's clients read a null SHOW as "done": goware/disque's Wait
        polls SHOW until then."""
        return info["state"] == "acked" and not set(info["nodes_delivered"]) - {self.client.node_id}

    async def waitjob(self, args: list[bytes]) -> Any:
        """``WAITJOB id [TIMEOUT ms]`` (pgq): block until the job is done
        with (acknowledged anywhere, deleted, expired): ``:1``; ``:0`` after
        the timeout (0 or none: forever). A native form of what Disque's
        clients do by polling SHOW (antirez/disque#168)."""
        if len(args) not in (1, 3) or (len(args) == 3 and args[1].lower() != b"timeout"):
            raise _Syntax("ERR syntax error, try WAITJOB <id> [TIMEOUT <ms>]")
        timeout_ms = _int(args[2], "TIMEOUT") if len(args) == 3 else 0
        if timeout_ms < 0:
            raise _Syntax("ERR timeout is negative")
        done = await self.client.wait_job(_job_id(args[0]), timeout_ms / 1000 if timeout_ms else None)
        return int(done)

    # -------------------------------------------------------------- queues

    async def qlen(self, args: list[bytes]) -> Any:
        if len(args) != 1:
            raise _Syntax("ERR wrong number of arguments for 'qlen' command")
        return await self.client.qlen(_text(args[0]))

    async def qpeek(self, args: list[bytes]) -> Any:
        if len(args) != 2:
            raise _Syntax("ERR wrong number of arguments for 'qpeek' command")
        count = _int(args[1], "count")
        if count == 0:  # Disque: nothing to peek (pgq's Python API refuses 0)
            return []
        jobs = await self.client.qpeek(_text(args[0]), count)
        return [_job_reply(job, False) for job in jobs]

    async def qstat(self, args: list[bytes]) -> Any:
        if len(args) != 1:
            raise _Syntax("ERR wrong number of arguments for 'qstat' command")
        stat = await self.client.qstat(_text(args[0]))
        if stat is None:
            return NULL_ARRAY
        reply: list[Any] = []
        for key in ("name", "len", "age", "idle", "blocked", "import_from", "import_rate",
                    "jobs_in", "jobs_out", "pause"):
            value = stat.get(key)
            if isinstance(value, float):
                value = int(value)
            reply += [key.replace("_", "-"), list(value) if isinstance(value, list) else value]
        return reply

    async def qscan(self, args: list[bytes]) -> Any:
        cursor, options = self._scan_args(args, ("count", "minlen", "maxlen", "importrate"),
                                          flags=("busyloop",))
        busyloop = options.pop("busyloop", False)
        for bound in ("minlen", "maxlen"):  # Disque: MAXLEN -1 (or MINLEN 0) is no bound
            if bound in options and options[bound] < (0 if bound == "maxlen" else 1):
                del options[bound]
        found = await self.client.qscan(cursor, **options)
        queues = list(found[1])
        while busyloop and found[0] != 0:  # BUSYLOOP: every page, one reply, cursor 0
            found = await self.client.qscan(found[0], **options)
            queues += found[1]
        return [str(found[0]).encode(), queues]

    async def jscan(self, args: list[bytes]) -> Any:
        cursor, options = self._scan_args(args, ("count", "queue", "state", "reply"),
                                          flags=("busyloop",), repeat=("state",))
        reply = str(options.get("reply", "id")).lower()
        if reply not in ("id", "all"):
            raise _Syntax("ERR Invalid REPLY type, try ID or ALL")
        # Case-blind, as Disque's jobStateFromString (strcasecmp) and the
        # other flags here: STATE QUEUED was refused (found by a review).
        states = [str(state).lower() for state in options.get("state", [])]
        if any(state not in commands.JOB_STATES for state in states):
            raise _Syntax("ERR Invalid job state name")
        page = {"count": options.get("count", 100), "queue": options.get("queue"),
                "states": states, "reply": reply}
        next_cursor, items = await self.client.jscan(cursor, **page)
        items = list(items)
        while options.get("busyloop") and next_cursor != 0:  # every page, one reply, cursor 0
            next_cursor, more = await self.client.jscan(next_cursor, **page)
            items += more
        if reply == "id":
            out: list[Any] = [Status(str(i)) for i in items]
        else:
            out = [self._show_reply(i) for i in items]
        return [str(next_cursor).encode(), out]

    def _scan_args(self, args: list[bytes], keys: tuple[str, ...], flags: tuple[str, ...] = (),
                   repeat: tuple[str, ...] = ()) -> tuple[int, dict[str, Any]]:
        """A scan's cursor (a bare number anywhere) and its options."""
        cursor: int | None = None
        options: dict[str, Any] = {}
        i = 0
        while i < len(args):
            word = args[i].lower().decode(errors="replace")
            if word in flags:
                options[word] = True
                i += 1
            elif word in keys and i + 1 < len(args):
                value: Any = _text(args[i + 1])
                if word in ("count", "minlen", "maxlen", "importrate"):
                    value = _int(args[i + 1], word.upper())
                if word in repeat:
                    options.setdefault(word, []).append(value)
                else:
                    options[word] = value
                i += 2
            elif args[i].isdigit() and cursor is None:
                cursor = _scan_cursor(args[i])
                i += 1
            else:
                raise _Syntax("ERR syntax error")
        return cursor or 0, options

    def _show_reply(self, info: dict[str, Any]) -> list[Any]:
        reply: list[Any] = []
        acked = info["state"] == "acked"
        for key in _SHOW_KEYS:
            value = info.get(key)
            if acked and value is None:
                # pgq keeps a tombstone, not the job: what it no longer
                # knows goes out as Disque's types (its clients read an
                # integer: goware/disque's Fetch failed on a null repl)
                value = b"" if key == "body" else 0
            if key in ("nodes_delivered", "nodes_confirmed"):
                value = list(value or [])
            elif key in ("next_requeue_within", "next_awake_within") and value is not None:
                value = int(float(value) * 1000)
            elif key == "retry" and value is not None:
                value = _whole_retry(value)
            elif key in ("ttl", "delay") and value is not None:
                value = int(value)  # whole seconds, as Disque (its clients read integers)
            elif isinstance(value, float):
                value = _number_or_null(value)
            reply += [key.replace("_", "-"), value]
        return reply

    async def cluster(self, args: list[bytes]) -> Any:
        sub = args[0].lower() if args else b""
        if sub == b"myid":
            return self.client.node_id.encode()  # a bulk string, as Disque's
        if sub == b"nodes":
            info = await self.client.hello()
            lines = [f"{n['id']} {':'.join(self._client_address(n))} {self._node_flags(n)}"
                     for n in info["nodes"]]
            return ("\n".join(lines) + "\n").encode()
        if sub == b"leaving" and len(args) == 1:
            me = [n for n in (await self.client.hello())["nodes"] if n["id"] == self.client.node_id]
            return Status("yes" if me and me[0]["leaving"] else "no")
        if sub == b"leaving" and len(args) == 2 and args[1].lower() in (b"yes", b"no"):
            await self.client.cluster_leaving(args[1].lower() == b"yes")
            return Status("OK")
        if sub == b"meet" and len(args) == 3:  # CLUSTER MEET ip port (the node's bus)
            host = _text(args[1])
            host = f"[{host}]" if ":" in host else host  # IPv6
            await self.client.cluster_meet(f"{host}:{_int(args[2], 'port')}")
            return Status("OK")
        raise _Syntax("ERR CLUSTER subcommands here: MYID, NODES, MEET <ip> <port>, "
                      "LEAVING [yes|no] (forget a node with `pgq cluster forget`)")

    async def config(self, args: list[bytes]) -> Any:
        """``CONFIG GET pattern``: what a Disque client or operator asks,
        answered from pgq's state; settings are changed in PostgreSQL and on
        the node's command line, so ``CONFIG SET`` says so."""
        sub = args[0].lower() if args else b""
        if sub == b"get" and len(args) == 2:
            if len(args[1]) > MAX_CONFIG_PATTERN:
                # fnmatch compiles a pattern to a regex, on the event loop:
                # 1 MB took 3 s and 160 MiB (every connection waited)
                raise _Syntax(f"ERR a CONFIG GET pattern is at most {MAX_CONFIG_PATTERN} bytes")
            pattern = _text(args[1]).lower()
            reply: list[Any] = []
            for name, value in self._config().items():
                if fnmatch.fnmatchcase(name, pattern):
                    reply += [name, value]
            return reply
        if sub in (b"set", b"rewrite"):
            return Error("ERR CONFIG SET/REWRITE: pgq's settings live in PostgreSQL "
                         "(durability: synchronous_commit) and on the node's command line")
        if sub == b"resetstat" and len(args) == 1:
            return Status("OK")
        raise _Syntax("ERR CONFIG subcommands here: GET <pattern>, RESETSTAT")

    def _config(self) -> dict[str, str]:
        # Durable like Disque's "appendonly yes, appendfsync always": every
        # reply follows a PostgreSQL commit flushed to the WAL.
        return {"appendonly": "yes", "appendfsync": "always",
                "requirepass": "" if self.password is None else "(set)",
                "maxmemory": "0", "maxmemory-policy": "noeviction",
                "maxclients": str(self.max_clients)}

    async def debug(self, args: list[bytes]) -> Any:
        """``DEBUG SLEEP seconds`` and ``DEBUG ERROR message``: the harmless
        part of Disque's DEBUG, which client test suites use. The rest
        (segfault, restart, flushall...) has no pgq meaning or is a
        database operation: refused with a clear error."""
        sub = args[0].lower() if args else b""
        if sub == b"sleep" and len(args) == 2:
            import anyio

            await anyio.sleep(max(0.0, _float(args[1], "seconds")))
            return Status("OK")
        if sub == b"error" and len(args) == 2:
            return Error(_text(args[1]))
        raise _Syntax("ERR DEBUG subcommands here: SLEEP <seconds>, ERROR <message> "
                      "(to empty a queue, DELJOB its jobs or drop it in PostgreSQL)")

    async def pause(self, args: list[bytes]) -> Any:
        if len(args) < 2:
            raise _Syntax("ERR wrong number of arguments for 'pause' command")
        flags = [_text(a).lower() for a in args[1:]]
        if any(flag not in commands.PAUSE_FLAGS for flag in flags):
            raise _Syntax("ERR syntax error")
        return Status(await self.client.pause(_text(args[0]), *flags))


COMMANDS: dict[str, Callable[[Session, list[bytes]], Awaitable[Any]]] = {
    name: getattr(Session, name) for name in (
        "ping", "auth", "hello", "info", "addjob", "getjob", "ackjob", "fastack", "nack",
        "enqueue", "dequeue", "deljob", "working", "show", "qlen", "qpeek", "qstat", "pause",
        "qscan", "jscan", "cluster", "waitjob", "config", "debug")
}

# The commands of arity -2 in Disque (at least one argument) that would
# otherwise answer a syntax error or their help.
_AT_LEAST = {"getjob": 1, "cluster": 1, "config": 1, "debug": 1}

# ADDJOB's options with a value: Disque's, then pgq's own (PRIORITY, KEY).
_ADDJOB_OPTIONS = (b"replicate", b"delay", b"retry", b"ttl", b"maxlen", b"priority", b"key")


_GONE = object()  # the client closed its connection while its command blocked
MAX_CONFIG_PATTERN = 256  # the longest setting name is 30 bytes


# What a blocked command's watcher reads of the commands pipelined behind
# it, at most: past it, reading stops until the command ends (a closed
# connection is then seen only after it).
MAX_PIPELINED = 1 << 20


def _may_block(command: list[bytes]) -> bool:
    """GETJOB without NOHANG, WAITJOB and DEBUG SLEEP wait: the connection
    is watched meanwhile (see _run_watched). NOHANG counts only among
    GETJOB's options, before FROM: a queue may be named "nohang"."""
    name = command[0].lower()
    if name in (b"waitjob", b"debug"):
        return True
    if name != b"getjob":
        # Before any argument is looked at: lowercasing every argument
        # copied an ADDJOB's body (7 ms per 16 MiB one), found by a review.
        return False
    for arg in command[1:]:
        option = arg.lower()
        if option == b"from":
            return True
        if option == b"nohang":
            return False
    return True


async def _run_watched(stream: Any, parser: Parser, session: Session,
                       command: list[bytes]) -> Any:
    """Run a command that may block while reading the connection: a client
    that closes it cancels the command, as Disque unblocks a client it
    frees (_GONE). It went on blocking for nobody, holding its place among
    the blocked GETs, and took the next job for a closed socket (that job
    then waited for its RETRY). Bytes that arrive meanwhile (commands
    pipelined behind it) are kept for after it, and reading goes on (a
    client that sent one and then closed was no longer watched, and its
    GETJOB took a job for nobody) up to MAX_PIPELINED bytes, so a client
    cannot make the server buffer without bound. A cancellation
    lands between the command's statements (pgq's own are shielded), in
    practice in its wait: a claim already made is not undone, and its jobs
    (Session.unsent) go back to their queue when the connection ends.
    They waited out their RETRY, and a RETRY 0 job was never delivered."""
    import anyio

    gone = False
    reply: Any = _GONE
    async with anyio.create_task_group() as tasks:
        async def watch() -> None:
            nonlocal gone
            try:
                while parser.buffered() < MAX_PIPELINED:
                    parser.add(await stream.receive(65536))
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                gone = True
                tasks.cancel_scope.cancel()

        tasks.start_soon(watch)
        reply = await session.run(command)
        tasks.cancel_scope.cancel()
    return _GONE if gone else reply


async def _connection(stream: Any, client: AsyncClient, password: str | None,
                      max_clients: int = DEFAULT_MAX_CLIENTS) -> None:
    import anyio

    local = stream.local_address  # (host, port, ...) on TCP
    address = f"{local[0]}:{local[1]}" if isinstance(local, tuple) else None
    session = Session(client, password, address, max_clients)
    parser = Parser() if session.authenticated else \
        Parser(UNAUTHENTICATED_BULK, UNAUTHENTICATED_ARGS)
    try:
        await _serve_connection(stream, parser, session)
    finally:
        if session.unsent:
            # Claimed for this connection and never written to it: the
            # client gone while its GETJOB was watched, or the server's stop
            # (taken just before a write, see send). Back in their queue, as
            # for a cancelled GET.
            with anyio.CancelScope(shield=True):
                await client._give_back(session.unsent)


async def _serve_connection(stream: Any, parser: Parser, session: Session) -> None:
    import anyio
    import anyio.lowlevel

    async def send(data: bytes) -> None:
        # A stop's cancellation is taken here if it came while the command
        # ran (this is the first await after a claim), before anything is
        # written: the reply's jobs go back (_connection). From the write
        # on, the client may have them (or those of some of the pipelined
        # replies in it): they are never given back after it, or a job could
        # be delivered twice, and a lease taken since by another consumer
        # undone. (Shielding the write from a stop, with a time bound, cost
        # about 24 us a reply, a tenth of a get+ack's server time.)
        await anyio.lowlevel.checkpoint_if_cancelled()
        session.unsent.clear()
        await stream.send(data)

    async with stream:
        while True:
            try:
                data = await stream.receive(65536)
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return
            parser.add(data)
            out = bytearray()
            while True:
                try:
                    command = parser.take()
                except ProtocolError as exc:
                    await send(bytes(out) + encode(Error(f"ERR Protocol error: {exc}")))
                    return
                if command is None:
                    break
                if command[0].lower() == b"quit":
                    await send(bytes(out) + encode(Status("OK")))
                    return
                if _may_block(command):
                    # What came before it is answered now, not after the wait.
                    if out:
                        await send(bytes(out))
                        out = bytearray()
                    reply = await _run_watched(stream, parser, session, command)
                    if reply is _GONE:
                        return
                else:
                    reply = await session.run(command)
                out += encode(reply, session.resp3)
                if session.authenticated:
                    parser.max_bulk, parser.max_args = MAX_BULK, MAX_ARGS
            if out:
                await send(bytes(out))


def max_clients() -> int:
    """The cap on connections: PGQ_RESP_MAX_CLIENTS, or Disque's default."""
    text = os.environ.get("PGQ_RESP_MAX_CLIENTS")
    if text is None:
        return DEFAULT_MAX_CLIENTS
    digits = text.strip()
    # ASCII digits only, and few: str.isdigit() takes '²', which int() refuses
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 9 and int(digits) >= 1):
        log.warning("PGQ_RESP_MAX_CLIENTS=%r is not a positive number: using %d", text,
                    DEFAULT_MAX_CLIENTS)
        return DEFAULT_MAX_CLIENTS
    return int(digits)


# File descriptors the process keeps for itself beside the RESP
# connections: its database connections, the HTTP API's and dashboard's,
# log files, the listening sockets (Redis keeps 32; pgq's pools need more).
RESERVED_FILES = 64


def fitted_max_clients(cap: int) -> int:
    """``cap``, within the open-files limit, as Redis fits maxclients: the
    soft limit is raised towards ``cap`` + RESERVED_FILES (up to the hard
    one), and the cap lowered, with a warning, where it still does not fit.
    With the common soft limit of 1,024 and the default cap of 10,000, the
    1,025th descriptor made accept() fail, which ended the server."""
    try:
        import resource
    except ImportError:  # not on this platform (Windows): nothing to fit
        return cap
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = cap + RESERVED_FILES
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < wanted:
        fitted = max(1, soft - RESERVED_FILES)
        log.warning("pgq resp: at most %d clients, not %d: the open-files limit is %d "
                    "(raise it with `ulimit -n`, or LimitNOFILE= under systemd)", fitted, cap, soft)
        return fitted
    return cap


async def serve(client: AsyncClient, host: str, port: int, password: str | None = None,
                ready: Callable[[], None] | None = None,
                sockets: Sequence[socket.socket] | None = None) -> None:
    """Serve Disque's protocol on ``host:port`` until cancelled; on
    ``sockets`` instead when given (bound and listening: pgq.fronts binds
    them before anything serves). They are closed at the end.

    Connections are :class:`pgq.protostream.ProtocolStream`s, not anyio's
    socket streams: a third of the server's CPU per request went to the
    latter (see that module)."""
    import anyio

    from .fronts import ROLES, listen
    from .protostream import ProtocolListener

    if not sockets:
        sockets = listen(ROLES["resp"], host, port)
    listeners = [ProtocolListener(sock) for sock in sockets]
    if ready is not None:
        ready()
    cap, connected = fitted_max_clients(max_clients()), [0]

    async def handle(stream: Any) -> None:
        try:
            if connected[0] >= cap:
                with anyio.move_on_after(1):  # a client that reads nothing is not waited for
                    await stream.send(TOO_MANY_CLIENTS)
                await stream.aclose()
                return
            connected[0] += 1
            try:
                await _connection(stream, client, password, cap)
            finally:
                connected[0] -= 1
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the client went away while its reply was written: nothing is wrong here
        except Exception:  # one connection's failure is its own
            log.exception("pgq resp: a connection failed; it is closed")

    # One accept loop per socket (a name such as localhost may give two).
    try:
        async with anyio.create_task_group() as tasks:
            for one in listeners:
                tasks.start_soon(accept_forever, one, handle, tasks, "pgq resp")
    finally:
        for one in listeners:
            await one.aclose()
