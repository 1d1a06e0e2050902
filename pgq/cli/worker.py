"""``pgq worker MODULE:FUNC --queue Q ...``: run a worker from a shell."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import click

from ..connecting import FIRST_CONNECT_TIMEOUT
from ..worker import DEFAULT_MAX_DELIVERIES
from .common import SECONDS, check_metrics, client_for, handles_errors, json_logs_option, target_options, typed

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _load(target: str) -> Any:
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise click.UsageError(f"expected MODULE:FUNC (e.g. myapp.jobs:send_email), not {target!r}")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except (ImportError, TypeError, ValueError) as exc:  # TypeError: a relative name (.jobs)
        raise click.UsageError(f"cannot import {module_name}: {exc}") from None
    except SyntaxError as exc:  # its message names the file and line; other errors of the
        # module's own code keep their traceback (where in it they came from)
        raise click.UsageError(f"cannot import {module_name}: {exc.__class__.__name__}: "
                               f"{exc}") from None
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise click.UsageError(f"{module_name} has no attribute {attribute!r}") from None


# Options a pgq.Worker target sets in its own code: given on the command
# line too, they were dropped without a word.
_WORKER_SETTINGS = ("queues", "concurrency", "timeout", "max_nacks", "max_deliveries", "backoff",
                    "transactional", "grace")


def _configured_in_code(runner: Any, target: str) -> None:
    """Refuse the command line's settings that ``runner`` (a pgq.Worker)
    already has: the worker ran with its own and ignored them."""
    given = [name for name in _WORKER_SETTINGS if typed(name)]
    if runner._dsn is not None:
        given += [name for name in ("dsn", "data") if typed(name)]
    if given:
        options = ", ".join("--queue" if name == "queues" else "--" + name.replace("_", "-")
                            for name in given)
        raise click.UsageError(f"{target} is a pgq.Worker configured in its code: {options} "
                               "would be ignored. Set them in pgq.Worker(...), or point the "
                               "command at a handler function (MODULE:FUNC)")


@click.command()
@click.argument("target")
@click.option("--queue", "queues", multiple=True, help="Queue to serve (repeatable; order = priority).")
@click.option("--concurrency", type=click.IntRange(1, 10_000), default=4, show_default=True,
              help="Jobs handled at once.")
@click.option("--timeout", type=SECONDS, help="Seconds a job may run before it counts as failed.")
@click.option("--max-nacks", type=click.IntRange(1, 2**31 - 1), help="Failures before a job goes to the dead letters.")
@click.option("--max-deliveries", type=click.IntRange(0, 2**31 - 1), default=DEFAULT_MAX_DELIVERIES,
              show_default=True,
              help="Deliveries before a job goes to the dead letters (0: no limit).")
@click.option("--backoff", type=SECONDS, default=1.0, show_default=True,
              help="First retry delay after a failure (doubles each time).")
@click.option("--transactional", is_flag=True, help="Call FUNC(job, conn); its writes commit with the ACK.")
@click.option("--grace", type=SECONDS, default=30.0, show_default=True,
              help="Seconds in-flight jobs get to finish on SIGTERM before being NACKed.")
@click.option("--metrics", metavar="HOST:PORT", envvar="PGQ_METRICS",
              help="Serve Prometheus metrics on this address.")
@click.option("--scheduler", is_flag=True,
              help="Also add the due jobs of the database's schedules (pgq periodic).")
@click.option("--log-level", envvar="PGQ_LOG_LEVEL", default="INFO", show_default=True,
              type=click.Choice(LEVELS, case_sensitive=False), help="What the worker logs.")
@click.option("--job-log-level", default="INFO", show_default=True,
              type=click.Choice(LEVELS, case_sensitive=False),
              help="Level of the one line logged per finished job.")
@json_logs_option
@target_options
@handles_errors
def worker(target: str, queues: tuple[str, ...], concurrency: int, timeout: float | None,
           max_nacks: int | None, max_deliveries: int | None, backoff: float, transactional: bool,
           grace: float, metrics: str | None, scheduler: bool, log_level: str, job_log_level: str,
           dsn: str | None, data: str | None) -> None:
    """Run TARGET (MODULE:FUNC, or MODULE:WORKER for a pgq.Worker) on jobs until SIGTERM."""
    import logging

    from ..cluster.process import setup_logging
    from ..metrics import WorkerMetrics
    from ..worker import Worker

    os.environ["PGQ_LOG_LEVEL"] = log_level.upper()
    setup_logging(f"worker:{target}")
    job_level = getattr(logging, job_log_level.upper())
    check_metrics(metrics)  # a bad address fails here, not after connecting
    handler = _load(target)
    if isinstance(handler, Worker):
        _configured_in_code(handler, target)
    elif not queues:  # before connecting (or starting the embedded server)
        raise click.UsageError("name the queues to serve: --queue NAME")
    gauges = WorkerMetrics() if metrics else None
    with client_for(dsn, data, connect_timeout=FIRST_CONNECT_TIMEOUT) as client:
        if isinstance(handler, Worker):
            runner = handler
            runner._dsn = client.dsn if runner._dsn is None else runner._dsn
            # Only what the command line says: a Worker's own metrics
            # object and job log level were replaced by None and INFO
            # (found by a read-only review).
            if gauges is not None:
                runner.metrics = gauges
            if typed("job_log_level"):
                runner.job_log_level = job_level
            runner.scheduler = runner.scheduler or scheduler
        else:
            runner = Worker(client, queues=list(queues), handler=handler, concurrency=concurrency,
                            timeout=timeout, max_nacks=max_nacks,
                            max_deliveries=max_deliveries or None, backoff=backoff,
                            transactional=transactional, grace=grace, metrics=gauges,
                            job_log_level=job_level, scheduler=scheduler)
    if gauges is not None and metrics:
        gauges.serve(metrics)
    stats = runner.run()
    click.echo(f"worker stopped: {stats.succeeded} succeeded, {stats.failed} failed, "
               f"{stats.dead} dead-lettered, {stats.interrupted} interrupted", err=True)
