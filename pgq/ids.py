"""Disque job IDs and node IDs: generation and validation.

A job ID is exactly 40 ASCII characters::

    D-<8 hex: node prefix>-<24 base64: random>-<4 hex: TTL in minutes>

* The node prefix is the first 8 characters of the creating node's 40-hex ID,
  so a consumer can tell where a job was produced.
* The 24 base64 characters encode 18 bytes: a 6-byte creation time in
  milliseconds, a 3-byte counter within the batch that made the ID, then 9
  random bytes (72 bits, which alone keep IDs unique). The alphabet is base64's, reordered as in ASCII
  (``+/0-9A-Za-z``) so that IDs sort by creation time: a node's new jobs land
  at the right edge of the primary-key B-tree instead of on random pages,
  which makes inserting (and acking recent jobs) cheaper, and a bulk add of a
  million jobs touches a few hot index pages instead of the whole index.
* The last field is the job's TTL in minutes, capped at 65535, and forced
  **odd when retry > 0** (at-least-once) and **even when retry = 0**
  (at-most-once). A node that sees an ACK for an unknown ID can therefore tell
  whether it must keep a "dummy ack" (at-least-once: a late copy must not
  resurrect the job) and for how long (the TTL).

Invariants: :func:`new_job_id` always returns an ID that
:func:`validate_job_id` accepts; validation never touches the database.
"""

from __future__ import annotations

import base64
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable

from .errors import BadIdError, InvalidTypeError

__all__ = [
    "JOB_ID_LENGTH",
    "new_node_id",
    "new_job_id",
    "new_job_ids",
    "ingest_job_id",
    "validate_job_id",
    "validate_job_ids",
    "ttl_minutes_field",
    "is_at_least_once_id",
    "ttl_seconds_from_id",
    "millis_from_id",
]

JOB_ID_LENGTH = 40
_MAX_TTL_MINUTES = 65535

# Positions are the contract (D- at 0, '-' at 10 and 35); the character classes
# are checked too, because an ID with a non-hex TTL field cannot be given a
# dummy ack with a meaningful lifetime.
_JOB_ID_RE = re.compile(r"D-[0-9a-f]{8}-[A-Za-z0-9+/]{24}-[0-9a-f]{4}\Z")
_NODE_ID_RE = re.compile(r"[0-9a-f]{40}\Z")


def new_node_id() -> str:
    """Return a fresh random 40-hex node ID."""
    return secrets.token_hex(20)


def is_node_id(value: str) -> bool:
    """True if ``value`` is a well-formed 40-hex node ID."""
    return bool(_NODE_ID_RE.match(value))


