"""``python -m bench`` / ``pgq bench``: run the benchmarks and write the report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=(
        "pgq against pgqueuer, procrastinate and the raw-SQL floor, side by side in one run"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a few seconds per step")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3; 1 with --smoke)")
    parser.add_argument("--only", action="append", help="only workloads whose name contains this (cluster rows too)")
    parser.add_argument("--no-cluster", action="store_true", help="skip the 3-node cluster workload")
    parser.add_argument("--out", type=Path, help=f"report directory (default {DEFAULT_OUT}; "
                        "smoke runs: its smoke/, runs with --only: its partial/)")
    parser.add_argument("--json", action="store_true",
                        help="print results.json on stdout at the end (the progress goes to stderr)")
    opts = parser.parse_args(argv)
    if opts.rounds is not None and opts.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {opts.rounds}")
    rounds = opts.rounds or (1 if opts.smoke else 3)
    # A smoke or partial run never writes over the committed full report
    # (an `--only` that matched nothing replaced it with an empty one).
    out = opts.out or (DEFAULT_OUT / "smoke" if opts.smoke
                       else DEFAULT_OUT / "partial" if opts.only else DEFAULT_OUT)
    if out.exists() and not out.is_dir():
        # refused now: the run's end (an hour later) could not write there
        parser.error(f"--out {out} is a file: name a directory (made if missing)")

    from .report import write
    from .runner import row_names, run

    if opts.only:
        rows = row_names(opts.smoke, with_cluster=not opts.no_cluster)
        unmatched = [o for o in opts.only if not any(o in row for row in rows)]
        if unmatched:
            parser.error(f"--only {unmatched[0]!r} matches no workload; the workloads are: "
                         + "; ".join(rows))

    progress = sys.stderr if opts.json else sys.stdout

    def log(line: str) -> None:
        print(line, flush=True, file=progress)

    results = run(opts.smoke, rounds, opts.only, log, with_cluster=not opts.no_cluster)
    for path in write(results, out):
        print(f"wrote {path}", file=progress)
    print((out / ("results.json" if opts.json else "results.md")).read_text())
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the servers it started are stopped on the way out
        print("interrupted", file=sys.stderr)
        sys.exit(130)
