"""``pgq periodic add|list|remove``: schedules of periodic jobs (pgq.periodic)."""

from __future__ import annotations

import json
from typing import Any

import click

from ..arguments import MAX_REPLICATE
from .common import SECONDS, arg_bytes, client_for, handles_errors, json_option, report, table, target_options


@click.group("periodic")
def periodic_group() -> None:
    """Periodic jobs: a job to a queue at every tick of a cron expression
    (added by workers started with --scheduler, one per tick)."""


@periodic_group.command("add")
@click.argument("name")
@click.argument("cron")
@click.option("--queue", required=True, help="Queue the jobs go to.")
@click.option("--body", default="", help="Body of every job (text).")
@click.option("--tz", default="UTC", show_default=True, help="Time zone of the cron expression.")
@click.option("--replicate", type=click.IntRange(1, MAX_REPLICATE), help="Copies of each job (cluster).")
@click.option("--retry", type=SECONDS, help="Seconds before an unacknowledged job is queued again.")
@click.option("--ttl", type=SECONDS, help="Seconds a job lives.")
@click.option("--catch-up", type=SECONDS, default=3600.0, show_default=True,
              help="After downtime, add the latest missed tick if it is at most this old.")
@json_option
@target_options
@handles_errors
def periodic_add(name: str, cron: str, queue: str, body: str, tz: str, replicate: int | None,
                 retry: float | None, ttl: float | None, catch_up: float, as_json: bool,
                 dsn: str | None, data: str | None) -> None:
    """Create or change schedule NAME: a job to QUEUE at every tick of CRON
    (e.g. "*/5 * * * *", "0 3 * * *", "@daily"); its first job at its next tick."""
    import psycopg

    from .. import periodic

    options = {k: v for k, v in (("replicate", replicate), ("retry", retry), ("ttl", ttl))
               if v is not None}
    schedule = periodic.Schedule(name, cron, queue, arg_bytes(body), tz,
                                 {**options, "catch_up": catch_up})
    with client_for(dsn, data) as client, psycopg.connect(client.dsn, autocommit=True) as conn:
        now = periodic.database_now(conn)  # the schedulers' clock, not this machine's
        periodic.save(conn, schedule, now)
    following = periodic.next_tick(cron, tz, now)
    report({"name": name, "next_tick": following}, as_json, f"{name}: next job {following.isoformat()}")


@periodic_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@target_options
@handles_errors
def periodic_list(as_json: bool, dsn: str | None, data: str | None) -> None:
    """The schedules, with their last and next ticks (exit 3 if there is none)."""
    import psycopg

    from .. import periodic

    broken: list[tuple[str, str]] = []
    with client_for(dsn, data) as client, psycopg.connect(client.dsn) as conn:
        now = periodic.database_now(conn)  # the schedulers' clock
        schedules = periodic.load(conn, broken)
    rows: list[tuple[Any, ...]] = [
        (s.name, s.cron, s.tz, s.queue, last.isoformat() if last else None,
         periodic.next_tick(s.cron, s.tz, now).isoformat(),
         s.options if as_json else json.dumps(s.options))
        for s, last in schedules]
    # A row made invalid by hand adds no job: listed with why, so that it
    # can be fixed or removed (`pgq periodic remove NAME`).
    rows += [(name, None, None, None, None, f"never (invalid: {why})", None) for name, why in broken]
    table(rows, ("name", "cron", "tz", "queue", "last_tick", "next_tick", "options"), as_json,
          empty_is_missing=True)


@periodic_group.command("remove")
@click.argument("name")
@json_option
@target_options
@handles_errors
def periodic_remove(name: str, as_json: bool, dsn: str | None, data: str | None) -> None:
    """Remove schedule NAME (exit 3 if there is none)."""
    import psycopg

    from .. import periodic

    with client_for(dsn, data) as client, psycopg.connect(client.dsn, autocommit=True) as conn:
        removed = periodic.remove(conn, name)
    report({"removed": name if removed else None}, as_json, f"removed {name}", found=bool(removed),
           missing=f"no schedule named {name}")
