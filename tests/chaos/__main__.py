"""``python -m tests.chaos``: one chaos run from the command line (``make chaos``)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .nemesis import KINDS
from .run import Options, run


@click.command()
@click.option("--seed", type=int, default=1, show_default=True, help="Seed of the fault schedule.")
@click.option("--nodes", type=click.IntRange(3, 7), default=5, show_default=True)
@click.option("--minutes", type=float, default=10.0, show_default=True,
              help="How long faults are injected (the drain comes after).")
@click.option("--faults", default="all", show_default=True,
              help=f"Comma-separated kinds among {', '.join(KINDS)}, or 'all'.")
@click.option("--producers", type=int, default=4, show_default=True)
@click.option("--consumers", type=int, default=4, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("chaos-results"),
              show_default=True, help="Directory for history.jsonl, summary.json and summary.md.")
def main(seed: int, nodes: int, minutes: float, faults: str, producers: int, consumers: int,
         out: Path) -> None:
    """Run pgq's Jepsen-style chaos test against a real local cluster and
    check that no acknowledged add was lost (exit 1 if one was)."""
    kinds = KINDS if faults == "all" else tuple(k.strip() for k in faults.split(",") if k.strip())
    bad = set(kinds) - set(KINDS)
    if bad:
        raise click.BadParameter(f"unknown kinds {sorted(bad)}; choose among {', '.join(KINDS)}",
                                 param_hint="--faults")
    outcome = run(Options(seed=seed, nodes=nodes, seconds=minutes * 60, kinds=kinds,
                          producers=producers, consumers=consumers, durations=(5.0, 15.0),
                          rests=(5.0, 10.0), out=out / f"seed-{seed}"),
                  log=lambda line: click.echo(line, err=True))
    click.echo(outcome.line())
    sys.exit(0 if outcome.verdict.valid and outcome.held_after_drain == 0 else 1)


main()
