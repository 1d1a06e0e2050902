"""A node database as Spark's JDBC data source sees it.

:func:`jdbc_target` turns a libpq DSN into the JDBC URL and connection
properties Spark's executors use. Why each setting:

* ``reWriteBatchedInserts=true``: the driver sends one multi-row INSERT per
  batch instead of one statement per row (+50-75 % write speed here).
* ``logServerErrorDetail=false``: a failed batch must not copy thousands of
  rows of job bodies into exception texts and logs.
* ``options=-c statement_timeout=... -c idle_in_transaction_session_timeout=...``:
  a Spark connection can never hold a statement or an open transaction (and
  with it the snapshot that holds back VACUUM of the hot job table) for long.
* ``driver=org.postgresql.Driver``: needed with ``spark.jars`` (otherwise
  "No suitable driver").

Invariants: the URL names the host and port of the DSN as they are (never
assumed to be localhost: executors may run elsewhere); a DSN Spark cannot
use (a Unix socket, several hosts) is refused with a message saying why.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..errors import InvalidArgumentError
from .environment import DRIVER_CLASS

__all__ = ["JdbcTarget", "jdbc_target"]

READ_STATEMENT_TIMEOUT_MS = 300_000  # one partition of a read: seconds, never minutes
WRITE_STATEMENT_TIMEOUT_MS = 300_000
IDLE_IN_TRANSACTION_TIMEOUT_MS = 60_000
_PASSED_THROUGH = ("sslmode", "sslrootcert", "sslcert", "sslkey", "connect_timeout")


@dataclass(frozen=True)
class JdbcTarget:
    """Where and how Spark connects to one node database."""

    url: str
    user: str
    password: str

    def options(self) -> dict[str, str]:
        """Options for ``spark.read/write.format("jdbc")``."""
        options = {"url": self.url, "driver": DRIVER_CLASS, "user": self.user}
        if self.password:
            options["password"] = self.password
        return options


def jdbc_target(dsn: str, *, statement_timeout_ms: int = READ_STATEMENT_TIMEOUT_MS,
                application_name: str = "pgq-spark") -> JdbcTarget:
    """The JDBC URL and credentials for the database of ``dsn``."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise InvalidArgumentError(f"invalid DSN: {exc}") from None
    host = str(params.get("host") or params.get("hostaddr") or "")
    if not host or host.startswith("/") or "," in host:
        raise InvalidArgumentError(
            f"Spark's JDBC driver needs one TCP host in the DSN, not {host or 'a Unix socket'!r}: "
            "give host=ADDRESS port=PORT (the embedded server listens on 127.0.0.1)")
    port = str(params.get("port") or 5432)
    dbname = str(params.get("dbname") or params.get("user") or "postgres")
    netloc = f"[{host}]" if ":" in host else host
    settings = (f"-c statement_timeout={statement_timeout_ms} "
                f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_TIMEOUT_MS}")
    query = {
        "reWriteBatchedInserts": "true",
        "logServerErrorDetail": "false",
        "ApplicationName": application_name,
        "options": settings,
    }
    for key in _PASSED_THROUGH:
        if params.get(key):
            query["connectTimeout" if key == "connect_timeout" else key] = str(params[key])
    url = (f"jdbc:postgresql://{netloc}:{port}/{quote(dbname, safe='')}?"
           + "&".join(f"{k}={quote(v, safe='')}" for k, v in query.items()))
    return JdbcTarget(url, str(params.get("user") or ""), str(params.get("password") or ""))
