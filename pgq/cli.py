"""The ``pgq`` command line.

Every command has ``--help``. Exit codes scripts can rely on: 0 success,
1 a pgq error (message on stderr, starting with ``error:``), 2 bad usage.
``--json`` prints machine-readable output where a command reports data.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from . import __version__
from .errors import PgqError


def _fail(exc: PgqError) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(1)


def _emit(data: Any, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(data, default=str, sort_keys=True))
        return
    if isinstance(data, dict):
        width = max((len(k) for k in data), default=0)
        for key, value in data.items():
            click.echo(f"{key:<{width}}  {value}")
    else:
        click.echo(data)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pgq")
def main() -> None:
    """pgq: Disque's distributed job queue on PostgreSQL."""


@main.command()
@click.option("--dsn", envvar="PGQ_DSN", help="Database to migrate (default: the embedded server).")
@click.option("--home", envvar="PGQ_HOME", help="Embedded server directory when no DSN is given.")
def migrate(dsn: str | None, home: str | None) -> None:
    """Create or upgrade schema pgq in a database."""
    from . import embedded
    from .migrate import migrate as run

    try:
        target = dsn or embedded.ensure_running(home).dsn
        click.echo(f"schema pgq at revision {run(target)}")
    except PgqError as exc:
        _fail(exc)


@main.group("embedded")
def embedded_group() -> None:
    """Manage the embedded PostgreSQL server (used when no DSN is given)."""


@embedded_group.command("start")
@click.option("--home", envvar="PGQ_HOME", help="Server directory (default: $PGQ_HOME or the user data dir).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def embedded_start(home: str | None, as_json: bool) -> None:
    """Start the embedded server (or find it running) and migrate it; print its DSN."""
    from . import embedded
    from .migrate import migrate as run

    try:
        instance = embedded.ensure_running(home)
        run(instance.dsn)
        _emit({"dsn": instance.dsn, "port": instance.port}, as_json)
    except PgqError as exc:
        _fail(exc)


@embedded_group.command("stop")
@click.option("--home", envvar="PGQ_HOME", help="Server directory.")
def embedded_stop(home: str | None) -> None:
    """Stop the embedded server."""
    from . import embedded

    try:
        stopped = embedded.stop(home)
        click.echo("stopped" if stopped else "not running")
    except PgqError as exc:
        _fail(exc)


@embedded_group.command("status")
@click.option("--home", envvar="PGQ_HOME", help="Server directory.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def embedded_status(home: str | None, as_json: bool) -> None:
    """Show whether the embedded server runs, and where."""
    from . import embedded

    try:
        _emit(embedded.status(home), as_json)
    except PgqError as exc:
        _fail(exc)


if __name__ == "__main__":  # pragma: no cover
    main()
