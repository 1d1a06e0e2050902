"""The ``pgq`` command line (``pgq --help``).

Every command has ``--help`` and ``--json``; exit codes: 0 success, 1 a pgq
error (one line on stderr: ``error: ...``), 2 bad usage, 3 nothing found,
130 interrupted (the rules: :mod:`pgq.cli.common`). Commands that talk to a queue take ``--dsn`` (or ``$PGQ_DSN``) or a
node's ``--data`` directory, and default to the embedded server.
"""

from __future__ import annotations

import click

from .. import __version__
from . import cluster, dashboard, jobs, server
from .common import handles_errors
from .periodic import periodic_group
from .serve import serve
from .simulate import simulate
from .spark import spark_group
from .stats import stats
from .worker import worker


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pgq")
def main() -> None:
    """pgq: Disque's distributed job queue on PostgreSQL."""


@main.command()
@click.option("--jobs", type=click.IntRange(min=1), default=6000, show_default=True,
              help="Jobs to add.")
@click.option("--no-kill", is_flag=True, help="Do not kill a node halfway.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the verdict as JSON on stdout (the story goes to stderr).")
@handles_errors
def demo(jobs: int, no_kill: bool, as_json: bool) -> None:
    """Start a local 3-node cluster, run producers and consumers, kill a node
    halfway, restart it, and print the verdict (lost must be 0)."""
    import sys

    from ..demo import main as run_demo

    sys.exit(run_demo(["--jobs", str(jobs)] + (["--no-kill"] if no_kill else [])
                      + (["--json"] if as_json else [])))


for command in (server.migrate, server.embedded_group, cluster.node_group, cluster.cluster_group,
                jobs.add, jobs.get, jobs.ack, jobs.fast_ack, jobs.nack, jobs.del_job, jobs.enqueue,
                jobs.dequeue, jobs.show, jobs.wait, jobs.qlen, jobs.qstat, jobs.qscan, jobs.jscan, jobs.pause,
                jobs.dead_letters, worker, stats, spark_group, simulate, periodic_group, serve,
                dashboard.dashboard):
    main.add_command(command)

__all__ = ["main"]


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
@handles_errors  # Ctrl-C: 130, as every command (click said "Aborted!" and 1)
def bench(ctx: click.Context) -> None:
    """Run the benchmarks (options as `python -m bench --help`: --smoke, --rounds, --only, --out,
    --json)."""
    import sys

    from ..bench.__main__ import main as run_bench

    sys.exit(run_bench(list(ctx.args)))
