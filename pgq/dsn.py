"""DSNs: checking them, normalising them to libpq URLs, and showing them safely.

Invariants:

* A DSN that libpq could not use (bad syntax, a port that is not a number)
  raises :class:`~pgq.errors.InvalidArgumentError` here, before any
  connection attempt.
* Credentials are URL-quoted when a URL is built, so any password
  round-trips.
* :func:`redact` is what pgq prints: a DSN with its password masked. A DSN
  with its password is shown only when a user asks for it.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import quote

import psycopg
from psycopg.conninfo import conninfo_to_dict

from .arguments import port_number, text
from .errors import InvalidArgumentError

__all__ = ["libpq_url", "host_and_port", "redact", "MASK", "connection_settings"]

MASK = "***"


def _params(dsn: str) -> dict[str, Any]:
    # libpq reads C strings: "host=a\x00b" was silently host a, and a lone
    # surrogate raised UnicodeEncodeError from inside psycopg.
    text("the DSN", dsn, max_chars=len(dsn))
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise InvalidArgumentError(f"invalid DSN: {_quoting_no_password(str(exc), dsn)}") \
            from None
    for port in str(params.get("port") or "").split(","):
        # isascii: str.isdigit() takes '²' and other scripts' digits, which
        # int() refuses or reads as another number
        if port and not 0 < (port_number(port) or 0) < 65536:
            raise InvalidArgumentError(
                f"invalid DSN: port {port!r} is not a TCP port (1-65535)")
    return params


def connection_settings(dsn: str, options: str, application_name: str,
                        default_name: str = "pgq") -> dict[str, Any]:
    """The ``options`` and ``application_name`` of pgq's connections to
    ``dsn``: pgq's session settings, then the DSN's own ``options`` (later
    ``-c`` settings win); the DSN's application name unless one other than
    the default was asked for. Given as keyword arguments, psycopg's replace
    the DSN's: a user's ``?options=-c lock_timeout=2s`` (or a provider's
    routing option) reached the first connection only, never the pool."""
    params = conninfo_to_dict(dsn)
    theirs = params.get("options")
    name = params.get("application_name") if application_name == default_name else None
    return {"options": f"{options} {theirs}" if theirs else options,
            "application_name": str(name or application_name)}


def libpq_url(dsn: str) -> str:
    """``dsn`` as a libpq URL (key=value strings are converted), checked."""
    params = _params(dsn)
    if dsn.startswith(("postgresql://", "postgres://")):
        return dsn
    user = params.pop("user", None)
    password = params.pop("password", None)
    host = str(params.pop("host", None) or "")
    port = params.pop("port", None)
    dbname = str(params.pop("dbname", None) or "")
    auth = ""
    if user:
        auth = quote(str(user), safe="")
        if password:
            auth += ":" + quote(str(password), safe="")
        auth += "@"
    elif password:  # no user (libpq takes PGUSER): the password goes as a parameter
        params["password"] = password
    if "," in host or "," in str(port or ""):
        # Several hosts: as parameters, which libpq reads as lists ("a,b"
        # in the netloc was one host named "a,b" and a port of "5432,").
        params.update({"host": host, **({"port": port} if port else {})})
        host, port = "", None
    netloc = (f"[{host}]" if ":" in host else quote(host, safe="")) + (f":{port}" if port else "")
    query = "&".join(f"{k}={quote(str(v), safe=',')}" for k, v in params.items())
    return f"postgresql://{auth}{netloc}/{quote(dbname, safe='')}" + (f"?{query}" if query else "")


def host_and_port(dsn: str) -> tuple[str, int]:
    """The first host and port a DSN names (libpq's defaults otherwise)."""
    params = _params(dsn)
    host = str(params.get("host") or "localhost").split(",")[0]
    port = int(str(params.get("port") or 5432).split(",")[0])
    return host, port


_URL_PASSWORD = re.compile(r"(postgres(?:ql)?://[^:/@?#\s]*:)([^@\s]*)(@)")
_KV_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)")


def _quoting_no_password(message: str, dsn: str) -> str:
    """libpq's complaint about ``dsn``, redacted, with any piece of text it
    quotes masked when that piece is part of the DSN's password (libpq
    quotes the bad token: 'invalid percent-encoded token: "Hunter%zz2"')."""
    secrets = [m.group(2) for m in _URL_PASSWORD.finditer(dsn)] + \
              [m.group(2).strip("'") for m in _KV_PASSWORD.finditer(dsn)]
    secrets = [secret for secret in secrets if secret]

    def mask(quoted: re.Match[str]) -> str:
        piece = quoted.group(1)
        leaks = any(piece in secret or secret in piece for secret in secrets)
        return f'"{MASK}"' if leaks and piece != MASK else quoted.group(0)
    return re.sub(r'"([^"]*)"', mask, redact(message))


def redact(text: str) -> str:
    """``text`` (a DSN, or a message quoting one) with every password masked."""
    text = _URL_PASSWORD.sub(lambda m: m.group(1) + MASK + m.group(3), text)
    return _KV_PASSWORD.sub(lambda m: m.group(1) + MASK, text)
