"""What every ``pgq`` command shares: finding the database, printing, failing.

Exit codes scripts can rely on: 0 success; 1 a pgq error (one line on
stderr starting with ``error:``, saying what to do); 2 bad usage (click's);
130 interrupted. ``--json`` prints one JSON document on stdout.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table

from ..errors import PgqError

F = TypeVar("F", bound=Callable[..., Any])
console = Console(stderr=False, soft_wrap=True)
# Progress bars go to stderr: stdout carries the command's output (IDs,
# JSON), which scripts redirect.
progress_console = Console(stderr=True)


def fail(message: str | PgqError) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


def handles_errors(func: F) -> F:
    """Turn pgq errors into exit status 1 with a one-line message."""
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except PgqError as exc:
            fail(exc)
        except KeyboardInterrupt:
            sys.exit(130)
    return wrapper  # type: ignore[return-value]


def to_json(data: Any) -> str:
    def default(value: Any) -> Any:
        if isinstance(value, (bytes, bytearray, memoryview)):
            return text_of(bytes(value))
        return str(value)
    return json.dumps(data, default=default, sort_keys=True)


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



def emit_found(data: Any, as_json: bool, missing: str) -> None:
    """Print ``data`` like :func:`emit`; when it is None, say ``missing``
    (``null`` on stdout with --json) and exit 3, the "not found" code."""
    if data is None:
        click.echo("null" if as_json else missing, err=not as_json)
        sys.exit(3)
    emit(data, as_json)

def table(rows: Iterable[Sequence[Any]], columns: Sequence[str], as_json: bool,
          title: str | None = None) -> None:
    """Print rows as a table (or a JSON list of objects)."""
    rows = list(rows)
    if as_json:
        click.echo(to_json([dict(zip(columns, r, strict=True)) for r in rows]))
        return
    out = Table(title=title, show_edge=False, header_style="bold")
    # Piped output is not wrapped to 80 columns: scripts and logs get whole rows.
    printer = console if console.is_terminal else Console(width=max(console.width, 200))
    for column in columns:
        out.add_column(column, overflow="fold")
    for row in rows:
        out.add_row(*("" if v is None else text_of(v) if isinstance(v, bytes) else str(v) for v in row))
    printer.print(out)


def node_dsn(data: str | None, dsn: str | None) -> str:
    """The database of the node named by --data (its node.json), --dsn or $PGQ_DSN."""
    from ..cluster.process import read_state

    if dsn:
        return dsn
    if data:
        state = read_state(Path(data))
        if not state or not state.get("dsn"):
            raise click.UsageError(f"no running node found in {data} (node.json has no DSN yet)")
        return str(state["dsn"])
    env = os.environ.get("PGQ_DSN")
    if env:
        return env
    raise click.UsageError("name the node: --data DIR or --dsn DSN")


def target_options(func: F) -> F:
    """--dsn / --data: which database a command talks to (default: the embedded one)."""
    func = click.option("--data", type=click.Path(file_okay=False),
                        help="A node's data directory (its node.json names the DSN).")(func)
    func = click.option("--dsn", envvar="PGQ_DSN",
                        help="Database DSN (default: $PGQ_DSN, else the embedded server).")(func)
    return func


def client_for(dsn: str | None, data: str | None, **options: Any) -> Any:
    """The client of a one-shot command: a server that does not answer is
    reported at once (each DSN tried once), not after seconds of retries."""
    from .. import Client

    options.setdefault("connect_timeout", 0)

    if data and not dsn:
        dsn = node_dsn(data, None)
    return Client(dsn, **options)
