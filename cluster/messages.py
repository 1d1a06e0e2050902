"""Cluster bus messages: what nodes say to each other, and their strict decoding.

Payloads are msgpack maps ``{"k": kind, ...}``. Decoding checks every field's
type and bounds and raises :class:`MessageError` on the first mismatch, so a
malformed message (even one correctly authenticated) is dropped whole; no
partial message ever reaches the node's state. Every field is checked as
the database and the node will use it: hosts are IP addresses or ASCII host
names (never something the IDNA codec rejects), ports 1..65535, queue
names non-empty UTF-8 of at most 512 bytes without NUL, durations finite
and non-negative, integers within what a BIGINT (and one increment) holds,
incarnations below 2^62, lists and bodies bounded.

Kinds (Disque's inter-node protocol plus SWIM membership):

* membership: PING, ACK, PINGREQ, PUSHPULL (full state / join), FORGET
* jobs: REPLJOB / GOTJOB (replication), ENQUEUE, WILLQUEUE / QUEUED /
  WORKING (one queued copy), SETACK / GOTACK / DELJOB (acks and GC),
  NEEDJOBS / YOURJOBS (federation), PAUSE
* ADVERT: the DSN of the sender's database, where clients of other nodes
  write copies directly (schema 0014)

A kind this version does not know raises :class:`UnknownKind` (a
:class:`MessageError`): the bus drops that message and keeps the link, so a
later version may add kinds without cutting this one off. (Versions before
ADVERT closed the link on an unknown kind: see :class:`Advert`.)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from pgq.arguments import MAX_KEY_BYTES, MAX_PRIORITY

from .addresses import valid_host

__all__ = [
    "MessageError", "Member", "JobCopy", "Message", "encode", "decode",
    "Ping", "Ack", "PingReq", "PushPull", "Forget",
    "ReplJob", "GotJob", "Enqueue", "WillQueue", "Queued", "Working",
    "SetAck", "GotAck", "DelJob", "NeedJobs", "YourJobs", "Pause", "Advert",
    "UnknownKind", "MEMBER_STATES", "MAX_DSN",
]

_NODE_RE = re.compile(r"[0-9a-f]{40}\Z")
_JOB_RE = re.compile(r"D-[0-9a-f]{8}-[A-Za-z0-9+/]{24}-[0-9a-f]{4}\Z")
MAX_ITEMS = 100_000
MAX_MEMBERS = 1000  # records in one PUSHPULL or piggyback: a membership view holds no more
# Arrays, maps and their items in one message (see _Budget): a copy takes
# about 17, and a REPLJOB holds at most 10,000 (senders batch 500).
MAX_OBJECTS = 10 * MAX_ITEMS
MEMBER_STATES = ("alive", "suspect", "dead", "left")
# "left" is this node's own word for a member it forgot: no node gossips it,
# and one accepted from the wire excluded a healthy node (nothing refutes it).
WIRE_STATES = ("alive", "suspect", "dead")
# Incarnations grow by one per refutation: far below 2^63 so that neither
# an increment nor the BIGINT they are stored in can overflow.
MAX_INCARNATION = 2**62
MAX_QUEUE_BYTES = 512
MAX_SECONDS = 10 * 365 * 86400.0  # the longest TTL
MAX_BODY = 64 * 1024 * 1024
MAX_INT = 2**62
# A copy's counters (nacks, additional deliveries): the columns are int4,
# and every holder adds one at each NACK or re-queue. A copy at the int4
# maximum made its holder's timers statement fail at its next re-queue, and
# with it every re-queue of that node, ten times a second until the job
# expired (found by a read-only review). No job gets near 2**30 otherwise.
MAX_COUNTER = 2**30
MAX_DSN = 4096
MAX_ADDRESS = 300  # HOST:PORT (a DNS name is at most 253 bytes)


class MessageError(Exception):
    """A payload is not a valid message."""


class UnknownKind(MessageError):
    """A well-formed payload of a kind this version does not know (a newer
    node's): dropped, the link kept."""


# ----------------------------------------------------------------- checks


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise MessageError(what)


def is_node_id(value: Any) -> bool:
    """Whether ``value`` is a node ID as the wire accepts it."""
    return isinstance(value, str) and bool(_NODE_RE.match(value))


def _node(value: Any) -> str:
    _need(isinstance(value, str) and bool(_NODE_RE.match(value)), "bad node id")
    return value


def _job(value: Any) -> str:
    _need(isinstance(value, str) and bool(_JOB_RE.match(value)), "bad job id")
    return value


def _int(value: Any, low: int = 0, high: int = MAX_INT) -> int:
    _need(isinstance(value, int) and not isinstance(value, bool) and low <= value <= high, "bad int")
    return value


def _num(value: Any, low: float = 0.0, high: float = MAX_SECONDS) -> float:
    """A finite number in [low, high] (NaN, infinities and negatives are refused)."""
    _need(isinstance(value, (int, float)) and not isinstance(value, bool), "bad number")
    number = float(value)
    _need(math.isfinite(number) and low <= number <= high, "number out of range")
    return number


def _queue(value: Any) -> str:
    _need(isinstance(value, str) and value != "" and "\x00" not in value
          and len(value.encode("utf-8")) <= MAX_QUEUE_BYTES, "bad queue name")
    return value


def _host(value: Any) -> str:
    _need(valid_host(value), "bad host")
    return value


def _str(value: Any, limit: int = 1024) -> str:
    _need(isinstance(value, str) and len(value) <= limit and "\x00" not in value, "bad string")
    return value


def _list(value: Any, limit: int = MAX_ITEMS) -> list[Any]:
    _need(isinstance(value, list) and len(value) <= limit, "bad list")
    return value


def _bool(value: Any) -> bool:
    _need(isinstance(value, bool), "bad bool")
    return value


# ----------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class Member:
    """One node as gossiped: identity, address, SWIM state."""

    id: str
    host: str
    port: int
    incarnation: int
    status: str = "alive"
    leaving: bool = False
    name: str = ""

    def to_wire(self) -> list[Any]:
        return [self.id, self.host, self.port, self.incarnation, self.status, self.leaving, self.name]

    @classmethod
    def from_wire(cls, raw: Any) -> Member:
        r = _list(raw, 7)
        _need(len(r) == 7, "bad member")
        status = _str(r[4], 16)
        _need(status in WIRE_STATES, "bad member status")
        return cls(_node(r[0]), _host(r[1]), _int(r[2], 1, 65535), _int(r[3], 0, MAX_INCARNATION),
                   status, _bool(r[5]), _str(r[6], 255))


@dataclass(frozen=True, slots=True)
class JobCopy:
    """Everything a node needs to hold a copy of a job."""

    id: str
    queue: str
    body: bytes
    ctime: int
    repl: int
    retry: float
    delay: float
    expires_at: float  # unix time
    nacks: int = 0
    additional_deliveries: int = 0
    nodes: tuple[str, ...] = ()
    priority: int = 0  # higher first (schema 0013)
    key: str | None = None  # idempotency key

    def to_wire(self) -> list[Any]:
        # Priority and key travel only when set: a copy without them is the
        # 11 fields every earlier node reads. A node from before schema 0013
        # refuses a 13-field copy (its link drops and the add times out):
        # upgrade every node before adding replicated jobs with a priority
        # or a key. Fields past the 13th are ignored, so the next extension
        # does not break this version the same way.
        extra = [self.priority, self.key] if self.priority or self.key is not None else []
        return [self.id, self.queue, self.body, self.ctime, self.repl, self.retry, self.delay,
                self.expires_at, self.nacks, self.additional_deliveries, list(self.nodes),
                *extra]

    @classmethod
    def from_wire(cls, raw: Any) -> JobCopy:
        r = _list(raw, 32)
        _need(len(r) == 11 or len(r) >= 13, "bad job copy")
        _need(isinstance(r[2], bytes) and len(r[2]) <= MAX_BODY, "bad job body")
        priority, key = (r[11], r[12]) if len(r) >= 13 else (0, None)
        _need(key is None or (isinstance(key, str) and key != "" and "\x00" not in key
                              and len(key.encode("utf-8")) <= MAX_KEY_BYTES), "bad job key")
        return cls(_job(r[0]), _queue(r[1]), r[2], _int(r[3]), _int(r[4], 1, 65535),
                   _num(r[5]), _num(r[6]), _num(r[7], 0.0, 2.0**40), _int(r[8], 0, MAX_COUNTER),
                   _int(r[9], 0, MAX_COUNTER), tuple(_node(n) for n in _list(r[10], 1000)),
                   _int(priority, 0, MAX_PRIORITY), key)


# ----------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class Message:
    """Base: every message carries its kind and may piggyback membership updates."""

    KIND: ClassVar[str] = ""

    def fields(self) -> dict[str, Any]:
        return {}

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> Message:
        return cls()


def _updates_to_wire(updates: tuple[Member, ...]) -> list[Any]:
    return [m.to_wire() for m in updates]


def _updates_from_wire(raw: Any) -> tuple[Member, ...]:
    return tuple(Member.from_wire(m) for m in _list(raw, MAX_MEMBERS))


@dataclass(frozen=True, slots=True)
class Ping(Message):
    KIND: ClassVar[str] = "ping"
    seq: int = 0
    updates: tuple[Member, ...] = ()

    def fields(self) -> dict[str, Any]:
        return {"s": self.seq, "u": _updates_to_wire(self.updates)}

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> Ping:
        return cls(_int(raw.get("s")), _updates_from_wire(raw.get("u", [])))


@dataclass(frozen=True, slots=True)
class Ack(Message):
    """Reply to PING; ``target`` is the node that was probed (for indirect probes)."""

    KIND: ClassVar[str] = "ack"
    seq: int = 0
    target: str = ""
    updates: tuple[Member, ...] = ()

    def fields(self) -> dict[str, Any]:
        return {"s": self.seq, "t": self.target, "u": _updates_to_wire(self.updates)}

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> Ack:
        return cls(_int(raw.get("s")), _node(raw.get("t")), _updates_from_wire(raw.get("u", [])))


@dataclass(frozen=True, slots=True)
class PingReq(Message):
    """Ask the receiver to probe ``target`` for the sender (SWIM's indirect probe)."""

    KIND: ClassVar[str] = "pingreq"
    seq: int = 0
    target: str = ""
    updates: tuple[Member, ...] = ()

    def fields(self) -> dict[str, Any]:
        return {"s": self.seq, "t": self.target, "u": _updates_to_wire(self.updates)}

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> PingReq:
        return cls(_int(raw.get("s")), _node(raw.get("t")), _updates_from_wire(raw.get("u", [])))


@dataclass(frozen=True, slots=True)
class PushPull(Message):
    """Full membership state; ``reply`` asks the receiver to send its own back (join, heal)."""

    KIND: ClassVar[str] = "pushpull"
    members: tuple[Member, ...] = ()
    reply: bool = False

    def fields(self) -> dict[str, Any]:
        return {"m": _updates_to_wire(self.members), "r": self.reply}

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> PushPull:
        return cls(_updates_from_wire(raw.get("m")), _bool(raw.get("r")))


@dataclass(frozen=True, slots=True)
class Forget(Message):
    """Remove a node from the cluster (and refuse it for a minute)."""

    KIND: ClassVar[str] = "forget"
    node: str = ""

    def fields(self) -> dict[str, Any]:
        return {"n": self.node}

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> Forget:
        return cls(_node(raw.get("n")))


@dataclass(frozen=True, slots=True)
class _Ids(Message):
    ids: tuple[str, ...] = ()

    def fields(self) -> dict[str, Any]:
        return {"i": list(self.ids)}

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> Message:
        return cls(tuple(_job(i) for i in _list(raw.get("i"))))


@dataclass(frozen=True, slots=True)
class ReplJob(Message):
    """Store these copies durably, then answer GOTJOB."""

    KIND: ClassVar[str] = "repljob"
    jobs: tuple[JobCopy, ...] = ()

    def fields(self) -> dict[str, Any]:
        return {"j": [j.to_wire() for j in self.jobs]}

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> ReplJob:
        return cls(tuple(JobCopy.from_wire(j) for j in _list(raw.get("j"), 10_000)))


@dataclass(frozen=True, slots=True)
class GotJob(_Ids):
    KIND: ClassVar[str] = "gotjob"


@dataclass(frozen=True, slots=True)
class Enqueue(_Ids):
    """Queue these jobs now (a leaving node hands its new jobs over)."""

    KIND: ClassVar[str] = "enqueue"


def _holders_to_wire(holders: tuple[tuple[str, ...], ...]) -> list[list[str]]:
    return [list(h) for h in holders]


def _holders_from_wire(raw: Any, ids: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """Per job, the holders the sender knows: as many lists as ids, or none."""
    holders = tuple(tuple(_node(n) for n in _list(h, 1000)) for h in _list(raw or []))
    _need(len(holders) in (0, len(ids)), "holders do not match ids")
    return holders


@dataclass(frozen=True, slots=True)
class WillQueue(Message):
    """I am about to re-queue these: tell me if you have them queued or acked.
    ``holders``: per job, the holders I know (you learn those you did not)."""

    KIND: ClassVar[str] = "willqueue"
    ids: tuple[str, ...] = ()
    holders: tuple[tuple[str, ...], ...] = ()

    def fields(self) -> dict[str, Any]:
        return {"i": list(self.ids), "h": _holders_to_wire(self.holders)}

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> WillQueue:
        ids = tuple(_job(i) for i in _list(raw.get("i")))
        return cls(ids, _holders_from_wire(raw.get("h"), ids))


@dataclass(frozen=True, slots=True)
class Queued(Message):
    """I queued these; ``counter`` is the counter the (re-)queue increments;
    ``holders``: per job, the holders I know (you learn those you did not)."""

    KIND: ClassVar[str] = "queued"
    ids: tuple[str, ...] = ()
    counter: str = ""  # "", "nacks" or "additional_deliveries"
    holders: tuple[tuple[str, ...], ...] = ()

    def fields(self) -> dict[str, Any]:
        return {"i": list(self.ids), "c": self.counter, "h": _holders_to_wire(self.holders)}

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> Queued:
        counter = _str(raw.get("c"), 32)
        _need(counter in ("", "nacks", "additional_deliveries"), "bad counter")
        ids = tuple(_job(i) for i in _list(raw.get("i")))
        return cls(ids, counter, _holders_from_wire(raw.get("h"), ids))


@dataclass(frozen=True, slots=True)
class Working(_Ids):
    """A consumer is working on these: postpone your re-queue, take them out of your queue."""

    KIND: ClassVar[str] = "working"


@dataclass(frozen=True, slots=True)
class SetAck(Message):
    """These jobs are acknowledged; ``nodes`` lists the holders the sender knows."""

    KIND: ClassVar[str] = "setack"
    items: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def fields(self) -> dict[str, Any]:
        return {"a": [[i, list(nodes)] for i, nodes in self.items]}

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> SetAck:
        items = []
        for item in _list(raw.get("a")):
            pair = _list(item, 2)
            _need(len(pair) == 2, "bad setack item")
            items.append((_job(pair[0]), tuple(_node(n) for n in _list(pair[1], 1000))))
        return cls(tuple(items))


@dataclass(frozen=True, slots=True)
class GotAck(Message):
    """Acknowledgement of SETACK: ``known`` tells whether the job was known here."""

    KIND: ClassVar[str] = "gotack"
    items: tuple[tuple[str, bool], ...] = ()

    def fields(self) -> dict[str, Any]:
        return {"a": [[i, known] for i, known in self.items]}

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> GotAck:
        items = []
        for item in _list(raw.get("a")):
            pair = _list(item, 2)
            _need(len(pair) == 2, "bad gotack item")
            items.append((_job(pair[0]), _bool(pair[1])))
        return cls(tuple(items))


@dataclass(frozen=True, slots=True)
class DelJob(_Ids):
    KIND: ClassVar[str] = "deljob"


@dataclass(frozen=True, slots=True)
class NeedJobs(Message):
    """Consumers wait on ``queue`` here: send me up to ``count`` jobs."""

    KIND: ClassVar[str] = "needjobs"
    queue: str = ""
    count: int = 1

    def fields(self) -> dict[str, Any]:
        return {"q": self.queue, "n": self.count}

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> NeedJobs:
        return cls(_queue(raw.get("q")), _int(raw.get("n"), 1, 1000))


@dataclass(frozen=True, slots=True)
class YourJobs(Message):
    """Jobs for your waiting consumers (federation)."""

    KIND: ClassVar[str] = "yourjobs"
    jobs: tuple[JobCopy, ...] = ()

    def fields(self) -> dict[str, Any]:
        return {"j": [j.to_wire() for j in self.jobs]}

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> YourJobs:
        return cls(tuple(JobCopy.from_wire(j) for j in _list(raw.get("j"), 1000)))


@dataclass(frozen=True, slots=True)
class Pause(Message):
    KIND: ClassVar[str] = "pause"
    queue: str = ""
    state: str = "none"

    def fields(self) -> dict[str, Any]:
        return {"q": self.queue, "p": self.state}

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> Pause:
        state = _str(raw.get("p"), 8)
        _need(state in ("none", "in", "out", "all"), "bad pause state")
        return cls(_queue(raw.get("q")), state)


@dataclass(frozen=True, slots=True)
class Advert(Message):
    """The DSN of my database, for your clients to write copies into
    (empty: write none, send them through me), and the HOST:PORT where I
    speak Disque's client protocol (empty: I do not; HELLO lists it). Sent
    to each peer when it comes alive and every
    :data:`cluster.core.ADVERT_EVERY` seconds. A node from before this
    kind closes the link on it (it is unknown there), which the bus opens
    again: upgrade every node, as the guide says, before relying on direct
    copies. A node from before the address ignores it (it reads "d" only)
    and sends none."""

    KIND: ClassVar[str] = "advert"
    dsn: str = ""
    resp: str = ""

    def fields(self) -> dict[str, Any]:
        return {"d": self.dsn, "r": self.resp} if self.resp else {"d": self.dsn}

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> Advert:
        return cls(_str(raw.get("d"), MAX_DSN), _str(raw.get("r", ""), MAX_ADDRESS))


KINDS: dict[str, type[Message]] = {
    cls.KIND: cls for cls in (Ping, Ack, PingReq, PushPull, Forget, ReplJob, GotJob, Enqueue,
                              WillQueue, Queued, Working, SetAck, GotAck, DelJob, NeedJobs,
                              YourJobs, Pause, Advert)
}


def encode(message: Message) -> bytes:
    return msgpack.packb({"k": message.KIND, **message.fields()}, use_bin_type=True)


class _Budget:
    """Counts the arrays, maps and their items msgpack builds for one payload,
    and stops it past ``MAX_OBJECTS``: msgpack bounds each array, not their
    number, and an empty array is one byte on the wire and about 64 in
    memory, so a 64 MiB frame of nested empty arrays built some 4 GB."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_OBJECTS

    def spend(self, container: Any) -> Any:
        self.left -= len(container) + 1
        if self.left < 0:
            raise MessageError("too many objects in one message")
        return container


def decode(payload: bytes) -> Message:
    """Decode one message. Raises MessageError for anything that is not exactly valid."""
    budget = _Budget()
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_bin_len=MAX_BODY,
                              max_str_len=2**20, max_array_len=MAX_ITEMS, max_map_len=64,
                              max_ext_len=0, list_hook=budget.spend, object_hook=budget.spend)
    except Exception as exc:  # msgpack raises several types for garbage
        raise MessageError(f"undecodable payload: {type(exc).__name__}") from None
    _need(isinstance(raw, dict), "payload is not a map")
    kind = raw.get("k")
    _need(isinstance(kind, str), "bad message kind")
    if kind not in KINDS:
        raise UnknownKind(f"unknown message kind {kind[:32]!r}")
    try:
        return KINDS[kind].parse(raw)
    except MessageError:
        raise
    except Exception as exc:
        raise MessageError(f"malformed {kind}: {type(exc).__name__}") from None
