"""Validation of command arguments, and the defaults of Disque's job parameters.

Every public command checks its arguments here *before* it talks to the
database, so bad input never reaches SQL and never leaves half-done work.
Each check raises :class:`~pgq.errors.InvalidArgumentError` (a ``ValueError``)
or :class:`~pgq.errors.InvalidTypeError` (a ``TypeError``) whose message says
what is allowed.

The limits below are part of the documented contract (README, "Limits").
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import InvalidArgumentError, InvalidTypeError

__all__ = [
    "DEFAULT_TTL",
    "MAX_TTL",
    "MAX_RETRY_DEFAULT",
    "MAX_QUEUE_NAME_BYTES",
    "DEFAULT_MAX_BODY_SIZE",
    "MAX_COUNT",
    "MAX_IDS",
    "MAX_PRIORITY",
    "MAX_KEY_BYTES",
    "MAX_RESULT_ERROR",
    "JobParams",
    "job_priority",
    "idempotency_key",
    "job_params",
    "queue_name",
    "queue_names",
    "body_bytes",
    "count",
    "timeout",
    "seconds",
    "positive_int",
]

DEFAULT_TTL = 86400.0
MAX_TTL = 10 * 365 * 86400.0  # keeps every deadline a finite PostgreSQL timestamp
MAX_RETRY_DEFAULT = 300.0
MAX_REPLICATE = 65535
MAX_QUEUE_NAME_BYTES = 512
DEFAULT_MAX_BODY_SIZE = 16 * 1024 * 1024
HARD_MAX_BODY_SIZE = 512 * 1024 * 1024
MAX_COUNT = 100_000
MAX_IDS = 100_000
MAX_PRIORITY = 1_000_000
MAX_KEY_BYTES = 512
MAX_RESULT_ERROR = 100_000  # characters of a kept error (longer is cut, as a dead letter's reason)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def seconds(
    name: str, value: object, *, minimum: float = 0.0, maximum: float = MAX_TTL,
    allow_minimum: bool = True,
) -> float:
    """A duration in seconds (int or float), finite, within [minimum, maximum]."""
    if not _is_number(value):
        raise InvalidTypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    try:
        result = float(value)  # type: ignore[arg-type]
    except OverflowError:  # an int beyond any float (about 10**308)
        raise InvalidArgumentError(f"{name} must be ≤ {maximum:g} seconds; "
                                   "this number is beyond any duration") from None
    if math.isnan(result) or math.isinf(result):
        raise InvalidArgumentError(f"{name} must be a finite number of seconds, not {value!r}")
    too_small = result < minimum if allow_minimum else result <= minimum
    if too_small or result > maximum:
        low = "≥" if allow_minimum else ">"
        raise InvalidArgumentError(
            f"{name} must be {low} {minimum:g} and ≤ {maximum:g} seconds, not {value!r}"
        )
    return result


def positive_int(name: str, value: object, *, maximum: int) -> int:
    """An int in 1..maximum."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidTypeError(f"{name} must be an int, not {type(value).__name__}")
    if not 1 <= value <= maximum:
        raise InvalidArgumentError(f"{name} must be between 1 and {maximum}, not {value}")
    return value


def count(value: object) -> int:
    """GETJOB's COUNT: how many jobs to return at most."""
    return positive_int("count", value, maximum=MAX_COUNT)


def timeout(value: object) -> float | None:
    """A blocking timeout: None or 0 block forever (Disque's TIMEOUT 0)."""
    if value is None:
        return None
    result = seconds("timeout", value, maximum=MAX_TTL)
    return None if result == 0 else result


