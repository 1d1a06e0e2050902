"""Typed errors raised by pgq.

Every error pgq raises on purpose is a :class:`PgqError`. The Disque error
replies map one to one onto a subclass (``-NOREPL`` is :class:`NoReplError`,
``-BADID`` is :class:`BadIdError`, and so on), so code ported from a Disque
client can catch the same conditions by name.

Invariants:

* Bad arguments raise :class:`InvalidArgumentError` (a ``ValueError``) or
  :class:`InvalidTypeError` (a ``TypeError``) *before* anything is sent to the
  database, with a message that says what is allowed.
* Every message says what to do next when there is something to do.
* Database failures that are not the caller's fault are wrapped in
  :class:`DatabaseUnavailableError` or :class:`SchemaNotReadyError`; the
  original psycopg exception stays available as ``__cause__``.
"""

from __future__ import annotations

from typing import Self

__all__ = [
    "PgqError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "BadIdError",
    "NoReplError",
    "MaxLenError",
    "PausedError",
    "NoJobError",
    "TooLateError",
    "LeavingError",
    "DatabaseUnavailableError",
    "SchemaNotReadyError",
    "TaskFailedError",
    "ResultNotKeptError",
    "TransactionAbortedError",
    "EmbeddedServerError",
    "SparkSetupError",
    "IngestError",
]


class PgqError(Exception):
    """Base class of every error raised by pgq.

    ``str(error)`` names what to do in the API's terms (``pause(queue,
    'none')``); :attr:`cli_message`, when set, says the same for a shell
    user (``pgq pause emails none``), and the CLI prints that one.
    """

    cli_message: str | None = None

    def for_cli(self, message: str) -> Self:
        """Set the shell spelling of this error's message; returns the error."""
        self.cli_message = message
        return self


class InvalidArgumentError(PgqError, ValueError):
    """An argument has the right type but a value outside what is allowed."""


class InvalidTypeError(PgqError, TypeError):
    """An argument has a type pgq does not accept."""


class BadIdError(InvalidArgumentError):
    """A job ID is not in Disque's format (``-BADID``).

    One bad ID rejects the whole multi-ID command: nothing is changed.
    """


class NoReplError(PgqError):
    """The job could not be stored on the requested number of nodes (``-NOREPL``).

    ``removed`` lists the jobs that were withdrawn (never delivered);
    ``added`` the jobs of the same call that did get their copies;
    ``node_down`` tells that this node's process is not running (a client
    given several node DSNs then adds through another node).
    """

    def __init__(self, message: str, removed: tuple[str, ...] = (),
                 added: tuple[str, ...] = (), node_down: bool = False) -> None:
        super().__init__(message)
        self.removed = removed
        self.added = added
        self.node_down = node_down


class MaxLenError(PgqError):
    """The queue already holds ``maxlen`` or more jobs (``-MAXLEN``)."""


class PausedError(PgqError):
    """The queue is paused for input, so adds are refused (``-PAUSED``)."""


class NoJobError(PgqError):
    """The job is not known on this node, or no longer active (``-NOJOB``)."""


class TooLateError(PgqError):
    """Half of the job's TTL has elapsed: its delivery can no longer be postponed (``-TOOLATE``)."""


class LeavingError(PgqError):
    """This node is leaving the cluster and will not block consumers (``-LEAVING``)."""


class DatabaseUnavailableError(PgqError):
    """The node's PostgreSQL database could not be reached in time."""


class SchemaNotReadyError(PgqError):
    """The database has no pgq schema, or an older one than this library needs."""


class TransactionAbortedError(PgqError):
    """The caller's transaction is aborted; it must be rolled back before reuse."""


class EmbeddedServerError(PgqError):
    """The embedded PostgreSQL server could not be found, initialised or started."""


class SparkSetupError(PgqError):
    """Spark cannot be used: PySpark, Java or the PostgreSQL JDBC driver is missing."""


class IngestError(PgqError):
    """A bulk ingestion (``pgq.spark.write_jobs``) could not be completed.

    Nothing half-done is ever visible: a node either merged all of its rows
    in one transaction or none. Re-run with the same ``ingest_id`` to finish;
    nodes that merged already are skipped.
    """


class TaskFailedError(PgqError):
    """A task's job ended in the dead letters; the message is its error and
    traceback (see :meth:`pgq.Tasks.result`)."""


class ResultNotKeptError(PgqError):
    """A task's job succeeded and was acknowledged, but what it returned
    could not be encoded or stored (too big), so no result was kept (the message says why; see
    :meth:`pgq.Tasks.result`). Not a failure: running it again would repeat
    work that is done."""


def first_line(error: BaseException) -> str:
    """The first line of what ``error`` says (its type's name if nothing):
    what pgq quotes of a foreign error (psycopg's, SQLAlchemy's, Spark's,
    whose texts go on for pages)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