def ttl_minutes_field(ttl_seconds: float, retry_seconds: float) -> str:
    """Encode the TTL field of a job ID: minutes, capped, parity = delivery mode."""
    minutes = min(int(ttl_seconds // 60), _MAX_TTL_MINUTES)
    at_least_once = retry_seconds > 0
    if (minutes % 2 == 1) != at_least_once:
        # Move to the nearest value of the right parity, staying in range.
        minutes = minutes - 1 if minutes == _MAX_TTL_MINUTES else minutes + 1
    return f"{minutes:04x}"


# Standard base64 alphabet -> the same 64 characters in ASCII order.
_COUNTER_LIMIT = 1 << 24
STANDARD_BASE64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
SORTABLE_BASE64 = "+/0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_SORTABLE_BASE64 = bytes.maketrans(STANDARD_BASE64.encode(), SORTABLE_BASE64.encode())
_STANDARD_BASE64 = bytes.maketrans(SORTABLE_BASE64.encode(), STANDARD_BASE64.encode())


_FIRST_COUNTER = (0).to_bytes(3, "big")


def _sortable_base64(data: bytes) -> str:
    return base64.b64encode(data).translate(_SORTABLE_BASE64).decode("ascii")


class _EntropyPool:
    """The OS's entropy, read 4 KiB at a time (thread-safe, fork-safe).

    One ``os.urandom`` per job ID was a system call per add, and a thread
    that gives up the GIL for one waits to get it back behind the others:
    with 10 threads adding through one Client it was a sixth of the time the
    threads spent in Python. The bytes are the same kernel entropy; a child
    process never reuses its parent's (the pool is dropped after a fork)."""

    CHUNK = 4096

    def __init__(self) -> None:
        self._reset()
        # A child starts afresh: the parent's bytes are not its own, and a
        # fork while another thread held the lock would leave it held.
        # (Where there is no register_at_fork, there is no fork either.)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._buffer, self._offset = b"", 0

    def __call__(self, n: int) -> bytes:
        if n > self.CHUNK // 4:
            return os.urandom(n)
        with self._lock:
            if self._offset + n > len(self._buffer):
                self._buffer, self._offset = os.urandom(self.CHUNK), 0
            start = self._offset
            self._offset += n
            return self._buffer[start:self._offset]


entropy = _EntropyPool()


def new_job_id(node_id: str, ttl_seconds: float, retry_seconds: float) -> str:
    """Return a new job ID created on node ``node_id``."""
    return new_job_ids(node_id, ttl_seconds, retry_seconds, 1)[0]


def new_job_ids(node_id: str, ttl_seconds: float, retry_seconds: float, count: int,
                millis: int | None = None,
                random_bytes: Callable[[int], bytes] = entropy) -> list[str]:
    """Return ``count`` new job IDs, in increasing order.

    The 18 bytes are: 6 bytes of time (ms), a 3-byte counter within this
    batch, 9 random bytes (72 bits). Every part is a multiple of 3 bytes, so
    each encodes on its own to whole base64 characters (8 + 4 + 12) and a
    million IDs are built from three bulk encodings and slices, not a million
    encodings. Uniqueness rests on the random part (two IDs collide only if
    made in the same millisecond, at the same counter, with the same 72 random
    bits); ordering only on the time and counter. ``millis`` and
    ``random_bytes`` default to the real clock and the OS's entropy (the
    simulation passes virtual ones).
    """
    if millis is None:
        millis = time.time_ns() // 1_000_000
    tail = f"-{ttl_minutes_field(ttl_seconds, retry_seconds)}"
    if count == 1:
        # One job (most adds): its 18 bytes in one encoding, the same
        # characters as the three below (each part is whole base64 groups).
        raw = millis.to_bytes(6, "big") + _FIRST_COUNTER + random_bytes(9)
        return [f"D-{node_id[:8]}-{_sortable_base64(raw)}{tail}"]
    ids: list[str] = []
    for chunk_start in range(0, count, _COUNTER_LIMIT):
        n = min(_COUNTER_LIMIT, count - chunk_start)
        # A batch larger than the counter takes the next milliseconds: still increasing.
        head = f"D-{node_id[:8]}-{_sortable_base64((millis + chunk_start // _COUNTER_LIMIT).to_bytes(6, 'big'))}"
        counters = _sortable_base64(b"".join(i.to_bytes(3, "big") for i in range(n)))
        randoms = _sortable_base64(random_bytes(9 * n))
        ids.extend(f"{head}{counters[4 * i:4 * i + 4]}{randoms[12 * i:12 * i + 12]}{tail}"
                   for i in range(n))
    return ids


def ingest_job_id(node_id: str, started_ms: int, ingest_key: int, seq: int, ttl_field: str) -> str:
    """The ID of row ``seq`` of a bulk ingestion (see :mod:`pgq.spark.ingest`).

    The 18 bytes are: 6 bytes of the ingestion's start time (ms), 4 bytes
    of its key (a hash of its ``ingest_id``), 8 bytes of the row number.
    Every attempt at the same ingestion, and every node holding a copy,
    computes the same ID for the same row; IDs of one ingestion increase
    with the row number. (Spark builds the same string column-wise; a test
    checks the two agree.)
    """
    raw = started_ms.to_bytes(6, "big") + ingest_key.to_bytes(4, "big") + seq.to_bytes(8, "big")
    return f"D-{node_id[:8]}-{_sortable_base64(raw)}-{ttl_field}"


def validate_job_id(job_id: object) -> str:
    """Return ``job_id`` if it is a well-formed job ID, else raise
    :class:`BadIdError`. A :class:`~pgq.job.Job` stands for its ID (so
    ``client.ack_job(job)`` works as well as ``client.ack_job(job.id)``)."""
    # The common case first, without the import below (a worker validates
    # every ID it acknowledges: 1.3 -> 0.3 µs an ID, measured here).
    if type(job_id) is str and len(job_id) == JOB_ID_LENGTH and _JOB_ID_RE.match(job_id):
        return job_id
    from .job import Job

    if isinstance(job_id, Job):
        job_id = job_id.id
    if not isinstance(job_id, str):
        raise InvalidTypeError(
            f"a job ID must be a str of {JOB_ID_LENGTH} characters (or a pgq.Job), "
            f"not {type(job_id).__name__}"
        )
    if len(job_id) != JOB_ID_LENGTH or not _JOB_ID_RE.match(job_id):
        shown = job_id if len(job_id) <= 60 else job_id[:57] + "..."
        raise BadIdError(
            f"invalid job ID {shown!r}: expected 40 characters like "
            "'D-1a2b3c4d-<24 base64 chars>-<4 hex>'"
        )
    return job_id


def validate_job_ids(ids: Iterable[object], *, at_least: int = 1) -> list[str]:
    """Validate every ID before anything is done: one bad ID rejects them all."""
    checked = [validate_job_id(i) for i in ids]
    if len(checked) < at_least:
        raise BadIdError("no job ID given: pass at least one ID")
    return checked


def is_at_least_once_id(job_id: str) -> bool:
    """True if the ID's TTL field is odd, i.e. the job was created with retry > 0."""
    return int(job_id[36:40], 16) % 2 == 1


def ttl_seconds_from_id(job_id: str) -> int:
    """The job's TTL in seconds as encoded in its ID (minute precision)."""
    return int(job_id[36:40], 16) * 60


def millis_from_id(job_id: str) -> int:
    """The creation time (ms, the creator's clock) a job ID encodes: its
    first 6 bytes, the 8 characters after the node prefix."""
    return int.from_bytes(base64.b64decode(job_id[11:19].encode().translate(_STANDARD_BASE64)), "big")
