"""What every ``pgq`` command shares: finding the database, printing, failing.

Exit codes scripts can rely on (one rule for every command):

* 0: done, and there was something to act on or show;
* 1: a pgq error (one line on stderr starting with ``error:``, saying what
  to do, in the shell's terms);
* 2: bad usage (click's);
* 3: nothing found: no job came (``get``), an unknown job or queue
  (``show``, ``qstat``), an empty queue (``qlen`` prints 0), none of the
  IDs was known (``ack``, ``nack``, ``fastack``, ``deljob``, ``enqueue``,
  ``dequeue``), an empty listing (``qscan``, ``jscan``, ``dead-letters
  list``, ``periodic list``), nothing to requeue, remove or stop;
* 130: interrupted.

``--json`` prints one JSON document on stdout (:mod:`pgq.jsonable`: numbers
as numbers, ISO-8601 times, bodies as text or ``body_base64``); commands
that run until stopped (``worker``, ``serve``, ``node start``) log one JSON
object per line instead. Progress bars and notes go to stderr.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..errors import PgqError, first_line
from ..jsonable import dumps
from ..ports import is_loopback

F = TypeVar("F", bound=Callable[..., Any])
console = Console(stderr=False, soft_wrap=True)
# Progress bars go to stderr: stdout carries the command's output (IDs,
# JSON), which scripts redirect.
progress_console = Console(stderr=True)


def fail(message: str | PgqError) -> None:
    """One line on stderr; a pgq error in its shell spelling (the hint names
    the ``pgq`` command, not the API call)."""
    from ..dsn import redact

    text = message.cli_message or str(message) if isinstance(message, PgqError) else message
    # Messages may quote a DSN (libpq's do): never its password. libpq's
    # end in a newline: stripped, or the line was followed by a blank one.
    click.echo(f"error: {redact(text).strip()}", err=True)
    sys.exit(1)


def handles_errors(func: F) -> F:
    """Turn pgq errors, and the database's own (a bad DSN, no server, a
    refused statement), into exit status 1 with a one-line message."""
    import psycopg

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except PgqError as exc:
            fail(exc)
        except psycopg.Error as exc:
            first = first_line(exc)
            fail(f"the database: {first} (check --dsn, --data or PGQ_DSN, and that the "
                 "server runs)")
        except KeyboardInterrupt:
            sys.exit(130)
        except BrokenPipeError:  # `pgq add ... | head`: click ends it quietly (status 1)
            raise
        except OSError as exc:  # a path: not there, not allowed, not a directory
            where = f"{exc.filename}: " if exc.filename else ""
            fail(f"{where}{exc.strerror or exc} (check the path and its permissions)")
    return wrapper  # type: ignore[return-value]


class Seconds(click.ParamType):  # type: ignore[type-arg]  # generic since click 8.3
    """A duration in seconds: a finite number ≥ 0 (click's FloatRange lets
    NaN through, and a wait until NaN never ends)."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        import math

        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not math.isfinite(seconds) or seconds < 0:
            self.fail(f"{value!r} is not a finite number of seconds ≥ 0", param, ctx)
        return seconds


SECONDS = Seconds()


def arg_bytes(text: str) -> bytes:
    """A command-line argument's own bytes: Python decodes argv with
    surrogateescape, so an argument that is not UTF-8 (a binary body) holds
    lone surrogates, which a plain encode() refused with a traceback."""
    return text.encode("utf-8", "surrogateescape")


def to_json(data: Any) -> str:
    """JSON as every front writes it (:mod:`pgq.jsonable`): numbers as
    numbers, ISO-8601 times, bodies as text or ``body_base64``."""
    return dumps(data)


def text_of(body: bytes) -> str:
    """A body for display: its UTF-8 text, or a Python bytes literal."""
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return repr(body)


def emit(data: Any, as_json: bool) -> None:
    """Print a dict as key/value lines (or JSON)."""
    if as_json:
        click.echo(to_json(data))
        return
    if isinstance(data, dict):
        data = {k: v for k, v in data.items() if v is not None}  # an acked job: its tombstone
        width = max((len(str(k)) for k in data), default=0)
        for key, value in data.items():
            if isinstance(value, (bytes, bytearray)):
                value = text_of(bytes(value))
            click.echo(f"{key:<{width}}  {value}")
    else:
        click.echo(data)



def json_option(func: F) -> F:
    """``--json``: the command's result as one JSON document."""
    return click.option("--json", "as_json", is_flag=True, help="Print JSON.")(func)


