"""pgq: Disque's distributed job queue, rebuilt in Python on PostgreSQL.

Public API (names are stable; code outside this repository calls them):

* :class:`Client` / :class:`AsyncClient`: Disque's client commands as methods.
* :class:`Job`: what ``get_job`` and ``qpeek`` return.
* :class:`Worker`: run a function for every job of some queues.
* :class:`Tasks`: functions called with arguments through a queue (``defer``).
* :func:`migrate`: create or upgrade schema ``pgq`` in a database.
* :func:`stop_embedded`: stop the embedded PostgreSQL server.
* :mod:`pgq.errors`: every error pgq raises on purpose.
"""

from __future__ import annotations

from . import errors
from .aio import AsyncClient
from .client import Client
from .job import Job
from .migrate import SCHEMA_VERSION, migrate
from .tasks import Tasks
from .worker import Worker

__version__ = "0.1.0"

__all__ = [
    "Client",
    "AsyncClient",
    "Job",
    "Worker",
    "Tasks",
    "migrate",
    "stop_embedded",
    "errors",
    "SCHEMA_VERSION",
    "__version__",
]


def stop_embedded(home: str | None = None, mode: str = "fast") -> bool:
    """Stop the embedded PostgreSQL server under ``home`` (default ``$PGQ_HOME``).

    Returns False if it was not running. Clients using it will fail until it is
    started again (any ``pgq.Client()`` without a DSN starts it).
    """
    from . import embedded

    return embedded.stop(home, mode)
