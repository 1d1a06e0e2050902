"""One module per contender, each run in its own process.

Protocol: ``python -m bench.contenders.<name> '<json>'`` where the JSON names
the workload and its parameters (``dsn`` always); the module prints one JSON
object with the measurements on stdout and exits 0. Peers run with the
interpreter of the peers' virtualenv (see bench.peers), so nothing here may
import pgq except the pgq contender.
"""
