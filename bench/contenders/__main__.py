"""Not runnable: run one contender module, e.g. ``python -m bench.contenders.raw_sql '<json>'``."""
raise SystemExit(__doc__)