def json_logs_option(func: F) -> F:
    """``--json`` of a command that runs until stopped: its log, one JSON
    object per line (the same as ``PGQ_LOG_FORMAT=json``)."""
    def use_json(ctx: click.Context, param: click.Parameter, value: bool) -> None:
        if value:
            os.environ["PGQ_LOG_FORMAT"] = "json"
    return click.option("--json", is_flag=True, expose_value=False, is_eager=True, callback=use_json,
                        help="Log one JSON object per line (as PGQ_LOG_FORMAT=json).")(func)


def report(data: dict[str, Any], as_json: bool, text: str, found: bool = True,
           missing: str | None = None) -> None:
    """Print ``text`` (or ``data`` as JSON); exit 3 when nothing was
    ``found``, saying ``missing`` on stderr instead of ``text`` if given."""
    if as_json:
        click.echo(to_json(data))
    elif found or missing is None:
        click.echo(text)
    else:
        click.echo(missing, err=True)
    if not found:
        sys.exit(3)


def wide_console() -> Console:
    """The console for a table: piped output is not cut to 80 columns, so
    scripts and logs get whole rows."""
    return console if console.is_terminal else Console(width=max(console.width, 200))


def emit_found(data: Any, as_json: bool, missing: str) -> None:
    """Print ``data`` like :func:`emit`; when it is None, say ``missing``
    (``null`` on stdout with --json) and exit 3, the "not found" code."""
    if data is None:
        click.echo("null" if as_json else missing, err=not as_json)
        sys.exit(3)
    emit(data, as_json)


def table(rows: Iterable[Sequence[Any]], columns: Sequence[str], as_json: bool,
          title: str | None = None, empty_is_missing: bool = False) -> None:
    """Print rows as a table (or a JSON list of objects); with
    ``empty_is_missing``, no rows exits 3 (after printing the empty table)."""
    rows = list(rows)
    if as_json:
        click.echo(to_json([dict(zip(columns, r, strict=True)) for r in rows]))
    else:
        _print_table(rows, columns, title)
    if empty_is_missing and not rows:
        sys.exit(3)


def _print_table(rows: list[Sequence[Any]], columns: Sequence[str], title: str | None) -> None:
    out = Table(title=title, show_edge=False, header_style="bold")
    printer = wide_console()
    for column in columns:
        out.add_column(column, overflow="fold")
    for row in rows:  # Text: user data is never read as rich markup ("[/]" in a body)
        out.add_row(*(Text("" if v is None else text_of(v) if isinstance(v, bytes) else str(v))
                      for v in row))
    printer.print(out)


def typed(option: str) -> bool:
    """Whether the command's ``option`` was given on its command line (not
    filled from its environment variable or its default); True outside a
    command."""
    context = click.get_current_context(silent=True)
    return context is None or \
        context.get_parameter_source(option) is click.core.ParameterSource.COMMANDLINE


def node_dsn(data: str | None, dsn: str | None) -> str:
    """The database of the node named by --data (its node.json), --dsn or
    $PGQ_DSN. --data beats $PGQ_DSN (a DSN from the environment took the
    place of the node named on the command line, so `ack` or `migrate
    --data DIR` acted on another database); --data with --dsn is refused."""
    from ..cluster.process import read_state
    from ..dsn import libpq_url

    if dsn and data:
        if typed("dsn"):
            raise click.UsageError("--dsn and --data both name the database: give one")
        dsn = None
    if dsn:
        found = dsn
    elif data:
        state = read_state(Path(data))
        if not state or not state.get("dsn"):
            raise click.UsageError(f"no running node found in {data} (node.json has no DSN yet)")
        found = str(state["dsn"])
    elif os.environ.get("PGQ_DSN"):
        found = os.environ["PGQ_DSN"]
    else:
        raise click.UsageError("name the node: --data DIR or --dsn DSN")
    # Checked here (a typed error), not by libpq in the command: a DSN that
    # is not UTF-8 was a UnicodeEncodeError traceback there.
    libpq_url(found)
    return found


