"""Disque's client commands from a shell: add, get, ack, nack, show, qlen,
qstat, qscan, jscan, pause, and the dead letters."""

from __future__ import annotations

import itertools
import os
import sys
from typing import Any

import click
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from ..arguments import DEFAULT_MAX_BODY_SIZE, HARD_MAX_BODY_SIZE, MAX_COUNT, MAX_PRIORITY, MAX_REPLICATE
from ..errors import DatabaseUnavailableError, InvalidArgumentError, NoReplError, PgqError
from .common import (
    SECONDS,
    arg_bytes,
    client_for,
    emit_found,
    handles_errors,
    json_option,
    progress_console,
    report,
    table,
    target_options,
    to_json,
)


class _InputFile(click.File):
    """click.File for reading, '-' included: standard input that is closed
    (``<&-``) is a usage error, not click's RuntimeError and a traceback
    (found by a read-only review)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return super().convert(value, param, ctx)
        except RuntimeError as exc:
            self.fail(f"cannot read {value!r}: {exc}", param, ctx)


def _progress() -> Progress:
    # In bytes of the file (its lines are not counted before they are read).
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TimeRemainingColumn(), transient=True, disable=not sys.stderr.isatty(),
                    console=progress_console)


@click.command()
@click.argument("queue")
@click.argument("bodies", nargs=-1)
@click.option("--file", "path", type=_InputFile("rb"),
              help="Add one job per line of this file ('-' for stdin), in batches.")
@click.option("--replicate", type=click.IntRange(1, MAX_REPLICATE),
              help="Copies to keep (default: min(3, reachable nodes)).")
@click.option("--delay", type=SECONDS, default=0, show_default=True, help="Seconds before it is queued.")
@click.option("--retry", type=SECONDS, help="Seconds before an unacknowledged job is re-queued (0: at most once).")
@click.option("--ttl", type=SECONDS, help="Seconds the job lives (default 86400).")
@click.option("--maxlen", type=click.IntRange(1), help="Refuse if the queue already holds this many jobs.")
@click.option("--async", "asynchronous", is_flag=True, help="Replicate in the background.")
@click.option("--timeout", type=SECONDS, help="Seconds to wait for the copies.")
@click.option("--priority", type=click.IntRange(0, MAX_PRIORITY), default=0, show_default=True,
              help="Higher is delivered first (FIFO within a priority).")
@click.option("--key", help="Idempotency key: while a job added with it lives in QUEUE, "
                            "print that job's ID instead of adding (one BODY only).")
@click.option("--max-body-size", type=click.IntRange(1, HARD_MAX_BODY_SIZE), metavar="BYTES",
              default=DEFAULT_MAX_BODY_SIZE, show_default=True,
              help="Largest body accepted (up to 512 MiB).")
@click.option("--json", "as_json", is_flag=True, help="Print the IDs as JSON.")
@target_options
@handles_errors
def add(queue: str, bodies: tuple[str, ...], path, replicate, delay, retry, ttl, maxlen,  # type: ignore[no-untyped-def]
        asynchronous, timeout, priority, key, max_body_size, as_json, dsn, data) -> None:
    """Add jobs to QUEUE: each BODY argument is one job (or use --file)."""
    if not bodies and path is None:
        raise click.UsageError("give job bodies as arguments, or --file FILE")
    if key is not None and (len(bodies) != 1 or path is not None):
        raise click.UsageError("--key names one job: give exactly one BODY (and no --file)")
    options = dict(replicate=replicate, delay=delay, retry=retry, ttl=ttl, maxlen=maxlen,
                   asynchronous=asynchronous, timeout=timeout, priority=priority)
    import psycopg

    ids: list[str] = []  # added and not printed yet (--json prints them all at the end)
    printed = 0  # IDs printed already (plain output: each chunk's, once committed)
    committed = 0  # jobs added (printed or not)
    lines_done = 0
    chunk_lines = 0  # lines of the chunk being added (--file)

    def added(new: list[str]) -> None:
        nonlocal printed, committed
        committed += len(new)
        if as_json:
            ids.extend(new)
        elif new:
            click.echo("\n".join(new))
            printed += len(new)

    try:
        with client_for(dsn, data, max_body_size=max_body_size) as client:
            if key is not None:
                added([client.add_job(queue, arg_bytes(bodies[0]), key=key, **options)])
            elif bodies:
                added(client.add_jobs(queue, [arg_bytes(b) for b in bodies], **options))
            if path is not None:
                # Streamed, a chunk at a time: a file larger than memory, or
                # a pipe that never ends, adds as it reads (the whole file
                # was read first, and stdin only at its end).
                with _progress() as progress:
                    task = progress.add_task(f"adding to {queue}", total=_size(path))
                    while chunk := list(itertools.islice(path, _FILE_CHUNK)):
                        chunk_lines = len(chunk)
                        lines = [line.rstrip(b"\r\n") for line in chunk]
                        _check_sizes(lines, lines_done, max_body_size)
                        new = client.add_jobs(queue, lines, **options)
                        lines_done, chunk_lines = lines_done + len(chunk), 0
                        added(new)  # counted before anything else can be interrupted
                        progress.advance(task, sum(len(line) for line in chunk))
    except BrokenPipeError:
        # stdout closed (`| head -1`): what was added is said on stderr
        click.echo(f"note: stdout was closed: {committed} jobs were added, not all their IDs "
                   "printed", err=True)
        if path is not None:
            _resume_note(lines_done, chunk_lines, 0, norepl=False, unknown=False)
        raise
    except (PgqError, psycopg.Error, KeyboardInterrupt) as exc:
        # The batches before the failure are committed: their IDs go out
        # (printed already, or now), or a second run adds them again. Of
        # the chunk that failed, a NOREPL names the jobs that stayed (they
        # will be delivered).
        kept = list(getattr(exc, "added", ()) or ())
        if ids or kept:
            _echo_ids(ids + kept, as_json)
        if printed or ids or kept:
            click.echo(f"note: {printed + len(ids) + len(kept)} jobs were added before this "
                       "(their IDs are on stdout)", err=True)
        if path is not None and (printed or ids or kept or chunk_lines):
            # A chunk is one statement and one commit: refused, none of it
            # is in; only a lost connection or an interrupt leaves it unknown.
            unknown = isinstance(exc, (psycopg.Error, DatabaseUnavailableError, KeyboardInterrupt))
            _resume_note(lines_done, chunk_lines, len(kept), isinstance(exc, NoReplError), unknown)
        raise
    if as_json:
        _echo_ids(ids, as_json)


_FILE_CHUNK = 5000  # lines per add (one statement, one commit)


def _size(path: Any) -> int | None:
    """The bytes a file holds, for the progress bar; None for a pipe."""
    try:
        return os.fstat(path.fileno()).st_size or None if path.seekable() else None
    except (OSError, ValueError, AttributeError):
        return None


def _check_sizes(lines: list[bytes], lines_done: int, limit: int) -> None:
    """Each line's size, before the chunk goes: the line over the limit is
    named (the client's own check said only that a body was too large)."""
    for n, line in enumerate(lines):
        if len(line) > limit:
            raise InvalidArgumentError(
                f"line {lines_done + n + 1} is {len(line)} bytes, over the limit of {limit} "
                "(raise it with --max-body-size BYTES, up to 512 MiB, or queue a reference "
                "to the data)")


def _resume_note(lines_done: int, chunk_lines: int, kept: int, norepl: bool,
                 unknown: bool = True) -> None:
    """Where a second run of `add --file` may start, and what it would repeat."""
    if not chunk_lines:
        click.echo(f"note: resume from line {lines_done + 1} of the file", err=True)
        return
    first, last = lines_done + 1, lines_done + chunk_lines
    if not norepl and not unknown:
        click.echo(f"note: lines {first}-{last} were refused together (none of them was added): "
                   f"resume from line {first}", err=True)
        return
    if norepl:
        state = f"{kept} of their jobs stayed (their IDs are on stdout), the others were not added"
    else:
        state = "they may have been added, in part or whole (their IDs are unknown)"
    click.echo(f"note: lines {first}-{last} were being added: {state}; lines after {last} were "
               f"not: resume from line {first} only if repeating those is acceptable, else "
               f"from line {last + 1}", err=True)


def _echo_ids(ids: list[str], as_json: bool) -> None:
    click.echo(to_json(ids) if as_json else "\n".join(ids))


@click.command()
@click.argument("queues", nargs=-1, required=True)
@click.option("--count", type=click.IntRange(1, MAX_COUNT), default=1, show_default=True,
              help="Most jobs to return.")
@click.option("--timeout", type=SECONDS, help="Seconds to block (default: forever; 0 = forever).")
@click.option("--nohang", is_flag=True, help="Return at once if no job is ready.")
@click.option("--ack", "ack_now", is_flag=True, help="Acknowledge the jobs right away.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@target_options
@handles_errors
def get(queues: tuple[str, ...], count: int, timeout: float | None, nohang: bool, ack_now: bool,
        as_json: bool, dsn: str | None, data: str | None) -> None:
    """Get jobs from QUEUES (left to right = priority). Exit 3 if none came."""
    with client_for(dsn, data) as client:
        jobs = client.get_job(*queues, count=count, timeout=timeout, nohang=nohang, withcounters=True)
        if ack_now and jobs:
            client.ack_job(*(j.id for j in jobs))
    table([(j.id, j.queue, j.body, j.nacks, j.additional_deliveries) for j in jobs],
          ("id", "queue", "body", "nacks", "additional_deliveries"), as_json)
    if not jobs:
        sys.exit(3)


def _ids_command(name: str, method: str, done: str, help_text: str,  # type: ignore[no-untyped-def]
                 none: str = "none of the IDs was known"):
    @click.command(name, help=f"{help_text} Exit 3 if {none}.")
    @click.argument("ids", nargs=-1, required=True)
    @json_option
    @target_options
    @handles_errors
    def command(ids: tuple[str, ...], as_json: bool, dsn: str | None, data: str | None) -> None:
        with client_for(dsn, data) as client:
            count = getattr(client, method)(*ids)
        report({done: count}, as_json, str(count), found=count > 0)
    return command


ack = _ids_command("ack", "ack_job", "acked", "Acknowledge jobs; prints how many known jobs were acked.")
fast_ack = _ids_command("fastack", "fast_ack", "deleted", "Delete jobs now, everywhere (best effort).")
del_job = _ids_command("deljob", "del_job", "deleted", "Delete jobs on this node, in any state.")
enqueue = _ids_command("enqueue", "enqueue", "queued", "Queue active jobs now.",
                       "none was queued (not known here, or queued already)")
dequeue = _ids_command("dequeue", "dequeue", "dequeued", "Take queued jobs out of their queue.",
                       "none was taken out (not known here, or not queued)")


@click.command()
@click.argument("ids", nargs=-1, required=True)
@click.option("--delay", type=SECONDS, default=0, show_default=True, help="Seconds of back-off.")
@json_option
@target_options
@handles_errors
def nack(ids: tuple[str, ...], delay: float, as_json: bool, dsn: str | None, data: str | None) -> None:
    """Put delivered jobs back in their queue (now, or after --delay). Exit 3
    if none of the IDs was known."""
    with client_for(dsn, data) as client:
        count = client.nack_job(*ids, delay=delay)
    report({"nacked": count}, as_json, str(count), found=count > 0)


@click.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@target_options
@handles_errors
def show(job_id: str, as_json: bool, dsn: str | None, data: str | None) -> None:
    """Everything known about a job. Exit 3 if it is unknown."""
    with client_for(dsn, data) as client:
        info = client.show(job_id)
    emit_found(info, as_json, "unknown job")


@click.command()
@click.argument("job_id")
@click.option("--timeout", type=SECONDS,
              help="Seconds to wait (default: forever; 0: look once).")
@json_option
@target_options
@handles_errors
def wait(job_id: str, timeout: float | None, as_json: bool, dsn: str | None, data: str | None) -> None:
    """Wait until a job is done with: acknowledged (on any node whose ACK
    reaches this one's copy), deleted, expired or dead-lettered. Exit 3 if
    TIMEOUT passes first; an error if this node holds no copy and knows of
    none (wait on a node that holds one: SHOW there lists them)."""
    with client_for(dsn, data) as client:
        done = client.wait_job(job_id, timeout=timeout)
    report({"id": job_id, "done": done}, as_json, "done", found=done,
           missing=f"{job_id}: not done within {timeout:g} s" if timeout is not None else None)


@click.command()
@click.argument("queue")
@json_option
@target_options
@handles_errors
def qlen(queue: str, as_json: bool, dsn: str | None, data: str | None) -> None:
    """Number of jobs queued in QUEUE. Exit 3 if there are none."""
    with client_for(dsn, data) as client:
        length = client.qlen(queue)
    report({"queue": queue, "length": length}, as_json, str(length), found=length > 0)


@click.command()
@click.argument("queue")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@target_options
@handles_errors
def qstat(queue: str, as_json: bool, dsn: str | None, data: str | None) -> None:
    """Statistics of QUEUE. Exit 3 if it does not exist."""
    with client_for(dsn, data) as client:
        stat = client.qstat(queue)
    emit_found(stat, as_json, "no such queue")


@click.command()
@click.option("--minlen", type=click.IntRange(0), help="Only queues with at least this many jobs.")
@click.option("--maxlen", type=click.IntRange(0), help="Only queues with at most this many jobs.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@target_options
@handles_errors
def qscan(minlen: int | None, maxlen: int | None, as_json: bool, dsn: str | None, data: str | None) -> None:
    """List every queue (with its length). Exit 3 if there is none."""
    names: list[str] = []
    with client_for(dsn, data) as client:
        cursor = 0
        while True:
            cursor, page = client.qscan(cursor, count=500, minlen=minlen, maxlen=maxlen)
            names += page
            if cursor == 0:
                break
        rows = [(name, client.qlen(name)) for name in names]
    table(rows, ("queue", "length"), as_json, empty_is_missing=True)


@click.command()
@click.option("--queue", help="Only jobs of this queue.")
@click.option("--state", "states", multiple=True,
              type=click.Choice(["wait-repl", "active", "queued", "acked"]), help="Only these states.")
@click.option("--limit", type=click.IntRange(1), default=1000, show_default=True,
              help="Stop after this many jobs.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@target_options
@handles_errors
def jscan(queue: str | None, states: tuple[str, ...], limit: int, as_json: bool,
          dsn: str | None, data: str | None) -> None:
    """List jobs (ID, queue, state, counters). Exit 3 if there is none."""
    found: list[dict[str, Any]] = []
    with client_for(dsn, data) as client:
        cursor = 0
        while len(found) < limit:
            cursor, page = client.jscan(cursor, count=min(500, limit), queue=queue, states=states,
                                        reply="all")
            found += page
            if cursor == 0:
                break
    table([(j["id"], j["queue"], j["state"], j["nacks"], j["additional_deliveries"], j["body"])
           for j in found[:limit]], ("id", "queue", "state", "nacks", "additional_deliveries", "body"),
          as_json, empty_is_missing=True)


@click.command()
@click.argument("queue")
@click.argument("flags", nargs=-1, required=True)
@json_option
@target_options
@handles_errors
def pause(queue: str, flags: tuple[str, ...], as_json: bool, dsn: str | None, data: str | None) -> None:
    """Pause QUEUE: FLAGS among in, out, all, none, state, bcast; prints the state."""
    with client_for(dsn, data) as client:
        state = client.pause(queue, *flags)
    report({"queue": queue, "paused": state}, as_json, state)


@click.group("dead-letters")
def dead_letters() -> None:
    """Jobs workers gave up on: list them, put them back."""


@dead_letters.command("list")
@click.option("--queue", help="Only this queue.")
@click.option("--limit", type=click.IntRange(1, MAX_COUNT), default=100, show_default=True,
              help="Most to show.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@target_options
@handles_errors
def dead_letters_list(queue: str | None, limit: int, as_json: bool, dsn: str | None, data: str | None) -> None:
    """List dead letters, oldest first. Exit 3 if there is none."""
    with client_for(dsn, data) as client:
        rows = client.dead_letters(queue, count=limit)
    table([(d["id"], d["queue"], d["nacks"], d["died_at"], d["reason"], bytes(d["body"]))
           for d in rows], ("id", "queue", "nacks", "died_at", "reason", "body"), as_json,
          empty_is_missing=True)


@dead_letters.command("requeue")
@click.option("--queue", help="Only this queue.")
@click.option("--id", "ids", multiple=True, help="Only these job IDs (repeatable).")
@click.option("--limit", type=click.IntRange(1, MAX_COUNT), default=100_000, show_default=True,
              help="Most to requeue.")
@json_option
@target_options
@handles_errors
def dead_letters_requeue(queue: str | None, ids: tuple[str, ...], limit: int, as_json: bool,
                         dsn: str | None, data: str | None) -> None:
    """Add dead letters back to their queues as new jobs; prints how many
    (exit 3 if there was none)."""
    with client_for(dsn, data) as client:
        new = client.requeue_dead_letters(queue, ids=list(ids) or None, count=limit)
    report({"requeued": len(new), "ids": list(new)}, as_json, str(len(new)), found=bool(new))
