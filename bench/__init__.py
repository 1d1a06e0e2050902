"""pgq's benchmark suite (``python -m bench`` or ``pgq bench``).

Every contender (pgq, pgqueuer, procrastinate, the raw-SQL floor, a plain
COPY) runs each workload against the same PostgreSQL server, started by the
suite with the same settings for all (fsync on, synchronous_commit on; the
"turbo" rows turn synchronous_commit off), in interleaved rounds (A B A B
...), each on a fresh database; the median of the rounds is reported, with
ratios to the peers measured in the same run. See bench/README.md.
"""