def given_dsn(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Click callback of every --dsn option: an empty one is bad usage. libpq
    took '' for its defaults (the local socket, the OS user's name), so
    `--dsn "$PGQ_DSN"` with the variable unset reached another database, or
    failed with a message about a role named after the OS user."""
    for dsn in value if isinstance(value, tuple) else (value,):
        if dsn is not None and not dsn.strip():
            raise click.BadParameter("is empty: give a DSN (postgresql://USER@HOST:PORT/DB) "
                                     "or leave the option out", ctx, param)
    return value


def target_options(func: F) -> F:
    """--dsn / --data: which database a command talks to (default: the embedded one)."""
    func = click.option("--data", type=click.Path(file_okay=False),
                        help="A node's data directory (its node.json names the DSN).")(func)
    func = click.option("--dsn", envvar="PGQ_DSN", callback=given_dsn,
                        help="Database DSN (default: $PGQ_DSN, else the embedded server).")(func)
    return func


def listen_address(option: str, text: str, secret: str | None,
                   secret_option: str = "--token-file") -> tuple[str, int]:
    """(host, port) of a server's ``option`` HOST:PORT. Beyond loopback only
    with a secret (given by ``secret_option``): whoever reaches the port
    could otherwise act on the queue."""
    host, port = _address(option, text)
    if not secret and not is_loopback(host):
        raise click.UsageError(f"{option}: listening on {host} (beyond loopback) needs a secret: "
                               f"{secret_option} FILE")
    return host, port


def check_metrics(metrics: str | None) -> None:
    """--metrics HOST:PORT checked before anything starts: a bad one failed
    only once the server ran (a traceback from `pgq node start`, with the
    embedded PostgreSQL it had started left running)."""
    if metrics:
        _address("--metrics", metrics)


def _address(option: str, text: str) -> tuple[str, int]:
    """(host, port) of ``option`` HOST:PORT; anything else is bad usage."""
    from ..metrics import parse_listen

    try:
        return parse_listen(text)
    except ValueError:
        raise click.UsageError(f"{option} wants HOST:PORT, not {text!r}") from None


def read_token(token_file: str | None) -> str | None:
    """The secret in ``token_file`` (None without one); an empty file is bad usage."""
    if not token_file:
        return None
    try:
        token = Path(token_file).read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise click.UsageError(f"the token file {token_file} is not UTF-8 text: write the "
                               "secret as text (e.g. `pgq cluster secret > FILE`)") from None
    except OSError as exc:
        raise click.UsageError(f"the token file {token_file}: {exc.strerror}") from None
    if not token:
        raise click.UsageError(f"the token file {token_file} is empty")
    return token


def fronts_options(func: F) -> F:
    """--http, --resp, --token-file, --dashboard, --dashboard-token-file:
    what ``pgq serve`` and ``pgq node start`` serve to other programs."""
    options = [
        click.option("--http", "http_listen", metavar="HOST:PORT",
                     help="Serve the HTTP API here (JSON; its OpenAPI document at /openapi.json)."),
        click.option("--resp", "resp_listen", metavar="HOST:PORT",
                     help="Serve Disque's client protocol here (RESP2; Disque's port is 7711)."),
        click.option("--token-file", type=click.Path(exists=True, dir_okay=False),
                     help="File holding the secret of --http and --resp: the HTTP bearer token "
                          "and the RESP AUTH password (default: $PGQ_HTTP_TOKEN)."),
        click.option("--dashboard", "dashboard_listen", metavar="HOST:PORT", envvar="PGQ_DASHBOARD",
                     help="Serve the web dashboard here (see `pgq dashboard`)."),
        click.option("--dashboard-token-file", type=click.Path(dir_okay=False, exists=True),
                     envvar="PGQ_DASHBOARD_TOKEN_FILE",
                     help="File holding the token that unlocks the dashboard's actions (else read-only)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def fronts_of(http_listen: str | None, resp_listen: str | None, token_file: str | None,
              dashboard_listen: str | None, dashboard_token_file: str | None) -> Any:
    """The :class:`pgq.fronts.Fronts` the options ask for, checked (bad
    addresses and open ports without a secret are usage errors)."""
    from ..fronts import Fronts

    # stripped as a token file's content is (a client's header is, too)
    token = read_token(token_file) if token_file else (os.environ.get("PGQ_HTTP_TOKEN") or "").strip() or None
    board_token = read_token(dashboard_token_file)
    return Fronts(
        http=listen_address("--http", http_listen, token) if http_listen else None,
        resp=listen_address("--resp", resp_listen, token) if resp_listen else None,
        dashboard=listen_address("--dashboard", dashboard_listen, board_token, "--dashboard-token-file")
        if dashboard_listen else None,
        token=token, dashboard_token=board_token)


def client_for(dsn: str | None, data: str | None, **options: Any) -> Any:
    """The client of a one-shot command: a server that does not answer is
    reported at once (each DSN tried once), not after seconds of retries."""
    from .. import Client

    options.setdefault("connect_timeout", 0)

    if data:
        dsn = node_dsn(data, dsn)
    return Client(dsn, **options)