def queue_name(value: object) -> str:
    """A queue name: a non-empty str of at most 512 UTF-8 bytes, without NUL.

    Any other character is allowed (names are always sent as parameters,
    never spliced into SQL).
    """
    if not isinstance(value, str):
        raise InvalidTypeError(f"a queue name must be a str, not {type(value).__name__}")
    if not value:
        raise InvalidArgumentError("a queue name must not be empty")
    if "\x00" in value:
        raise InvalidArgumentError("a queue name must not contain NUL characters")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_QUEUE_NAME_BYTES:
        raise InvalidArgumentError(
            f"a queue name must be at most {MAX_QUEUE_NAME_BYTES} bytes in UTF-8"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgumentError("a queue name must be valid Unicode (no lone surrogates)") from None
    return value


def text(name: str, value: object, max_chars: int) -> str:
    """Free text stored in the database (a dead letter's reason, say): a str
    without NUL and of valid Unicode; longer text is cut at ``max_chars``."""
    if not isinstance(value, str):
        raise InvalidTypeError(f"{name} must be a str, not {type(value).__name__}")
    if "\x00" in value:
        raise InvalidArgumentError(f"{name} must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgumentError(f"{name} must be valid Unicode (no lone surrogates)") from None
    return value[:max_chars]


def port_number(text: str) -> int | None:
    """A TCP port's digits as a number, None when they are not ASCII digits
    (str.isdigit() takes '²' and other scripts' digits, which int() refuses
    or reads as another number) or too many for a port; callers bound it."""
    if text.isascii() and text.isdigit() and len(text) <= 5:
        return int(text)
    return None


def queue_names(values: Iterable[object]) -> list[str]:
    """One or more queue names, in priority order; duplicates keep their first position."""
    # A dict keeps the first position and checks in O(1): a list's `in`
    # made 100k names (one HTTP lease) a minute of the event loop's time.
    names = list(dict.fromkeys(queue_name(value) for value in values))
    if not names:
        raise InvalidArgumentError("name at least one queue to get jobs from")
    return names


def body_bytes(value: object, max_size: int) -> bytes:
    """A job body: bytes-like, or str (stored as UTF-8), at most ``max_size`` bytes."""
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, (bytearray, memoryview)):
        data = bytes(value)
    elif isinstance(value, str):
        try:
            data = value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgumentError("a str body must be valid Unicode (no lone surrogates)") from None
    else:
        raise InvalidTypeError(
            f"a job body must be bytes, bytearray, memoryview or str, not {type(value).__name__}"
        )
    if len(data) > max_size:
        raise InvalidArgumentError(
            f"job body is {len(data)} bytes, over the limit of {max_size} bytes "
            "(raise it with Client(max_body_size=...), up to 512 MiB, or store "
            "large payloads elsewhere and queue a reference)"
        )
    return data


@dataclass(frozen=True, slots=True)
class JobParams:
    """The per-job parameters of ADDJOB after defaults are applied."""

    replicate: int | None  # None: the node decides (min(3, reachable nodes))
    delay: float
    retry: float
    ttl: float
    maxlen: int | None
    asynchronous: bool
    timeout: float | None
    priority: int = 0  # higher first; FIFO within a priority
    key: str | None = None  # idempotency key (at most one live job per key and queue)


def default_retry(ttl: float) -> float:
    """Disque's default RETRY: a tenth of the TTL, at most 300 s, at least 1 s."""
    return max(1.0, min(ttl / 10.0, MAX_RETRY_DEFAULT))


def job_priority(value: object) -> int:
    """A job's priority: an int from 0 (the default) to MAX_PRIORITY, higher first."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidTypeError(f"priority must be an int, not {type(value).__name__}")
    if not 0 <= value <= MAX_PRIORITY:
        raise InvalidArgumentError(
            f"priority must be between 0 and {MAX_PRIORITY} (higher first), not {value}")
    return value


def idempotency_key(value: object) -> str | None:
    """An idempotency key: None, or a non-empty str of at most MAX_KEY_BYTES
    UTF-8 bytes without NUL."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidTypeError(f"key must be a str, not {type(value).__name__}")
    if not value:
        raise InvalidArgumentError("key must not be empty (pass None for no key)")
    checked = text("key", value, MAX_KEY_BYTES + 1)
    if len(checked.encode("utf-8")) > MAX_KEY_BYTES:
        raise InvalidArgumentError(f"key must be at most {MAX_KEY_BYTES} bytes in UTF-8")
    return checked


def job_params(
    *, replicate: object, delay: object, retry: object, ttl: object, maxlen: object,
    asynchronous: object, timeout: object, priority: object = 0, key: object = None,
) -> JobParams:
    """Check ADDJOB's options and apply Disque's defaults and cross-field rules."""
    ttl_s = DEFAULT_TTL if ttl is None else seconds("ttl", ttl, minimum=0.0, allow_minimum=False)
    delay_s = seconds("delay", delay, maximum=MAX_TTL)
    if delay_s >= ttl_s:
        raise InvalidArgumentError(
            f"delay ({delay_s:g} s) must be shorter than ttl ({ttl_s:g} s): "
            "the job would expire before it is ever queued"
        )
    retry_s = default_retry(ttl_s) if retry is None else seconds("retry", retry, maximum=MAX_TTL)
    repl = None if replicate is None else positive_int("replicate", replicate, maximum=MAX_REPLICATE)
    if retry_s == 0 and repl is not None and repl > 1:
        why = "copies on other nodes could otherwise deliver the job a second time"
        raise InvalidArgumentError(
            f"retry=0 (at-most-once delivery) requires replicate=1: {why}"
        ).for_cli(f"--retry 0 (at-most-once delivery) requires --replicate 1: {why}")
    max_len = None if maxlen is None else positive_int("maxlen", maxlen, maximum=2**62)
    if not isinstance(asynchronous, bool):
        raise InvalidTypeError(f"asynchronous must be a bool, not {type(asynchronous).__name__}")
    wait = None if timeout is None else seconds("timeout", timeout, maximum=MAX_TTL)
    return JobParams(repl, delay_s, retry_s, ttl_s, max_len, asynchronous, wait,
                     job_priority(priority), idempotency_key(key))
