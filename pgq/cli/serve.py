"""``pgq serve``: pgq for programs in any language, on a database: the HTTP
API (``--http``), Disque's client protocol (``--resp``) and the dashboard
(``--dashboard``), in one process (:mod:`pgq.fronts`)."""

from __future__ import annotations

import click

from .common import fronts_of, fronts_options, handles_errors, json_logs_option, node_dsn, target_options


@click.command("serve")
@fronts_options
@json_logs_option
@target_options
@handles_errors
def serve(http_listen: str | None, resp_listen: str | None, token_file: str | None,
          dashboard_listen: str | None, dashboard_token_file: str | None,
          dsn: str | None, data: str | None) -> None:
    """Serve pgq to programs in any language: an HTTP API (add, lease, ack,
    nack, working, status, wait, stats, health, metrics), Disque's protocol
    (ADDJOB, GETJOB, ACKJOB, ...) and/or the web dashboard.

    Runs on uvloop where it is installed; PGQ_EVENT_LOOP=asyncio runs it
    on asyncio's own event loop instead."""
    from .. import eventloop
    from ..cluster.process import setup_logging
    from ..fronts import serve_until_signalled

    if not http_listen and not resp_listen and not dashboard_listen:
        raise click.UsageError("say what to serve: --http HOST:PORT, --resp HOST:PORT and/or "
                               "--dashboard HOST:PORT")
    fronts = fronts_of(http_listen, resp_listen, token_file, dashboard_listen, dashboard_token_file)
    setup_logging("serve")
    # A signal stops it gracefully (status 0); a second one during that
    # stop, or one before the signals are taken, is an interrupt (130), and
    # PgqError (a port in use) one line and status 1: @handles_errors.
    eventloop.run(serve_until_signalled, node_dsn(data, dsn) if data else dsn, fronts)
