"""``pgq migrate`` and ``pgq embedded start|stop|status``."""

from __future__ import annotations

import click

from .common import emit, given_dsn, handles_errors, json_option, node_dsn, report


@click.command()
@click.option("--dsn", envvar="PGQ_DSN", callback=given_dsn, help="Database to migrate (default: the embedded server).")
@click.option("--data", type=click.Path(file_okay=False),
              help="A node's data directory (its node.json names the DSN).")
@click.option("--home", envvar="PGQ_HOME", help="Embedded server directory when no DSN is given.")
@json_option
@handles_errors
def migrate(dsn: str | None, data: str | None, home: str | None, as_json: bool) -> None:
    """Create or upgrade schema pgq in a database."""
    from .. import embedded
    from ..migrate import migrate as run

    if data or dsn:
        dsn = node_dsn(data, dsn)  # checked: a non-UTF-8 DSN was a traceback
    target = dsn or embedded.ensure_running(home).dsn
    revision = run(target)
    report({"revision": revision}, as_json, f"schema pgq at revision {revision}")


@click.group("embedded")
def embedded_group() -> None:
    """Manage the embedded PostgreSQL server (used when no DSN is given)."""


@embedded_group.command("start")
@click.option("--home", envvar="PGQ_HOME", help="Server directory (default: $PGQ_HOME or the user data dir).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--show-password", is_flag=True,
              help="Print the DSN with its password (default: masked).")
@handles_errors
def embedded_start(home: str | None, as_json: bool, show_password: bool) -> None:
    """Start the embedded server (or find it running) and migrate it; print its DSN."""
    from .. import embedded
    from ..dsn import redact
    from ..migrate import migrate as run

    instance = embedded.ensure_running(home)
    run(instance.dsn)
    emit({"dsn": instance.dsn if show_password else redact(instance.dsn),
          "port": instance.port}, as_json)


@embedded_group.command("stop")
@click.option("--home", envvar="PGQ_HOME", help="Server directory.")
@json_option
@handles_errors
def embedded_stop(home: str | None, as_json: bool) -> None:
    """Stop the embedded server (exit 3 if it was not running)."""
    from .. import embedded

    stopped = embedded.stop(home)
    report({"stopped": stopped}, as_json, "stopped" if stopped else "not running", found=stopped)


@embedded_group.command("status")
@click.option("--home", envvar="PGQ_HOME", help="Server directory.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@handles_errors
def embedded_status(home: str | None, as_json: bool) -> None:
    """Show whether the embedded server runs, and where."""
    from .. import embedded

    emit(embedded.status(home), as_json)
