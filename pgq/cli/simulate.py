"""``pgq simulate``: run the seeded cluster simulation (see pgq.cluster.simulation)."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .common import handles_errors, progress_console, report


@click.command()
@click.option("--seeds", type=click.IntRange(1, 100_000), default=20, show_default=True,
              help="How many seeds to run (from --first).")
@click.option("--first", type=click.IntRange(0), default=1, show_default=True, help="The first seed.")
@click.option("--seed", type=int, default=None,
              help="Replay this one seed and print its trace on a violation (as reported).")
@click.option("--nodes", type=click.IntRange(3, 7), default=3, show_default=True)
@click.option("--faults", default="all", show_default=True,
              help="Comma-separated among drop, duplicate, reorder, partition, crash, skew; "
                   "'all' or 'none'.")
@click.option("--seconds", type=click.FloatRange(1, 600), default=6.0, show_default=True,
              help="Virtual seconds of workload and faults per seed (a settling phase follows).")
@click.option("--home", type=click.Path(path_type=Path), default=None,
              help="Directory of the PostgreSQL server the simulation uses "
                   "(default: a temporary one, removed at the end).")
@click.option("-v", "--verbose", is_flag=True, help="One line per seed.")
@click.option("--json", "as_json", is_flag=True, help="End with the totals as one JSON object.")
@handles_errors
def simulate(seeds: int, first: int, seed: int | None, nodes: int, faults: str, seconds: float,
             home: Path | None, verbose: bool, as_json: bool) -> None:
    """Run the deterministic simulation of a pgq cluster: node cores under a
    virtual clock on an in-memory network that drops, duplicates, reorders
    and partitions messages, with node crashes and clock skews, each node
    with a real database. Checks the invariants after every step; a seed
    replays exactly. Ends with `seeds=N steps=S violations=V` and exits 1 on
    any violation."""
    from .. import embedded
    from ..cluster.simulation import FAULTS, SimDatabases, run_seeds

    chosen = FAULTS if faults == "all" else () if faults == "none" else \
        tuple(f.strip() for f in faults.split(",") if f.strip())
    unknown = set(chosen) - set(FAULTS)
    if unknown:
        raise click.BadParameter(f"unknown faults {sorted(unknown)}; choose among "
                                 f"{', '.join(FAULTS)}", param_hint="--faults")
    seed_list = [seed] if seed is not None else list(range(first, first + seeds))
    started = time.monotonic()
    totals = {"steps": 0, "violations": 0}

    def on_result(result: object) -> None:
        totals["steps"] += result.steps  # type: ignore[attr-defined]
        totals["violations"] += len(result.violations)  # type: ignore[attr-defined]
        for violation in result.violations:  # type: ignore[attr-defined]
            click.echo(violation.report(), err=True)
        if verbose or seed is not None:
            click.echo(f"seed={result.seed} steps={result.steps} "  # type: ignore[attr-defined]
                       f"virtual={result.virtual_seconds:.1f}s added={result.added} "  # type: ignore[attr-defined]
                       f"delivered={result.delivered} violations={len(result.violations)} "  # type: ignore[attr-defined]
                       f"digest={result.digest[:16]}",  # type: ignore[attr-defined]
                       err=as_json)  # --json: stdout holds the one JSON object

    with contextlib.ExitStack() as cleanup:
        # Seeds done, on a terminal (200 seeds take minutes; without -v
        # nothing was printed until the end).
        progress = cleanup.enter_context(Progress(
            TextColumn("seeds"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            transient=True, disable=not sys.stderr.isatty() or len(seed_list) < 2,
            console=progress_console))
        task = progress.add_task("seeds", total=len(seed_list))

        def counted(result: object) -> None:
            on_result(result)
            progress.advance(task)

        if home is None:  # a server of its own, gone at the end
            instance, _ = cleanup.enter_context(
                embedded.temporary_server("pgq-simulate-", "immediate"))
        else:
            instance = embedded.ensure_running(home)
        databases = SimDatabases(instance, nodes)
        cleanup.callback(databases.close)
        run_seeds(databases, seed_list, nodes, chosen, on_result=counted, seconds=seconds,
                  trace_lines=400 if seed is not None else 30)
    took = round(time.monotonic() - started, 1)
    report({"seeds": len(seed_list), **totals, "seconds": took}, as_json,
           f"seeds={len(seed_list)} steps={totals['steps']} violations={totals['violations']} ({took} s)")
    sys.exit(1 if totals["violations"] else 0)
