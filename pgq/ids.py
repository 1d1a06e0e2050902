"""Disque job IDs and node IDs: generation and validation.

A job ID is exactly 40 ASCII characters::

    D-<8 hex: node prefix>-<24 base64: random>-<4 hex: TTL in minutes>

* The node prefix is the first 8 characters of the creating node's 40-hex ID,
  so a consumer can tell where a job was produced.
* The 24 base64 characters encode 18 random bytes: the full 144 bits (Disque's
  own encoder fills about 114 of them).
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
from collections.abc import Iterable

from .errors import BadIdError, InvalidTypeError

__all__ = [
    "JOB_ID_LENGTH",
    "new_node_id",
    "new_job_id",
    "validate_job_id",
    "validate_job_ids",
    "ttl_minutes_field",
    "is_at_least_once_id",
    "ttl_seconds_from_id",
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


def new_job_id(node_id: str, ttl_seconds: float, retry_seconds: float) -> str:
    """Return a new job ID created on node ``node_id``."""
    rand = base64.b64encode(os.urandom(18)).decode("ascii")
    return f"D-{node_id[:8]}-{rand}-{ttl_minutes_field(ttl_seconds, retry_seconds)}"


def validate_job_id(job_id: object) -> str:
    """Return ``job_id`` if it is a well-formed job ID, else raise :class:`BadIdError`."""
    if not isinstance(job_id, str):
        raise InvalidTypeError(
            f"a job ID must be a str of {JOB_ID_LENGTH} characters, not {type(job_id).__name__}"
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
