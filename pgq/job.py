"""The :class:`Job` value returned by GETJOB and QPEEK.

A ``Job`` is a plain immutable record: it holds no connection and no state,
so it can be pickled, sent to a thread or a process, and compared.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Job"]


@dataclass(frozen=True, slots=True)
class Job:
    """A job as handed to a consumer.

    ``nacks`` and ``additional_deliveries`` are Disque's counters: how many
    times the job was put back by NACK, and how many times it was re-queued
    because it was not acknowledged in time (or ENQUEUEd again). They are
    ``None`` unless the job was fetched with ``withcounters=True`` (QPEEK
    always fills them).

    ``retry`` (the job's lease in seconds; 0 for an at-most-once job) and
    ``ttl`` (seconds it has left to live) come with every GETJOB, so a
    worker can extend its lease with ``working`` in time.
    """

    id: str
    queue: str
    body: bytes
    nacks: int | None = None
    additional_deliveries: int | None = None
    retry: float | None = None
    ttl: float | None = None
