"""Free TCP ports for the servers pgq starts on this machine (embedded
PostgreSQL, local clusters' node buses, fronts in tests and benchmarks).

Invariant: a port handed out is outside the kernel's ephemeral range
(``net.ipv4.ip_local_port_range``, 32768-60999 by default). A port probed
with ``bind(0)`` comes from that range, and between the probe and the
server's own bind, any outgoing connection on the machine (a client to
PostgreSQL, say) may take it as its source port: the server then fails
with "Address already in use". A busy test run (two workers, clusters of
five) made that happen. Below the range no connection takes a port
without asking for it, so only another server probing at the same moment
could, and a random choice among some twenty thousand makes that rare.

Embedded PostgreSQL servers draw from above the range (``servers=True``,
61000-65535 by default on Linux; where /proc does not give the range,
from below it too), everything else from below it: a local cluster
picks its nodes' bus ports first and starts their embedded servers next,
and a server that drew a bus port picked but not yet bound made that
node fail to start. The two pools never meet.
"""

from __future__ import annotations

import ipaddress
import random
import socket

__all__ = ["free_port", "bindable", "is_loopback"]

_DEFAULT_EPHEMERAL = (32768, 60999)
_LOWEST = 10000  # below: well-known and registered services
_random = random.SystemRandom()


def _ephemeral() -> tuple[int, int]:
    return _read_ephemeral() or _DEFAULT_EPHEMERAL


def _read_ephemeral() -> tuple[int, int] | None:
    """The kernel's ephemeral range, None where /proc does not say (macOS,
    BSD: 49152-65535 there, so no pool above it may be assumed)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            low, high = (int(part) for part in handle.read().split())
        return low, high
    except (OSError, ValueError):
        return None


def _candidates(servers: bool = False) -> range | None:
    known = _read_ephemeral()
    low, high = known or _DEFAULT_EPHEMERAL
    below = range(_LOWEST, low) if low - _LOWEST >= 1000 else None
    above = range(high + 1, 65536) if known and 65535 - high >= 1000 else None
    if servers:
        return above or below
    return below or above  # None: the range covers (almost) every port: bind(0)


def free_port(host: str = "127.0.0.1", reuse_address: bool = False, servers: bool = False) -> int:
    """A port that nothing listens on at ``host`` now, outside the ephemeral
    range when the range leaves room. ``reuse_address``: probe as a server
    that binds with SO_REUSEADDR does (PostgreSQL: a port with connections
    in TIME_WAIT is free for it). ``servers``: from the embedded servers'
    pool, above the range (see the module doc)."""
    candidates = _candidates(servers)
    tries = [_random.choice(candidates) for _ in range(100)] if candidates else []
    for port in [*tries, 0]:
        bound = bindable(host, port, reuse_address)
        if bound is not None:
            return bound
    raise OSError(f"no free TCP port on {host}")


def bindable(host: str, port: int, reuse_address: bool = False) -> int | None:
    """The port a server could bind at ``host`` now (``port``, or the one
    the kernel picks for 0), or None if it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        if reuse_address:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return None
        return int(sock.getsockname()[1])


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback:
    ``localhost``, 127.0.0.0/8 or ::1. Any other name counts as beyond it."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
