"""``pgq dashboard``: the web dashboard of a node's database
(:mod:`pgq.dashboard`), served by uvicorn until interrupted.

Read-only unless ``--token-file`` is given (then pause/resume and requeue
need that token); like ``pgq serve``, it refuses to listen beyond loopback
without one.
"""

from __future__ import annotations

import click

from .common import handles_errors, json_logs_option, listen_address, node_dsn, read_token, target_options

DEFAULT_LISTEN = "127.0.0.1:7780"


@click.command("dashboard")
@click.option("--listen", default=DEFAULT_LISTEN, show_default=True, metavar="HOST:PORT",
              help="Address of the dashboard (open http://HOST:PORT/ in a browser).")
@click.option("--token-file", type=click.Path(exists=True, dir_okay=False), envvar="PGQ_DASHBOARD_TOKEN_FILE",
              help="File holding the token that unlocks actions (pause/resume, requeue); "
                   "without it the dashboard is read-only.")
@json_logs_option
@target_options
@handles_errors
def dashboard(listen: str, token_file: str | None, dsn: str | None, data: str | None) -> None:
    """Serve the web dashboard: queues (length, rates, oldest job, paused),
    jobs and their history, dead letters, the cluster's nodes; live updates.
    Read-only unless --token-file is given."""
    from .. import eventloop
    from ..cluster.process import setup_logging
    from ..fronts import Fronts, serve_until_signalled

    token = read_token(token_file)
    fronts = Fronts(dashboard=listen_address("--listen", listen, token), dashboard_token=token)
    setup_logging("dashboard")
    # As `pgq serve`: a second signal during the graceful stop is an interrupt (130).
    eventloop.run(serve_until_signalled, node_dsn(data, dsn) if data else dsn, fronts)
